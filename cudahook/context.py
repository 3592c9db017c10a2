"""Everything one hook invocation works with, built lazily from the settings."""

from __future__ import annotations

from dataclasses import dataclass, field
from functools import cached_property

from .backends import make_backend
from .config import Settings
from .engine import Engine
from .host import Host
from .store import Store

# typing costs milliseconds at every hook start: annotations only.
TYPE_CHECKING = False
if TYPE_CHECKING:
    from .backends import Backend


@dataclass
class Context:
    settings: Settings
    host: Host = field(default_factory=Host)

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
        from .eventlog import log

        log(self.settings.log_file, event, **fields)  # type: ignore[arg-type]
