"""Reversible changes to system files: every write remembers what it replaced.

install.sh and `cudahook configure` touch files other tools own
(/etc/criu/runc.conf, /etc/docker/daemon.json...). Each change is recorded
with the file's previous bytes (or its absence), so --revert and --uninstall
put every file back byte for byte - unless someone changed it since, which
is reported and left alone. Standard library only: install.sh runs this
before any virtual environment exists.
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

JOURNAL = "var/lib/cudahook/journal.json"


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


class Journal:
    def __init__(self, root: str | os.PathLike[str] = "/"):
        self.root = Path(root)
        self.path = self.root / JOURNAL

    def at(self, path: str) -> Path:
        return self.root / path.lstrip("/")

    def entries(self) -> list[dict]:  # type: ignore[type-arg]
        try:
            return json.loads(self.path.read_text())
        except (FileNotFoundError, ValueError):
            return []

    def _save(self, entries: list[dict]) -> None:  # type: ignore[type-arg]
        if not entries:
            self.path.unlink(missing_ok=True)
            for d in (self.path.parent, self.path.parent.parent):
                try:
                    d.rmdir()
                except OSError:
                    break
            return
        self.path.parent.mkdir(parents=True, exist_ok=True)
        tmp = self.path.with_suffix(".tmp")
        tmp.write_text(json.dumps(entries, indent=1))
        os.replace(tmp, self.path)

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
                tmp = ch.path.with_name(f".{ch.path.name}.cudahook-tmp")
                tmp.write_bytes(ch.after)
                mode = ch.path.stat().st_mode & 0o7777 if ch.path.exists() else ch.mode
                os.chmod(tmp, mode)
                os.replace(tmp, ch.path)
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

    def revert(self, groups: set[str] | None = None, *, dry_run: bool = False
               ) -> tuple[list[str], list[str]]:
        """Put files back; (what was restored, what was left because it changed since)."""
        restored, kept = [], []
        remaining = []
        for e in reversed(self.entries()):
            if groups is not None and e["group"] not in groups:
                remaining.insert(0, e)
                continue
            path = Path(e["path"])
            if _sha(_read(path)) != e.get("after_sha"):
                kept.append(f"{path}: changed since cudahook wrote it; left as is")
                continue
            restored.append(str(path))
            if dry_run:
                remaining.insert(0, e)
                continue
            before = None if e["before"] is None else base64.b64decode(e["before"])
            if path.is_symlink() or path.exists():
                path.unlink()
            if before is not None:
                if before.startswith(b"symlink:"):
                    path.symlink_to(before[len(b"symlink:"):].decode())
                else:
                    path.write_bytes(before)
                    if e.get("mode") is not None:
                        os.chmod(path, e["mode"])
            for d in e.get("created_dirs", []):
                with contextlib.suppress(OSError):
                    os.rmdir(d)
        if not dry_run:
            self._save(remaining)
        return restored, kept
