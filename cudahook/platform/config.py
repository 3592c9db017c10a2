"""Configuration: defaults, the YAML file, and its schema.

Only `load` touches PyYAML and jsonschema, and only when a file exists, so the
hooks' fast path never imports them.
"""

from __future__ import annotations

import os
import re
import sys
from pathlib import Path

from . import configcache, paths
from .errors import ConfigError
from .record import Record

# typing costs milliseconds at every hook start: annotations only.
TYPE_CHECKING = False
if TYPE_CHECKING:
    from typing import Any


ENV_PATH = "CUDAHOOK_CONFIG"


def default_path() -> Path:
    return paths.at(paths.CONFIG)


class Settings(Record, frozen=True):
    # How cudahook drives the driver: "driver-api" (cuCheckpointProcess* in
    # libcuda, one driver attach per phase), "cli" (one cuda-checkpoint run,
    # one attach, per call) or "auto" (the driver API when libcuda has it and
    # the driver is R570+, else the CLI). One phase never mixes them.
    backend: str = "auto"
    libcuda: str = "libcuda.so.1"
    cuda_checkpoint: str = "/usr/bin/cuda-checkpoint"
    nvidia_smi: str = "/usr/bin/nvidia-smi"
    # The installed driver's version (features, manifest, same-branch check);
    # nvidia-smi's driver_version when this file is absent.
    driver_version_file: str = "/proc/driver/nvidia/version"
    device_pattern: str = r"^/dev/nvidia([0-9]+|ctl|-uvm|-uvm-tools)$"
    lock_timeout_ms: int = 10000
    call_timeout_s: float = 300.0
    sequential: bool = False
    max_parallel: int = 64
    # Node paths move with CUDAHOOK_ROOT (see paths.py) unless set explicitly:
    # None here means the node's, under the root when the Settings are made.
    state_dir: str = None  # type: ignore[assignment]
    log_file: str = None  # type: ignore[assignment]
    vmm_coordinator: str = "/usr/local/bin/snapshot-cuda-vmm"
    vmm_timeout_s: float = 300.0
    vmm_restore_before_unlock: bool = False
    # How long a gone container's last results (and, when poststop never ran,
    # its record) stay in the state directory, which is RAM.
    state_retention_s: float = 86400.0
    # How long a checkpoint waits for the guardian of an earlier checkpoint
    # of the same container to finish bringing it back, before it refuses.
    guardian_wait_s: float = 60.0
    # CRIU, as `cudahook check` finds it (the hooks never run it: CRIU runs them).
    criu: str = "criu"
    # Prometheus metrics for node_exporter's textfile collector; None: under
    # the state directory. "" turns them off.
    metrics_file: str | None = None
    # `cudahook migrate restore` (admin/migrate.py, admin/archive.py): the most
    # an archive may unpack to; whether an archive must carry a signature by
    # a trusted key; a directory of trusted public keys (*.pub).
    migrate_max_unpacked_bytes: int = 256 << 30
    migrate_require_signature: bool = False
    migrate_trusted_keys_dir: str | None = None

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        for name, node_path in (("state_dir", paths.STATE_DIR), ("log_file", paths.LOG_FILE)):
            if getattr(self, name) is None:
                object.__setattr__(self, name, str(paths.at(node_path)))

    def with_overrides(self, **changes: Any) -> Settings:
        return self.replace(**changes)

    @property
    def device_regex(self) -> re.Pattern[str]:
        return re.compile(self.device_pattern)

    def tool(self, name: str) -> str:
        """Absolute path of a configured tool; a bare name is looked up on PATH."""
        value = getattr(self, name)
        if os.path.isabs(value):
            return value
        import shutil  # with bz2 and lzma: only for a bare tool name

        found = shutil.which(value)
        return found or value


def config_dir() -> Path:
    """Where the shipped defaults and schemas live (source tree or installed)."""
    here = Path(__file__).resolve().parents[2] / "config"
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
    key, cached = configcache.lookup(target)
    if cached is not None:
        try:
            return Settings(**cached)
        except TypeError:
            pass  # written by another version: parse the file again
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
    known = set(Settings._fields)
    settings = Settings(**{k: v for k, v in data.items() if k in known})
    configcache.remember(target, key, settings.as_dict())
    return settings
