"""The cgroup tree: a container's processes from its own cgroup, the
freezer that containerd and docker use to pause a container, and the room
left under a process's memory limit.
"""

from __future__ import annotations

import os
import time
from collections.abc import Iterator
from pathlib import Path

# cgroup v1 reports "no limit" as a huge page-rounded number.
_NO_LIMIT = 1 << 60


class CgroupReader:
    """Mixin of Host: reads under its `cgroup_root`; needs `cgroup_paths`."""

    cgroup_root: Path

    def cgroup_paths(self, pid: int) -> list[tuple[str, str]]:
        raise NotImplementedError  # ProcReader's

    def cgroup_members(self, pid: int) -> Iterator[list[int]]:
        """The PIDs of each (non-root) cgroup subtree that holds the process.

        This is what keeps discovery independent of host size: a container's
        cgroup lists exactly its processes, while walking /proc costs one read
        per process on the host. The caller decides which hierarchy is the
        container's own: a shared one also lists processes outside it.
        """
        seen: set[Path] = set()
        for controllers, path in self.cgroup_paths(pid):
            if path in ("", "/"):
                continue
            for base in self._cgroup_mounts(controllers):
                top = (base / path.lstrip("/")).resolve()
                if top in seen:
                    continue
                seen.add(top)
                pids = _read_cgroup_tree(top)
                if pids is not None and pid in pids:
                    yield sorted(pids)
                    break

    # -- the cgroup freezer ----------------------------------------------------
    # containerd and docker pause a container (freeze its cgroup) before they
    # call `runc checkpoint`. A frozen process's CUDA restore thread cannot
    # run, and cuda-checkpoint then hangs, so the CUDA phase must thaw it.

    def freezer(self, pid: int) -> Path | None:
        """The freezer control file of the process's own (non-root) cgroup.

        A v1 freezer comes first: on a hybrid host (v1 controllers, v2
        mounted beside them) runtimes freeze through v1.
        """
        entries = self.cgroup_paths(pid)
        entries.sort(key=lambda e: "freezer" not in e[0].split(","))
        for controllers, path in entries:
            if path in ("", "/"):
                continue
            if controllers == "":
                candidates = [b / path.lstrip("/") / "cgroup.freeze"
                              for b in (self.cgroup_root, self.cgroup_root / "unified")]
            elif "freezer" in controllers.split(","):
                candidates = [self.cgroup_root / "freezer" / path.lstrip("/") / "freezer.state"]
            else:
                continue
            for f in candidates:
                if f.exists():
                    return f
        return None

    def is_frozen(self, pid: int) -> bool:
        f = self.freezer(pid)
        if f is None:
            return False
        if f.name == "freezer.state":
            return f.read_text().strip() in ("FROZEN", "FREEZING")
        return f.read_text().strip() == "1"

    def set_frozen(self, pid: int, frozen: bool, timeout: float = 10.0) -> None:
        f = self.freezer(pid)
        if f is None:
            return
        v1 = f.name == "freezer.state"
        f.write_text(("FROZEN" if frozen else "THAWED") if v1 else ("1" if frozen else "0"))
        deadline = time.monotonic() + timeout
        while True:
            if v1:
                state = f.read_text().strip()
                done = state == ("FROZEN" if frozen else "THAWED")
            else:
                events = (f.parent / "cgroup.events").read_text()
                done = f"frozen {1 if frozen else 0}" in events
            if done:
                return
            if time.monotonic() > deadline:
                raise TimeoutError(f"cgroup {f.parent} did not {'freeze' if frozen else 'thaw'}")
            time.sleep(0.01)

    # -- the memory limit ------------------------------------------------------

    def memory_room(self, pid: int) -> tuple[str, int] | None:
        """(cgroup, bytes left under its memory limit) of the process's memory
        cgroup, v2 or v1; None without a limit, or when unreadable."""
        try:
            entries = self.cgroup_paths(pid)
        except Exception:
            return None
        for controllers, path in entries:
            if path in ("", "/"):
                continue
            if controllers == "":
                files = [(b / path.lstrip("/"), "memory.max", "memory.current")
                         for b in (self.cgroup_root, self.cgroup_root / "unified")]
            elif "memory" in controllers.split(","):
                files = [(self.cgroup_root / "memory" / path.lstrip("/"),
                          "memory.limit_in_bytes", "memory.usage_in_bytes")]
            else:
                continue
            for d, limit_name, usage_name in files:
                try:
                    limit_text = (d / limit_name).read_text().strip()
                    usage = int((d / usage_name).read_text().strip())
                except (OSError, ValueError):
                    continue
                if limit_text == "max" or not limit_text.isdigit() or int(limit_text) >= _NO_LIMIT:
                    continue
                return path, max(0, int(limit_text) - usage)
        return None

    def _cgroup_mounts(self, controllers: str) -> list[Path]:
        root = self.cgroup_root
        if controllers == "":
            return [root, root / "unified"]
        names = [c.removeprefix("name=") for c in controllers.split(",")]
        return [root / n for n in names] + [root / controllers]


def _read_cgroup_tree(top: Path) -> set[int] | None:
    pids: set[int] = set()
    try:
        walker = os.walk(top)
        first = True
        for dirpath, _dirs, files in walker:
            if first and "cgroup.procs" not in files:
                return None
            first = False
            try:
                text = Path(dirpath, "cgroup.procs").read_text()
            except OSError:
                continue
            pids.update(int(x) for x in text.split())
    except OSError:
        return None
    return pids if not first else None
