"""cudahook's own directories under /run: created private, verified when found.

The hooks run as root and the files under these directories steer what they
do to containers, so a directory someone else controls, or a symlink to one,
is refused rather than used. Nor is a directory cudahook did not create ever
changed: a `state_dir: /run` typo must not make /run private. cudahook
creates every directory of its own 0700 and owned by itself and never
loosens one, so a directory found in any other state is not cudahook's. The
test costs one fstat, on the hooks' path too.
"""

from __future__ import annotations

import os
import stat
from pathlib import Path

from .errors import Exit, StateError

MODE = 0o700


class ForeignDirectory(StateError):
    """A directory where cudahook keeps its own is not one cudahook made:
    most often a configured path (state_dir) naming the wrong place."""

    exit_code = Exit.CONFIG


def _make(path: Path) -> bool:
    """Create `path` 0700, and its missing parents as ensure_private_dir
    does; False if it already existed."""
    try:
        os.mkdir(path, MODE)
    except FileNotFoundError:
        if path.parent == path:
            raise
        ensure_private_dir(path.parent)
        return _make(path)
    except FileExistsError:
        return False
    return True


def ensure_private_dir(path: Path) -> Path:
    """`path` as a private directory: created 0700 (parents too) when absent;
    when present, it must be a real directory (not a symlink) owned by us
    with mode 0700, as cudahook creates them. A directory that is not is
    refused with ForeignDirectory (exit 3), a symlink or a file with
    StateError (exit 5); neither is ever changed."""
    created = _make(path)
    try:
        fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW)
    except OSError:
        # A file where a directory belongs: the environment (exit 5), as
        # errors.report counts it.
        raise StateError(f"{path}: not a directory (a symlink or a file); "
                         "refusing to use it") from None
    try:
        st = os.fstat(fd)
        if st.st_uid != os.geteuid():
            raise ForeignDirectory(f"{path}: owned by uid {st.st_uid}, not {os.geteuid()}; "
                                   "refusing to use it")
        mode = stat.S_IMODE(st.st_mode)
        if created and mode != MODE:
            os.fchmod(fd, MODE)  # ours, made just now under a umask
        elif mode != MODE:
            raise ForeignDirectory(
                f"{path}: mode {mode:o}, not the 700 of a directory cudahook created; refusing "
                "to use or change it (check state_dir in the configuration, or remove it "
                "or chmod 700 it if it is cudahook's)")
    finally:
        os.close(fd)
    return path


def private_subdir(root: str | os.PathLike[str], name: str) -> Path:
    """`root`/`name` as a private directory, `root` verified first: inside a
    state directory that is a symlink or someone else's, nothing is made."""
    return ensure_private_dir(ensure_private_dir(Path(root)) / name)
