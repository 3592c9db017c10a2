"""Find a container's CUDA processes from its init PID.

Scope first, then filter: the container's PIDs come from its cgroup (or, for
a process in our own PID namespace, its descendants), candidates are the ones
holding an NVIDIA device node open or running a CUDA restore thread (a
checkpointed process holds no device node, but its restore thread lives on),
and only the driver can say which of those are CUDA processes - an NVML-only
process holds the same device nodes but makes every cuda-checkpoint call fail.
"""

from __future__ import annotations

import re

from cudahook.platform.errors import CudahookError, ToolError
from cudahook.platform.host import Host, ProcessGone
from cudahook.platform.record import Record

from .backends import CHECKPOINTED, RUNNING
from .fanout import Raised, fan_out

# typing costs milliseconds at every hook start: annotations only.
TYPE_CHECKING = False
if TYPE_CHECKING:
    from .backends import Backend

# The CUDA driver's restore thread; R550-R554 have no query for it (gVisor's rule).
CUDA_THREAD = re.compile(r"^cuda[0-9a-f]{11}$")


class DiscoveryError(CudahookError):
    """Some candidate could not be classified; nothing was touched."""


class CudaProcess(Record, frozen=True):
    pid: int  # host PID
    nspid: int  # PID inside the container's PID namespace
    state: str | None = None  # as read during discovery, when the probe gave it


class Discovery(Record):
    init_pid: int
    scope: str  # "cgroup", "pidns-scan" or "tree-scan": how the container was scoped
    scanned: int  # processes looked at
    candidates: list[int] = []  # (a fresh list for each: see Record)
    processes: list[CudaProcess] = []
    skipped: dict[int, str] = {}  # candidate -> why not CUDA
    warnings: list[str] = []

    @property
    def pids(self) -> list[int]:
        return [p.pid for p in self.processes]


def container_pids(host: Host, init_pid: int) -> tuple[list[int], str]:
    """All host PIDs of the container whose init is `init_pid`."""
    init_ns = host.pidns(init_pid)
    if init_ns != host.own_pidns():
        for members in host.cgroup_members(init_pid):
            inside = [p for p in members if _same_ns(host, p, init_ns)]
            if len(inside) == len(members):  # the container's own cgroup
                return inside, "cgroup"
        pids = [p for p in host.all_pids() if _same_ns(host, p, init_ns)]
        return pids, "pidns-scan"
    return _descendants(host, init_pid), "tree-scan"


def _same_ns(host: Host, pid: int, ns: str) -> bool:
    try:
        return host.pidns(pid) == ns
    except (ProcessGone, PermissionError):
        return False


def _descendants(host: Host, root: int) -> list[int]:
    """The process tree under `root`, for processes that share our PID namespace.

    This kernel interface (/proc/PID/task/TID/children) is optional, so walk
    parent links instead; this path is only taken for non-containerised
    processes, where no cgroup bounds the search.
    """
    children: dict[int, list[int]] = {}
    for pid in host.all_pids():
        try:
            children.setdefault(host.ppid(pid), []).append(pid)
        except (ProcessGone, PermissionError, ValueError, IndexError):
            continue
    found, todo = [], [root]
    while todo:
        pid = todo.pop()
        found.append(pid)
        todo.extend(children.get(pid, ()))
    return sorted(found)


def device_files(host: Host, pid: int, pattern: re.Pattern[str]) -> list[str]:
    """The NVIDIA device files `pid` holds open; [] when it has exited."""
    try:
        return sorted({t for t in host.fd_targets(pid) if pattern.search(t)})
    except ProcessGone:
        return []


def describe_holders(holders: dict[int, list[str]], what: str) -> str:
    return "; ".join(f"pid {pid} ({what}) holds {', '.join(files)}"
                     for pid, files in sorted(holders.items()))


def has_device_fd(host: Host, pid: int, pattern: re.Pattern[str]) -> bool:
    return any(pattern.search(t) for t in host.fd_targets(pid))


def has_cuda_thread(host: Host, pid: int) -> bool:
    return any(CUDA_THREAD.match(name) for _tid, name in host.thread_names(pid))


def discover(
    host: Host,
    backend: Backend,
    init_pid: int,
    device_pattern: re.Pattern[str],
    *,
    require_device_fd: bool = True,
    max_parallel: int = 64,
    members: tuple[list[int], str] | None = None,
) -> Discovery:
    """CUDA processes of the container.

    At checkpoint time a CUDA process holds device nodes open, which makes the
    cheap /proc filter exact enough to keep driver probes few. A checkpointed
    process holds none, but keeps the driver's restore thread (named like
    CUDA_THREAD): it is a candidate too, so that a checkpoint can see a
    process an earlier one left checkpointed. Restore-time discovery
    (`require_device_fd=False`) probes every process of the container.
    """
    # `members`: container_pids(host, init_pid) as the caller just read it.
    pids, scope = members if members is not None else container_pids(host, init_pid)
    result = Discovery(init_pid=init_pid, scope=scope, scanned=len(pids))
    for pid in pids:
        try:
            if (not require_device_fd or has_device_fd(host, pid, device_pattern)
                    or has_cuda_thread(host, pid)):
                result.candidates.append(pid)
        except ProcessGone:
            continue
    if not result.candidates:
        return result

    feats = backend.features
    if feats.get_state and not feats.launch_job:
        # One call answers both "is it CUDA" and "what state is it in".
        probe = _probe_with(host, backend.get_state, strict=True)
    elif feats.restore_tid:
        # --get-state also answers for --launch-job coordinators (R590+); the
        # restore thread only exists in a real CUDA process, and its failure
        # message carries no CUDA error to tell causes apart.
        probe = _probe_with(host, lambda pid: (backend.get_restore_tid(pid), None)[1],
                            strict=False)
    else:
        if (feats.major and feats.major < 550) or not feats.toggle:
            result.warnings.append(
                f"cuda-checkpoint {feats.version or '(unknown)'} predates R550: "
                "checkpoint support is unlikely to work"
            )
        probe = _thread_probe(host, device_pattern)

    # A probe that raised gave no answer either: never "not CUDA".
    outcomes = [(None, None, f"{type(o.exc).__name__}: {o.exc}") if isinstance(o, Raised) else o
                for o in fan_out(probe, result.candidates, max_parallel)]
    unanswered = [(pid, why) for pid, (is_cuda, _, why) in zip(result.candidates, outcomes,
                                                              strict=True) if is_cuda is None]
    if unanswered:
        # No answer, or an answer other than "not a CUDA process", is not "not
        # CUDA": skipping it would let CRIU dump a live GPU process. A stopped,
        # frozen or traced target makes the tool hang.
        hint = (": is the process stopped, frozen or traced?"
                if any(why == "timed out" for _, why in unanswered) else "")
        raise DiscoveryError(
            "cannot tell whether these are CUDA processes: " + ", ".join(
                f"pid {pid} ({why})" for pid, why in unanswered) + hint)
    for pid, (is_cuda, state, why) in zip(result.candidates, outcomes, strict=True):
        if not is_cuda:
            result.skipped[pid] = why
            continue
        try:
            nspid = host.nspid(pid)
        except ProcessGone:
            result.skipped[pid] = "exited during discovery"
            continue
        result.processes.append(CudaProcess(pid, nspid, state))
    return result


# What the driver says about a process without CUDA (or with NVML only).
NOT_CUDA = '"initialization error"'


def _probe_with(host: Host, call, *, strict: bool):  # type: ignore[no-untyped-def]
    """`strict`: only the driver's "initialization error" means not CUDA;
    any other failure leaves the process unclassified."""

    def probe(pid: int) -> tuple[bool | None, str | None, str]:
        try:
            return True, call(pid), ""
        except ToolError as exc:
            why = exc.stderr or f"exit {exc.returncode}"
            if exc.timed_out:
                return None, None, "timed out"
            if not host.exists(pid):
                return False, None, "exited during discovery"
            if exc.cuda or (strict and NOT_CUDA not in exc.stderr):
                return None, None, why
            return False, None, why

    return probe


def _thread_probe(host: Host, pattern: re.Pattern[str]):  # type: ignore[no-untyped-def]
    """R550-R554: the restore thread's name is the only sign of a CUDA process.

    Without --get-state, the device nodes tell the state: a checkpointed
    process has released all of them.
    """

    def probe(pid: int) -> tuple[bool, str | None, str]:
        try:
            if not has_cuda_thread(host, pid):
                return False, None, "no CUDA restore thread"
            return True, RUNNING if has_device_fd(host, pid, pattern) else CHECKPOINTED, ""
        except ProcessGone:
            return False, None, "exited during discovery"

    return probe
