"""Exit codes and the exception types every entry point maps onto them.

The hooks run under runc and CRIU, which only see an exit status and stderr, so
every failure must reduce to one documented code and one line of text.
"""

from __future__ import annotations

import sys
from enum import IntEnum

from .eventlog import log
from .text import escape_lines, one_line  # noqa: F401 - imported from here by others


class Exit(IntEnum):
    OK = 0
    FAILED = 1  # the operation failed; the workload was rolled back and is running
    USAGE = 2  # bad arguments or input; nothing was changed
    CONFIG = 3  # invalid configuration; nothing was changed
    UNSAFE = 4  # the workload could not be brought back to a safe state: needs attention
    ENVIRONMENT = 5  # a required tool or driver feature is missing; nothing was changed
    # This image can never be restored on this node (driver branch, GPU count,
    # model or memory): an orchestrator should start the workload cold here
    # or restore it elsewhere, not retry.
    NOT_HERE = 6


class CudahookError(Exception):
    """Base error: carries the exit code the CLI and hooks report."""

    exit_code: Exit = Exit.FAILED
    # The code (platform/reasons.py) of a refusal, where the error is one.
    reason: str | None = None

    def __init__(self, *args: object, reason: str | None = None) -> None:
        super().__init__(*args)
        if reason is not None:
            self.reason = reason


class UsageError(CudahookError):
    exit_code = Exit.USAGE


class ConfigError(CudahookError):
    exit_code = Exit.CONFIG


class EnvironmentProblem(CudahookError):
    exit_code = Exit.ENVIRONMENT


class NotRestorableHere(CudahookError):
    """The image needs what this node does not have and cannot get by waiting."""

    exit_code = Exit.NOT_HERE


class StateError(CudahookError):
    """cudahook's own state (directories under /run) is missing, unsafe or unusable."""

    exit_code = Exit.ENVIRONMENT


class DeviceMapError(CudahookError):
    exit_code = Exit.USAGE


class ToolError(CudahookError):
    """A cuda-checkpoint call (or driver-API call) that failed: what it was
    asked, and what it said."""

    def __init__(
        self,
        pid: int,
        action: str,
        returncode: int | None,
        stderr: str,
        *,
        timed_out: bool = False,
        cuda: bool = False,
        status: str = "exit",
    ) -> None:
        self.pid = pid
        self.cuda = cuda  # the tool answered as for a CUDA process, however oddly
        self.action = action
        self.returncode = returncode
        self.stderr = stderr.strip()
        self.timed_out = timed_out
        # `status` names what returncode is: an exit status, or a CUresult.
        what = "timed out (process group killed)" if timed_out else f"{status} {returncode}"
        detail = f": {self.stderr}" if self.stderr else ""
        super().__init__(f"pid {pid}: {action} {what}{detail}")


class PhaseError(CudahookError):
    """A checkpoint or restore phase failed for one or more processes.

    `errors` holds one message per failed process; `safe` says whether every
    process the phase touched was verified back in a running state.
    """

    def __init__(self, phase: str, errors: list[str], *, safe: bool, result: object = None):
        self.phase = phase
        self.errors = errors
        self.safe = safe
        self.result = result
        self.exit_code = Exit.FAILED if safe else Exit.UNSAFE
        super().__init__(f"{phase} failed: " + "; ".join(errors))


def report(exc: BaseException, prog: str = "cudahook", log_file: str | None = None) -> int:
    """Print `exc` as one line on stderr; the documented exit code for it.

    cudahook's own errors carry their code. Outside them: input nested past
    the interpreter's recursion limit is bad input (2); a filesystem that
    refuses cudahook's state (read-only, full, a file where a directory
    belongs) is the environment (5); anything else is a bug: one line
    "internal error: ..." and exit 1, its traceback only in `log_file`.
    """
    if isinstance(exc, CudahookError):
        text, code = str(exc), int(exc.exit_code)
    elif isinstance(exc, RecursionError):
        text, code = "input nested too deeply", int(Exit.USAGE)
    elif isinstance(exc, OSError):
        where = f"{exc.filename}: " if exc.filename else ""
        text, code = f"{where}{exc.strerror or exc}", int(Exit.ENVIRONMENT)
    else:
        text, code = f"internal error: {type(exc).__name__}: {exc}", int(Exit.FAILED)
        if log_file:
            import traceback  # 2 ms at every start, for a bug's report only

            log(log_file, "internal-error", exception=one_line(f"{type(exc).__name__}: {exc}"),
                traceback="".join(traceback.format_exception(exc))[-20000:])
    print(f"{prog}: {one_line(text)}", file=sys.stderr)
    return code
