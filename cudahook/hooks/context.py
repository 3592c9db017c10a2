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


class Context:
    def __init__(self, settings: Settings, host: Host | None = None):
        self.settings = settings
        self.host = host if host is not None else Host()

    @cached_property
    def store(self) -> Store:
        return Store(self.settings.state_dir)

    @cached_property
    def backend(self) -> Backend:
        return make_backend(self.settings, self.host)

    @cached_property
    def engine(self) -> Engine:
        return Engine(self.backend, self.settings, self.host)

    def log(self, event: str, **fields: object) -> None:
        from cudahook.platform.eventlog import log

        log(self.settings.log_file, event, **fields)  # type: ignore[arg-type]
