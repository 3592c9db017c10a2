"""Reading files that someone else controls: a checkpoint image, a bundle's
config.json, the records under the state directory.

Such a file may be a symlink to a host file, a FIFO that blocks the reader
forever, /dev/zero, or simply huge. Every file is opened without following a
symlink in its last component and without blocking on a FIFO, must be a
regular file, is read up to a size cap, and the whole read runs under a
deadline (a regular file on a hung network or FUSE mount blocks too).
JSON is decoded as UTF-8 (RFC 8259), and a document nested deeper than the
decoder's recursion limit is refused like any other malformed one.
"""

from __future__ import annotations

import errno
import json
import os
import stat
import threading

from .errors import CudahookError, Exit

# typing costs milliseconds at every hook start: annotations only.
TYPE_CHECKING = False
if TYPE_CHECKING:
    from collections.abc import Callable
    from typing import Any, TypeVar

    T = TypeVar("T")

READ_TIMEOUT_S = 10.0


class FileRefused(CudahookError):
    """The file is not one cudahook reads: its message names the reason."""

    exit_code = Exit.USAGE


def open_regular(path: str, limit: int) -> int:
    """A read-only fd on `path` if it is a regular file of at most `limit`
    bytes, reached without following a symlink in its last component."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError as exc:
        if exc.errno == errno.ELOOP:  # O_NOFOLLOW met a symlink
            raise FileRefused(f"{path}: is a symlink") from exc
        raise
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise FileRefused(f"{path}: not a regular file")
        if st.st_size > limit:
            raise FileRefused(f"{path}: larger than {limit} bytes")
    except BaseException:
        os.close(fd)
        raise
    return fd


def _read(path: str, limit: int) -> bytes:
    fd = open_regular(path, limit)
    try:
        chunks, total = [], 0
        while True:
            # Bounded even if the file grows while it is read.
            chunk = os.read(fd, min(1 << 20, limit + 1 - total))
            if not chunk:
                break
            chunks.append(chunk)
            total += len(chunk)
            if total > limit:
                raise FileRefused(f"{path}: larger than {limit} bytes")
        return b"".join(chunks)
    finally:
        os.close(fd)


def _copy(src: str, dst: str, limit: int) -> None:
    fd = open_regular(src, limit)
    try:
        out = os.open(dst, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC,
                      0o600)
        try:
            total = 0
            while chunk := os.read(fd, min(1 << 20, limit + 1 - total)):
                total += len(chunk)
                if total > limit:
                    raise FileRefused(f"{src}: larger than {limit} bytes")
                os.write(out, chunk)
        except BaseException:
            os.close(out)
            out = -1
            os.unlink(dst)
            raise
        finally:
            if out >= 0:
                os.close(out)
    finally:
        os.close(fd)


def with_deadline(fn: Callable[[], T], timeout_s: float, what: str) -> T:
    """fn() in a daemon thread, or FileRefused once `timeout_s` has passed.

    A read stuck in the kernel (a hung network or FUSE mount) cannot be
    interrupted, but it must not hold the hook, or the interpreter's exit,
    past the deadline.
    """
    box: list[Any] = []

    def work() -> None:
        try:
            box.append((True, fn()))
        except BaseException as exc:  # handed to the caller's thread
            box.append((False, exc))

    t = threading.Thread(target=work, daemon=True)
    t.start()
    t.join(timeout_s)
    if not box:
        raise FileRefused(f"{what}: no answer within {timeout_s:g}s")
    ok, value = box[0]
    if not ok:
        raise value
    return value  # type: ignore[no-any-return]


def read_bytes(path: str | os.PathLike[str], limit: int,
               timeout_s: float = READ_TIMEOUT_S) -> bytes:
    """The file's bytes. Raises FileRefused (symlink, not a regular file,
    over `limit`, deadline passed) or OSError (FileNotFoundError...)."""
    p = os.fspath(path)
    return with_deadline(lambda: _read(p, limit), timeout_s, p)


def copy_file(src: str | os.PathLike[str], dst: str | os.PathLike[str], limit: int,
              timeout_s: float = READ_TIMEOUT_S) -> None:
    """Copy `src` (checked as read_bytes checks it) to a new private file `dst`."""
    s, d = os.fspath(src), os.fspath(dst)
    with_deadline(lambda: _copy(s, d, limit), timeout_s, s)


def _sha256(path: str, limit: int) -> tuple[str, int]:
    import hashlib

    fd = open_regular(path, limit)
    try:
        h, total = hashlib.sha256(), 0
        while chunk := os.read(fd, 1 << 20):
            total += len(chunk)
            if total > limit:
                raise FileRefused(f"{path}: larger than {limit} bytes")
            h.update(chunk)
        return h.hexdigest(), total
    finally:
        os.close(fd)


def sha256_file(path: str | os.PathLike[str], limit: int,
                timeout_s: float = READ_TIMEOUT_S) -> tuple[str, int]:
    """(sha256 hex digest, size) of the file, checked as read_bytes checks it."""
    p = os.fspath(path)
    return with_deadline(lambda: _sha256(p, limit), timeout_s, p)


def parse_json(data: bytes, what: str) -> Any:
    """`data` as JSON, or FileRefused naming `what` and the reason."""
    try:
        return json.loads(data.decode("utf-8"))
    except UnicodeDecodeError:
        raise FileRefused(f"{what}: not UTF-8") from None
    except ValueError as exc:
        msg = getattr(exc, "msg", None) or str(exc)
        raise FileRefused(f"{what}: not JSON: {msg}") from exc
    except RecursionError:
        raise FileRefused(f"{what}: not JSON: nested too deeply") from None


def load_json(path: str | os.PathLike[str], limit: int,
              timeout_s: float = READ_TIMEOUT_S) -> Any:
    """read_bytes + parse_json."""
    return parse_json(read_bytes(path, limit, timeout_s), os.fspath(path))
