#!/usr/bin/env python3
"""Soak: checkpoint and restore GPU containers at random while killing hooks.

Runs as root, for --minutes: four GPU containers (simulated GPUs, real runc
and CRIU, cudahook's hooks installed under a work directory of its own) are
checkpointed and restored one operation at a time, in random order, the
backend alternating between cuda-checkpoint (cli) and the driver API. At
random, the operation's action script - pre-dump, post-restore or
post-resume - is SIGKILLed after a random delay, alone or with its whole
process group (runc and CRIU included: a runtime's timeout). The simulated
driver reports `checkpointing` / `restoring` meanwhile (CUDA 13.4+).

After each operation, each container must be in one of two states:

- running, every workload `running` on the driver, its counter advancing
  and its memory check passing (a failed checkpoint, or a restore that
  succeeded);
- dumped: nothing of it alive, its image byte for byte as the checkpoint
  left it - and a restore of it, when the one just tried failed, retried at
  once without a kill, must bring it back running.

Anything else counts as a workload lost. Within 5 s of each operation no
driver call or driver-API helper of its phases may be left (a guardian's
or restore watcher's own calls excepted), and at the end none at all. The
files and bytes under the state directory are counted at the start, every
minute and at the end: they must stay bounded. A summary is printed (and
written as JSON next to the work directory); the exit status is 0 only when
nothing was lost, orphaned or unbounded.

    sudo .venv/bin/python scripts/soak.py --minutes 30
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import random
import shutil
import signal
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from cudahook.platform.tools import CALLS_ENV  # noqa: E402
from tests.e2e.outcomes import (  # noqa: E402
    container_pids,
    image_hashes,
    sim_state,
    workload_pids,
)

LEFT_S = 5.0  # a phase's calls must be gone this long after its operation ended
SETTLE_S = 30.0  # how long a guardian or watcher may take to finish its work
DEADLINES = {"call_timeout_s": 10.0, "lock_timeout_ms": 3000}
PHASES = {"checkpoint": ("pre-dump",), "restore": ("post-restore", "post-resume")}


def remove_tree(path: Path | str) -> None:
    """rmtree, once every mount below `path` is gone: CRIU or runc killed in
    the middle of a restore leave theirs (CRIU's cgroup yard mounts the
    node's cgroup hierarchies: removing through it would remove cgroups)."""
    import subprocess

    base = os.path.realpath(path)
    with open("/proc/self/mountinfo") as f:
        points = [line.split()[4] for line in f]
    for point in sorted((p for p in points if p == base or p.startswith(base + "/")),
                        reverse=True):
        subprocess.run(["umount", "-l", point], check=False)
    shutil.rmtree(path, ignore_errors=True)


@dataclass
class Box:
    name: str
    cid: str
    bundle: Path
    tags: list[str]
    image: Path | None = None  # set while dumped
    hashes: dict[str, str] = field(default_factory=dict)
    frozen: dict[str, int] = field(default_factory=dict)


class Soak:
    def __init__(self, work: Path, seed: int, kill_rate: float):
        from cudahook.admin import hookfiles
        from cudahook.sim.bundle import find_criu
        from cudahook.sim.lab import SimLab
        from cudahook.sim.runcbox import RuncBox

        self.work = work
        self.rng = random.Random(seed)
        self.kill_rate = kill_rate
        self.lab = SimLab(work / "node", gpus=2).start()
        self.lab.set(transient_states=True)
        settings = self.lab.settings()
        self.state_dir = Path(settings.state_dir)
        self.log_file = Path(settings.log_file)
        self.config = work / "cudahook.yaml"
        self.settings = {**dict(settings.__dict__), **DEADLINES}
        hooks = work / "hooks"
        hookfiles.install(hooks, config=str(self.config))
        criu = find_criu()
        if criu is None:
            raise SystemExit("soak: CRIU >= 4.0 not found (scripts/provision-criu.sh)")
        self.box = RuncBox(work / "runc", self.lab, hooks_dir=hooks, criu=criu)
        self.box.own_session = True  # as a runtime runs runc: a group of its own
        self.boxes: list[Box] = []
        self.stats: dict[str, Any] = {
            "operations": 0, "checkpoints_ok": 0, "checkpoints_failed": 0,
            "restores_ok": 0, "restores_failed": 0, "retries": 0, "left_to_runtime": 0,
            "restored_then_runc_killed": 0,
            "kills": 0,
            "kills_by_phase": {}, "lost": [], "orphans": [], "state": [],
        }
        self.backend = "cli"

    # -- setup ---------------------------------------------------------------------

    def configure(self, backend: str) -> None:
        import yaml

        self.backend = backend
        self.config.write_text(yaml.safe_dump({**self.settings, "backend": backend}))

    def start(self, count: int) -> None:
        self.configure("cli")
        for i in range(count):
            name = f"c{i}"
            bundle = self.box.bundle(name, [(f"{name}s", {"mib": 2}),
                                            (f"{name}m", {"mib": 2, "procs": 2})],
                                     others=["sleep 1000000"])
            box = Box(name, f"soak-{name}-0", bundle, [f"{name}s", f"{name}m.0", f"{name}m.1"])
            r = self.box.run(box.cid, bundle)
            if r.returncode != 0:
                raise SystemExit(f"soak: cannot start {box.cid}: {r.stderr}")
            self.boxes.append(box)
        for box in self.boxes:
            for t in box.tags:
                self.lab.wait_counter(t, 3, timeout=60)

    # -- checks ----------------------------------------------------------------------

    def healthy(self, box: Box, since: dict[str, int] | None = None) -> str | None:
        """None when every workload of the container runs on its GPU, its counter
        advancing (past `since`, if given) with memory intact; else why not."""
        deadline = time.monotonic() + SETTLE_S
        why = "not checked"
        while time.monotonic() < deadline:
            pids = workload_pids(self.lab, box.cid, box.tags)
            if not any(pids.values()) and not container_pids(box.cid):
                return "no process of the container is alive"
            states = {t: sim_state(self.lab, p) if p else "gone" for t, p in pids.items()}
            if set(states.values()) == {"running"}:
                break
            why = f"states {states}"
            time.sleep(0.2)
        else:
            return why
        for t in box.tags:
            base = max(self.lab.status(t).get("counter", 0), (since or {}).get(t, 0))
            try:
                st = self.lab.wait_counter(t, base + 5, timeout=SETTLE_S)
            except Exception as exc:
                return f"{t}: {exc}"
            if not st.get("intact") or st.get("errors"):
                return f"{t}: memory check failed: {st}"
        return None

    def unwatched_since(self, since: float) -> bool:
        """No CRIU run since `since` (the restore just tried: one operation
        at a time) armed a restore watcher."""
        for p in (self.state_dir / "runs").glob("*.json"):
            try:
                if p.stat().st_mtime >= since and "watcher" in json.loads(p.read_text()):
                    return False
            except (OSError, ValueError):
                continue
        return True

    def gone(self, box: Box) -> bool:
        deadline = time.monotonic() + SETTLE_S
        while container_pids(box.cid):
            if time.monotonic() > deadline:
                return False
            time.sleep(0.1)
        return True

    def calls(self, *, all_phases: bool = False) -> list[str]:
        """The node's live driver calls and driver-API helpers; without
        `all_phases`, those a guardian or watcher started for itself are left
        out (their name ends in .guardian)."""
        tools = (str(self.lab.cuda_checkpoint).encode(), str(self.lab.nvidia_smi).encode(),
                 f"driver_helper.py {self.lab.libcuda}".encode())
        found = []
        for entry in os.listdir("/proc"):
            if not entry.isdigit():
                continue
            try:
                cmd = b" ".join(Path(f"/proc/{entry}/cmdline").read_bytes().split(b"\0")[:4])
                if not any(t in cmd for t in tools):
                    continue
                stat = Path(f"/proc/{entry}/stat").read_bytes()
                if stat[stat.rindex(b")") + 2:][:1] in b"ZX":
                    continue
                environ = Path(f"/proc/{entry}/environ").read_bytes().split(b"\0")
            except OSError:
                continue
            marks = [v for v in environ if v.startswith(CALLS_ENV.encode() + b"=")]
            if not all_phases and marks and marks[0].endswith(b".guardian"):
                continue
            found.append(f"{entry}: {cmd.decode(errors='replace')[:100]}")
        return found

    def no_calls_left(self, what: str, *, all_phases: bool = False,
                      wait_s: float = LEFT_S) -> None:
        deadline = time.monotonic() + wait_s
        while left := self.calls(all_phases=all_phases):
            if time.monotonic() > deadline:
                self.stats["orphans"].append({"after": what, "calls": left})
                return
            time.sleep(0.05)

    def no_guardians_left(self) -> None:
        """Every guardian and restore watcher has finished by the end."""
        deadline = time.monotonic() + SETTLE_S
        while True:
            left = []
            for entry in os.listdir("/proc"):
                if not entry.isdigit():
                    continue
                try:
                    cmd = Path(f"/proc/{entry}/cmdline").read_bytes()
                except OSError:
                    continue
                if b"cudahook.flow.guardian" in cmd and str(self.state_dir).encode() in cmd:
                    left.append(entry)
            if not left:
                return
            if time.monotonic() > deadline:
                self.stats["orphans"].append({"after": "the end", "guardians": left})
                return
            time.sleep(0.2)

    def state_size(self) -> dict[str, int]:
        files = size = 0
        for root, _dirs, names in os.walk(self.state_dir):
            for n in names:
                files += 1
                with contextlib.suppress(OSError):
                    size += os.lstat(os.path.join(root, n)).st_size
        return {"files": files, "bytes": size}

    # -- killing -----------------------------------------------------------------------

    def _hooks(self, action: str) -> list[int]:
        found = []
        want = (f"CRTOOLS_SCRIPT_ACTION={action}".encode(),
                f"CUDAHOOK_CONFIG={self.config}".encode())
        for entry in os.listdir("/proc"):
            if not entry.isdigit():
                continue
            try:
                if b"cudahook.hooks.criu_action" not in Path(f"/proc/{entry}/cmdline").read_bytes():
                    continue
                environ = Path(f"/proc/{entry}/environ").read_bytes().split(b"\0")
            except OSError:
                continue
            if all(w in environ for w in want):
                found.append(int(entry))
        return found

    def killer(self, phases: tuple[str, ...], stop: threading.Event) -> threading.Thread:
        """SIGKILL one of the operation's action scripts (or its process
        group), a random time into it, if one is running then."""
        phase = self.rng.choice(phases)
        delay = self.rng.uniform(0.0, 0.8)  # a hook of the simulated node lasts ~0.2-1 s
        group = self.rng.random() < 0.5

        def run() -> None:
            deadline = time.monotonic() + 30
            seen = None
            while not stop.is_set() and time.monotonic() < deadline:
                hooks = self._hooks(phase)
                if hooks:
                    seen = seen or time.monotonic()
                    if time.monotonic() - seen >= delay:
                        try:
                            if group:
                                os.killpg(os.getpgid(hooks[0]), signal.SIGKILL)
                            else:
                                os.kill(hooks[0], signal.SIGKILL)
                        except OSError:
                            return
                        self.stats["kills"] += 1
                        key = f"{phase}/{'group' if group else 'script'}"
                        self.stats["kills_by_phase"][key] = \
                            self.stats["kills_by_phase"].get(key, 0) + 1
                        return
                time.sleep(0.01)

        t = threading.Thread(target=run, daemon=True)
        t.start()
        return t

    def with_kill(self, kind: str, op: Any) -> Any:
        stop = threading.Event()
        t = self.killer(PHASES[kind], stop) if self.rng.random() < self.kill_rate else None
        try:
            return op()
        finally:
            stop.set()
            if t is not None:
                t.join()

    # -- operations ----------------------------------------------------------------------

    def lose(self, box: Box, what: str) -> None:
        self.stats["lost"].append({"container": box.cid, "what": what,
                                   "backend": self.backend, "at": time.time()})
        print(f"soak: LOST {box.cid}: {what}", flush=True)

    def checkpoint(self, box: Box) -> None:
        image = self.work / "images" / f"{box.cid}-{self.stats['operations']}"
        image.parent.mkdir(exist_ok=True)
        before = {t: self.lab.status(t).get("counter", 0) for t in box.tags}
        r = self.with_kill("checkpoint", lambda: self.box.checkpoint(box.cid, image))
        self.no_calls_left(f"checkpoint of {box.cid}")
        if r.returncode == 0 and self.gone(box):
            box.image = image
            box.hashes = image_hashes(image)
            box.frozen = {t: self.lab.status(t).get("counter", 0) for t in box.tags}
            self.stats["checkpoints_ok"] += 1
            self.box.delete(box.cid)
            return
        self.stats["checkpoints_failed"] += 1
        remove_tree(image)
        remove_tree(str(image) + ".work")
        why = self.healthy(box, before)
        if why:
            self.lose(box, f"after a failed checkpoint: {why}")

    def restore(self, box: Box) -> None:
        assert box.image is not None
        for t in box.tags:  # only the restored processes may report from here on
            (self.lab.status_dir / f"{t}.json").unlink(missing_ok=True)
        began = time.time()
        r = self.with_kill("restore",
                           lambda: self.box.restore(box.cid, box.bundle, box.image))
        self.no_calls_left(f"restore of {box.cid}")
        if r.returncode == 0:
            why = self.healthy(box, box.frozen)
            if why is None:
                self.restored(box)
                return
            # A kill at post-resume: CRIU reports success, the watcher kills.
            if not self.gone(box):
                self.lose(box, f"restored but not healthy: {why}")
                return
        self.stats["restores_failed"] += 1
        if container_pids(box.cid) and self.healthy(box, box.frozen) is None:
            # runc, killed with its group after post-resume had restored and
            # verified the workload, failed - the workload runs on its GPU,
            # intact: restored. runc's own record of it is not to be trusted
            # any more, so the runtime removes it, and the soak restores it
            # again from the (unchanged) image.
            self.stats["restored_then_runc_killed"] += 1
            self.box.delete(box.cid)
        if not self.gone(box):
            if not self.unwatched_since(began):
                self.lose(box, "a failed restore left the container alive")
                return
            # The group (runc, CRIU) was killed while post-restore's
            # interpreter started, before it could arm the restore watcher:
            # the never-resumed tasks are the runtime's to remove, as a
            # runtime does when runc fails.
            self.stats["left_to_runtime"] += 1
            self.box.delete(box.cid)
            if not self.gone(box):
                self.lose(box, "the runtime could not remove a failed restore")
                return
        if image_hashes(box.image) != box.hashes:
            self.lose(box, "a failed restore changed the image")
            return
        # Retry at once, without a kill; runc killed mid-restore leaves its
        # record behind (a mount it never undid): a new container id.
        self.box.delete(box.cid)
        box.cid = f"soak-{box.name}-{self.stats['operations']}"
        self.stats["retries"] += 1
        r = self.box.restore(box.cid, box.bundle, box.image)
        self.no_calls_left(f"retried restore of {box.cid}")
        why = self.healthy(box, box.frozen) if r.returncode == 0 else r.stderr.strip()[-300:]
        if why:
            self.lose(box, f"a retried restore failed: {why}")
            return
        self.restored(box)

    def restored(self, box: Box) -> None:
        self.stats["restores_ok"] += 1
        assert box.image is not None
        remove_tree(box.image)
        for suffix in (".work", ".rwork"):
            remove_tree(str(box.image) + suffix)
        box.image = None

    def one(self) -> None:
        box = self.rng.choice([b for b in self.boxes if not self.is_lost(b)] or self.boxes)
        self.configure("driver-api" if self.backend == "cli" else "cli")
        self.stats["operations"] += 1
        if box.image is None:
            self.checkpoint(box)
        else:
            self.restore(box)

    def is_lost(self, box: Box) -> bool:
        return any(x["container"] == box.cid for x in self.stats["lost"])

    def close(self) -> None:
        for box in self.boxes:
            self.box.delete(box.cid)
        self.box.close()
        self.lab.stop()


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--minutes", type=float, default=30.0)
    ap.add_argument("--containers", type=int, default=4)
    ap.add_argument("--kill-rate", type=float, default=0.5,
                    help="share of operations during which a hook is killed")
    ap.add_argument("--seed", type=int, default=None)
    ap.add_argument("--work", type=Path, default=None, help="work directory (default: a new one)")
    ap.add_argument("--keep", action="store_true", help="keep the work directory")
    args = ap.parse_args(argv)
    if os.geteuid() != 0:
        print("soak: needs root (runc, CRIU)", file=sys.stderr)
        return 2
    if os.environ.get("CUDAHOOK_SOAK_NS") != "1":
        # A mount namespace of its own: what a killed runc or CRIU leaves
        # mounted goes with it, never onto the node.
        os.environ["CUDAHOOK_SOAK_NS"] = "1"
        os.execvp("unshare", ["unshare", "--mount", "--propagation", "private",
                              sys.executable, os.path.abspath(__file__), *(argv or sys.argv[1:])])
    seed = args.seed if args.seed is not None else random.randrange(1 << 30)
    work = args.work or Path(tempfile.mkdtemp(prefix="cudahook-soak-"))
    work.mkdir(parents=True, exist_ok=True)
    # Every default path of cudahook (the hooks' marks above all) under the
    # work directory: the soak leaves the node's own untouched.
    os.environ["CUDAHOOK_ROOT"] = str(work / "root")
    # The checkout's provisioned CRIU (scripts/provision-criu.sh), as the suite uses it.
    if "CUDAHOOK_CRIU" not in os.environ and (REPO / ".cache/criu/bin/criu").exists():
        os.environ["CUDAHOOK_CRIU"] = str(REPO / ".cache/criu/bin/criu")
    soak = Soak(work, seed, args.kill_rate)
    began = time.monotonic()
    end = began + args.minutes * 60
    print(f"soak: {args.minutes:g} min, {args.containers} containers, seed {seed}, work {work}",
          flush=True)
    try:
        soak.start(args.containers)
        soak.stats["state"].append({"t_s": 0, **soak.state_size()})
        next_sample = time.monotonic() + 60
        while time.monotonic() < end:
            soak.one()
            if time.monotonic() >= next_sample:
                sample = {"t_s": round(time.monotonic() - began), **soak.state_size()}
                soak.stats["state"].append(sample)
                next_sample += 60
                print(f"soak: {sample['t_s']}s: {soak.stats['operations']} operations, "
                      f"{soak.stats['kills']} kills, {len(soak.stats['lost'])} lost, "
                      f"{len(soak.stats['orphans'])} orphans, state {sample['files']} files "
                      f"{sample['bytes']} B", flush=True)
        # Everything settles: guardians and watchers done, no call at all left.
        for box in soak.boxes:
            if box.image is None and not soak.is_lost(box):
                why = soak.healthy(box)
                if why:
                    soak.lose(box, f"at the end: {why}")
        soak.no_calls_left("the end", all_phases=True, wait_s=SETTLE_S)
        soak.no_guardians_left()
        soak.stats["state"].append({"t_s": round(time.monotonic() - began),
                                    **soak.state_size()})
    finally:
        summary = summarise(soak.stats, seed, time.monotonic() - began)
        (work.parent / f"{work.name}-summary.json").write_text(json.dumps(summary, indent=1))
        print(json.dumps(summary, indent=1), flush=True)
        soak.close()
        if not args.keep and summary["ok"]:
            remove_tree(work)
    return 0 if summary["ok"] else 1


def summarise(stats: dict[str, Any], seed: int, elapsed: float) -> dict[str, Any]:
    from cudahook.platform.store import RUN_GRACE_S

    samples = stats["state"]
    # Bounded: a finished CRIU run's record is kept RUN_GRACE_S, remembered
    # verdicts and results are capped, so the state grows for RUN_GRACE_S
    # and then levels off: the last third of the run holds no more than the
    # middle third did (10% and a few files of noise). A run too short to
    # reach the level is not judged.
    bounded: bool | None = None
    if samples and samples[-1]["t_s"] >= 2 * RUN_GRACE_S:
        end = samples[-1]["t_s"]
        middle = [s["files"] for s in samples if end / 3 <= s["t_s"] < 2 * end / 3]
        last = [s["files"] for s in samples if s["t_s"] >= 2 * end / 3]
        bounded = max(last) <= 1.1 * max(middle or last) + 20
    return {
        "ok": not stats["lost"] and not stats["orphans"] and bounded is not False,
        "seed": seed, "minutes": round(elapsed / 60, 1),
        **{k: stats[k] for k in ("operations", "checkpoints_ok", "checkpoints_failed",
                                 "restores_ok", "restores_failed", "retries",
                                 "left_to_runtime", "restored_then_runc_killed", "kills",
                                 "kills_by_phase")},
        "lost": len(stats["lost"]), "lost_detail": stats["lost"][:20],
        "orphaned_calls": len(stats["orphans"]), "orphan_detail": stats["orphans"][:20],
        "state_bounded": bounded,
        "state_start": samples[0] if samples else None,
        "state_end": samples[-1] if samples else None,
        "state_max_files": max((s["files"] for s in samples), default=0),
    }


if __name__ == "__main__":
    sys.exit(main())
