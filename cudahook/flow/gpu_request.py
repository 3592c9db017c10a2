"""Which GPUs a container asks for - NVIDIA_VISIBLE_DEVICES, CDI
annotations, /dev/nvidiaN device entries, read as nvidia-container-toolkit
reads them - and their UUIDs on this node.
"""

from __future__ import annotations

import re

from cudahook.platform.errors import UsageError

# typing costs milliseconds at every hook start: annotations only.
TYPE_CHECKING = False
if TYPE_CHECKING:
    from typing import Any


_DEVICE = re.compile(r"^/dev/nvidia(\d+)\Z")


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
