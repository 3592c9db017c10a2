"""Whether a cudahook operation is moving a container's CUDA processes now.

A checkpoint (pre-dump), and the guardian while it restores, hold the
container's busy lock exclusively. It is named by the container's key
(store.container_key), or, for a container without a record, by its init
(store.init_key): two CRIU dumps of one container serialise either way.
`cudahook status` takes it shared without waiting and, if it cannot, probes
nothing: a cuda-checkpoint call on a process in the middle of a lock or
checkpoint can hang or disturb it. While
status holds it, a checkpoint waits for it, for a bounded time. The lock is
an flock: it dies with its holder, so a killed hook leaves nothing held.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
from collections.abc import Iterator
from pathlib import Path

from .ids import check_key
from .locks import LockTimeout, lock_file, names_file
from .privdir import ensure_private_dir


class Busy(Exception):
    """Another operation held the container's lock past the wait."""


def _path(state_dir: str | os.PathLike[str], key: str) -> Path:
    d = ensure_private_dir(ensure_private_dir(Path(state_dir)) / "busy")
    return d / f"{check_key(key)}.lock"


def _open(state_dir: str, key: str) -> int:
    return os.open(_path(state_dir, key),
                   os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)


@contextlib.contextmanager
def hold(state_dir: str, key: str | None, wait_s: float, *,
         required: bool = True) -> Iterator[None]:
    """Hold the container's lock exclusively; Busy after wait_s. Not
    `required`: go on without it instead (after the wait, or when the lock
    file cannot be had), for a restore that matters more than the lock.
    The waiting, and starting over on a file removed meanwhile (see
    remove), are the state store's lock_file."""
    fd = None
    if key:
        try:
            fd = lock_file(_path(state_dir, key), timeout_s=wait_s)
        except LockTimeout:
            if required:
                raise Busy(f"another cudahook operation on container {key} "
                           f"still runs after {wait_s:g}s") from None
        except Exception:
            if required:
                raise
    try:
        yield
    finally:
        if fd is not None:
            os.close(fd)


@contextlib.contextmanager
def peek(state_dir: str, key: str) -> Iterator[bool]:
    """True (and held shared until the block ends) if nothing is moving the
    container's processes; False at once if something is."""
    fd = _open(state_dir, key)
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
        except BlockingIOError:
            yield False
            return
        yield _still_named(fd, state_dir, key)
    finally:
        os.close(fd)


def remove(state_dir: str | os.PathLike[str], key: str) -> bool:
    """Delete a gone container's lock file, only while nobody holds it (the
    state directory is RAM). Whoever opened it before the unlink finds, once
    it gets the lock, that the path no longer names it, and starts over."""
    path = Path(state_dir) / "busy" / f"{check_key(key)}.lock"
    try:
        fd = os.open(path, os.O_RDWR | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError:
        return not os.path.lexists(path)
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            return False
        with contextlib.suppress(FileNotFoundError):
            os.unlink(path)
        return True
    finally:
        os.close(fd)


def _still_named(fd: int, state_dir: str | os.PathLike[str], key: str) -> bool:
    return names_file(Path(state_dir) / "busy" / f"{key}.lock", fd)
