"""The CUDA VMM interposer's sockets in a container's /snapshot-control.

The container owns that directory, so nothing here follows a symlink: the
directory is opened with O_NOFOLLOW and every entry is examined and removed
relative to that descriptor. Only names of the exact form
cuda-vmm-<nspid>.sock that are sockets count.
"""

from __future__ import annotations

import contextlib
import os
import re
import stat
from collections.abc import Iterator

# Used with fullmatch: "$" alone also matches before a trailing newline, and a
# container could name a socket "cuda-vmm-7.sock\n".
SOCKET_NAME = re.compile(r"^cuda-vmm-([1-9][0-9]{0,9})\.sock$")


def open_dir_nofollow(path: str, base: str = "/") -> int | None:
    """An fd on `path` (under `base`) if it is a real directory, reached without
    any symlink. `base` itself is trusted: for a container it is
    /proc/<pid>/root, which the kernel resolves to the container's root."""
    if not os.path.isabs(path):
        return None
    try:
        fd = os.open(base, os.O_PATH | os.O_DIRECTORY)
    except OSError:
        return None
    try:
        for part in [p for p in path.split("/") if p]:
            if part in (".", ".."):
                return None
            try:
                nfd = os.open(part, os.O_PATH | os.O_DIRECTORY | os.O_NOFOLLOW, dir_fd=fd)
            except OSError:
                return None
            os.close(fd)
            fd = nfd
        good, fd = fd, -1
        return good
    finally:
        if fd >= 0:
            os.close(fd)


def _sockets_in(dfd: int) -> Iterator[tuple[int, str]]:
    """(nspid, name) of each entry of the directory fd that is a valid socket."""
    for name in os.listdir(f"/proc/self/fd/{dfd}"):
        m = SOCKET_NAME.fullmatch(name)
        if not m:
            continue
        try:
            st = os.stat(name, dir_fd=dfd, follow_symlinks=False)
        except OSError:
            continue
        if stat.S_ISSOCK(st.st_mode):
            yield int(m.group(1)), name


def list_sockets(path: str, base: str = "/") -> dict[int, str]:
    """nspid -> name for every valid interposer socket in the directory."""
    dfd = open_dir_nofollow(path, base)
    if dfd is None:
        return {}
    try:
        return dict(_sockets_in(dfd))
    finally:
        os.close(dfd)


def remove_stale_sockets(path: str) -> int:
    dfd = open_dir_nofollow(path)
    if dfd is None:
        return 0
    try:
        removed = 0
        for _nspid, name in list(_sockets_in(dfd)):
            with contextlib.suppress(FileNotFoundError):
                os.unlink(name, dir_fd=dfd)
                removed += 1
        return removed
    finally:
        os.close(dfd)
