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


# cudahook's own files in an image are checksummed up to this size (the VMM
# state is capped at 1 GiB where it is copied, see vmm/coordinator.py).
MAX_FILE_BYTES = 1 << 30
# Hashing must not hold a hook past this (all files together): 1 GiB takes
# a few seconds from a local disk, more from a network mount.
HASH_TIMEOUT_S = 120.0


def write(image_dir: Path, data: dict[str, Any], files: list[str] | tuple[str, ...] = ()) -> Path:
    """Write the manifest; `files`, cudahook's own files already in the
    image, go in with their sha256, which the restore side verifies."""
    from cudahook.platform import safeio

    sums = {}
    for name in files:
        digest, size = safeio.sha256_file(image_dir / name, MAX_FILE_BYTES, HASH_TIMEOUT_S)
        sums[name] = {"sha256": digest, "size": size}
    if sums:
        data = {**data, "files": sums}
    path = image_dir / NAME
    write_json_atomic(path, {"version": VERSION, **data}, mode=0o600)
    return path


def digest(image_dir: Path) -> str:
    """sha256 of the manifest file as it is: what identifies one checkpoint."""
    from cudahook.platform import safeio

    return safeio.sha256_file(image_dir / NAME, MAX_BYTES)[0]


def verify_files(image_dir: Path, data: dict[str, Any]) -> list[tuple[str, str]]:
    """(file, problem) for each file the manifest names that is missing,
    not a regular file, or not the file that was checksummed. A manifest
    written before checksums were recorded names none: nothing to verify."""
    import time

    from cudahook.platform import safeio

    out = []
    # One budget for all of them: a manifest may name up to 64 files.
    deadline = time.monotonic() + HASH_TIMEOUT_S
    for name, want in sorted((data.get("files") or {}).items()):
        left = deadline - time.monotonic()
        if left <= 0:
            out.append((name, f"not verified within {HASH_TIMEOUT_S:g}s"))
            continue
        try:
            got, size = safeio.sha256_file(image_dir / name, MAX_FILE_BYTES, left)
        except FileNotFoundError:
            out.append((name, "missing"))
            continue
        except (OSError, safeio.FileRefused) as exc:
            why = exc.strerror if isinstance(exc, OSError) else str(exc)
            out.append((name, f"unreadable ({why})"))
            continue
        if got != want.get("sha256") or size != want.get("size"):
            out.append((name, "checksum"))
    return out


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
        raise ManifestError(f"{NAME} in the checkpoint is unreadable ({why})") from exc
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
                raise ManifestError(f"{NAME}: {what}: {text.removeprefix(NAME + ': ')}") from exc
        raise ManifestError(text) from exc
