"""Exit codes and the exception types every entry point maps onto them.

The hooks run under runc and CRIU, which only see an exit status and stderr, so
every failure must reduce to one documented code and one line of text.
"""

from __future__ import annotations

from enum import IntEnum


class Exit(IntEnum):
    OK = 0
    FAILED = 1  # the operation failed; the workload was rolled back and is running
    USAGE = 2  # bad arguments or bad input; nothing was changed
    CONFIG = 3  # invalid configuration; nothing was changed
    UNSAFE = 4  # the workload could not be brought back to a safe state: needs attention
    ENVIRONMENT = 5  # a required tool or driver feature is missing; nothing was changed


class CudahookError(Exception):
    """Base error: carries the exit code the CLI and hooks report."""

    exit_code: Exit = Exit.FAILED


class UsageError(CudahookError):
    exit_code = Exit.USAGE


class ConfigError(CudahookError):
    exit_code = Exit.CONFIG


class EnvironmentProblem(CudahookError):
    exit_code = Exit.ENVIRONMENT


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
