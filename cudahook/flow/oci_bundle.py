"""What a container's bundle says: its config.json (read as a file someone
else controls), the GPUs it sees, its annotations and where its
/snapshot-control comes from.
"""

from __future__ import annotations

from pathlib import Path

from cudahook.platform.errors import UsageError
from cudahook.platform.record import Record

from .gpu_request import visible_devices

# typing costs milliseconds at every hook start: annotations only.
TYPE_CHECKING = False
if TYPE_CHECKING:
    from typing import Any


# config.json beyond this is refused (the shell fast path's CUDAHOOK_MAX_CONFIG).
MAX_CONFIG = 4 << 20
# Every config.json this module counts as a GPU container, or as one with
# cudahook's annotations, holds one of these in its raw text: the shell fast
# paths (hooks/cudahook-lib.sh) send exactly those files, and any with a
# \u or \/ escape that could spell one, to Python. Keep the two lists equal.
GPU_MARKERS = ("NVIDIA_VISIBLE_DEVICES", "/dev/nvidia", "nvidia.com/gpu", "cudahook.io/")
SNAPSHOT_CONTROL = "/snapshot-control"


class BundleInfo(Record):
    visible: list[str] = []  # UUIDs or indices, or ["all"] (a fresh list for each)
    annotations: dict[str, str] = {}
    snapshot_control: str | None = None  # host source of /snapshot-control

    @property
    def wants_gpu(self) -> bool:
        return bool(self.visible)


def read_config(bundle: str) -> Any:
    """The bundle's config.json, read as a file someone else controls
    (see safeio): the runtime's bundle directory may be a container image's."""
    from cudahook.platform.safeio import FileRefused, load_json

    path = Path(bundle) / "config.json"
    try:
        return load_json(path, MAX_CONFIG)
    except FileNotFoundError:
        raise UsageError(f"{path}: no such file") from None
    except FileRefused as exc:
        raise UsageError(str(exc)) from exc
    except OSError as exc:
        raise UsageError(f"{path}: unreadable ({exc.strerror})") from exc


def read_bundle(bundle: str) -> BundleInfo:
    path = Path(bundle) / "config.json"
    cfg = read_config(bundle)
    if not isinstance(cfg, dict):
        raise UsageError(f"{path}: not a JSON object")
    try:
        info = BundleInfo(annotations=_str_map(cfg.get("annotations")))
        env = (cfg.get("process") or {}).get("env") or []
        info.visible = visible_devices(env, info.annotations,
                                       (cfg.get("linux") or {}).get("devices"))
        for m in cfg.get("mounts") or []:
            if isinstance(m, dict) and m.get("destination") == SNAPSHOT_CONTROL:
                info.snapshot_control = m.get("source")
    except (AttributeError, TypeError) as exc:
        # A section of the wrong type ("process": "x") must be one line, not a traceback.
        raise UsageError(f"{path}: malformed ({exc})") from None
    if info.snapshot_control is not None and not isinstance(info.snapshot_control, str):
        raise UsageError(f"{path}: mount {SNAPSHOT_CONTROL} has no source path")
    return info


def _str_map(value: Any) -> dict[str, str]:
    if not isinstance(value, dict):
        return {}
    return {str(k): str(v) for k, v in value.items()}
