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
import json
import os
import time
from collections.abc import Callable, Iterator
from pathlib import Path

from . import busy, marks
from .atomic import (
    write_atomic,
    write_json_atomic,  # noqa: F401 - imported from here by others
)
from .errors import StateError, UsageError
from .host import Host
from .ids import (  # noqa: F401 - imported from here by others
    ID,
    ID_CUT,
    KEY,
    check_id,
    check_key,
    container_key,
    init_key,
    init_of,
)
from .locks import LOCK_WAIT_S, LockTimeout, lock_file, names_file  # noqa: F401 - as ids
from .privdir import ensure_private_dir

# typing costs milliseconds at every hook start: annotations only.
TYPE_CHECKING = False
if TYPE_CHECKING:
    from typing import Any


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
    text = (json.dumps(data, separators=(",", ":")) if compact
            else json.dumps(data, indent=1, sort_keys=True)).encode()
    if len(text) > MAX_FILE:
        raise TooLarge(f"{path.name}: {len(text)} bytes would be past {MAX_FILE}: not written")
    write_atomic(path, text, durable=durable)


def read_json(path: Path) -> Any | None:
    """The file's JSON, or None when it is missing or not what cudahook wrote
    (a symlink, a directory, a FIFO, too large, not JSON, nested too deeply)."""
    # Here: 0.7-2.4 ms (safeio and threading) at `import cudahook.hooks.criu_action`,
    # which bench P1 guards; a GPU run reads a record, and pays it, later.
    from .safeio import FileRefused, load_json

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
    return Host().alive(pid, start if isinstance(start, int) else None)


def _remove(path: Path) -> None:
    import shutil  # 2 ms at a hook start, for a gone CRIU run's directory only

    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path, ignore_errors=True)
    else:
        with contextlib.suppress(OSError):
            path.unlink()


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

            with contextlib.suppress(OSError):
                busy.remove(self.root, key)  # held by a checkpoint: next prune
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

    def prune_runs(self, grace_s: float | None = None,
                   gone: Callable[[Path], None] | None = None) -> int:
        """Remove the progress (and `.vmm` copies) of CRIU runs whose CRIU
        process is gone, once `grace_s` has passed since the last write. A
        run is named `<criu pid>-<start time>`: a reused PID is another run.
        `gone` is shown each run record before it is removed (what the run
        left outside this directory goes with it)."""
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
            if gone is not None and p.suffix == ".json":
                with contextlib.suppress(Exception):  # pruning goes on whatever it finds
                    gone(p)
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
            if not dot or ext not in ("json", "lock") or not (KEY.fullmatch(key)
                                                              or ID.fullmatch(key)):
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
            with contextlib.suppress(OSError, UsageError):
                marks.unmark_container(self.root, cid)
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
        gone = 0
        for sub, ext in (("busy", ".lock"), ("guardians", ".json")):
            d = self.root / sub
            for name in os.listdir(d) if d.is_dir() else ():
                key = name[:-len(ext)] if name.endswith(ext) else ""
                init = init_of(key) if KEY.fullmatch(key) else None
                if init is None or process_alive(*init):
                    continue
                with contextlib.suppress(OSError):
                    if sub == "busy":
                        gone += busy.remove(self.root, key)
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
