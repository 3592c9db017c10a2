"""Atomic file writes: the one way cudahook replaces a file.

A reader (a hook, runc, an operator) sees the old file or the new one, never a
half-written one. The temporary file is created exclusively, without
following links, with its final mode from the start (a rewritten config.json
may hold secrets in its environment: it is never readable by others, not even
for a moment), in the target's directory, under a name no other writer
uses; it is fsynced before the rename.
"""

from __future__ import annotations

import contextlib
import json
import os
from pathlib import Path

# typing costs milliseconds at every hook start: annotations only.
TYPE_CHECKING = False
if TYPE_CHECKING:
    from typing import Any


def write_atomic(path: str | os.PathLike[str], data: bytes, mode: int = 0o600, *,
                 durable: bool = True) -> None:
    """`durable=False` skips the fsync, for data that is derived and cheap
    to lose in a crash (the metrics): the rename stays atomic."""
    path = Path(path)
    # Unique per writer (threads of one process too), and cut to fit NAME_MAX.
    tmp = path.with_name(f".{path.name[:200]}.{os.urandom(6).hex()}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, mode)
    try:
        try:
            os.fchmod(fd, mode)  # the umask must not widen or narrow it
            view = memoryview(data)
            while view:
                view = view[os.write(fd, view):]
            if durable:
                os.fsync(fd)
        finally:
            os.close(fd)
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise


def write_json_atomic(path: str | os.PathLike[str], data: Any, mode: int = 0o600) -> None:
    write_atomic(path, json.dumps(data, indent=1, sort_keys=True).encode(), mode)
