"""The two outcomes a failed checkpoint or restore may have, as checks that
can fail, shared by the end-to-end fault tests.

- A failed checkpoint: every CUDA process is running and intact - its
  state, read back through the simulated driver, is `running`; its counter,
  read after the operation, advances; its memory check (VMM mappings
  included) passes.
- A failed restore: nothing half-restored runs (no process of the container
  alive), the image directory is byte-for-byte unchanged, and a restore
  retried once the fault is cleared brings the workload back healthy.

Processes are found by what they are, never by what they last reported: a
container's processes are those in its cgroup, and a
workload's process is the one whose namespace PID its status names.
"""

from __future__ import annotations

import hashlib
import os
import subprocess
import time
from pathlib import Path
from typing import Any

import yaml

from cudahook.sim.lab import SimLab

# How long a fault's aftermath may take to settle (a guardian resuming
# after CRIU exits, a killed container's processes being reaped).
SETTLE_S = 20.0


def container_pids(cid: str) -> dict[int, int]:
    """Host PID -> namespace PID of every live process in the container's
    cgroup (runc names it after the container, and a restore reuses it)."""
    found: dict[int, int] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/cgroup") as f:
                if not any(line.rstrip("\n").rsplit("/", 1)[-1] == cid for line in f):
                    continue
            with open(f"/proc/{entry}/status") as f:
                fields = dict(line.split(":", 1) for line in f if ":" in line)
            if fields.get("State", "").split()[:1] == ["Z"]:
                continue  # a zombie runs nothing
            found[int(entry)] = int(fields["NSpid"].split()[-1])
        except (OSError, KeyError, ValueError):
            continue
    return found


def _start_time(pid: int, *, zombie: bool = True) -> int | None:
    """The process's start time; None if it is gone (or, `zombie` False,
    exited and not yet reaped)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        return None if fields[0] == "Z" and not zombie else int(fields[19])
    except (OSError, ValueError, IndexError):
        return None


def process_tree(init_pid: int) -> dict[int, int]:
    """A process and all its descendants, PID -> start time (a PID reused
    later is another process)."""
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:
                    ppid = int(f.read().rsplit(")", 1)[1].split()[1])
            except (OSError, ValueError, IndexError):
                continue
            children.setdefault(ppid, []).append(int(entry))
    tree: dict[int, int] = {}
    todo = [init_pid]
    while todo:
        pid = todo.pop()
        start = _start_time(pid)
        if start is not None:
            tree[pid] = start
            todo += children.get(pid, [])
    return tree


def still_alive(tree: dict[int, int]) -> list[int]:
    """The processes of `tree` that still run (an unreaped zombie runs nothing)."""
    return [pid for pid, start in tree.items() if _start_time(pid, zombie=False) == start]


def workload_pids(lab: SimLab, cid: str, tags: list[str]) -> dict[str, int | None]:
    """Each workload's live host PID in that container (None: not alive)."""
    by_nspid = {ns: pid for pid, ns in container_pids(cid).items()}
    return {t: by_nspid.get(lab.status(t).get("pid", -1)) for t in tags}


def fresh_reports(lab: SimLab, tags: list[str]) -> None:
    """Remove the workloads' status files: from now on only a process that
    reports afresh under one of `tags` can satisfy a wait on it."""
    for t in tags:
        (lab.status_dir / f"{t}.json").unlink(missing_ok=True)


def sim_state(lab: SimLab, pid: int) -> str:
    """The process's CUDA state, read through the simulated driver (faults
    must be cleared first: they apply to this call too)."""
    r = subprocess.run([str(lab.cuda_checkpoint), "--get-state", "--pid", str(pid)],
                       capture_output=True, text=True, timeout=30)
    return r.stdout.strip() if r.returncode == 0 else f"error: {r.stderr.strip()}"


def _until(cond: Any, timeout: float = SETTLE_S) -> bool:
    deadline = time.monotonic() + timeout
    while not cond():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.1)
    return True


def assert_running_and_intact(env: Any, cid: str, tags: list[str],
                              dead: tuple[str, ...] = (), settle: float = SETTLE_S) -> None:
    """After a failed checkpoint: the container runs; every workload but those
    the fault killed (`dead`, which must really be gone) reads `running`
    from the driver and, counted from now, advances with memory intact."""
    lab = env.lab
    lab.clear_faults()
    st = env.box.state(cid)
    assert st is not None and st["status"] == "running", f"container {cid}: {st}"
    live = [t for t in tags if t not in dead]
    states: dict[str, str] = {}

    def settled() -> bool:
        # A guardian brings the processes back once CRIU has exited.
        pids = workload_pids(lab, cid, tags)
        states.clear()
        states.update({t: sim_state(lab, p) if p else "gone" for t, p in pids.items()
                       if t in live})
        return all(s == "running" for s in states.values()) and all(
            pids[t] is None for t in dead)

    if not _until(settled, settle):
        pids = workload_pids(lab, cid, tags)
        assert all(pids[t] is None for t in dead), f"killed workload still alive: {pids}"
        assert all(s == "running" for s in states.values()), f"not running: {states}"
    env.wait_running(live, env.counters(live))


def image_hashes(image: Path) -> dict[str, str]:
    """sha256 of every file in the image directory, by relative path."""
    return {str(p.relative_to(image)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(image.rglob("*")) if p.is_file()}


def assert_nothing_restored(env: Any, cid: str, image: Path,
                            before: dict[str, str], settle: float = SETTLE_S) -> None:
    """After a failed restore: no process of the container alive, the
    container gone or stopped, the image as it was."""
    if not _until(lambda: not container_pids(cid), settle):
        raise AssertionError(f"a half-restored container was left running: "
                             f"{container_pids(cid)}")
    st = env.box.state(cid)
    assert st is None or st["status"] == "stopped", f"container {cid}: {st}"
    after = image_hashes(image)
    changed = sorted(k for k in before.keys() | after.keys() if before.get(k) != after.get(k))
    assert not changed, f"the failed restore changed the image: {changed}"


def restore_and_check(env: Any, cid: str, bundle: Path, image: Path, tags: list[str],
                      frozen: dict[str, int]) -> None:
    """Restore the image (faults cleared) and see the workload go on from
    the checkpoint: each process alive in the container, `running`, its
    counter advancing past the frozen value with no jump and memory intact.
    The workloads' old status files are removed first, so only the restored
    processes can satisfy it."""
    env.lab.clear_faults()
    if env.box.state(cid) is not None:
        env.box.delete(cid)
    fresh_reports(env.lab, tags)
    r = env.box.restore(cid, bundle, image)
    assert r.returncode == 0, r.stderr
    assert env.box.state(cid)["status"] == "running"
    env.wait_running(tags, frozen)
    pids = workload_pids(env.lab, cid, tags)
    assert all(pids.values()), f"restored workloads not in the container: {pids}"
    states = {t: sim_state(env.lab, p) for t, p in pids.items() if p}
    assert set(states.values()) == {"running"}, states


def assert_dumped(env: Any, cid: str, tags: list[str]) -> dict[str, int]:
    """After a successful dump (not --leave-running): the container and every
    process of it are gone, so nothing runs on from the checkpoint. The
    counters each workload last reported: a restore must go on from them."""
    assert _until(lambda: not container_pids(cid)), \
        f"processes still alive after the dump: {container_pids(cid)}"
    assert env.box.state(cid) is None
    return env.counters(tags)


class SharedBoxes:
    """The containers a fault matrix's cases share on one node (`env`, an
    e2e Env): each case configures the backend and the matrix's short
    deadlines; a container is run, or checkpointed into a shared image, only
    as a check that can fail."""

    deadlines: dict[str, float] = {}

    def __init__(self, env: Any, tmp: Path):
        self.env = env
        self.tmp = tmp
        self.count = 0

    def configure(self, backend: str, **extra: Any) -> None:
        cfg = yaml.safe_load(self.env.config.read_text())
        cfg.update(self.deadlines, backend=backend, **extra)
        self.env.config.write_text(yaml.safe_dump(cfg))

    def run(self, bundle: Path, tags: list[str]) -> str:
        """A new container of `bundle`, once each of its workloads (`tags`)
        has made progress; its id."""
        fresh_reports(self.env.lab, tags)  # a tag is reused by a recreated container
        cid = self.env.cid()
        r = self.env.box.run(cid, bundle)
        assert r.returncode == 0, r.stderr
        self.env.wait_running(tags, steps=3)
        return cid

    def dump(self, cid: str, image: Path, tags: list[str]) -> dict[str, int]:
        """Checkpoint the container into `image`, which must succeed (see
        assert_dumped): the counters a restore must go on from."""
        r = self.env.box.checkpoint(cid, image)
        assert r.returncode == 0, r.stderr
        return assert_dumped(self.env, cid, tags)
