"""Can a checkpoint, or a restore, succeed now? The one place that decides.

`cudahook check` calls these functions, and so do the hooks: pre-dump runs
`checkpoint_checks` (its cheap part) before anything is locked and refuses
with the first problem's reason code; post-restore runs `restore_checks`
(which builds on restore_gate.plan_restore) while the restored tasks have
not run yet. Nothing here changes a workload: states are read, never moved.

Each problem carries a code of platform/reasons.py. A restore refused for a
reason that cannot change on this node (driver branch, GPUs, remap support)
is remembered per image manifest and node, so the next attempt is refused
at once instead of querying the driver and nvidia-smi again.
"""

from __future__ import annotations

import contextlib
import os
import time
from pathlib import Path

from cudahook.core import manifest
from cudahook.platform import criu as criu_node
from cudahook.platform import reasons
from cudahook.platform.errors import CudahookError, Exit
from cudahook.platform.record import Record

from . import annotations as ann
from .context import Context

# typing costs milliseconds at every hook start: annotations only.
TYPE_CHECKING = False
if TYPE_CHECKING:
    from collections.abc import Callable
    from typing import Any

    from cudahook.core.discovery import CudaProcess, Discovery
    from cudahook.core.manifest import Manifest

# Room in the image directory beyond the GPU memory itself, on the storage
# path: the chunk manifests and file-system overhead. Pre-dump preallocates
# the GPU memory plus this before anything is locked.
STORAGE_SLACK = 4 << 20

# A remembered "never on this node" restore verdict is trusted this long; MIG
# can be reconfigured without a reboot, and /run is emptied by one anyway.
VERDICT_CACHE_TTL_S = 3600.0


class Problem(Record):
    code: str
    detail: str

    @property
    def reason(self) -> reasons.Reason:
        return reasons.get(self.code)

    def to_dict(self) -> dict[str, Any]:
        r = self.reason
        return {"code": self.code, "detail": self.detail, "explanation": r.text, "hint": r.hint,
                "never_here": r.never_here}


class Verdict(Record):
    side: str  # "checkpoint" or "restore"
    target: dict[str, Any] = {}  # (a fresh dict or list for each: see Record)
    problems: list[Problem] = []
    warnings: list[str] = []
    checked: list[str] = []
    facts: dict[str, Any] = {}
    time: float = 0.0  # when it was given; 0: now
    cached: bool = False
    found: Discovery | None = None  # checkpoint side: the processes found
    manifest: Manifest | None = None  # restore side: the manifest judged

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        if not self.time:
            self.time = time.time()

    @property
    def ok(self) -> bool:
        return not self.problems

    @property
    def never_here(self) -> bool:
        return any(p.reason.never_here for p in self.problems)

    @property
    def exit_code(self) -> int:
        """`cudahook check`'s answer: 0 it can, 6 never on this node, 1 not now."""
        if self.ok:
            return Exit.OK
        return Exit.NOT_HERE if self.never_here else Exit.FAILED

    @property
    def hook_exit(self) -> int:
        """What a hook refusing on this verdict exits with: "never here" first,
        then the first problem's own code."""
        if self.ok:
            return Exit.OK
        if self.never_here:
            return Exit.NOT_HERE
        return int(self.problems[0].reason.exit)

    def add(self, code: str, detail: str) -> None:
        reasons.get(code)  # an unknown code is a bug: fail here, not in a reader
        self.problems.append(Problem(code, detail))

    def message(self) -> str:
        return "; ".join(f"{p.code}: {p.detail}" for p in self.problems)

    def to_dict(self) -> dict[str, Any]:
        return {"side": self.side, "ok": self.ok, "exit_code": self.exit_code,
                "target": self.target, "problems": [p.to_dict() for p in self.problems],
                "warnings": self.warnings, "checked": self.checked, "facts": self.facts,
                "time": self.time, "cached": self.cached}

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Verdict:
        v = cls(str(data.get("side", "")), dict(data.get("target") or {}),
                warnings=list(data.get("warnings") or []),
                checked=list(data.get("checked") or []), facts=dict(data.get("facts") or {}),
                time=float(data.get("time") or 0.0))
        for p in data.get("problems") or []:
            if isinstance(p, dict) and p.get("code") in reasons.REASONS:
                v.problems.append(Problem(p["code"], str(p.get("detail", ""))))
        return v

    def summary(self) -> dict[str, Any]:
        """What `cudahook status` keeps of it."""
        return {"time": self.time, "side": self.side, "ok": self.ok, "exit_code": self.exit_code,
                "codes": [p.code for p in self.problems], "message": self.message(),
                "cached": self.cached}


# == checkpoint side ============================================================


def checkpoint_checks(ctx: Context, *, init_pid: int | None = None, pids: list[int] | None = None,
                      image_dir: Path | None = None, full: bool = True,
                      container: str | None = None,
                      path: Callable[[], tuple[str | None, str]] | None = None) -> Verdict:
    """Whether a checkpoint of the container (`init_pid`) or of `pids` can
    succeed now. The processes found are in `verdict.found`.

    `full=False` is pre-dump's cut: CRIU is already running (no version
    check), a paused container is thawed by pre-dump itself, discovery looks
    only at processes holding NVIDIA device files, and the VMM interposer is
    checked by its own prepare step. What CRIU itself fails on cleanly after
    the checkpoint (the guardian then resumes the workload: the fault matrix
    proves it) is left to CRIU: a task traced while it runs, and the image
    size, an estimate that must not veto a checkpoint. What is left costs a
    /proc read or shares the nvidia-smi call the checkpoint makes anyway,
    except the GPU memory query (one nvidia-smi call, beside discovery),
    which guards against the worst outcome: the OOM killer in the middle of
    a checkpoint.

    `path` says where the GPU memory would go (memory_path's answer; pre-dump
    hands its own, asked of the driver once). Host memory is checked on the
    host path only; on the storage path the image directory's free space is.
    """
    v = Verdict("checkpoint", {"container": container, "init_pid": init_pid, "pids": pids})
    # The two nvidia-smi calls run beside discovery, not after it: each costs
    # a driver attach, and discovery waits on the driver too. Pre-dump starts
    # them only once a process holds an NVIDIA device file: a container
    # without CUDA makes no driver call at all.
    gpus = _Background(lambda: ctx.gpus, start=full)
    apps = _Background(lambda: ctx.host.run([ctx.settings.tool("nvidia_smi"), *APPS_QUERY], 30),
                       start=full)
    try:
        return _checkpoint_checks(ctx, v, init_pid, pids, image_dir, full, container,
                                  (gpus, apps), path or (lambda: memory_path(ctx)))
    finally:
        gpus.join()
        apps.join()


def _checkpoint_checks(ctx: Context, v: Verdict, init_pid: int | None, pids: list[int] | None,
                       image_dir: Path | None, full: bool, container: str | None,
                       queries: tuple[_Background, _Background],
                       path: Callable[[], tuple[str | None, str]]) -> Verdict:
    apps = queries[1]
    feats = None
    if full:
        feats = _driver(ctx, v)
        _criu(ctx, v)
        _criu_plugin(v)
        if any(p.code in ("DRIVER_UNKNOWN", "CHECKPOINT_TOOL_MISSING") for p in v.problems):
            return v  # nothing about the processes can be learnt without the driver
        # A frozen process's restore thread cannot run: every cuda-checkpoint
        # call on it hangs. Pre-dump thaws the container itself.
        v.checked.append("paused")
        for pid in [init_pid] if init_pid is not None else list(pids or []):
            try:
                if ctx.host.is_frozen(pid):
                    v.add("CONTAINER_PAUSED", f"the cgroup of pid {pid} is frozen")
                    return v
            except Exception as exc:  # unreadable is not paused: discovery will say more
                v.warnings.append(f"cannot read the freezer of pid {pid}: {exc}")
    # Before any cuda-checkpoint call: a stopped process makes each one hang
    # until its deadline (minutes).
    members = _members(ctx, init_pid)
    if _stopped(ctx, v, list(pids) if pids else (members or ([], ""))[0], traced=full):
        return v
    if not full and _may_use_a_gpu(ctx, pids, members):
        for query in queries:
            query.start()
    discovered = _discover(ctx, v, init_pid, pids, every=full, members=members)
    if discovered is None:
        return v
    v.found, procs = discovered
    v.facts["cuda_processes"] = [p.pid for p in procs]
    _nvml(ctx, v, v.found, procs)
    if not procs:
        return v  # no CUDA state: only what CRIU itself cannot dump matters
    if not full:
        feats = _driver(ctx, v)
        _criu_plugin(v)
    _states(ctx, v, procs)
    if feats is not None:
        _job_support(ctx, v, feats, procs)
    if full:
        _vmm(ctx, v, procs)
    _persistence(ctx, v, container)
    gpu = _gpu_memory(v, procs, apps)
    where = _where(v, path)
    if where == "storage":
        _storage_space(v, image_dir, gpu)
    elif where == "host":
        _host_memory(ctx, v, procs, gpu)
    if image_dir is not None and full:
        _image_space(ctx, v, list(pids) if pids else (members or ([init_pid], ""))[0],
                     image_dir, gpu, storage=where == "storage")
    return v


def memory_path(ctx: Context) -> tuple[str | None, str]:
    """Where a checkpoint puts the GPU memory under `gpu_memory`: "host",
    "storage", or None when storage is asked for and the driver cannot give
    it; and why. `gpu_memory: host` asks the driver nothing."""
    setting = ctx.settings.gpu_memory
    if setting == "host":
        return "host", "gpu_memory: host in the configuration"
    from cudahook.core.backends import gpu_memory_path, probe

    return gpu_memory_path(setting, probe(ctx.backend))


def _where(v: Verdict, path: Callable[[], tuple[str | None, str]]) -> str | None:
    """Which path the GPU memory takes (a fact of the verdict, with why);
    storage asked for and unavailable is refused: pre-dump would refuse it."""
    v.checked.append("gpu memory path")
    try:
        where, why = path()
    except Exception as exc:  # the driver could not be asked: say so, check as host
        v.warnings.append(f"GPU memory path unknown ({exc}): host memory checked as for the "
                          "host path")
        return "host"
    v.facts.update(gpu_memory_path=where, gpu_memory_path_why=why)
    if where is None:
        v.add("GPU_STORAGE_UNAVAILABLE", why)
    return where


def _driver(ctx: Context, v: Verdict) -> Any:
    v.checked.append("driver")
    try:
        tool = ctx.settings.tool("cuda_checkpoint")
        if ctx.backend.name != "driver-api" and not os.access(tool, os.X_OK):
            v.add("CHECKPOINT_TOOL_MISSING", f"not found at {tool}")
            return None
        feats = ctx.backend.features
    except CudahookError as exc:
        v.add("DRIVER_UNKNOWN", str(exc))
        return None
    v.facts["driver_version"] = feats.version
    v.facts["backend"] = ctx.backend.name
    if not feats.toggle and not feats.actions:
        v.add("DRIVER_TOO_OLD", f"driver {feats.version or '(unknown)'} has no checkpoint "
              "support (R550 or newer needed)")
    elif not feats.actions:
        v.warnings.append(f"driver {feats.version}: toggle only, no lock timeout (R555+ adds it)")
    return feats


def _criu(ctx: Context, v: Verdict) -> None:
    v.checked.append("criu")
    criu = ctx.settings.tool("criu")
    if not os.access(criu, os.X_OK):
        v.add("CRIU_MISSING", f"{criu} not found")
        return
    version = criu_node.parse_version(ctx.host.run([criu, "--version"], 10).stdout)
    # The verdict names the release (major.minor), as it always has.
    v.facts["criu_version"] = ".".join(map(str, version[:2])) or None
    if problem := criu_node.version_problem(version, criu):
        v.add(*problem)


def _criu_plugin(v: Verdict) -> None:
    """CRIU's own CUDA plugin locks at seize and checkpoints at dump on its
    own: after cudahook's checkpoint its lock fails ("illegal state") and
    the dump with it; its restore has no device map, no rollback, no VMM
    step, and runs before post-resume. Two owners of one process's CUDA
    state is never safe."""
    v.checked.append("criu cuda plugin")
    plugins = criu_node.cuda_plugins()
    if plugins:
        verb = "restore" if v.side == "restore" else "checkpoint"
        v.add("CRIU_CUDA_PLUGIN", f"CRIU's own CUDA plugin is installed ({', '.join(plugins)}) "
              f"and would {verb} the same processes")


def _members(ctx: Context, init_pid: int | None) -> tuple[list[int], str] | None:
    """The container's processes (and how they were found), read once for
    the stopped check, discovery and the image size; None when unreadable
    (discovery then says why)."""
    from cudahook.core.discovery import container_pids

    if init_pid is None:
        return None
    try:
        return container_pids(ctx.host, init_pid)
    except Exception:
        return None


def _may_use_a_gpu(ctx: Context, pids: list[int] | None,
                   members: tuple[list[int], str] | None) -> bool:
    """Whether any process may be CUDA's: pids named, members unknown, or
    one holding an NVIDIA device file (what pre-dump's discovery asks)."""
    from cudahook.core.discovery import has_device_fd

    if pids or members is None:
        return True
    for pid in members[0]:
        with contextlib.suppress(Exception):  # gone or unreadable: discovery says more
            if has_device_fd(ctx.host, pid, ctx.settings.device_regex):
                return True
    return False


def _stopped(ctx: Context, v: Verdict, pids: list[int], *, traced: bool) -> bool:
    """A stopped process (SIGSTOP, or a tracer's stop) makes every
    cuda-checkpoint call hang. `traced`: also a process a tracer holds while
    it runs - CRIU cannot seize it, and its dump fails (cleanly: pre-dump
    leaves that to CRIU and the guardian)."""
    v.checked.append("stopped")
    bad = []
    for pid in pids:
        with contextlib.suppress(Exception):
            if ctx.host.stopped(pid, traced=traced):
                bad.append(pid)
    if bad:
        v.add("PROCESS_STOPPED", "pid(s) " + ", ".join(map(str, bad)) + " stopped or traced")
    return bool(bad)


def _discover(ctx: Context, v: Verdict, init_pid: int | None, pids: list[int] | None,
              *, every: bool, members: tuple[list[int], str] | None
              ) -> tuple[Discovery, list[CudaProcess]] | None:
    """`every`: probe every process of the container, not only those with
    NVIDIA device files open - an already checkpointed process holds none,
    and a dump would take it without its GPU state. One driver probe per
    process: for `cudahook check`, not for pre-dump."""
    from cudahook.core.discovery import CudaProcess, Discovery, discover

    v.checked.append("processes")
    try:
        if init_pid is not None:
            found = discover(ctx.host, ctx.backend, init_pid, ctx.settings.device_regex,
                             require_device_fd=not every, max_parallel=ctx.settings.max_parallel,
                             members=members)
            v.warnings += found.warnings
            return found, list(found.processes)
        found = Discovery(init_pid=0, scope="pids", scanned=len(pids or []))
        procs = []
        for pid in pids or []:
            procs.append(CudaProcess(pid, ctx.host.nspid(pid)))
        found.processes = procs
        return found, procs
    except CudahookError as exc:
        # The driver's version unknown, or no tool: that, not the processes.
        v.add(exc.reason or ("DRIVER_UNKNOWN" if exc.exit_code == Exit.ENVIRONMENT
                             else "PROCESS_UNREADABLE"), str(exc))
    except Exception as exc:  # a process gone or unreadable: say which, do not guess
        v.add("PROCESS_UNREADABLE", f"{type(exc).__name__}: {exc}")
    return None


def _nvml(ctx: Context, v: Verdict, found: Discovery, procs: list[CudaProcess]) -> None:
    """Device files CRIU cannot dump: those of a process that is not CUDA
    (an NVML monitor), and NVML handles a CUDA process holds beside its CUDA
    context (libnvidia-ml mapped): the CUDA checkpoint releases only CUDA's."""
    from cudahook.core.discovery import describe_holders, device_files

    v.checked.append("nvml")
    regex = ctx.settings.device_regex
    others = {pid: files for pid in found.skipped
              if (files := device_files(ctx.host, pid, regex))}
    if others:
        v.add("NVML_FDS", describe_holders(others, "not a CUDA process, e.g. NVML"))
    # Loaded is not holding handles (many programs load NVML and shut it
    # down): only a warning. Pre-dump finds the handles themselves right
    # after the CUDA checkpoint, and then puts every process back.
    nvml = [p.pid for p in procs if _maps_nvml(ctx, p.pid)]
    if nvml:
        v.warnings.append("CUDA process(es) " + ", ".join(map(str, nvml)) + " load NVML "
                          "(libnvidia-ml): NVML handles still open at the checkpoint make "
                          "CRIU's dump fail (NVML_FDS)")


def _maps_nvml(ctx: Context, pid: int) -> bool:
    try:
        return "/libnvidia-ml.so" in ctx.host.read(pid, "maps")
    except Exception:
        return False


def _states(ctx: Context, v: Verdict, procs: list[CudaProcess]) -> None:
    from cudahook.core.backends import CHECKPOINTED, FAILED, LOCKED, RUNNING

    v.checked.append("states")
    states: dict[int, str] = {}
    for p in procs:
        if p.state:
            states[p.pid] = p.state
            continue
        try:
            states[p.pid] = ctx.engine.read_state(p.pid)
        except Exception as exc:
            v.add("PROCESS_UNREADABLE", f"pid {p.pid}: {exc}")
    v.facts["states"] = {str(k): s for k, s in states.items()}
    codes = {FAILED: "PROCESS_FAILED", LOCKED: "PROCESS_LOCKED", CHECKPOINTED: "PROCESS_CHECKPOINTED"}
    for pid, state in sorted(states.items()):
        if state != RUNNING:
            v.add(codes.get(state, "PROCESS_BUSY"), f"pid {pid} is {state}")


def _job_support(ctx: Context, v: Verdict, feats: Any, procs: list[CudaProcess]) -> None:
    from cudahook.core.engine import JOB_FILE_ENV

    if feats.launch_job:
        return
    jobs = []
    for p in procs:
        with contextlib.suppress(Exception):
            if ctx.host.environ(p.pid, JOB_FILE_ENV):
                jobs.append(p.pid)
    if jobs:
        v.add("DRIVER_TOO_OLD", f"pid(s) {', '.join(map(str, jobs))} run as a "
              f"cuda-checkpoint --launch-job job; driver {feats.version} cannot drive one (R590+)")


def _vmm(ctx: Context, v: Verdict, procs: list[CudaProcess]) -> None:
    from cudahook.vmm import coordinator as vmm

    v.checked.append("vmm")
    try:
        detection = vmm.detect(ctx.host, procs)
    except vmm.VmmRefused as exc:
        v.add("VMM_SOCKETS_INCOMPLETE", str(exc))
        return
    v.facts["vmm"] = detection.participates
    if detection.participates and not os.access(ctx.settings.tool("vmm_coordinator"), os.X_OK):
        v.add("VMM_COORDINATOR_MISSING", f"not executable: {ctx.settings.tool('vmm_coordinator')}")


def _persistence(ctx: Context, v: Verdict, container: str | None) -> None:
    """With persistence off the driver tears a GPU down once its last client
    is gone, and a checkpointed process is no client: the restore then
    meets a GPU that must initialise again, or fails."""
    from .containers import visible_gpus

    v.checked.append("persistence")
    try:
        gpus = ctx.gpus
    except CudahookError as exc:
        v.add("GPU_QUERY_FAILED", str(exc))
        return
    record = ctx.store.find(container) if container else None
    wanted = set(visible_gpus(record) or [])
    use = [g for g in gpus if not wanted or "all" in wanted or g.uuid in wanted
           or str(g.index) in wanted]
    off = [str(g.index) for g in use if g.persistence is False]
    if off:
        v.add("PERSISTENCE_OFF", f"disabled on GPU {', '.join(off)}")


APPS_QUERY = ("--query-compute-apps=pid,used_memory", "--format=csv,noheader,nounits")


class _Background:
    """fn() in a thread, from start() on; its result (or exception) at
    `result` (which starts it, if nobody did)."""

    def __init__(self, fn: Any, *, start: bool = True):
        import threading

        self._box: list[tuple[bool, Any]] = []
        self._thread = threading.Thread(target=self._run, args=(fn,), daemon=True)
        self._started = False
        if start:
            self.start()

    def start(self) -> None:
        if not self._started:
            self._started = True
            self._thread.start()

    def _run(self, fn: Any) -> None:
        try:
            self._box.append((True, fn()))
        except BaseException as exc:  # handed to whoever asks for the result
            self._box.append((False, exc))

    def join(self) -> None:
        if self._started:
            self._thread.join()

    def result(self) -> Any:
        self.start()
        self._thread.join()
        ok, value = self._box[0]
        if not ok:
            raise value
        return value


def _gpu_memory(v: Verdict, procs: list[CudaProcess], apps: _Background) -> dict[int, int] | None:
    """Bytes of GPU memory each CUDA process uses (nvidia-smi
    --query-compute-apps); None when nvidia-smi cannot say."""
    v.checked.append("gpu memory")
    try:
        r = apps.result()
    except Exception as exc:
        v.warnings.append(f"GPU memory in use unknown: nvidia-smi: {exc}")
        return None
    if not r.ok:
        v.warnings.append("GPU memory in use unknown: nvidia-smi --query-compute-apps failed")
        return None
    wanted = {p.pid for p in procs}
    used: dict[int, int] = {}
    for line in r.stdout.splitlines():
        cols = [c.strip() for c in line.split(",")]
        if len(cols) != 2 or not cols[0].isdigit():
            continue
        pid = int(cols[0])
        if pid in wanted and cols[1].isdigit():
            used[pid] = used.get(pid, 0) + (int(cols[1]) << 20)
    missing = wanted - set(used)
    if missing:
        v.warnings.append("GPU memory in use unknown for pid(s) "
                          + ", ".join(map(str, sorted(missing))) + " (not in nvidia-smi's list)")
    v.facts["gpu_memory_bytes"] = sum(used.values())
    return used


def _host_memory(ctx: Context, v: Verdict, procs: list[CudaProcess],
                 gpu: dict[int, int] | None) -> None:
    """The host path: a checkpoint copies each process's GPU memory into its
    own host memory; the host, and each process's memory cgroup, must have
    room. (On the storage path it never enters host memory: the staging
    buffers are the helper's, a few chunks per GPU.)"""
    if not gpu:
        return
    v.checked.append("host memory")
    need = sum(gpu.values())
    avail = mem_available(ctx.host.proc)
    v.facts["host_memory_available_bytes"] = avail
    if avail is not None and need > avail:
        v.add("HOST_MEMORY", f"GPU memory in use {_mib(need)} > host MemAvailable {_mib(avail)}")
        return
    by_cgroup: dict[str, tuple[int, int]] = {}
    for p in procs:
        room = ctx.host.memory_room(p.pid)
        if room is not None:
            where, left = room
            by_cgroup[where] = (left, by_cgroup.get(where, (left, 0))[1] + gpu.get(p.pid, 0))
    for where, (left, wants) in sorted(by_cgroup.items()):
        if wants > left:
            v.add("HOST_MEMORY", f"GPU memory in use {_mib(wants)} > {_mib(left)} left under "
                  f"the memory limit of cgroup {where}")


def _storage_space(v: Verdict, image_dir: Path | None, gpu: dict[int, int] | None) -> None:
    """The storage path: the GPU memory is written, whole, into the image
    directory (`cudahook-gpu/`), so its file system must have room for all of
    it. Dedupe and compression may save space but are never counted on: a
    disk that fills mid-copy fails with the processes locked. Pre-dump's
    preallocation refuses the same way (IMAGE_SPACE) before locking."""
    if not gpu:
        return
    v.checked.append("image space for GPU memory")
    need = sum(gpu.values()) + STORAGE_SLACK
    if image_dir is None:
        v.warnings.append(f"storage path: {_mib(need)} of GPU memory will be written into the "
                          "image directory; its free space is not checked (give --image-dir)")
        return
    free = _free_bytes(v, image_dir)
    if free is None:
        return
    v.facts.update(image_gpu_bytes=need, image_free_bytes=free)
    if need > free:
        v.add("IMAGE_SPACE", f"storage path: GPU memory {_mib(need)} (with {_mib(STORAGE_SLACK)} "
              f"for its manifests; dedupe and compression not counted on) > {_mib(free)} free "
              f"on the file system of {image_dir}")


def _free_bytes(v: Verdict, image_dir: Path) -> int | None:
    """Bytes free to an unprivileged writer on image_dir's file system;
    None, said as IMAGE_SPACE, when it cannot be asked."""
    try:
        st = os.statvfs(image_dir)
    except OSError as exc:
        v.add("IMAGE_SPACE", f"{image_dir}: {exc.strerror}")
        return None
    return st.f_bavail * st.f_frsize


def _image_space(ctx: Context, v: Verdict, pids: list[int], image_dir: Path,
                 gpu: dict[int, int] | None, *, storage: bool = False) -> None:
    """The whole image: CRIU's (the processes' memory), plus the GPU memory,
    inside it on the host path and beside it in `cudahook-gpu/` on the
    storage path."""
    if storage and any(p.code == "IMAGE_SPACE" for p in v.problems):
        return  # the GPU memory alone does not fit: said once
    v.checked.append("image space")
    # What CRIU writes of a process's memory: its anonymous and shared
    # pages, resident or swapped (file-backed pages are not dumped).
    rss = 0
    for pid in pids:
        with contextlib.suppress(Exception):
            status = ctx.host.status(pid)
            rss += sum(int(status.get(k, "0 kB").split()[0]) << 10
                       for k in ("RssAnon", "RssShmem", "VmSwap"))
    need = rss + sum((gpu or {}).values()) + (STORAGE_SLACK if storage and gpu else 0)
    free = _free_bytes(v, image_dir)
    if free is None:
        return
    v.facts.update(image_expected_bytes=need, image_free_bytes=free)
    if need > free:
        gpu_part = "GPU memory in cudahook-gpu/" if storage else "GPU memory"
        v.add("IMAGE_SPACE", f"expected image {_mib(need)} (anonymous process memory "
              f"{_mib(rss)} + {gpu_part}) > {_mib(free)} free in {image_dir}")


def mem_available(proc: Path) -> int | None:
    try:
        for line in (proc / "meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return None


def _mib(n: int) -> str:
    return f"{n / (1 << 20):.0f} MiB"


# == restore side ===============================================================


# restore_checks reads the image's manifest itself.
_READ: Any = object()


def read_manifest(image_dir: Path) -> Manifest | CudahookError | None:
    """The image's manifest as restore_checks takes it: None when the image
    holds no CUDA state, the error when it is unreadable (the checks'
    MANIFEST_UNREADABLE, not bad input)."""
    try:
        return manifest.read(image_dir)
    except CudahookError as exc:
        return exc


def restore_checks(ctx: Context, image_dir: Path, record: dict[str, Any] | None,
                   opts: ann.Options, *, use_cache: bool = True,
                   found: Manifest | CudahookError | None = _READ,
                   quick: bool = False) -> Verdict:
    """Whether this image can be restored on this node; the device map in
    facts["device_map"] when it can. Refusals that no retry on this node can
    change are remembered (see `_cache_key`).

    `found` is the image's manifest as the caller read it (read_manifest):
    the checks judge the very manifest the restore goes on to use, and the
    file is not opened again (it is read here when not given). The verdict
    carries it (`manifest`)."""
    from cudahook.vmm import coordinator as vmm

    from .restore_gate import plan_restore

    v = Verdict("restore", {"image": str(image_dir)})
    v.checked.append("manifest")
    if found is _READ:
        found = read_manifest(image_dir)
    if isinstance(found, CudahookError):
        v.add("MANIFEST_UNREADABLE", str(found))
        return v
    if found is None:
        v.facts["manifest"] = False  # no CUDA state: nothing of cudahook's to check
        return v
    m = v.manifest = found
    v.facts.update(manifest=True, container=m.container_id, driver_version=m.driver_version,
                   gpus=list(m.gpus), vmm=m.vmm, gpu_memory_bytes=m.gpu_memory_bytes)
    key = _cache_key(ctx, m, record, opts) if use_cache else None
    if key and (cached := _cache_get(ctx, key)) is not None:
        cached.manifest = m
        return cached
    storage = _integrity(ctx, v, image_dir, m, quick)
    if m.vmm and not vmm.has_state(image_dir):
        v.add("IMAGE_FILE_MISSING", f"the checkpoint took the CUDA VMM interposer's state, but "
              f"the image has no regular {vmm.STATE_FILE}")
    _criu_plugin(v)
    v.checked.append("driver, GPUs, device map")
    try:
        v.facts["device_map"] = plan_restore(ctx, record, opts, m)
    except CudahookError as exc:
        v.add(exc.reason or "DRIVER_UNKNOWN", str(exc))
    if m.vmm:
        v.checked.append("vmm coordinator")
        if not os.access(ctx.settings.tool("vmm_coordinator"), os.X_OK):
            v.add("VMM_COORDINATOR_MISSING",
                  f"the image needs it: not executable: {ctx.settings.tool('vmm_coordinator')}")
    _custom_storage(v, m, storage)
    if not v.problems:
        _restore_persistence(ctx, v, v.facts.get("device_map"), m)
    if key and v.problems and all(p.reason.cacheable for p in v.problems):
        _cache_put(ctx, key, v)
    return v


def _integrity(ctx: Context, v: Verdict, image_dir: Path, m: Manifest,
               quick: bool) -> tuple[bool, str] | None:
    """Every file the manifest names, checked; for an image with its GPU
    memory in storage, the driver asked meanwhile whether it has custom
    storage (its attach overlaps the hashing): the answer, or None."""
    asking = _ask_custom_storage(ctx, m)
    v.checked.append("integrity")
    try:
        found = manifest.verify_files(image_dir, m, quick)
    finally:
        storage = _custom_storage_answer(ctx, asking)
    for name, problem in found:
        if problem == "checksum":
            v.add("IMAGE_CHECKSUM", f"{name}: its digest or size differs from the manifest's")
        else:
            v.add("IMAGE_FILE_MISSING", f"{name}: {problem}")
    return storage


def _ask_custom_storage(ctx: Context, m: Manifest) -> Any:
    """For an image with its GPU memory in storage: the driver asked, on a
    thread started now, whether it has custom storage - its attach (a
    second or more) runs while the chunks are hashed. None for another image.
    `_custom_storage_answer` waits for it."""
    if m.gpu_storage is None:
        return None
    import threading

    from cudahook.core.backends import probe

    box: list[tuple[bool, str]] = []

    def ask() -> None:
        try:
            f = probe(ctx.backend)
            box.append((f.custom_storage, f.custom_storage_why))
        except CudahookError as exc:
            box.append((False, str(exc)))
        except Exception as exc:  # a bug refuses the image, never passes it
            box.append((False, f"the driver could not be asked: {exc!r}"))

    t = threading.Thread(target=ask, daemon=True)
    t.start()
    return t, box


def _custom_storage_answer(ctx: Context, asking: Any) -> tuple[bool, str] | None:
    """The answer `_ask_custom_storage` asked for (its attach has its own
    deadline), the probe's driver attach ended with it."""
    if asking is None:
        return None
    t, box = asking
    try:
        t.join()
    finally:
        ctx.engine.end_phase()  # no driver call outlives the check
    return box[0] if box else (False, "the driver could not be asked")


def _custom_storage(v: Verdict, m: Manifest, answer: tuple[bool, str] | None) -> None:
    """An image with its GPU memory in storage restores only through custom
    storage: a driver or backend without it is refused now, cleanly, not
    found out at post-resume with the tasks running."""
    if m.gpu_storage is None or answer is None:
        return
    v.checked.append("custom storage")
    have, why = answer
    if not have:
        v.add("GPU_STORAGE_UNAVAILABLE", f"the image holds its GPU memory in storage: {why}")


def _restore_persistence(ctx: Context, v: Verdict, mapping: dict[str, str] | None,
                         m: Manifest) -> None:
    v.checked.append("persistence")
    targets = set((mapping or {}).values()) or set(m.gpus)
    try:
        off = [str(g.index) for g in ctx.gpus if g.uuid in targets and g.persistence is False]
    except CudahookError as exc:
        v.add("GPU_QUERY_FAILED", str(exc))
        return
    if off:
        v.add("PERSISTENCE_OFF", f"disabled on GPU {', '.join(off)}")


def node_identity(ctx: Context) -> str | None:
    """This node as a restore verdict depends on it: the boot (GPUs and
    driver only change across one, MIG aside), the host and the driver.
    None when it cannot be told cheaply: nothing is then remembered."""
    import hashlib

    try:
        boot = (ctx.host.proc / "sys/kernel/random/boot_id").read_text().strip()
        with open(ctx.settings.driver_version_file, "rb") as f:
            driver = f.read(4096)
    except OSError:
        return None
    h = hashlib.sha256()
    for part in (boot.encode(), os.uname().nodename.encode(), driver,
                 ctx.settings.nvidia_smi.encode(), ctx.settings.cuda_checkpoint.encode()):
        h.update(part + b"\0")
    return h.hexdigest()


def _cache_key(ctx: Context, m: Manifest, record: dict[str, Any] | None,
               opts: ann.Options) -> str | None:
    import hashlib

    from .containers import visible_gpus

    node = node_identity(ctx)
    # The digest of the bytes the checks judged: never a second read of a
    # file that may have been replaced since.
    if node is None or m.digest is None:
        return None
    h = hashlib.sha256(f"{m.digest}\0{node}\0{visible_gpus(record)}\0{opts.device_map}".encode())
    return h.hexdigest()[:32]


def _cache_path(ctx: Context, key: str) -> Path:
    return Path(ctx.settings.state_dir) / "verdicts" / f"{key}.json"


def _cache_get(ctx: Context, key: str) -> Verdict | None:
    from cudahook.platform.store import read_json

    data = read_json(_cache_path(ctx, key))
    if not isinstance(data, dict) or time.time() - float(data.get("time") or 0) > VERDICT_CACHE_TTL_S:
        return None
    v = Verdict.from_dict(data)
    if not v.problems or not v.never_here:
        return None
    v.cached = True
    return v


def _cache_put(ctx: Context, key: str, v: Verdict) -> None:
    from cudahook.platform.atomic import write_json_atomic
    from cudahook.platform.privdir import private_subdir

    with contextlib.suppress(OSError, CudahookError):
        where = _cache_path(ctx, key)
        private_subdir(ctx.settings.state_dir, where.parent.name)
        write_json_atomic(where, v.to_dict())
        prune_cache(ctx)


# At most this many remembered verdicts (the state directory is RAM).
MAX_CACHED = 256


def prune_cache(ctx: Context) -> None:
    d = Path(ctx.settings.state_dir) / "verdicts"
    with contextlib.suppress(OSError):
        files = sorted(d.glob("*.json"), key=lambda p: p.stat().st_mtime, reverse=True)
        cutoff = time.time() - VERDICT_CACHE_TTL_S
        for i, p in enumerate(files):
            if i >= MAX_CACHED or p.stat().st_mtime < cutoff:
                p.unlink(missing_ok=True)


def write_verdict(ctx: Context, image_dir: Path, v: Verdict) -> Path | None:
    """Keep the verdict on this image, keyed by its manifest's digest, in
    the state directory: the image itself is never written at restore (a
    refused restore leaves it byte for byte as it was). Never fatal: the
    verdict is a report, the refusal stands without it."""
    from cudahook.platform.atomic import write_json_atomic
    from cudahook.platform.privdir import private_subdir

    try:
        # The manifest the checks judged, not the file as it is now.
        judged = v.manifest.digest if v.manifest is not None else None
        digest = judged or manifest.digest(image_dir)
        d = private_subdir(ctx.settings.state_dir, "verdicts")
        path = d / f"image-{digest[:32]}.json"
        write_json_atomic(path, {**v.to_dict(), "node": node_identity(ctx),
                                 "manifest_sha256": digest})
        prune_cache(ctx)
        return path
    except (OSError, CudahookError):
        return None


def last_verdict(ctx: Context, image_dir: Path) -> dict[str, Any] | None:
    """The verdict a restore of this image last got on this node, if kept."""
    from cudahook.platform.store import read_json

    try:
        digest = manifest.digest(image_dir)
    except (OSError, CudahookError):
        return None
    data = read_json(Path(ctx.settings.state_dir) / "verdicts" / f"image-{digest[:32]}.json")
    return data if isinstance(data, dict) else None


class Refused(CudahookError):
    """A hook's refusal on a verdict: its message, its exit code, its first reason."""

    def __init__(self, v: Verdict, where: str):
        super().__init__(f"{where}: {v.message()}",
                         reason=v.problems[0].code if v.problems else None)
        self.exit_code = Exit(v.hook_exit)
        self.verdict = v


def remember(ctx: Context, cid: str | None, v: Verdict) -> None:
    """The container's last verdict, for `cudahook status` and the metrics;
    never fatal."""
    from . import results

    results.remember(ctx, cid, "check", **v.summary())
