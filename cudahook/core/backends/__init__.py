"""Backends: how cudahook asks the driver to lock, checkpoint, restore and unlock.

The engine only sees the `Backend` protocol. Today there is one backend, the
`cuda-checkpoint` executable; a driver-API backend (cuCheckpointProcess*,
one driver attach per phase instead of one per call) implements the same
protocol and needs no engine change.
"""

from __future__ import annotations

from dataclasses import dataclass

# typing costs milliseconds at every hook start: annotations only.
TYPE_CHECKING = False
if TYPE_CHECKING:
    from typing import Protocol

    class Backend(Protocol):
        name: str

        @property
        def features(self) -> Features: ...

        def get_state(self, pid: int) -> str: ...

        def get_restore_tid(self, pid: int) -> int: ...

        def lock(self, pid: int, timeout_ms: int) -> None: ...

        def checkpoint(self, pid: int) -> None: ...

        def restore(self, pid: int, device_map: dict[str, str] | None = None) -> None: ...

        def unlock(self, pid: int) -> None: ...

        def toggle(self, pid: int) -> None: ...


RUNNING = "running"
LOCKED = "locked"
CHECKPOINTED = "checkpointed"
# A CUDA process in trouble (CU_PROCESS_STATE_FAILED) or one the driver cannot
# place; CUDA 13.4+ also reports an operation in progress. None of these is
# "not CUDA", and none is a state cudahook moves a process out of.
FAILED = "failed"
UNKNOWN = "unknown"
CHECKPOINTING = "checkpointing"
RESTORING = "restoring"
STABLE = (RUNNING, LOCKED, CHECKPOINTED)
STATES = (*STABLE, FAILED, UNKNOWN, CHECKPOINTING, RESTORING)


def explain_state(state: str) -> str:
    """A state as an operator should read it."""
    return {
        FAILED: "failed (the driver gave up on its CUDA state)",
        UNKNOWN: "in an unknown CUDA state",
        CHECKPOINTING: "still checkpointing",
        RESTORING: "still restoring",
    }.get(state, state)


@dataclass(frozen=True)
class Features:
    """What the installed driver's checkpoint support can do."""

    version: str = ""  # e.g. "570.86.10"; empty when the tool does not say
    toggle: bool = False  # R550+
    actions: bool = False  # R555+: lock/checkpoint/restore/unlock separately
    get_state: bool = False  # R555+
    restore_tid: bool = False  # R555+
    device_map: bool = False  # R580+
    launch_job: bool = False  # R590+

    @property
    def major(self) -> int:
        head = self.version.split(".", 1)[0]
        return int(head) if head.isdigit() else 0

    def describe(self) -> str:
        names = [n for n in ("toggle", "actions", "get_state", "restore_tid", "device_map",
                             "launch_job") if getattr(self, n)]
        return f"{self.version or 'unknown version'}: {', '.join(names) or 'nothing'}"


def make_backend(settings: object, host: object) -> Backend:
    from .cli import CudaCheckpointCLI

    return CudaCheckpointCLI(host, settings)  # type: ignore[arg-type]
