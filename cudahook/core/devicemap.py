"""GPU device maps for restoring onto different GPUs (cuda-checkpoint R580+).

The rule (as in ai-dynamo/snapshot's BuildDeviceMap): a source GPU that is
still present maps to itself, so a partial change moves as little as possible;
the remaining source GPUs pair with the remaining target GPUs in order. The
driver wants every checkpointed GPU listed once a map is given at all, so a map
that is not the identity includes the identity pairs too.
"""

from __future__ import annotations

import re

from cudahook.platform.errors import DeviceMapError

_UUID = re.compile(r"^GPU-[0-9a-fA-F]{8}(-[0-9a-fA-F]{4}){3}-[0-9a-fA-F]{12}$")


def check_uuid(uuid: str) -> str:
    if not _UUID.match(uuid):
        raise DeviceMapError(f"not a GPU UUID: {uuid!r} (expected GPU-xxxxxxxx-xxxx-...)")
    return uuid


def compute_device_map(source: list[str], target: list[str]) -> dict[str, str] | None:
    """Map from checkpointed GPUs to the GPUs now visible; None when nothing moves."""
    for u in (*source, *target):
        check_uuid(u)
    if len(set(source)) != len(source) or len(set(target)) != len(target):
        raise DeviceMapError("duplicate GPU UUID in the source or target list")
    if len(source) != len(target):
        raise DeviceMapError(
            f"checkpoint used {len(source)} GPU(s) but {len(target)} are available: "
            "cannot pair them"
        )
    present = set(target)
    kept = [s for s in source if s in present]
    moved = [s for s in source if s not in present]
    free = [t for t in target if t not in set(kept)]
    mapping = {s: s for s in kept}
    mapping.update(zip(moved, free, strict=True))
    if all(k == v for k, v in mapping.items()):
        return None
    return {s: mapping[s] for s in source}


def parse_device_map(text: str) -> dict[str, str]:
    """Parse `old=new[,old=new...]` as cuda-checkpoint's --device-map takes it."""
    mapping: dict[str, str] = {}
    for part in filter(None, (p.strip() for p in text.split(","))):
        old, sep, new = part.partition("=")
        if not sep:
            raise DeviceMapError(f"device map entry {part!r} is not old=new")
        old, new = check_uuid(old.strip()), check_uuid(new.strip())
        if old in mapping:
            raise DeviceMapError(f"device map lists {old} twice")
        mapping[old] = new
    if len(set(mapping.values())) != len(mapping):
        raise DeviceMapError("device map sends two GPUs to the same target")
    return mapping
