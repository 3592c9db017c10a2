"""Lock files: an flock on a regular file under the state directory,
waited for with a deadline, that dies with its holder. The state store
serialises a container's writers on one; the busy lock is another.
"""

from __future__ import annotations

import fcntl
import os
import stat
import time
from pathlib import Path

from .errors import StateError

# How long a hook waits for another one's lock on the same container.
LOCK_WAIT_S = 10.0


class LockTimeout(StateError):
    """Another process held a lock file past the wait."""


def _flock(fd: int, path: Path, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    delay = 0.001
    while True:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            return
        except BlockingIOError:
            if time.monotonic() >= deadline:
                raise LockTimeout(f"{path}: held by another cudahook process for "
                                 f"{timeout_s:g}s; giving up") from None
            time.sleep(delay)
            delay = min(delay * 2, 0.05)


def lock_file(path: Path, *, wait: bool = True, timeout_s: float = LOCK_WAIT_S) -> int | None:
    """An fd holding the lock file `path`, exclusively; StateError after
    `timeout_s` of waiting (LockTimeout). Without `wait`, None at once when
    it is held.

    The file must be a regular file reached without a symlink. It can be
    unlinked by its holder (Store.delete): a waiter that then gets the lock
    of an unlinked file holds nothing anyone else will ever ask for, so it
    checks that `path` still names the file it locked and otherwise starts
    over with the file now there."""
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_NONBLOCK
                         | os.O_CLOEXEC, 0o600)
        except OSError as exc:
            raise StateError(f"{path}: cannot open the lock ({exc.strerror}); "
                             "refusing to use it") from exc
        try:
            if not stat.S_ISREG(os.fstat(fd).st_mode):
                raise StateError(f"{path}: the lock is not a regular file; refusing to use it")
            if wait:
                _flock(fd, path, max(0.0, deadline - time.monotonic()))
            else:
                try:
                    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                except BlockingIOError:
                    os.close(fd)
                    return None
            same = names_file(path, fd)
        except BaseException:
            os.close(fd)
            raise
        if same:
            return fd
        os.close(fd)


def names_file(path: Path, fd: int) -> bool:
    """Does `path` (not followed) still name the file `fd` has open? A lock
    file unlinked by its holder while another process waited on it does not."""
    try:
        st = os.stat(path, follow_symlinks=False)
    except OSError:
        return False
    own = os.fstat(fd)
    return (st.st_dev, st.st_ino) == (own.st_dev, own.st_ino)
