"""CUDA VMM interposer support (the ai-dynamo/snapshot contract).

Workloads that share CUDA VMM allocations run with an LD_PRELOAD shim whose
mappings cuda-checkpoint alone does not save. Each shim listens on
/snapshot-control/cuda-vmm-<nspid>.sock inside its container; a coordinator
saves their state into the checkpoint before the CUDA lock, and replays it
into the restored processes afterwards.

A container where only some CUDA processes have a shim, or where a process
has the shim loaded (seen in its mappings) without a socket of its own (the
process listening on it, checked by SO_PEERCRED), cannot be checkpointed
consistently, so it is refused before anything is touched.
The container owns /snapshot-control: it is examined without following any
symlink (see sockets.py), so a container cannot point the hook at host paths.
"""

from __future__ import annotations

import os
import re
import stat
import time
from collections.abc import Callable, Sequence
from pathlib import Path

from cudahook.core.discovery import CudaProcess
from cudahook.platform.errors import CudahookError, EnvironmentProblem
from cudahook.platform.host import Host, ProcessGone
from cudahook.platform.record import Record

from .sockets import owned_socket

CONTROL_DIR = "/snapshot-control"
STATE_FILE = "cuda-vmm.state"
# The coordinator's saved state is copied out of the image at post-restore
# when the image directory is out of reach by post-resume; nothing larger.
MAX_STATE_BYTES = 1 << 30


class VmmRefused(CudahookError):
    """The interposer is present where its state cannot all be saved."""

    reason = "VMM_SOCKETS_INCOMPLETE"


class CoordinatorFailed(CudahookError):
    pass


# The interposer is an LD_PRELOAD shim: its library shows in the process's
# mappings whether or not its socket is where the hook looks.
SHIM_LIBRARY = re.compile(r"/lib[^/\s]*cuda[-_]?vmm[^/\s]*\.so(\.[0-9]+)*( \(deleted\))?$")
# Reads under /proc/PID/root and of /proc/PID/maps can block (a FUSE mount,
# a paused container, a process stuck in a page fault): each process's look
# runs in a worker that is abandoned after this long.
SCAN_TIMEOUT_S = 10.0


class Detection(Record, frozen=True):
    with_socket: list[CudaProcess]
    without: list[CudaProcess]
    # name -> [st_dev, st_ino] of each process's own socket, for poststop
    sockets: dict[str, list[int]] = {}  # (a fresh dict for each: see Record)

    @property
    def participates(self) -> bool:
        return bool(self.with_socket) and not self.without


class _Look(Record, frozen=True):
    shim: bool
    socket: tuple[str, int, int] | None


def has_shim(host: Host, pid: int) -> bool:
    return any(SHIM_LIBRARY.search(line) for line in host.read(pid, "maps").splitlines())


def _look(host: Host, p: CudaProcess) -> _Look:
    return _Look(has_shim(host, p.pid),
                 owned_socket(p.nspid, p.pid, CONTROL_DIR, str(host.proc / str(p.pid) / "root")))


def _with_deadline(fn: Callable[[], _Look], timeout: float) -> _Look | BaseException | None:
    """fn's result or exception, or None if it has not returned in time (its
    thread is left behind: a blocked read cannot be interrupted)."""
    box: list[_Look | BaseException] = []

    def run() -> None:
        try:
            box.append(fn())
        except BaseException as exc:  # reported to the caller, below
            box.append(exc)

    import threading  # here: only a VMM scan needs it at hook start

    t = threading.Thread(target=run, name="vmm-scan", daemon=True)
    t.start()
    t.join(timeout)
    return box[0] if box else None


def detect(host: Host, procs: Sequence[CudaProcess], timeout: float | None = None) -> Detection:
    """Which CUDA processes have their own interposer socket; refuses any set
    where the interposer is present and a process lacks its socket."""
    limit = SCAN_TIMEOUT_S if timeout is None else timeout
    deadline = time.monotonic() + limit
    looks: dict[int, _Look] = {}
    for p in procs:
        got = _with_deadline(lambda p=p: _look(host, p), max(0.0, deadline - time.monotonic()))
        if got is None:
            raise VmmRefused(
                f"cannot inspect pid {p.pid} for the CUDA VMM interposer within {limit:g}s "
                f"(a blocked {CONTROL_DIR} or a stuck process?): refusing the checkpoint")
        if isinstance(got, BaseException):
            if isinstance(got, ProcessGone):
                raise VmmRefused(f"pid {p.pid} exited while looking for the CUDA VMM "
                                 "interposer: refusing the checkpoint")
            raise VmmRefused(f"cannot inspect pid {p.pid} for the CUDA VMM interposer "
                             f"({type(got).__name__}: {got}): refusing the checkpoint")
        looks[p.pid] = got
    have = [p for p in procs if looks[p.pid].socket]
    lack = [p for p in procs if not looks[p.pid].socket]
    shimmed = [p for p in lack if looks[p.pid].shim]
    if lack and (have or shimmed):
        names = ", ".join(
            f"pid {p.pid} (namespace pid {p.nspid}"
            + (", interposer loaded" if looks[p.pid].shim else "") + ")" for p in lack)
        raise VmmRefused(
            f"CUDA VMM interposer active in {len(have) + len(shimmed)} of {len(procs)} CUDA "
            f"processes; no {CONTROL_DIR}/cuda-vmm-<pid>.sock of its own for {names}: "
            "refusing the checkpoint")
    sockets = {s[0]: [s[1], s[2]] for p in have if (s := looks[p.pid].socket)}
    return Detection(have, lack, sockets)


def has_state(image_dir: Path) -> bool:
    """A regular file, not a link or anything else the image might hold."""
    try:
        return stat.S_ISREG(os.lstat(image_dir / STATE_FILE).st_mode)
    except OSError:
        return False


def locate_state(image_dir: Path, private_copy: Path) -> str | None:
    """Where the coordinator will find cuda-vmm.state after the restore, if
    the image has one.

    CRIU hands the action script the image directory as a /proc/<criu>/fd/N
    path, and that fd is closed by post-resume: resolve the directory's real
    path now, and if that is not reachable, keep a private copy.
    """
    if not has_state(image_dir):
        return None
    real = os.path.realpath(image_dir)
    if os.path.isdir(real) and has_state(Path(real)):
        return real
    from cudahook.platform.privdir import ensure_private_dir

    ensure_private_dir(private_copy)
    (private_copy / STATE_FILE).unlink(missing_ok=True)  # CRIU's second call copies again
    copy_state(image_dir, private_copy, "post-restore")
    return str(private_copy)


def copy_state(image_dir: Path, into: Path, what: str) -> None:
    """Copy the image's cuda-vmm.state into the directory `into`. The image
    is the container's to fill: the state file is read without following a
    link, only if it is a regular file, capped and under a deadline (a FIFO
    or a hung mount never holds the hook). EnvironmentProblem if refused."""
    from cudahook.platform import safeio

    try:
        safeio.copy_file(image_dir / STATE_FILE, into / STATE_FILE, MAX_STATE_BYTES)
    except safeio.FileRefused as exc:
        raise EnvironmentProblem(f"{what}: {STATE_FILE}: {exc}") from exc


def _args(op: str, proc_root: str, directory: Path, procs: Sequence[tuple[int, int]]) -> list[str]:
    args = [f"--{op}", "--proc-root", proc_root, "--checkpoint-dir", str(directory)]
    for host_pid, nspid in procs:
        args += ["--process", str(host_pid), str(nspid)]
    return args


def run_coordinator(host: Host, coordinator: str, op: str, proc_root: str, directory: Path,
                    procs: Sequence[tuple[int, int]], timeout: float) -> str:
    """Run `--prepare` or `--restore`; its combined output, for the log."""
    if not os.access(coordinator, os.X_OK):
        raise EnvironmentProblem(f"CUDA VMM coordinator not executable: {coordinator}",
                                 reason="VMM_COORDINATOR_MISSING")
    result = host.run([coordinator, *_args(op, proc_root, directory, procs)], timeout)
    output = (result.stdout + result.stderr).strip()
    if result.timed_out:
        raise CoordinatorFailed(f"CUDA VMM coordinator --{op} timed out after {timeout:g}s")
    if result.returncode != 0:
        last = output.splitlines()[-1] if output else ""
        raise CoordinatorFailed(
            f"CUDA VMM coordinator --{op} failed (exit {result.returncode}): {last}")
    return output
