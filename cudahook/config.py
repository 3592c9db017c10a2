"""Configuration: defaults, the YAML file, and its schema.

Only `load` touches PyYAML and jsonschema, and only when a file exists, so the
hooks' fast path never imports them.
"""

from __future__ import annotations

import os
import re
import shutil
import sys
from dataclasses import dataclass, field, fields, replace
from pathlib import Path

from . import paths
from .errors import ConfigError

# typing costs milliseconds at every hook start: annotations only.
TYPE_CHECKING = False
if TYPE_CHECKING:
    from typing import Any


ENV_PATH = "CUDAHOOK_CONFIG"


def default_path() -> Path:
    return paths.at(paths.CONFIG)


@dataclass(frozen=True)
class Settings:
    cuda_checkpoint: str = "/usr/bin/cuda-checkpoint"
    nvidia_smi: str = "/usr/bin/nvidia-smi"
    device_pattern: str = r"^/dev/nvidia([0-9]+|ctl|-uvm|-uvm-tools)$"
    lock_timeout_ms: int = 10000
    call_timeout_s: float = 300.0
    sequential: bool = False
    max_parallel: int = 64
    # Node paths move with CUDAHOOK_ROOT (see paths.py) unless set explicitly.
    state_dir: str = field(default_factory=lambda: str(paths.at(paths.STATE_DIR)))
    log_file: str = field(default_factory=lambda: str(paths.at(paths.LOG_FILE)))
    vmm_coordinator: str = "/usr/local/bin/snapshot-cuda-vmm"
    vmm_timeout_s: float = 300.0
    vmm_restore_before_unlock: bool = False
    # How long a gone container's last results (and, when poststop never ran,
    # its record) stay in the state directory, which is RAM.
    state_retention_s: float = 86400.0

    def with_overrides(self, **changes: Any) -> Settings:
        return replace(self, **changes)

    @property
    def device_regex(self) -> re.Pattern[str]:
        return re.compile(self.device_pattern)

    def tool(self, name: str) -> str:
        """Absolute path of a configured tool; a bare name is looked up on PATH."""
        value = getattr(self, name)
        if os.path.isabs(value):
            return value
        found = shutil.which(value)
        return found or value


def config_dir() -> Path:
    """Where the shipped defaults and schemas live (source tree or installed)."""
    here = Path(__file__).resolve().parent.parent / "config"
    if here.is_dir():
        return here
    return Path(sys.prefix) / "share" / "cudahook" / "config"


def validate(data: Any, schema_name: str, what: str) -> None:
    import json

    import jsonschema

    schema = json.loads((config_dir() / schema_name).read_text())
    validator = jsonschema.Draft202012Validator(
        schema, format_checker=jsonschema.Draft202012Validator.FORMAT_CHECKER
    )
    errors = sorted(validator.iter_errors(data), key=lambda e: list(e.absolute_path))
    if errors:
        err = errors[0]
        where = "/".join(str(p) for p in err.absolute_path) or "(top level)"
        raise ConfigError(f"{what}: {where}: {err.message}")


def load(path: str | os.PathLike[str] | None = None) -> Settings:
    """Settings from the config file, or the defaults when there is none.

    An explicit path (argument or $CUDAHOOK_CONFIG) must exist; the default
    /etc/cudahook/config.yaml may be absent.
    """
    explicit = path or os.environ.get(ENV_PATH)
    target = Path(explicit) if explicit else default_path()
    key = _file_key(target)
    cached = _cached(target, key)
    if cached is not None:
        return cached
    try:
        text = target.read_text()
    except FileNotFoundError:
        if explicit:
            raise ConfigError(f"{target}: no such configuration file") from None
        return Settings()
    except OSError as exc:
        raise ConfigError(f"{target}: {exc.strerror}") from None
    import yaml

    try:
        data = yaml.safe_load(text)
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f" line {mark.line + 1}" if mark else ""
        raise ConfigError(f"{target}:{where} not valid YAML") from None
    if data is None:
        data = {}
    validate(data, "config.schema.json", str(target))
    known = {f.name for f in fields(Settings)}
    settings = Settings(**{k: v for k, v in data.items() if k in known})
    _remember(target, key, settings)
    return settings


# Parsing YAML and validating it takes about 50 ms, on every hook that does
# GPU work. A file already validated, unchanged since (same inode, size and
# mtime), is read back from a root-only cache instead.
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


def _cached(path: Path, key: list[int] | None) -> Settings | None:
    if key is None:
        return None
    import json

    try:
        entry = json.loads(cache_path().read_text()).get(str(path.resolve()))
        if entry and entry["key"] == key:
            return Settings(**entry["settings"])
    except (OSError, ValueError, TypeError, KeyError, AttributeError):
        pass
    return None


def _remember(path: Path, key: list[int] | None, settings: Settings) -> None:
    if key is None:
        return
    import json
    import time
    from dataclasses import asdict

    cache = cache_path()
    try:
        try:
            data = json.loads(cache.read_text())
        except (OSError, ValueError):
            data = {}
        if not isinstance(data, dict):
            data = {}
        data[str(path.resolve())] = {"key": key, "settings": asdict(settings),
                                     "at": time.time()}
        newest = sorted(data.items(), key=lambda kv: _age_key(kv[1]))[-CACHE_ENTRIES:]
        from .store import ensure_private_dir, write_json_atomic

        ensure_private_dir(cache.parent)
        write_json_atomic(cache, dict(newest))
    except (OSError, ValueError):
        pass  # only speed is lost


def _age_key(entry: Any) -> float:
    at = entry.get("at") if isinstance(entry, dict) else None
    return at if isinstance(at, (int, float)) else 0.0
