"""Everything one hook invocation works with, built lazily from the settings."""

from __future__ import annotations

from functools import cached_property

from cudahook.core.backends import make_backend
from cudahook.core.engine import Engine
from cudahook.platform.config import Settings
from cudahook.platform.host import Host
from cudahook.platform.store import Store

# typing costs milliseconds at every hook start: annotations only.
TYPE_CHECKING = False
if TYPE_CHECKING:
    from cudahook.core.backends import Backend
    from cudahook.core.gpus import Gpu


class Context:
    def __init__(self, settings: Settings, host: Host | None = None,
                 container: str | None = None):
        self.settings = settings
        self.host = host if host is not None else Host()
        # The container this run acts on (its store key), once known: the
        # node agent is told whose calls a session makes.
        self.container = container

    @cached_property
    def store(self) -> Store:
        return Store(self.settings.state_dir)

    @cached_property
    def backend(self) -> Backend:
        backend = make_backend(self.settings, self.host)
        if self.container is not None and hasattr(backend, "container"):
            backend.container = self.container
        return backend

    @cached_property
    def engine(self) -> Engine:
        return Engine(self.backend, self.settings, self.host)

    @cached_property
    def gpus(self) -> list[Gpu]:
        """The node's GPUs as nvidia-smi lists them, asked once per hook run:
        the checks and the checkpoint share one call."""
        from cudahook.core.gpus import query_gpus
        from cudahook.platform.errors import CudahookError

        try:
            return query_gpus(self.host, self.settings)
        except CudahookError as exc:
            exc.reason = exc.reason or "GPU_QUERY_FAILED"
            raise

    def log(self, event: str, **fields: object) -> None:
        from cudahook.platform.eventlog import log

        log(self.settings.log_file, event, **fields)  # type: ignore[arg-type]
