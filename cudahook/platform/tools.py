"""Running outside tools (cuda-checkpoint, nvidia-smi, the VMM coordinator,
the driver-API helper) with a deadline that really ends the wait - and that
never outlive the hook that started them.

A driver call left running after its hook died would finish a checkpoint
(or a restore) after the guardian judged the workload: checkpointed, off its
GPU, with nobody left to bring it back. Two independent bindings close that:

1. Each call's child is bound to the hook process: PR_SET_PDEATHSIG(SIGKILL),
   set before exec, then a check that the hook still lives (it may have died
   between fork and prctl). The signal fires on the death of the THREAD that
   forked the child, not of the process, so every call is forked by one
   thread that lasts as long as the hook (`_Spawner`), never by a worker
   thread that may end while its call (the driver-API helper serves a whole
   phase) still runs.
2. Each call carries, in its environment, the name of the phase that started
   it (`CALLS_ENV`, set by `own_calls` and written into the run's progress
   record before the first call). The environment is inherited by whatever
   the call starts in turn, in whatever group or session it moves to, and it
   is known before any fork - unlike a process-group id, which exists only
   after the fork (a window in which a hook can die unrecorded), can be left
   with setsid(), and is reused once empty. Whoever judges the workload after
   a hook died (the guardian, the restore watcher) first kills every process
   that carries the name (`end_calls`) and waits until none is left.

Each call still runs in a session of its own: a deadline kills the call's
whole group (cuda-checkpoint may leave helpers), and a runtime that kills
the hook's group kills the calls through 1 and 2, not through the group.
"""

from __future__ import annotations

import contextlib
import os
import time
from collections.abc import Sequence
from pathlib import Path

from .record import Record

# typing costs milliseconds at every hook start: annotations only.
TYPE_CHECKING = False
if TYPE_CHECKING:
    import subprocess
    from typing import Any

# After the deadline kills a tool's process group, how long to wait for its
# pipes to close. A tool stuck in the driver (D state) cannot die, and a
# helper it left in another session can hold the pipes open forever: past
# this grace the call is abandoned, not waited for.
KILL_GRACE_S = 2.0


class RunResult(Record, frozen=True):
    argv: tuple[str, ...]
    returncode: int | None  # None when the deadline killed it
    stdout: str
    stderr: str
    duration: float
    timed_out: bool = False

    @property
    def ok(self) -> bool:
        return self.returncode == 0 and not self.timed_out


class ToolRunner:
    """Mixin of Host: its `env` is the tools' environment."""

    env: dict[str, str] | None

    def run(self, argv: Sequence[str], timeout: float) -> RunResult:
        """Run a tool with a hard deadline.

        The tool is bound to this process (see the module notes) and gets
        its own process group; on expiry the whole group is killed:
        cuda-checkpoint may leave helpers behind, and a hung helper holding
        the driver would wedge every later call. The wait after the
        kill is bounded too (KILL_GRACE_S): the caller gets a timed-out
        result even when the process cannot be reaped.
        """
        # Here, not at module level: subprocess (with signal, selectors and
        # threading) costs every hook start milliseconds, and many hook runs
        # (CRIU's duplicate calls, every OCI hook) run no tool.
        import signal
        import subprocess

        start = time.monotonic()
        try:
            child = spawn(
                list(argv),
                stdin=subprocess.DEVNULL,
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                env=self.env,
                text=True,
                errors="replace",
            )
        except OSError as exc:
            return RunResult(tuple(argv), 127, "", f"{argv[0]}: {exc.strerror}", 0.0)
        try:
            out, err = child.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(child.pid, signal.SIGKILL)
            try:
                out, err = child.communicate(timeout=KILL_GRACE_S)
            except subprocess.TimeoutExpired:
                # Abandoned: close our ends so nothing blocks on them; the
                # process, if it ever dies, is reaped by whoever inherits it.
                for pipe in (child.stdout, child.stderr):
                    with contextlib.suppress(OSError):
                        if pipe is not None:
                            pipe.close()
                out, err = "", f"{argv[0]}: did not exit after SIGKILL; abandoned"
            return RunResult(
                tuple(argv), None, out, err, time.monotonic() - start, timed_out=True
            )
        return RunResult(tuple(argv), child.returncode, out, err, time.monotonic() - start)


# The environment variable naming the phase whose call a process is.
CALLS_ENV = "CUDAHOOK_CALLS_OF"


def own_calls(name: str) -> None:
    """Every call this process starts from now on carries `name` (see the
    module notes); the caller records it where a guardian will look first."""
    os.environ[CALLS_ENV] = name


def calls_env(env: dict[str, str] | None = None) -> dict[str, str]:
    """`env` (default: this process's) without the calls' name: for a
    process that must outlive this one, such as a guardian."""
    out = dict(os.environ if env is None else env)
    out.pop(CALLS_ENV, None)
    return out


def spawn(argv: list[str], **popen: Any) -> subprocess.Popen[Any]:
    """subprocess.Popen in a session of its own, bound to this process
    (PR_SET_PDEATHSIG): forked by the one lasting thread. An environment
    given explicitly still carries the calls' name."""
    env = popen.get("env")
    if env is not None and CALLS_ENV in os.environ:
        popen["env"] = {**env, CALLS_ENV: os.environ[CALLS_ENV]}
    return _Spawner.get().popen(argv, popen)


class _Spawner:
    """The thread that forks every call: it lives as long as the process,
    so a call's parent-death signal fires when the process dies, never when
    the worker thread that asked for the call ends."""

    # _thread, not threading: this module loads at every hook start.
    _lock = __import__("_thread").allocate_lock()
    _one: _Spawner | None = None

    def __init__(self) -> None:
        import ctypes
        import queue
        import threading

        libc = ctypes.CDLL(None, use_errno=True)
        self._prctl = libc.prctl  # resolved here: the child only calls it
        self._parent = os.getpid()
        self._todo: queue.SimpleQueue[tuple[Any, ...]] = queue.SimpleQueue()
        threading.Thread(target=self._serve, name="call-spawner", daemon=True).start()

    @classmethod
    def get(cls) -> _Spawner:
        with cls._lock:
            if cls._one is None or cls._one._parent != os.getpid():  # forked since
                cls._one = _Spawner()
            return cls._one

    def popen(self, argv: list[str], popen: dict[str, Any]) -> subprocess.Popen[Any]:
        import threading

        done = threading.Event()
        box: list[Any] = []
        self._todo.put((argv, popen, box, done))
        done.wait()
        if isinstance(box[0], BaseException):
            raise box[0]
        return box[0]  # type: ignore[no-any-return]

    def _serve(self) -> None:
        import subprocess

        prctl, parent = self._prctl, self._parent

        def bind() -> None:  # in the child, between fork and exec
            prctl(1, 9, 0, 0, 0)  # PR_SET_PDEATHSIG, SIGKILL
            if os.getppid() != parent:  # the hook died before the binding
                os._exit(127)

        while True:
            argv, popen, box, done = self._todo.get()
            try:
                box.append(subprocess.Popen(argv, start_new_session=True,
                                            preexec_fn=bind, **popen))
            except BaseException as exc:  # the caller raises it
                box.append(exc)
            done.set()


#: How much of each process's environment calls_of reads.
ENVIRON_CAP = 256 << 10


def calls_of(name: str, proc: Path | None = None) -> list[tuple[int, int]]:
    """(pid, start time) of every live process that carries the calls' name."""
    root = proc or Path("/proc")
    want = f"{CALLS_ENV}={name}".encode()
    found = []
    me = os.getpid()
    for entry in os.listdir(root):
        if not entry.isdigit() or int(entry) == me:
            continue
        try:
            with open(root / entry / "environ", "rb") as f:
                # Capped: any process's environment may be megabytes (a
                # container's too); the calls' own is the hook's, small.
                if want not in f.read(ENVIRON_CAP).split(b"\0"):
                    continue
            stat = (root / entry / "stat").read_text()
        except OSError:
            continue
        fields = stat[stat.rindex(")") + 2:].split()
        if fields[0] not in "ZX":  # a zombie has ended; its parent reaps it
            found.append((int(entry), int(fields[19])))
    return found


def end_calls(name: str, wait_s: float, proc: Path | None = None) -> list[int]:
    """SIGKILL every process carrying the calls' name (each one's whole group
    when it leads one) and wait until none is left; the PIDs still alive
    after wait_s (stuck in the driver: uninterruptible) - [] when all ended."""
    import signal  # as subprocess: not at module level

    root = proc or Path("/proc")
    deadline = time.monotonic() + wait_s
    while True:
        left = calls_of(name, proc)
        if not left:
            return []
        for pid, start in left:
            with contextlib.suppress(OSError, ValueError, IndexError):
                # Through a pidfd, opened on the process just seen (same start
                # time): a PID reused meanwhile is never hit.
                fd = os.pidfd_open(pid)
                try:
                    stat = (root / str(pid) / "stat").read_text()
                    if int(stat[stat.rindex(")") + 2:].split()[19]) != start:
                        continue
                    if os.getpgid(pid) == pid:
                        os.killpg(pid, signal.SIGKILL)
                    signal.pidfd_send_signal(fd, signal.SIGKILL)
                finally:
                    os.close(fd)
        if time.monotonic() >= deadline:
            return [pid for pid, _ in left]
        time.sleep(0.02)
