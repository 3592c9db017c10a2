"""Configuration: defaults, the YAML file, and its schema.

Only `load` touches PyYAML and jsonschema, and only when a file exists, so the
hooks' fast path never imports them.
"""

from __future__ import annotations

import itertools
import json
import math
import os
import re
import sys
from pathlib import Path

from . import configcache, paths
from .errors import ConfigError, CudahookError, one_line
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
    # Where a checkpoint puts the containers' GPU memory: "host" (the driver
    # copies it into each process's host memory, which CRIU dumps), "storage"
    # (CUDA 13.4+ custom storage: the driver-API helper copies it into the
    # image directory itself) or "auto" (storage where the driver has it).
    # `cudahook features` and doctor say which a container would get, and why.
    gpu_memory: str = "host"
    # GPU memory in storage: "zstd" stores each chunk that shrinks compressed
    # at gpu_storage_zstd_level (1-19), "off" stores every chunk raw.
    # gpu_storage_dedupe: identical chunks of one checkpoint are stored once,
    # as hard links (an archive that refuses hard links needs it off).
    gpu_storage_compression: str = "off"
    gpu_storage_zstd_level: int = 3
    gpu_storage_dedupe: bool = True
    # The node agent (core/agent.py, `cudahook agent start`): the driver-API
    # backend tries it first, waiting at most agent_connect_ms for a warm
    # worker, and attaches itself when none answers. "auto": the first hook
    # that finds none starts one, detached; "off": only an operator (or a
    # service unit) starts it. agent_idle_s: it exits after that long
    # without a session (0: never).
    agent: str = "off"
    agent_connect_ms: int = 50
    agent_idle_s: float = 0.0
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
        if self.agent is False:  # YAML reads a bare `agent: off` as false
            object.__setattr__(self, "agent", "off")
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


# Schema errors looked at, at most: each renders its (bounded) value.
MAX_ERRORS = 100


def validate(data: Any, schema_name: str, what: str) -> None:
    """`data` against config/`schema_name`, or ConfigError in one line.

    JSON Schema cannot tell NaN or infinity from a number (every comparison
    with NaN is false, so `.nan` passes any minimum and maximum): those are
    refused here, for every schema."""
    import jsonschema  # 47-59 ms: only when the configuration cache misses

    bad = _not_finite(data)
    if bad is not None:
        raise ConfigError(f"{what}: {bad or '(top level)'}: not a finite number")
    schema = json.loads((config_dir() / schema_name).read_text())
    validator = jsonschema.Draft202012Validator(
        schema, format_checker=jsonschema.Draft202012Validator.FORMAT_CHECKER
    )
    errors = sorted(itertools.islice(validator.iter_errors(data), MAX_ERRORS),
                    key=lambda e: list(e.absolute_path))
    if errors:
        err = errors[0]
        where = "/".join(str(p) for p in err.absolute_path) or "(top level)"
        raise ConfigError(one_line(f"{what}: {one_line(where, 200)}: {err.message}", 500))


def _not_finite(data: Any) -> str | None:
    """The path of the first NaN or infinite float in `data`, if any
    ("" for `data` itself). Iterative: any depth the parser allowed."""
    stack: list[tuple[str, Any]] = [("", data)]
    while stack:
        where, item = stack.pop()
        if isinstance(item, float) and not math.isfinite(item):
            return where
        if isinstance(item, dict):
            stack += ((f"{where}/{k}".lstrip("/"), v) for k, v in item.items())
        elif isinstance(item, list):
            stack += ((f"{where}/{i}".lstrip("/"), v) for i, v in enumerate(item))
    return None


# A configuration is a few kilobytes: a file past this is not one (and
# /dev/zero, a FIFO or a directory is no file at all).
MAX_BYTES = 1 << 20
READ_TIMEOUT_S = 10.0


def _read(target: Path) -> bytes:
    """The file's bytes: a regular file, capped, under a deadline. The
    operator's own symlinks (a Kubernetes ConfigMap mount is one) are
    followed to their end, which must then be a regular file."""
    try:
        real = os.path.realpath(target)
        # No file at all (the default path on most nodes) is told by one
        # stat: safeio's deadline thread is only paid for a file to read.
        os.stat(real)
        from . import safeio

        return safeio.read_bytes(real, MAX_BYTES, READ_TIMEOUT_S)
    except FileNotFoundError:
        raise
    except CudahookError as exc:  # safeio.FileRefused
        raise ConfigError(one_line(f"{target}: {str(exc).rpartition(': ')[2]}")) from exc
    except OSError as exc:
        raise ConfigError(one_line(f"{target}: {exc.strerror or exc}")) from exc
    except ValueError:  # a NUL in the path
        raise ConfigError(one_line(f"{target}: not a valid path")) from None


def parse_yaml(raw: bytes, what: str) -> Any:
    """`raw` as YAML, in bounded time and memory, or ConfigError in one line.

    Strict UTF-8. Anchors and aliases are refused before anything is built:
    ten nested aliases expand to billions of nodes (an "alias bomb"), and a
    configuration never needs them. A number past Python's digit limit, or
    nesting past the recursion limit, is one more malformed file."""
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise ConfigError(one_line(f"{what}: not UTF-8 (byte {exc.start})")) from exc
    import yaml  # 15-20 ms: only when the configuration cache misses

    # libyaml (PyYAML's C parser) refuses nesting past 1000 levels at once;
    # PyYAML's pure-Python scanner takes quadratic time on deep flow nesting
    # (a few hundred KiB of "[" run for minutes): the C parser when present.
    loader = getattr(yaml, "CSafeLoader", yaml.SafeLoader)
    try:
        for event in yaml.parse(text, Loader=loader):
            if isinstance(event, yaml.AliasEvent) or getattr(event, "anchor", None):
                line = event.start_mark.line + 1 if event.start_mark else "?"
                raise ConfigError(one_line(
                    f"{what}: line {line}: YAML anchors and aliases are not allowed"))
        return yaml.load(text, Loader=loader)
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f" line {mark.line + 1}" if mark else ""
        raise ConfigError(one_line(f"{what}:{where} not valid YAML")) from exc
    except ConfigError:
        raise
    except RecursionError:
        raise ConfigError(one_line(f"{what}: nested too deeply")) from None
    except ValueError as exc:
        if "digits" in str(exc):  # int(): past sys.get_int_max_str_digits()
            raise ConfigError(one_line(f"{what}: a number with too many digits")) from exc
        raise ConfigError(one_line(f"{what}: a value YAML cannot read ({exc})", 300)) from exc
    except Exception as exc:  # PyYAML's constructors: "!!float " is an IndexError
        raise ConfigError(one_line(f"{what}: a value YAML cannot read ({type(exc).__name__})")
                          ) from exc


def load(path: str | os.PathLike[str] | None = None) -> Settings:
    """Settings from the config file, or the defaults when there is none.

    An explicit path (argument or $CUDAHOOK_CONFIG) must exist; the default
    /etc/cudahook/config.yaml may be absent. Whatever is wrong with the file
    is a ConfigError (exit 3), in bounded time and memory.
    """
    explicit = path or os.environ.get(ENV_PATH)
    target = Path(explicit) if explicit else default_path()
    key, cached = configcache.lookup(target)
    # A value an older version let through (NaN) is not taken from the cache.
    if cached is not None and _not_finite(cached) is None:
        try:
            return Settings(**cached)
        except TypeError:
            pass  # written by another version: parse the file again
    try:
        raw = _read(target)
    except FileNotFoundError:
        if explicit:
            raise ConfigError(one_line(f"{target}: no such configuration file")) from None
        return Settings()
    data = parse_yaml(raw, one_line(str(target), 300))
    if data is None:
        data = {}
    validate(data, "config.schema.json", one_line(str(target), 300))
    known = set(Settings._fields)
    settings = Settings(**{k: v for k, v in data.items() if k in known})
    configcache.remember(target, key, settings.as_dict())
    return settings
