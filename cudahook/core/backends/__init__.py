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


def probe(backend: Backend) -> Features:
    """The backend's features, with what only the driver can tell (custom
    storage): the driver-API backend asks it (one attach); the CLI cannot."""
    ask = getattr(backend, "probe", None)
    if ask is not None:
        return ask()  # type: ignore[no-any-return]
    return backend.features.replace(
        custom_storage=False,
        custom_storage_why="custom storage is a driver-API call; the cuda-checkpoint tool "
                           f"copies GPU memory into host memory ({backend.why})")


def gpu_memory_path(setting: str, features: Features) -> tuple[str | None, str]:
    """Where a checkpoint would put a container's GPU memory under the
    `gpu_memory` setting: "host", "storage", or None when the setting asks
    for storage the driver cannot give (a checkpoint is refused); and why."""
    have, why = features.custom_storage, features.custom_storage_why
    if setting == "storage":
        if have:
            return "storage", f"gpu_memory: storage, and the driver has custom storage ({why})"
        return None, f"gpu_memory: storage, but custom storage is unavailable: {why}"
    if setting == "auto":
        if have:
            return "storage", f"gpu_memory: auto, and the driver has custom storage ({why})"
        return "host", f"gpu_memory: auto, custom storage unavailable: {why}"
    return "host", "gpu_memory: host in the configuration" + (
        " (custom storage is available: gpu_memory: auto or storage would use it)" if have else "")


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
