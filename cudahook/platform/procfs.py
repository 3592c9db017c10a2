"""Reading processes from /proc: status, namespaces, open files, threads,
cgroup membership. A process that vanishes mid-read raises ProcessGone.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path


class ProcessGone(Exception):
    """The process vanished while we were reading it."""


class ProcReader:
    """Mixin of Host: reads under its `proc` root."""

    proc: Path
    _own_pidns: str | None

    def _p(self, pid: int, *parts: str) -> Path:
        return self.proc.joinpath(str(pid), *parts)

    def exists(self, pid: int) -> bool:
        return self._p(pid).is_dir()

    def read(self, pid: int, name: str) -> str:
        try:
            return self._p(pid, name).read_text(errors="replace")
        except (FileNotFoundError, ProcessLookupError) as exc:
            raise ProcessGone(pid) from exc

    def environ(self, pid: int, name: str) -> str | None:
        """One variable of the process's initial environment (None: unset)."""
        prefix = name.encode() + b"="
        for item in self.read(pid, "environ").encode(errors="surrogateescape").split(b"\0"):
            if item.startswith(prefix):
                return item[len(prefix):].decode(errors="replace")
        return None

    def job_file_id(self, pid: int, path: str) -> str:
        """Identity of a file as the process sees it (through its root), so
        one job file reached by different mount paths is one job."""
        base = self._p(pid, "root") if os.path.isabs(path) else self._p(pid, "cwd")
        try:
            st = os.stat(base / path.lstrip("/"))
        except OSError:
            return f"path:{path}"
        return f"{st.st_dev}:{st.st_ino}"

    def status(self, pid: int) -> dict[str, str]:
        fields: dict[str, str] = {}
        for line in self.read(pid, "status").splitlines():
            key, _, value = line.partition(":")
            fields[key] = value.strip()
        return fields

    def stopped(self, pid: int, *, traced: bool = True) -> bool:
        """Is the process stopped (SIGSTOP, or a tracer's stop: State T or
        t) or, with `traced`, held by a tracer (TracerPid) while it runs?
        cuda-checkpoint hangs on a stopped process, and CRIU cannot seize a
        traced one."""
        status = self.status(pid)
        return status.get("State", "")[:1] in ("t", "T") or (
            traced and status.get("TracerPid", "0") != "0")

    def nspid(self, pid: int) -> int:
        """The PID as the process's own (innermost) PID namespace sees it."""
        chain = self.status(pid).get("NSpid", "").split()
        return int(chain[-1]) if chain else pid

    def ppid(self, pid: int) -> int:
        stat = self.read(pid, "stat")
        # comm may hold spaces and parentheses: split after the last ')'
        return int(stat[stat.rindex(")") + 2 :].split()[1])

    def start_time(self, pid: int) -> int:
        """Start time in clock ticks: with the PID, names one process for good."""
        stat = self.read(pid, "stat")
        return int(stat[stat.rindex(")") + 2 :].split()[19])

    def alive(self, pid: int, start: int | None = None) -> bool:
        """Running (not a zombie) and, if given, the same process as before."""
        try:
            if self.state(pid) in "ZX":
                return False
            return start is None or self.start_time(pid) == start
        except ProcessGone:
            return False

    def state(self, pid: int) -> str:
        stat = self.read(pid, "stat")
        return stat[stat.rindex(")") + 2]

    def pidns(self, pid: int) -> str:
        try:
            return os.readlink(self._p(pid, "ns", "pid"))
        except (FileNotFoundError, ProcessLookupError) as exc:
            raise ProcessGone(pid) from exc

    def own_pidns(self) -> str:
        if self._own_pidns is None:
            self._own_pidns = os.readlink(self.proc / "self" / "ns" / "pid")
        return self._own_pidns

    def fd_targets(self, pid: int) -> Iterator[str]:
        fd_dir = self._p(pid, "fd")
        try:
            names = os.listdir(fd_dir)
        except (FileNotFoundError, ProcessLookupError) as exc:
            raise ProcessGone(pid) from exc
        for name in names:
            try:
                yield os.readlink(fd_dir / name)
            except OSError:
                continue  # closed between listdir and readlink

    def thread_names(self, pid: int) -> Iterator[tuple[int, str]]:
        task_dir = self._p(pid, "task")
        try:
            tids = os.listdir(task_dir)
        except (FileNotFoundError, ProcessLookupError) as exc:
            raise ProcessGone(pid) from exc
        for tid in tids:
            try:
                yield int(tid), (task_dir / tid / "comm").read_text().rstrip("\n")
            except OSError:
                continue

    def all_pids(self) -> Iterator[int]:
        for name in os.listdir(self.proc):
            if name.isdigit():
                yield int(name)

    def cgroup_paths(self, pid: int) -> list[tuple[str, str]]:
        """(controllers, path) pairs from /proc/<pid>/cgroup, v2 entry first."""
        entries = []
        for line in self.read(pid, "cgroup").splitlines():
            _, controllers, path = line.split(":", 2)
            entries.append((controllers, path))
        entries.sort(key=lambda e: e[0] != "")
        return entries

