"""The one seam between cudahook and everything outside its own process.

External tools (cuda-checkpoint, nvidia-smi, the VMM coordinator) are run
through `Host.run`, and `/proc` and the cgroup tree are read through the
`Host` methods below. Tests and the simulator change the tool paths in the
configuration; nothing in the engine reaches the system any other way, so a
second backend (the driver API) or another proc root slots in here alone.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path


@dataclass(frozen=True)
class RunResult:
    argv: tuple[str, ...]
    returncode: int | None  # None when the deadline killed it
    stdout: str
    stderr: str
    duration: float
    timed_out: bool = False

    @property
    def ok(self) -> bool:
        return self.returncode == 0 and not self.timed_out


class ProcessGone(Exception):
    """The process vanished while we were reading it."""


@dataclass
class Host:
    proc: Path = Path("/proc")
    cgroup_root: Path = Path("/sys/fs/cgroup")
    env: dict[str, str] | None = None
    _own_pidns: str | None = field(default=None, repr=False)

    # -- external tools --------------------------------------------------

    def run(self, argv: Sequence[str], timeout: float) -> RunResult:
        """Run a tool with a hard deadline.

        The tool gets its own process group, and on expiry the whole group is
        killed: cuda-checkpoint may leave helpers behind, and a hung helper
        holding the driver would wedge every later call.
        """
        start = time.monotonic()
        try:
            child = subprocess.Popen(
                list(argv),
                stdin=subprocess.DEVNULL,
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                start_new_session=True,
                env=self.env,
                text=True,
                errors="replace",
            )
        except OSError as exc:
            return RunResult(tuple(argv), 127, "", f"{argv[0]}: {exc.strerror}", 0.0)
        try:
            out, err = child.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(child.pid, signal.SIGKILL)
            out, err = child.communicate()
            return RunResult(
                tuple(argv), None, out, err, time.monotonic() - start, timed_out=True
            )
        return RunResult(tuple(argv), child.returncode, out, err, time.monotonic() - start)

    # -- /proc -------------------------------------------------------------

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
