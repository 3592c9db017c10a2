"""The checkpoint manifest: what cudahook adds to a CRIU image directory.

It is written at pre-dump, before CRIU writes anything, and read at restore;
it is the only way the restore side learns which processes were CUDA
processes and on which GPUs, so it is versioned and validated on read.
"""

from __future__ import annotations

from pathlib import Path

from cudahook.platform.errors import CudahookError, Exit
from cudahook.platform.store import write_json_atomic

# typing costs milliseconds at every hook start: annotations only.
TYPE_CHECKING = False
if TYPE_CHECKING:
    from typing import Any


NAME = "cudahook-manifest.json"
VERSION = 1
# A manifest holds a few lines per CUDA process; anything near this is not ours.
MAX_BYTES = 32 << 20


class ManifestError(CudahookError):
    """The checkpoint's manifest is unusable: bad input, nothing was changed."""

    exit_code = Exit.USAGE


def write(image_dir: Path, data: dict[str, Any]) -> Path:
    path = image_dir / NAME
    write_json_atomic(path, {"version": VERSION, **data}, mode=0o600)
    return path


def read(image_dir: Path) -> dict[str, Any] | None:
    """The manifest, or None when the checkpoint holds no CUDA state.

    The image comes from wherever the checkpoint was stored: the manifest is
    read like any file someone else controls (no symlink, regular file, size
    cap, deadline) and validated against config/manifest.schema.json.
    """
    from cudahook.platform import safeio

    path = image_dir / NAME
    try:
        data = safeio.load_json(path, MAX_BYTES)
    except FileNotFoundError:
        return None
    except (OSError, safeio.FileRefused) as exc:
        why = exc.strerror if isinstance(exc, OSError) else str(exc).removeprefix(f"{path}: ")
        raise ManifestError(f"{NAME} in the checkpoint is unreadable ({why})") from None
    if not isinstance(data, dict):
        raise ManifestError(f"{NAME} in the checkpoint is unreadable (not a JSON object)")
    if type(data.get("version")) is not int or data["version"] != VERSION:
        raise ManifestError(
            f"{NAME} has version {data.get('version')!r}; this cudahook reads version {VERSION}"
        )
    _validate(data)
    return data


def _validate(data: dict[str, Any]) -> None:
    from cudahook.platform.config import validate
    from cudahook.platform.errors import ConfigError

    try:
        validate(data, "manifest.schema.json", NAME)
    except ConfigError as exc:
        text = str(exc)
        # Name the part a reader looks for first; the schema says the rest.
        for key, what in (("processes", "malformed process list"), ("gpus", "malformed GPU list")):
            if text.startswith(f"{NAME}: {key}"):
                raise ManifestError(f"{NAME}: {what}: {text.removeprefix(NAME + ': ')}") from None
        raise ManifestError(text) from None
