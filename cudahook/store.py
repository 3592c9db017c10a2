"""Durable little JSON files under the state directory: per-container records,
per-CRIU-run progress, and the last results kept for `cudahook status`.

Every write is atomic (temp file + rename in the same directory) and private
(0700 directories, 0600 files): the hooks run as root and these files steer
what they do to a container. Writers of one container serialise on a lock
file, because runc may run a create hook while a checkpoint is under way.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import re
import stat
import threading
import time
from collections.abc import Iterator
from pathlib import Path

from . import paths
from .errors import StateError, UsageError

# typing costs milliseconds at every hook start: annotations only.
TYPE_CHECKING = False
if TYPE_CHECKING:
    from typing import Any


def marks_dir() -> Path:
    """Marks the hooks' shell fast paths test before they start Python."""
    return paths.at(paths.MARKS_DIR)


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


# At most 250 characters: "<id>.json" must fit NAME_MAX (255); a longer id
# used to end in an OSError traceback (ENAMETOOLONG) instead of a clear error.
_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.+-]{0,249}$")


def check_id(container_id: str) -> str:
    # fullmatch: with match, "$" also accepts a trailing newline ("abc\n").
    if not isinstance(container_id, str) or not _ID.fullmatch(container_id):
        raise UsageError(f"invalid container id {container_id!r}")
    return container_id


def write_json_atomic(path: Path, data: Any, mode: int = 0o600) -> None:
    # Unique per thread too: two threads of one process sharing a temp name
    # would write into each other's file (and one os.replace would fail).
    # The name is cut so that the temp name fits NAME_MAX as well.
    tmp = path.with_name(f".{path.name[:200]}.{os.getpid()}.{threading.get_ident()}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW, mode)
    try:
        with os.fdopen(fd, "w") as f:
            json.dump(data, f, indent=1, sort_keys=True)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise


# Records, progress and history files are a few kilobytes; a bigger one was
# not written by cudahook.
MAX_FILE = 1 << 20


def read_json(path: Path) -> Any | None:
    """The file's JSON, or None when it is missing or not what cudahook wrote
    (a symlink, a directory, a FIFO, too large, not JSON, nested too deeply)."""
    from .safeio import FileRefused, load_json

    try:
        return load_json(path, MAX_FILE)
    except (OSError, FileRefused):
        return None


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


# How long a hook waits for another one's lock on the same container.
LOCK_WAIT_S = 10.0


def _flock(fd: int, path: Path, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    delay = 0.001
    while True:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            return
        except BlockingIOError:
            if time.monotonic() >= deadline:
                raise StateError(f"{path}: held by another cudahook process for "
                                 f"{timeout_s:g}s; giving up") from None
            time.sleep(delay)
            delay = min(delay * 2, 0.05)


class Store:
    def __init__(self, state_dir: str | os.PathLike[str]):
        self.root = Path(state_dir)

    def _dir(self, name: str) -> Path:
        ensure_private_dir(self.root)
        return ensure_private_dir(self.root / name)

    # -- container records ---------------------------------------------------

    def record_path(self, container_id: str) -> Path:
        return self._dir("containers") / f"{check_id(container_id)}.json"

    @contextlib.contextmanager
    def locked(self, container_id: str, timeout_s: float = LOCK_WAIT_S) -> Iterator[None]:
        """Hold the container's lock; StateError after `timeout_s` of waiting
        (a hook that waits forever holds up the runtime, or CRIU)."""
        path = self._dir("containers") / f"{check_id(container_id)}.lock"
        try:
            fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_NONBLOCK
                         | os.O_CLOEXEC, 0o600)
        except OSError as exc:
            raise StateError(f"{path}: cannot open the lock ({exc.strerror}); "
                             "refusing to use it") from None
        try:
            if not stat.S_ISREG(os.fstat(fd).st_mode):
                raise StateError(f"{path}: the lock is not a regular file; refusing to use it")
            _flock(fd, path, timeout_s)
            yield
        finally:
            os.close(fd)

    def load(self, container_id: str) -> dict[str, Any] | None:
        """The record, if there is one of the shape cudahook writes."""
        record = read_json(self.record_path(container_id))
        return record if isinstance(record, dict) else None

    def save(self, container_id: str, record: dict[str, Any]) -> None:
        write_json_atomic(self.record_path(container_id), record)

    def update(self, container_id: str, **fields: Any) -> dict[str, Any]:
        with self.locked(container_id):
            record = self.load(container_id) or {"id": container_id}
            record.update(fields)
            self.save(container_id, record)
            return record

    def delete(self, container_id: str) -> None:
        """Forget the record. The lock file stays: unlinking a lock that
        another hook may be waiting on would let two writers in at once."""
        with self.locked(container_id), contextlib.suppress(FileNotFoundError):
            os.unlink(self.record_path(container_id))

    def records(self) -> list[dict[str, Any]]:
        d = self.root / "containers"
        if not d.is_dir():
            return []
        out = []
        for p in sorted(d.glob("*.json")):
            rec = read_json(p)
            if isinstance(rec, dict):
                out.append(rec)
        return out

    def find_by_pid(self, pid: int, start: int | None = None) -> dict[str, Any] | None:
        """The record of the container whose init is `pid`. With `start`, a
        record left behind by a container whose PID was since reused does not
        match (its init started at another time)."""
        for rec in self.records():
            if rec.get("pid") != pid:
                continue
            if start is not None and rec.get("pid_start") not in (None, start):
                continue
            return rec
        return None

    # -- results kept past the container's life -------------------------------

    def remember(self, container_id: str, kind: str, result: dict[str, Any],
                 timeout_s: float = 1.0) -> None:
        """Keep a result for `cudahook status`. Only history: the lock wait
        is short (a checkpointed workload waits on whoever calls this)."""
        path = self._dir("history") / f"{check_id(container_id)}.json"
        with self.locked(container_id, timeout_s):
            data = read_json(path)
            if not isinstance(data, dict):
                data = {}
            data[kind] = result
            write_json_atomic(path, data)

    def history(self) -> dict[str, dict[str, Any]]:
        d = self.root / "history"
        if not d.is_dir():
            return {}
        out = {}
        for p in sorted(d.glob("*.json")):
            data = read_json(p)
            out[p.stem] = data if isinstance(data, dict) else {}
        return out

    # -- progress of one CRIU run (its actions run twice) -----------------------

    def run_path(self, run_key: str) -> Path:
        return self._dir("runs") / f"{run_key}.json"

    def prune_runs(self, max_age_s: float = 86400) -> None:
        d = self.root / "runs"
        cutoff = time.time() - max_age_s
        for p in d.glob("*.json") if d.is_dir() else ():
            with contextlib.suppress(OSError):
                if p.stat().st_mtime < cutoff:
                    p.unlink()
