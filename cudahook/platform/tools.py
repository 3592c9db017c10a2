"""Running outside tools (cuda-checkpoint, nvidia-smi, the VMM coordinator)
with a deadline that really ends the wait.
"""

from __future__ import annotations

import contextlib
import os
import time
from collections.abc import Sequence

from .record import Record

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

        The tool gets its own process group, and on expiry the whole group is
        killed: cuda-checkpoint may leave helpers behind, and a hung helper
        holding the driver would wedge every later call. The wait after the
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
            child = subprocess.Popen(
                list(argv),
                stdin=subprocess.DEVNULL,
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                start_new_session=True,
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
