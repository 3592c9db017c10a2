"""Runs entry points in-process for the fuzz tests, one case per line.

Started once per test module (tests/test_fuzz_hooks.py, tests/test_fuzz_surfaces.py)
under an address-space limit. Each request (a JSON line on stdin) names the
entry point, its argv, its environment, its stdin and its working directory;
the reply (a JSON line on stdout) gives the exit code, what went to stdout
and stderr, the time taken, any exception that escaped the entry point, any
signal it tried to send to a process the case did not offer as the
container's, and (for the runtime wrapper) the program it would exec.

Entry points: "oci" (the OCI hook), "criu" (the CRIU action script), "cli"
(the admin command line), "wrapper" (the runtime wrapper: its exec of runc is
stopped and reported, runc itself is not under test), "kill_same" (the one
function that signals a container's processes, for the guard's own test).

The test modules import the other end from here: Worker (which starts this
file and kills it on a hang), the bounds every reply is held to
(assert_bounded), and the fresh node root each example runs under.
"""

from __future__ import annotations

import base64
import contextlib
import io
import json
import os
import resource
import select
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import traceback
from pathlib import Path
from typing import Any

MEMORY_LIMIT = 2 << 30  # address space of the worker and of each hook process
SLOW_S = 8.0  # no call may take longer (the longest deadline cudahook has is 10 s)
HANG_S = 2 * SLOW_S  # past this a call is a hang: the worker is killed and the case fails


class Exec(BaseException):
    """The wrapper's exec of runc, stopped: what it would run."""

    def __init__(self, path: str, argv: list[str]) -> None:
        super().__init__(path)
        self.argv = [path, *argv]


def pidfd_target(fd: int) -> int | None:
    """The PID a pidfd refers to, as the kernel reports it."""
    try:
        with open(f"/proc/self/fdinfo/{fd}") as f:
            for line in f:
                if line.startswith("Pid:"):
                    return int(line.split()[1])
    except (OSError, ValueError, IndexError):
        pass
    return None


def main() -> int:
    limit = int(sys.argv[1])
    resource.setrlimit(resource.RLIMIT_AS, (limit, limit))
    # The protocol runs on private copies of fds 0 and 1: a child process the
    # entry point starts inherits /dev/null there, never a request or a reply.
    requests = os.fdopen(os.dup(0), "r")
    out = os.fdopen(os.dup(1), "w")
    null = os.open(os.devnull, os.O_RDWR)
    os.dup2(null, 0)
    os.dup2(null, 1)
    os.close(null)
    real_kill = os.kill
    real_pidfd_send_signal = signal.pidfd_send_signal
    allowed: set[int] = set()
    refused: list[str] = []

    def kill(pid: int, sig: int) -> None:
        if pid not in allowed:
            refused.append(f"kill({pid}, {sig})")
            raise PermissionError(1, "refused by the fuzz harness")
        real_kill(pid, sig)

    def killpg(pgid: int, sig: int) -> None:
        refused.append(f"killpg({pgid}, {sig})")
        raise PermissionError(1, "refused by the fuzz harness")

    def pidfd_send_signal(fd: int, sig: int, siginfo: object = None, flags: int = 0) -> None:
        # A pidfd names its process only through the kernel: ask it which.
        pid = pidfd_target(fd)
        if pid is None or pid not in allowed:
            refused.append(f"pidfd_send_signal(pid {pid}, {sig})")
            raise PermissionError(1, "refused by the fuzz harness")
        real_pidfd_send_signal(fd, sig, siginfo, flags)

    def execv(path: str, argv: list[str]) -> None:
        raise Exec(path, list(argv)[1:])

    os.kill, os.killpg = kill, killpg  # type: ignore[assignment]
    signal.pidfd_send_signal = pidfd_send_signal  # type: ignore[assignment]
    os.execv = execv  # type: ignore[assignment]
    from cudahook.admin import cli
    from cudahook.flow import containers
    from cudahook.hooks import criu_action as criuhook
    from cudahook.hooks import oci_hook as ocihook
    from cudahook.hooks import runtime_wrapper
    from cudahook.platform.host import Host

    def run(case: dict[str, object]) -> int:
        hook, argv = case["hook"], case["argv"]
        if hook == "oci":
            return ocihook.main(argv)  # type: ignore[arg-type]
        if hook == "criu":
            return criuhook.main()
        if hook == "cli":
            return cli.main(argv)  # type: ignore[arg-type]
        if hook == "wrapper":
            return runtime_wrapper.main(argv)  # type: ignore[arg-type]
        if hook == "kill_same":
            pid = int(case["pid"])  # type: ignore[call-overload]
            return int(containers.kill_same(Host(), pid, Host().start_time(pid)))
        raise ValueError(f"no entry point {hook!r}")

    home = os.getcwd()
    for line in requests:
        case = json.loads(line)
        allowed.clear()
        allowed.update(case.get("killable", []))
        refused.clear()
        os.environ.clear()
        os.environ.update(case["env"])
        tempfile.tempdir = None  # read from $TMPDIR again, as a new process would
        os.chdir(case["cwd"])
        sys.stdin = io.TextIOWrapper(io.BytesIO(base64.b64decode(case["stdin"])))
        # "pipe": fd 0 is a pipe nobody writes to (what /proc/self/fd/0 blocks on).
        writer = None
        if case.get("fd0") == "pipe":
            reader, writer = os.pipe()
            os.dup2(reader, 0)
            os.close(reader)
        err, stdout = io.StringIO(), io.StringIO()
        sys.stderr, sys.stdout = err, stdout
        raised, execs = None, None
        t0 = time.monotonic()
        try:
            rc = run(case)
        except Exec as exc:
            rc, execs = 0, exc.argv
        except SystemExit as exc:  # argparse's --help and friends: how the process would end
            rc = exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
        except BaseException:  # the property under test: nothing escapes
            rc = None
            raised = traceback.format_exc()
        took = time.monotonic() - t0
        sys.stderr, sys.stdout = sys.__stderr__, sys.__stdout__
        if writer is not None:
            null = os.open(os.devnull, os.O_RDWR)
            os.dup2(null, 0)
            os.close(null)
            os.close(writer)
        os.chdir(home)
        out.write(json.dumps({"rc": rc, "stderr": err.getvalue(), "stdout": stdout.getvalue(),
                              "seconds": took, "raised": raised, "refused": list(refused),
                              "exec": execs}) + "\n")
        out.flush()
    return 0


# -- the tests' end ---------------------------------------------------------------------------


class Worker:
    """The in-process worker; a call that outlives its deadline kills it (and
    everything it started) and comes back as a hang, and the next call starts
    a fresh one."""

    def __init__(self) -> None:
        self.proc = self._start()

    @staticmethod
    def _start() -> subprocess.Popen[str]:
        return subprocess.Popen([sys.executable, os.path.abspath(__file__), str(MEMORY_LIMIT)],
                                stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
                                cwd="/", start_new_session=True)

    def call(self, case: dict[str, Any], timeout: float = HANG_S) -> dict[str, Any]:
        if self.proc.poll() is not None:
            self.proc = self._start()
        assert self.proc.stdin is not None and self.proc.stdout is not None
        self.proc.stdin.write(json.dumps(case) + "\n")
        self.proc.stdin.flush()
        ready, _, _ = select.select([self.proc.stdout], [], [], timeout)
        if not ready:
            self.kill()
            return {"rc": None, "stderr": "", "stdout": "", "seconds": timeout, "raised": None,
                    "refused": [], "hang": True}
        line = self.proc.stdout.readline()
        assert line, f"the worker died (exit {self.proc.wait()}) on {case}"
        return json.loads(line)  # type: ignore[no-any-return]

    def kill(self) -> None:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.proc.pid, signal.SIGKILL)
        self.proc.wait()

    def close(self) -> None:
        if self.proc.poll() is not None:
            return
        if self.proc.stdin:
            self.proc.stdin.close()
        try:
            self.proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self.kill()


def assert_bounded(result: dict[str, Any], case: str) -> None:
    """What every entry point owes every input, whatever its exit: an answer
    within HANG_S, nothing escaping it, done within SLOW_S, and no signal to
    a process that is not the container's."""
    assert not result.get("hang"), f"no answer within {HANG_S}s: {case}"
    assert result["raised"] is None, f"{case}\n{result['raised']}"
    assert result["seconds"] < SLOW_S, (result["seconds"], case)
    assert not result.get("refused"), (result["refused"], case)


COUNTER = iter(range(10**9))


def new_root(base: Path, *dirs: str) -> Path:
    """A node root of its own for one example (CUDAHOOK_ROOT): var/log, run
    and `dirs`, all empty."""
    root = base / f"case{next(COUNTER)}"
    if root.exists():
        shutil.rmtree(root)
    for d in ("var/log", "run", *dirs):
        (root / d).mkdir(parents=True)
    return root


if __name__ == "__main__":
    sys.exit(main())
