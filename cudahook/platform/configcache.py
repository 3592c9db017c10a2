"""A root-only cache of validated configuration files, under /run.

Parsing YAML and validating it takes about 50 ms, on every hook that does GPU
work. A file already validated, unchanged since (same inode, size, mtime and
ctime), is read back from here instead. Bounded: the least recently validated
files go first.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

from . import paths
from .atomic import write_json_atomic
from .privdir import ensure_private_dir

# typing costs milliseconds at every hook start: annotations only.
TYPE_CHECKING = False
if TYPE_CHECKING:
    from typing import Any


def cache_path() -> Path:
    return paths.at(paths.MARKS_DIR) / "config-cache.json"


def _file_key(path: Path) -> list[int] | None:
    try:
        st = path.stat()
    except OSError:
        return None
    return [st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns]


# At most this many configuration files are remembered; the least recently
# validated ones go first (the cache lives in /run, which is RAM).
CACHE_ENTRIES = 8


def lookup(path: Path) -> tuple[list[int] | None, dict[str, Any] | None]:
    """(the file's identity, its settings as validated last time, if unchanged)."""
    key = _file_key(path)
    if key is None:
        return None, None
    try:
        entry = json.loads(cache_path().read_text()).get(str(path.resolve()))
        if entry and entry["key"] == key and isinstance(entry["settings"], dict):
            return key, entry["settings"]
    except (OSError, ValueError, TypeError, KeyError, AttributeError):
        pass
    return key, None


def remember(path: Path, key: list[int] | None, settings: dict[str, Any]) -> None:
    """Keep a validated file's settings, under the identity read before parsing
    it (a change while parsing then only costs a parse next time)."""
    if key is None:
        return
    cache = cache_path()
    try:
        try:
            data = json.loads(cache.read_text())
        except (OSError, ValueError):
            data = {}
        if not isinstance(data, dict):
            data = {}
        data[str(path.resolve())] = {"key": key, "settings": settings, "at": time.time()}
        newest = sorted(data.items(), key=lambda kv: _age_key(kv[1]))[-CACHE_ENTRIES:]
        ensure_private_dir(cache.parent)
        write_json_atomic(cache, dict(newest))
    except (OSError, ValueError):
        pass  # only speed is lost


def _age_key(entry: Any) -> float:
    at = entry.get("at") if isinstance(entry, dict) else None
    return at if isinstance(at, (int, float)) else 0.0
