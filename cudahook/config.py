"""Configuration: defaults, the YAML file, and its schema.

Only `load` touches PyYAML and jsonschema, and only when a file exists, so the
hooks' fast path never imports them.
"""

from __future__ import annotations

import os
import re
import shutil
import sys
from dataclasses import dataclass, fields, replace
from pathlib import Path

from .errors import ConfigError

# typing costs milliseconds at every hook start: annotations only.
TYPE_CHECKING = False
if TYPE_CHECKING:
    from typing import Any


DEFAULT_PATH = Path("/etc/cudahook/config.yaml")
ENV_PATH = "CUDAHOOK_CONFIG"


@dataclass(frozen=True)
class Settings:
    cuda_checkpoint: str = "/usr/bin/cuda-checkpoint"
    nvidia_smi: str = "/usr/bin/nvidia-smi"
    device_pattern: str = r"^/dev/nvidia([0-9]+|ctl|-uvm|-uvm-tools)$"
    lock_timeout_ms: int = 10000
    call_timeout_s: float = 300.0
    sequential: bool = False
    max_parallel: int = 64
    state_dir: str = "/run/cudahook"
    log_file: str = "/var/log/cudahook.log"
    vmm_coordinator: str = "/usr/local/bin/snapshot-cuda-vmm"
    vmm_timeout_s: float = 300.0
    vmm_restore_before_unlock: bool = False

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
    target = Path(explicit) if explicit else DEFAULT_PATH
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
CACHE = Path("/run/cudahook-marks/config-cache.json")


def _file_key(path: Path) -> list[int] | None:
    try:
        st = path.stat()
    except OSError:
        return None
    return [st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns]


def _cached(path: Path, key: list[int] | None) -> Settings | None:
    if key is None:
        return None
    import json

    try:
        entry = json.loads(CACHE.read_text()).get(str(path.resolve()))
        if entry and entry["key"] == key:
            return Settings(**entry["settings"])
    except (OSError, ValueError, TypeError, KeyError, AttributeError):
        pass
    return None


def _remember(path: Path, key: list[int] | None, settings: Settings) -> None:
    if key is None:
        return
    import json
    from dataclasses import asdict

    try:
        data = json.loads(CACHE.read_text()) if CACHE.exists() else {}
        if not isinstance(data, dict):
            data = {}
        data[str(path.resolve())] = {"key": key, "settings": asdict(settings)}
        CACHE.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
        tmp = CACHE.with_name(f".{CACHE.name}.{os.getpid()}")
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW, 0o600)
        with os.fdopen(fd, "w") as f:
            json.dump(data, f)
        os.replace(tmp, CACHE)
    except (OSError, ValueError):
        pass  # only speed is lost
