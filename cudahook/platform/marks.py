"""Marks: empty files the hooks' shell fast paths test before they start
Python (`gpu/<container id>`: a GPU container - or several, under several
runtime roots - to forget at poststop;
`restore/<criu pid>`: post-resume has CUDA state to restore). They live at a
fixed place under the node root, not under the configurable state
directory, because the shell reads no configuration.
"""

from __future__ import annotations

import contextlib
import os
from pathlib import Path

from . import paths
from .ids import ID_CUT, check_id
from .privdir import ensure_private_dir


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


def unmark_container(state_dir: str | os.PathLike[str], container_id: str) -> None:
    """Clear a gone container's GPU mark, unless another container of that
    id (under another runtime root) still has a record: the shell knows only
    the id. Cleared first and set again when one is found: a create that
    wrote its record meanwhile is seen here, and one that writes it later
    sets its mark again after (see flow/tracking.track), so a live GPU
    container never stays without its mark."""
    mark("gpu", container_id, on=False)
    try:
        names = os.listdir(Path(state_dir) / "containers")
    except OSError:
        return
    # Records are named by the key, which starts with the id (store.container_key);
    # one written before keys by the id alone. A longer id cut to the same
    # start only keeps a mark that costs a Python start.
    prefix = check_id(container_id)[:ID_CUT] + "@"
    if any(n.endswith(".json") and (n.startswith(prefix) or n == f"{container_id}.json")
           for n in names):
        mark("gpu", container_id)


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
