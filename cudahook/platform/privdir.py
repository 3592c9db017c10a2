"""cudahook's own directories under /run: created private, verified when found.

The hooks run as root and the files under these directories steer what they
do to containers, so a directory someone else controls, or a symlink to one,
is refused rather than used or "fixed" by a chmod through the link.
"""

from __future__ import annotations

import os
import stat
from pathlib import Path

from .errors import StateError


def ensure_private_dir(path: Path) -> Path:
    """`path` as a private directory: created 0700 (parents too) when absent;
    when present, it must be a real directory (not a symlink), owned by us and
    writable by nobody else. The hooks run as root and these files steer what
    they do to containers: a directory someone else controls, or a symlink to
    one, is refused rather than used or "fixed" by a chmod through the link."""
    try:
        os.mkdir(path, 0o700)
    except FileNotFoundError:
        ensure_private_dir(path.parent) if path.parent != path else None
        os.mkdir(path, 0o700)
    except FileExistsError:
        pass
    try:
        fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW)
    except OSError:
        raise StateError(f"{path}: not a directory (a symlink or a file); "
                         "refusing to use it") from None
    try:
        st = os.fstat(fd)
        if st.st_uid != os.geteuid():
            raise StateError(f"{path}: owned by uid {st.st_uid}, not {os.geteuid()}; "
                             "refusing to use it")
        if st.st_mode & 0o022:
            raise StateError(f"{path}: writable by group or others (mode "
                             f"{stat.S_IMODE(st.st_mode):o}); refusing to use it")
        if stat.S_IMODE(st.st_mode) != 0o700:
            os.fchmod(fd, 0o700)  # ours and safe, but readable: tighten it
    finally:
        os.close(fd)
    return path
