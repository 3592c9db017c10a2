"""Marks: empty files the hooks' shell fast paths test before they start
Python (`gpu/<container id>`: a GPU container to forget at poststop;
`restore/<criu pid>`: post-resume has CUDA state to restore). They live at a
fixed place under the node root, not under the configurable state
directory, because the shell reads no configuration.
"""

from __future__ import annotations

import contextlib
import os
from pathlib import Path

from . import paths
from .privdir import ensure_private_dir
from .store import check_id


def marks_dir() -> Path:
    """Marks the hooks' shell fast paths test before they start Python."""
    return paths.at(paths.MARKS_DIR)


def mark(kind: str, key: str, *, on: bool = True) -> None:
    """Set (or clear) a fast-path mark. A stale mark only costs a Python
    start; a missing one makes the shell skip work, so setting can raise."""
    path = marks_dir() / kind / check_id(key)
    if on:
        ensure_private_dir(marks_dir())
        ensure_private_dir(path.parent)
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_NOFOLLOW, 0o600)
        os.close(fd)
    else:
        path.unlink(missing_ok=True)


def prune_restore_marks() -> None:
    """Remove restore marks of CRIU runs that are gone: post-resume removes
    its own, but it never runs when CRIU dies or the restore fails first."""
    d = marks_dir() / "restore"
    try:
        names = os.listdir(d)
    except OSError:
        return
    for name in names:
        if name.isdigit() and not os.path.isdir(f"/proc/{name}"):
            with contextlib.suppress(OSError):
                os.unlink(d / name)
