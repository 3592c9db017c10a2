"""GPU device maps for restoring onto different GPUs (cuda-checkpoint R580+).

The rule (as in ai-dynamo/snapshot's BuildDeviceMap): a source GPU that is
still present maps to itself, so a partial change moves as little as possible;
the remaining source GPUs pair with the remaining target GPUs in order. The
driver wants every GPU that CUDA sees in the process listed once a map is
given at all ("invalid argument" otherwise), so a map that is not the identity
includes the identity pairs too; each target must be the same chip with at
least as much memory. MIG instances only come back where they were.
"""

from __future__ import annotations

import re

from cudahook.platform.errors import DeviceMapError

_HEX = r"[0-9a-fA-F]{8}(-[0-9a-fA-F]{4}){3}-[0-9a-fA-F]{12}"
_UUID = re.compile(rf"^GPU-{_HEX}\Z")
# MIG instances: MIG-<uuid> (R470+) or the older MIG-GPU-<uuid>/<gi>/<ci>.
_MIG = re.compile(rf"^MIG-({_HEX}|GPU-{_HEX}/[0-9]+/[0-9]+)\Z")


def check_uuid(uuid: str) -> str:
    if not (_UUID.match(uuid) or _MIG.match(uuid)):
        raise DeviceMapError(f"not a GPU UUID: {uuid!r} (expected GPU-xxxxxxxx-xxxx-...)")
    return uuid


def _no_mig_moves(mapping: dict[str, str]) -> None:
    """cuda-checkpoint's --device-map takes GPU-... UUIDs; a MIG instance can
    come back where it was (no map at all) but cannot be moved."""
    moved = [f"{a}={b}" for a, b in mapping.items()
             if a != b and (a.startswith("MIG-") or b.startswith("MIG-"))]
    if moved:
        raise DeviceMapError(
            f"cannot move MIG instances ({', '.join(moved)}): the driver's device map takes "
            "whole GPUs only; restore onto the same MIG instances")


def check_targets(mapping: dict[str, str], models: dict[str, tuple[str, int | None]],
                  now: dict[str, tuple[str, int | None]]) -> None:
    """Every moved GPU lands on the same chip with at least as much memory,
    as the driver requires. `models`: (name, MiB) at checkpoint time, by
    UUID; `now`: the same for this node. A GPU recorded without its model
    (an older checkpoint) is left to the driver."""
    for old, new in mapping.items():
        if old == new or old not in models or new not in now:
            continue
        (name, mib), (to_name, to_mib) = models[old], now[new]
        if name != to_name:
            raise DeviceMapError(f"cannot restore the state of {old} ({name}) onto {new} "
                                 f"({to_name}): the driver needs the same GPU model")
        if mib is not None and to_mib is not None and to_mib < mib:
            raise DeviceMapError(f"cannot restore the state of {old} ({mib} MiB) onto {new} "
                                 f"({to_mib} MiB): the target has less memory")


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
    _no_mig_moves(mapping)
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
    _no_mig_moves(mapping)
    return mapping
