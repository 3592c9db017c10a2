"""The checkpoint manifest: what cudahook adds to a CRIU image directory.

It is written at pre-dump, before CRIU writes anything, and read at restore;
it is the only way the restore side learns which processes were CUDA
processes and on which GPUs, so it is versioned and validated on read.
"""

from __future__ import annotations

from pathlib import Path

from cudahook.platform.errors import CudahookError
from cudahook.platform.store import read_json, write_json_atomic

# typing costs milliseconds at every hook start: annotations only.
TYPE_CHECKING = False
if TYPE_CHECKING:
    from typing import Any


NAME = "cudahook-manifest.json"
VERSION = 1


class ManifestError(CudahookError):
    pass


def write(image_dir: Path, data: dict[str, Any]) -> Path:
    path = image_dir / NAME
    write_json_atomic(path, {"version": VERSION, **data}, mode=0o600)
    return path


def read(image_dir: Path) -> dict[str, Any] | None:
    """The manifest, or None when the checkpoint holds no CUDA state."""
    path = image_dir / NAME
    if not path.exists():
        return None
    data = read_json(path)
    if not isinstance(data, dict):
        raise ManifestError(f"{NAME} in the checkpoint is unreadable")
    if type(data.get("version")) is not int or data["version"] != VERSION:
        raise ManifestError(
            f"{NAME} has version {data.get('version')!r}; this cudahook reads version {VERSION}"
        )
    procs = data.get("processes")
    if not isinstance(procs, list) or not all(
        isinstance(p, dict) and type(p.get("nspid")) is int and p["nspid"] > 0 for p in procs
    ):
        raise ManifestError(f"{NAME}: malformed process list")
    if not isinstance(data.get("gpus", []), list):
        raise ManifestError(f"{NAME}: malformed GPU list")
    return data
