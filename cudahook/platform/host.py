"""The one seam between cudahook and everything outside its own process.

External tools are run through `Host.run` (`tools`), and `/proc` (`procfs`)
and the cgroup tree (`cgroups`) are read through the `Host` methods. Tests
and the simulator change the tool paths in the configuration; nothing in the
engine reaches the system any other way, so another backend or another proc
root slots in here alone.
"""

from __future__ import annotations

from pathlib import Path

from .cgroups import CgroupReader
from .procfs import ProcessGone, ProcReader
from .record import Record
from .tools import RunResult, ToolRunner

__all__ = ["Host", "ProcessGone", "RunResult"]


class Host(Record, ToolRunner, ProcReader, CgroupReader):
    proc: Path = Path("/proc")
    cgroup_root: Path = Path("/sys/fs/cgroup")
    env: dict[str, str] | None = None
    _own_pidns: str | None = None
