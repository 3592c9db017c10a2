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


def socket_name(nspid: int) -> str:
    return f"cuda-vmm-{nspid}.sock"


def listener_pid(dfd: int, name: str, timeout: float = 2.0) -> int | None:
    """PID (in our namespace) of the process listening on the socket `name`
    in the directory fd; None if nobody listens.

    SO_PEERCRED names the process that called listen(): a socket of the same
    name bound by another container's process sharing the directory is told
    apart from this one's. The connection is closed without a word.
    """
    import socket  # with selectors and friends: only where an interposer listens
    import struct

    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM | socket.SOCK_CLOEXEC)
    try:
        s.settimeout(timeout)
        s.connect(f"/proc/self/fd/{dfd}/{name}")
        pid, _uid, _gid = struct.unpack(
            "3i", s.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i")))
        return pid or None
    except OSError:
        return None
    finally:
        s.close()


def owned_socket(nspid: int, pid: int, path: str, base: str) -> tuple[str, int, int] | None:
    """(name, st_dev, st_ino) of the socket cuda-vmm-<nspid>.sock in `path`
    under `base` if it is a socket that process `pid` listens on."""
    dfd = open_dir_nofollow(path, base)
    if dfd is None:
        return None
    try:
        name = socket_name(nspid)
        try:
            st = os.stat(name, dir_fd=dfd, follow_symlinks=False)
        except OSError:
            return None
        if not stat.S_ISSOCK(st.st_mode) or listener_pid(dfd, name) != pid:
            return None
        return name, st.st_dev, st.st_ino
    finally:
        os.close(dfd)


def remove_owned_sockets(path: str, owned: dict[str, list[int]]) -> int:
    """Remove the sockets recorded as this container's: same name, same file
    (device and inode), and nobody listening on it any more. A shared
    directory's other entries, including a live socket that took one of these
    names, are left alone."""
    if not owned:
        return 0
    dfd = open_dir_nofollow(path)
    if dfd is None:
        return 0
    try:
        removed = 0
        for name, ident in owned.items():
            if not SOCKET_NAME.fullmatch(name) or not isinstance(ident, list) or len(ident) != 2:
                continue
            try:
                st = os.stat(name, dir_fd=dfd, follow_symlinks=False)
            except OSError:
                continue
            if not stat.S_ISSOCK(st.st_mode) or [st.st_dev, st.st_ino] != ident:
                continue
            if listener_pid(dfd, name) is not None:
                continue
            with contextlib.suppress(FileNotFoundError):
                os.unlink(name, dir_fd=dfd)
                removed += 1
        return removed
    finally:
        os.close(dfd)
