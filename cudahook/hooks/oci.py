"""The OCI side: container state on stdin, and what the bundle says about GPUs.

A runtime hands every hook the container's state; the bundle's config.json
says which GPUs the container sees (NVIDIA_VISIBLE_DEVICES, CDI annotations
or /dev/nvidiaN device entries) and where its /snapshot-control comes from.
"""

from __future__ import annotations

import json
import os
import re
from dataclasses import dataclass, field
from pathlib import Path

from cudahook.platform.errors import UsageError

# typing costs milliseconds at every hook start: annotations only.
TYPE_CHECKING = False
if TYPE_CHECKING:
    from typing import Any


MAX_STATE = 1 << 20
# config.json beyond this is refused (the shell fast path's CUDAHOOK_MAX_CONFIG).
MAX_CONFIG = 4 << 20
# Every config.json this module counts as a GPU container, or as one with
# cudahook's annotations, holds one of these in its raw text: the shell fast
# paths (hooks/cudahook-lib.sh) send exactly those files, and any with a
# \u or \/ escape that could spell one, to Python. Keep the two lists equal.
GPU_MARKERS = ("NVIDIA_VISIBLE_DEVICES", "/dev/nvidia", "nvidia.com/gpu", "cudahook.io/")
SNAPSHOT_CONTROL = "/snapshot-control"
_DEVICE = re.compile(r"^/dev/nvidia(\d+)$")


def read_state(text: str) -> dict[str, Any]:
    """Parse the state; cheap structural checks only (the fast path)."""
    if len(text) > MAX_STATE:
        raise UsageError("container state on stdin is too large")
    try:
        state = json.loads(text)
    except ValueError as exc:
        raise UsageError(f"container state on stdin is not JSON: {exc.msg}") from None
    except RecursionError:
        # Deeply nested input fits in MAX_STATE but overflows the decoder.
        raise UsageError("container state on stdin is not JSON: nested too deeply") from None
    if not isinstance(state, dict):
        raise UsageError("container state on stdin is not a JSON object")
    for key in ("id", "bundle"):
        if not isinstance(state.get(key), str) or not state[key]:
            raise UsageError(f"container state has no {key!r}")
    return state


def validate_state(state: dict[str, Any]) -> None:
    """Full check against the runtime-spec state schema (imports jsonschema)."""
    import jsonschema
    from referencing import Registry, Resource
    from referencing.jsonschema import DRAFT4

    from cudahook.platform.config import config_dir

    base = config_dir() / "oci"
    schema = json.loads((base / "state-schema.json").read_text())
    defs = json.loads((base / "defs.json").read_text())
    registry = Registry().with_resource(
        "defs.json", Resource.from_contents(defs, default_specification=DRAFT4)
    )
    validator = jsonschema.Draft4Validator(schema, registry=registry)
    errors = sorted(validator.iter_errors(state), key=lambda e: list(e.absolute_path))
    if errors:
        where = "/".join(str(p) for p in errors[0].absolute_path) or "(top level)"
        raise UsageError(f"container state: {where}: {errors[0].message}")


@dataclass
class BundleInfo:
    visible: list[str] = field(default_factory=list)  # UUIDs or indices, or ["all"]
    annotations: dict[str, str] = field(default_factory=dict)
    snapshot_control: str | None = None  # host source of /snapshot-control
    root: str = ""

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
        raise UsageError(str(exc)) from None
    except OSError as exc:
        raise UsageError(f"{path}: unreadable ({exc.strerror})") from None


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
        root = (cfg.get("root") or {}).get("path", "")
        info.root = root if os.path.isabs(root) else str(Path(bundle) / root)
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


def visible_devices(env: list[str], annotations: dict[str, str], devices: Any) -> list[str]:
    """GPUs the container sees, as nvidia-container-toolkit reads them."""
    for item in env:
        if isinstance(item, str) and item.startswith("NVIDIA_VISIBLE_DEVICES="):
            value = item.split("=", 1)[1].strip()
            if value in ("", "void", "none"):
                return []
            return [v.strip() for v in value.split(",") if v.strip()]
    # A CDI annotation's value is a comma-separated list of fully qualified
    # names (vendor/class=name, as CDI's UpdateAnnotations writes it), possibly
    # of several vendors; a bare name after nvidia.com/gpu=... continues that
    # list (the short form "nvidia.com/gpu=0,1").
    cdi: list[str] = []
    for k, v in annotations.items():
        if not k.startswith("cdi.k8s.io/"):
            continue
        ours = False
        for item in (x.strip() for x in v.split(",")):
            if "=" in item:
                kind, _, name = item.partition("=")
                ours = kind.strip() == "nvidia.com/gpu"
                item = name.strip()
            if ours and item:
                cdi.append(item)
    if cdi:
        return cdi
    found = []
    for d in devices or []:
        m = _DEVICE.match(str((d or {}).get("path", ""))) if isinstance(d, dict) else None
        if m:
            found.append(m.group(1))
    return found


def resolve_uuids(visible: list[str], gpus: list[Any]) -> list[str]:
    """Turn indices/'all' into UUIDs against what nvidia-smi reports."""
    if visible == ["all"]:
        return [g.uuid for g in gpus]
    by_index = {str(g.index): g.uuid for g in gpus}
    out = []
    for v in visible:
        if v.startswith(("GPU-", "MIG-")):
            out.append(v)
        elif v in by_index:
            out.append(by_index[v])
        else:
            raise UsageError(f"container asks for GPU {v!r}, which this node does not have")
    return out
