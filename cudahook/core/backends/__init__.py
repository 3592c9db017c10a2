"""Backends: how cudahook asks the driver to lock, checkpoint, restore and unlock.

The engine only sees the `Backend` protocol. Two backends implement it: the
`cuda-checkpoint` executable (`cli`, one driver attach per call) and the
driver API (`driver_api`, cuCheckpointProcess* in libcuda, one driver attach
per phase). `make_backend` picks one per hook invocation, so one phase never
mixes them, and records why in the backend's `why`.
"""

from __future__ import annotations

from cudahook.platform.record import Record

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


class Features(Record, frozen=True):
    """What the installed driver's checkpoint support can do."""

    version: str = ""  # e.g. "570.86.10"; empty when the tool does not say
    toggle: bool = False  # R550+
    actions: bool = False  # R555+: lock/checkpoint/restore/unlock separately
    get_state: bool = False  # R555+
    restore_tid: bool = False  # R555+
    device_map: bool = False  # R580+
    launch_job: bool = False  # R590+
    # CUDA 13.4+ custom storage (cuCheckpointOperationComplete, driver API
    # only), as the driver itself answers cuGetProcAddress; why not, if not.
    custom_storage: bool = False
    custom_storage_why: str = "not asked"

    @property
    def major(self) -> int:
        head = self.version.split(".", 1)[0]
        return int(head) if head.isdigit() else 0

    def describe(self) -> str:
        names = [n for n in ("toggle", "actions", "get_state", "restore_tid", "device_map",
                             "launch_job", "custom_storage") if getattr(self, n)]
        return f"{self.version or 'unknown version'}: {', '.join(names) or 'nothing'}"


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
