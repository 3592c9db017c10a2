"""Backends: how cudahook asks the driver to lock, checkpoint, restore and unlock.

The engine only sees the `Backend` protocol. Two backends implement it: the
`cuda-checkpoint` executable (`cli`, one driver attach per call) and the
driver API (`driver_api`, cuCheckpointProcess* in libcuda, one driver attach
per phase). `make_backend` picks one per hook invocation, so one phase never
mixes them, and records why in the backend's `why`.
"""

from __future__ import annotations

from .base import (  # noqa: F401 - the package's names
    CHECKPOINTED,
    CHECKPOINTING,
    FAILED,
    LOCKED,
    RESTORING,
    RUNNING,
    STABLE,
    STATES,
    UNKNOWN,
    Features,
    driver_major,
    explain_state,
    parse_nvrm,
)

# typing costs milliseconds at every hook start: annotations only.
TYPE_CHECKING = False
if TYPE_CHECKING:
    from typing import Protocol

    class Backend(Protocol):
        name: str
        why: str

        @property
        def features(self) -> Features: ...

        def get_state(self, pid: int) -> str: ...

        def get_restore_tid(self, pid: int) -> int: ...

        def lock(self, pid: int, timeout_ms: int) -> None: ...

        def checkpoint(self, pid: int) -> None: ...

        def restore(self, pid: int, device_map: dict[str, str] | None = None) -> None: ...

        def unlock(self, pid: int) -> None: ...

        def toggle(self, pid: int) -> None: ...


def make_backend(settings: object, host: object) -> Backend:
    """The backend the configuration asks for; `auto` decides here, once."""
    from .cli import CudaCheckpointCLI

    choice = getattr(settings, "backend", "auto")
    if choice == "cli":
        cli = CudaCheckpointCLI(host, settings)  # type: ignore[arg-type]
        cli.why = "backend: cli in the configuration"
        return cli
    from .driver_api import DriverAPI, choose

    if choice == "driver-api":
        return DriverAPI(host, settings, why="backend: driver-api in the configuration")  # type: ignore[arg-type]
    features, why = choose(settings, host)  # type: ignore[arg-type]
    if features is not None:
        return DriverAPI(host, settings, features, why=why)  # type: ignore[arg-type]
    cli = CudaCheckpointCLI(host, settings)  # type: ignore[arg-type]
    cli.why = why
    return cli
