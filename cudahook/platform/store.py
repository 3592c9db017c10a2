"""Durable little JSON files under the state directory: per-container records,
per-CRIU-run progress, and the last results kept for `cudahook status`.

Every write is atomic (temp file + rename in the same directory) and private
(0700 directories, 0600 files): the hooks run as root and these files steer
what they do to a container. Writers of one container serialise on a lock
file, because runc may run a create hook while a checkpoint is under way.

The state directory lives in /run, which is RAM, so nothing in it is kept
for good: a CRIU run's progress goes once that CRIU process is gone (after a
grace period), a container's record and lock at poststop (or, when poststop
never ran, once its init is gone and the retention time has passed), and
the last results of a gone container after the retention time (and beyond
the newest HISTORY_MAX).

A container's state is named by its key (container_key), never by its id
alone: an id is unique only within one runc --root, containerd namespace or
podman storage, and two containers of one id would otherwise share a record,
a lock and a CRIU configuration.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import re
import stat
import time
from collections.abc import Iterator
from pathlib import Path

from .atomic import write_json_atomic  # noqa: F401 - imported from here by others
from .errors import StateError, UsageError
from .privdir import ensure_private_dir

# typing costs milliseconds at every hook start: annotations only.
TYPE_CHECKING = False
if TYPE_CHECKING:
    from typing import Any


# At most 250 characters: "<id>.json" must fit NAME_MAX (255); a longer id
# used to end in an OSError traceback (ENAMETOOLONG) instead of a clear error.
_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.+-]{0,249}$")


def check_id(container_id: str) -> str:
    # fullmatch: with match, "$" also accepts a trailing newline ("abc\n").
    if not isinstance(container_id, str) or not _ID.fullmatch(container_id):
        raise UsageError(f"invalid container id {container_id!r}")
    return container_id


# What names a container's state: "<id>@<16 hex digits>" (container_key);
# "@<init pid>-<its start time>" for a container without a record (init_key);
# a bare id, as written before keys, still read and swept.
ID_CUT = 250 - 17
_KEY = re.compile(rf"[A-Za-z0-9][A-Za-z0-9_.+-]{{0,{ID_CUT - 1}}}@[0-9a-f]{{16}}"
                  r"|@[1-9][0-9]{0,9}-[0-9]{1,20}")


def container_key(container_id: str, bundle: str) -> str:
    """The one identity of a container on this node, which names its state.

    The OCI hooks see the id and the bundle in the runtime's state; the
    runtime wrapper sees the id and runc's --bundle; the CRIU action script
    finds the record by its init's PID, and with it the key. The bundle
    tells apart containers of one id under two runc roots, containerd
    namespaces or podman storages. runc reports as the bundle its working
    directory once there, which may be spelt through a symlink (or its
    caller's $PWD): the real path is what counts. The key starts with the
    id (cut to fit a file name; the digest covers all of it), for whoever
    reads the state directory."""
    cid = check_id(container_id)
    if not isinstance(bundle, str) or not bundle or "\0" in bundle:
        raise UsageError(f"container {cid}: invalid bundle {bundle!r}")
    where = os.path.realpath(bundle)
    digest = _sha256(f"{cid}\0{where}".encode(errors="surrogateescape")).hexdigest()
    return f"{cid[:ID_CUT]}@{digest[:16]}"


def _sha256(data: bytes) -> Any:
    """SHA-256 from CPython's built-in module where there is one: importing
    hashlib starts OpenSSL, about 3.5 ms at every GPU container's hook."""
    try:
        from _sha2 import sha256  # Python 3.12+
    except ImportError:
        try:
            from _sha256 import sha256  # Python 3.11
        except ImportError:
            from hashlib import sha256
    return sha256(data)


def init_key(pid: int, start: int) -> str:
    """What serialises the checkpoints of a container the OCI hook never
    recorded (created before cudahook, or by a runtime without the hook):
    its init process, which every CRIU run of it names."""
    if type(pid) is not int or type(start) is not int or pid <= 0 or start < 0:
        raise UsageError(f"invalid init process {pid!r} (start {start!r})")
    return f"@{pid}-{start}"


def check_key(key: str) -> str:
    """A key (or a bare id of an older record); UsageError for anything else."""
    if not isinstance(key, str) or not (_KEY.fullmatch(key) or _ID.fullmatch(key)):
        raise UsageError(f"invalid container id {key!r}")
    return key


def init_of(key: str) -> tuple[int, int] | None:
    """The (pid, start time) an init_key names; None for any other key."""
    if not key.startswith("@"):
        return None
    pid, _, start = key[1:].partition("-")
    return int(pid), int(start)


# Records, progress and history files are a few kilobytes; a bigger one was
# not written by cudahook.
MAX_FILE = 1 << 20


class TooLarge(StateError):
    """A state file would be past MAX_FILE: read_json would refuse it."""


def write_bounded(path: Path, data: Any, *, compact: bool = False, durable: bool = True) -> None:
    """Write `data` as JSON unless it comes to more than MAX_FILE: then
    TooLarge, and the file stays as it was. A file past the cap would be
    read back as absent (read_json), so one oversized write would cost
    everything the file held, not just its own addition."""
    import json

    from .atomic import write_atomic

    text = (json.dumps(data, separators=(",", ":")) if compact
            else json.dumps(data, indent=1, sort_keys=True)).encode()
    if len(text) > MAX_FILE:
        raise TooLarge(f"{path.name}: {len(text)} bytes would be past {MAX_FILE}: not written")
    write_atomic(path, text, durable=durable)


def read_json(path: Path) -> Any | None:
    """The file's JSON, or None when it is missing or not what cudahook wrote
    (a symlink, a directory, a FIFO, too large, not JSON, nested too deeply)."""
    from cudahook.platform.safeio import FileRefused, load_json

    try:
        return load_json(path, MAX_FILE)
    except (OSError, FileRefused):
        return None


# A finished CRIU run's progress is kept this long (s) for a look after a
# failure; the runs of a live CRIU process are always kept.
RUN_GRACE_S = 600.0
# Gone containers' last results kept at most, newest first, whatever the retention.
HISTORY_MAX = 256


def process_alive(pid: Any, start: Any = None) -> bool:
    """A live (not zombie) process; with `start`, the same one as then."""
    if not isinstance(pid, int) or isinstance(pid, bool) or pid <= 0:
        return False
    from .host import Host

    return Host().alive(pid, start if isinstance(start, int) else None)


def _remove(path: Path) -> None:
    import shutil

    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path, ignore_errors=True)
    else:
        with contextlib.suppress(OSError):
            path.unlink()


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


class Store:
    def __init__(self, state_dir: str | os.PathLike[str]):
        self.root = Path(state_dir)

    def _dir(self, name: str) -> Path:
        ensure_private_dir(self.root)
        return ensure_private_dir(self.root / name)

    # -- container records ---------------------------------------------------

    # Each takes the container's key (container_key), or the bare id an
    # older record is named by.

    def record_path(self, key: str) -> Path:
        return self._dir("containers") / f"{check_key(key)}.json"

    def lock_path(self, key: str) -> Path:
        return self._dir("containers") / f"{check_key(key)}.lock"

    @contextlib.contextmanager
    def locked(self, key: str, timeout_s: float = LOCK_WAIT_S) -> Iterator[None]:
        """Hold the container's lock; StateError after `timeout_s` of waiting
        (a hook that waits forever holds up the runtime, or CRIU)."""
        path = self.lock_path(key)
        fd = lock_file(path, timeout_s=timeout_s)
        assert fd is not None
        try:
            yield
        finally:
            os.close(fd)

    def load(self, key: str) -> dict[str, Any] | None:
        """The record, if there is one of the shape cudahook writes."""
        record = read_json(self.record_path(key))
        return record if isinstance(record, dict) else None

    def find(self, container_id: str) -> dict[str, Any] | None:
        """The record of the one container named `container_id` (or whose
        key it is); None when there is none, or more than one of that id
        (under two runtime roots: only its key tells which)."""
        record = self.load(container_id)
        if record is not None:
            return {**record, "key": container_id}
        same = [r for r in self.records() if r.get("id") == container_id]
        return same[0] if len(same) == 1 else None

    def save(self, key: str, record: dict[str, Any]) -> None:
        write_bounded(self.record_path(key), {k: v for k, v in record.items() if k != "key"})

    def update(self, key: str, **fields: Any) -> dict[str, Any]:
        with self.locked(key):
            record = self.load(key) or {"id": key.partition("@")[0]}
            record.update(fields)
            self.save(key, record)
            return record

    def delete(self, key: str) -> None:
        """Forget the record and its lock file (the last results stay, for
        `cudahook status`). The lock file goes while held: a hook that was
        waiting on it finds it unlinked once it gets it, and starts over on
        a new one (see lock_file), so two writers are never in at once."""
        self._delete(key, wait=True)

    def _delete(self, key: str, *, wait: bool) -> bool:
        path = self.lock_path(key)
        fd = lock_file(path, wait=wait)
        if fd is None:
            return False
        try:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(self.record_path(key))
            with contextlib.suppress(FileNotFoundError):
                os.unlink(path)
            from .busy import remove

            with contextlib.suppress(OSError):
                remove(self.root, key)  # held by a checkpoint: next prune
        finally:
            os.close(fd)
        return True

    def records(self) -> list[dict[str, Any]]:
        """Every record, each with its key (the name it is stored under)."""
        d = self.root / "containers"
        if not d.is_dir():
            return []
        out = []
        for p in sorted(d.glob("*.json")):
            rec = read_json(p)
            if isinstance(rec, dict):
                out.append({**rec, "key": p.stem})
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
            write_bounded(path, data)  # too large: this result is dropped, the others stay

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

    def prune_runs(self, grace_s: float | None = None) -> int:
        """Remove the progress (and `.vmm` copies) of CRIU runs whose CRIU
        process is gone, once `grace_s` has passed since the last write. A
        run is named `<criu pid>-<start time>`: a reused PID is another run."""
        grace = RUN_GRACE_S if grace_s is None else grace_s
        d = self.root / "runs"
        if not d.is_dir():
            return 0
        cutoff = time.time() - grace
        removed = 0
        for p in d.iterdir():
            key = p.name.split(".")[0] if not p.name.startswith(".") else ""
            pid, _, start = key.partition("-")
            if pid.isdigit() and process_alive(int(pid), int(start) if start.isdigit() else None):
                continue
            try:
                if p.lstat().st_mtime >= cutoff:
                    continue
            except OSError:
                continue
            _remove(p)
            removed += 1
        return removed

    def prune(self, retention_s: float, *, now: float | None = None) -> int:
        """Forget containers that are gone without a poststop (their init is
        dead) once `retention_s` has passed, lock files left without a record,
        and gone containers' last results after `retention_s` (and beyond the
        newest HISTORY_MAX), and the busy locks of gone inits (init_key)."""
        now = time.time() if now is None else now
        cutoff = now - retention_s
        removed = 0
        d = self.root / "containers"
        live: set[str] = set()
        live_ids: set[str] = set()
        for p in sorted(d.iterdir()) if d.is_dir() else ():
            key, dot, ext = p.name.rpartition(".")
            if not dot or ext not in ("json", "lock") or not (_KEY.fullmatch(key)
                                                              or _ID.fullmatch(key)):
                continue
            if key in live or not os.path.lexists(p):  # gone with its record above
                continue
            cid = key.partition("@")[0]
            if ext == "json":
                rec = read_json(p)
                if isinstance(rec, dict) and isinstance(rec.get("id"), str):
                    cid = rec["id"]
                if isinstance(rec, dict) and process_alive(rec.get("pid"), rec.get("pid_start")):
                    live.add(key)
                    live_ids.add(cid)
                    continue
            elif (d / f"{key}.json").exists():
                continue
            if not _older(p, cutoff):
                continue
            # Never waits: a hook busy with that container has a reason to be,
            # and the hooks prune right after a checkpoint, which must end.
            if not self._delete(key, wait=False):
                live.add(key)
                live_ids.add(cid)
                continue
            from .marks import unmark_container

            with contextlib.suppress(OSError, UsageError):
                unmark_container(self.root, cid)
            removed += 1
        removed += self._prune_init_locks()
        h = self.root / "history"
        entries = []
        for p in h.glob("*.json") if h.is_dir() else ():
            with contextlib.suppress(OSError):
                entries.append((p.stat().st_mtime, p))
        entries.sort(reverse=True)
        for i, (mtime, p) in enumerate(entries):
            if p.stem in live_ids or (i < HISTORY_MAX and mtime >= cutoff):
                continue
            with contextlib.suppress(OSError):
                p.unlink()
                removed += 1
        return removed


    def _prune_init_locks(self) -> int:
        """Busy locks of record-less containers whose init is gone (a lock
        held now is kept: busy.remove takes it first), and the markers of
        guardians of such containers that were killed before they could
        remove their own (a live one's is kept)."""
        from .busy import remove

        gone = 0
        for sub, ext in (("busy", ".lock"), ("guardians", ".json")):
            d = self.root / sub
            for name in os.listdir(d) if d.is_dir() else ():
                key = name[:-len(ext)] if name.endswith(ext) else ""
                init = init_of(key) if _KEY.fullmatch(key) else None
                if init is None or process_alive(*init):
                    continue
                with contextlib.suppress(OSError):
                    if sub == "busy":
                        gone += remove(self.root, key)
                        continue
                    marker = read_json(d / name)
                    if not (isinstance(marker, dict)
                            and process_alive(marker.get("pid"), marker.get("start"))):
                        (d / name).unlink()
                        gone += 1
        return gone


def _older(path: Path, cutoff: float) -> bool:
    try:
        return path.stat().st_mtime < cutoff
    except OSError:
        return False


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
