"""Reversible changes to system files: every write remembers what it replaced.

install.sh and `cudahook configure` touch files other tools own
(/etc/criu/runc.conf, /etc/docker/daemon.json...). Each change is recorded
with the file's previous bytes (or its absence), so --revert and --uninstall
put every file back byte for byte - unless someone changed it since, which
is reported and left alone (a registration in such a file loses only
cudahook's part, see registrations.py).

Each installation prefix has its own journal: installing or uninstalling at
one prefix never adopts or reverts what another one did. The default
prefix's journal is var/lib/cudahook/journal.json (where every earlier
version kept the one journal); any other prefix's is
var/lib/cudahook/journals/<hash of the prefix>.json and names its prefix.
Standard library only: install.sh runs this before any virtual environment
exists.
"""

from __future__ import annotations

import base64
import contextlib
import difflib
import hashlib
import json
import os
import time
from dataclasses import dataclass
from pathlib import Path

from cudahook.platform import paths
from cudahook.platform.atomic import write_atomic

from . import registrations

JOURNAL = "var/lib/cudahook/journal.json"
JOURNALS = "var/lib/cudahook/journals"


def _sha(data: bytes | None) -> str | None:
    return None if data is None else hashlib.sha256(data).hexdigest()


def _read(path: Path) -> bytes | None:
    try:
        if path.is_symlink():
            return b"symlink:" + os.readlink(path).encode()
        return path.read_bytes()
    except FileNotFoundError:
        return None


@dataclass
class Change:
    path: Path  # absolute, already under the root
    after: bytes | None  # None: remove the file
    mode: int = 0o644
    symlink: str | None = None  # make `path` a symlink to this instead

    def new_bytes(self) -> bytes | None:
        return b"symlink:" + self.symlink.encode() if self.symlink is not None else self.after


def _norm(path: str | os.PathLike[str]) -> Path:
    return Path(os.path.normpath(os.path.abspath(path)))


def _load(path: Path) -> dict | None:  # type: ignore[type-arg]
    """A journal file: {"prefix", "entries", "owned"}; the first format was
    the bare list of entries, for the default prefix."""
    try:
        raw = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    if isinstance(raw, list):
        return {"prefix": None, "entries": raw, "owned": []}
    if not isinstance(raw, dict):
        return None
    return {"prefix": raw.get("prefix"), "entries": list(raw.get("entries") or []),
            "owned": list(raw.get("owned") or [])}


class Journal:
    def __init__(self, root: str | os.PathLike[str] = "/",
                 prefix: str | os.PathLike[str] | None = None):
        self.root = Path(root)
        default = _norm(paths.at(paths.PREFIX, self.root))
        self.prefix = _norm(prefix) if prefix is not None else default
        if self.prefix == default:
            self.path = self.root / JOURNAL
        else:
            key = hashlib.sha256(str(self.prefix).encode()).hexdigest()[:16]
            self.path = self.root / JOURNALS / f"{key}.json"

    @classmethod
    def all(cls, root: str | os.PathLike[str] = "/") -> list[Journal]:
        """Every installation journaled under this root (those with anything in them)."""
        found = []
        candidates = [Path(root) / JOURNAL, *sorted((Path(root) / JOURNALS).glob("*.json"))]
        for path in candidates:
            data = _load(path)
            if data is None or not (data["entries"] or data["owned"]):
                continue
            j = cls(root, data["prefix"]) if data["prefix"] else cls(root)
            if j.path == path:
                found.append(j)
        return found

    def at(self, path: str) -> Path:
        return self.root / path.lstrip("/")

    def data(self) -> dict:  # type: ignore[type-arg]
        return _load(self.path) or {"prefix": str(self.prefix), "entries": [], "owned": []}

    def entries(self) -> list[dict]:  # type: ignore[type-arg]
        return self.data()["entries"]

    def owned(self) -> list[str]:
        """Directories this installation created and removes whole on uninstall."""
        return list(self.data()["owned"])

    def own(self, *dirs: str | os.PathLike[str]) -> None:
        data = self.data()
        for d in dirs:
            if str(d) not in data["owned"]:
                data["owned"].append(str(d))
        self._write(data)

    def forget_owned(self, *dirs: str) -> None:
        data = self.data()
        data["owned"] = [d for d in data["owned"] if d not in dirs]
        self._write(data)

    def _save(self, entries: list[dict]) -> None:  # type: ignore[type-arg]
        data = self.data()
        data["entries"] = entries
        self._write(data)

    def _write(self, data: dict) -> None:  # type: ignore[type-arg]
        if not data["entries"] and not data["owned"]:
            self.path.unlink(missing_ok=True)
            for d in self.path.parents:  # the directories it made, when empty
                if d == self.root or self.root not in d.parents:
                    break
                try:
                    d.rmdir()
                except OSError:
                    break
            return
        data = {"version": 2, "prefix": str(self.prefix), "entries": data["entries"],
                "owned": data["owned"]}
        self.path.parent.mkdir(parents=True, exist_ok=True)
        write_atomic(self.path, json.dumps(data, indent=1).encode(), 0o600)

    def diff(self, change: Change) -> str:
        old = _read(change.path)
        new = change.new_bytes()
        if old == new:
            return ""
        a = (old or b"").decode(errors="replace").splitlines(keepends=True)
        b = (new or b"").decode(errors="replace").splitlines(keepends=True)
        name = str(change.path)
        return "".join(difflib.unified_diff(a, b, name if old is not None else "/dev/null",
                                            name if new is not None else "/dev/null"))

    def apply(self, group: str, changes: list[Change], *, dry_run: bool = False) -> list[str]:
        """Make the changes; the diffs of those that change anything."""
        shown = []
        entries = self.entries()
        for ch in changes:
            d = self.diff(ch)
            if not d:
                continue
            shown.append(d)
            if dry_run:
                continue
            before = _read(ch.path)
            before_mode = (ch.path.stat().st_mode & 0o7777
                           if ch.path.exists() and not ch.path.is_symlink() else None)
            created_dirs = []
            parent = ch.path.parent
            while not parent.exists():
                created_dirs.append(str(parent))
                parent = parent.parent
            ch.path.parent.mkdir(parents=True, exist_ok=True)
            if ch.path.is_symlink() or (ch.path.exists() and ch.new_bytes() is None):
                ch.path.unlink()
            if ch.symlink is not None:
                if ch.path.exists():
                    ch.path.unlink()
                ch.path.symlink_to(ch.symlink)
            elif ch.after is not None:
                mode = ch.path.stat().st_mode & 0o7777 if ch.path.exists() else ch.mode
                write_atomic(ch.path, ch.after, mode)
            # Keep the first "before" of a path: that is what uninstall restores.
            if not any(e["path"] == str(ch.path) for e in entries):
                entries.append({
                    "group": group, "path": str(ch.path), "time": time.time(),
                    "before": None if before is None else base64.b64encode(before).decode(),
                    "mode": before_mode,
                    "created_dirs": created_dirs,
                })
            for e in entries:
                if e["path"] == str(ch.path):
                    e["after_sha"] = _sha(ch.new_bytes())
        if not dry_run:
            self._save(entries)
        return shown

    def ours(self, exe: str) -> bool:
        """Whether a registered executable is this installation's, or dangling."""
        return (exe.startswith(str(self.prefix) + "/")
                or not registrations.executable(exe))

    def revert(self, groups: set[str] | None = None, *, dry_run: bool = False,
               skip: set[str] | None = None) -> tuple[list[str], list[str]]:
        """Put files back; (what was restored, notes on what was left and why).

        Registrations go first, before the files they name. A registration
        file changed since loses only cudahook's part; one put back as it was
        loses what in it names an executable that no longer exists (an
        installation at another prefix, uninstalled since). Paths in `skip`
        stay as they are and stay journaled.
        """
        restored, kept = [], []
        remaining = []
        todo = []
        for e in reversed(self.entries()):
            if (groups is not None and e["group"] not in groups) or e["path"] in (skip or ()):
                remaining.insert(0, e)
            else:
                todo.append(e)
        todo.sort(key=lambda e: registrations.kind_of(Path(e["path"]), self.root) is None)
        for e in todo:
            path = Path(e["path"])
            kind = registrations.kind_of(path, self.root)
            before = None if e["before"] is None else base64.b64decode(e["before"])
            current = _read(path)
            if _sha(current) != e.get("after_sha"):
                if kind is None or current is None or current.startswith(b"symlink:"):
                    kept.append(f"{path}: changed since cudahook wrote it; left as is")
                    continue
                new = registrations.strip(kind, current, self.ours, before)
                if new == current:
                    kept.append(f"{path}: changed since cudahook wrote it; left as is")
                    continue
                kept.append(f"{path}: changed since cudahook wrote it; removed only "
                            "cudahook's registration")
                if not dry_run:
                    _put(path, new, None)
                continue
            restored.append(str(path))
            if dry_run:
                remaining.insert(0, e)
                continue
            if kind is not None and before is not None:
                before = registrations.strip(kind, before, self.ours, before)
            if before is not None and before.startswith(b"symlink:"):
                target = before[len(b"symlink:"):].decode()
                if not (path.parent / target).exists():
                    kept.append(f"{path}: not put back as a link to {target}, which is gone")
                    before = None
            _put(path, before, e.get("mode"))
            for d in e.get("created_dirs", []):
                with contextlib.suppress(OSError):
                    os.rmdir(d)
        if not dry_run:
            self._save(remaining)
        return restored, kept


def _put(path: Path, data: bytes | None, mode: int | None) -> None:
    """Make `path` hold `data` (a "symlink:" target, bytes, or None: absent)."""
    if data is not None and not data.startswith(b"symlink:") and path.is_file() \
            and not path.is_symlink():
        write_atomic(path, data, mode if mode is not None else path.stat().st_mode & 0o7777)
        return
    if path.is_symlink() or path.exists():
        path.unlink()
    if data is None:
        return
    if data.startswith(b"symlink:"):
        path.symlink_to(data[len(b"symlink:"):].decode())
    else:
        write_atomic(path, data, mode if mode is not None else 0o644)
