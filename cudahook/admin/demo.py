"""`cudahook demo`: a GPU container checkpointed and restored onto another GPU,
through real runc and CRIU and cudahook's hooks, on the simulated GPU.

Without runc or a CRIU >= 4.0 it says so and runs the process-level demo
(the engine alone) instead.
"""

from __future__ import annotations

import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

from .chart import render as chart

TAGS = ["trainer", "ranks.0", "ranks.1", "ranks.2"]


def say(text: str) -> None:
    print(f"==> {text}", flush=True)


def main(processes_only: bool = False) -> int:
    from cudahook.sim.bundle import find_criu

    criu = find_criu()
    if processes_only or os.geteuid() != 0 or not shutil.which("runc") or criu is None:
        if not processes_only:
            why = ("not root" if os.geteuid() != 0 else "runc not found" if not shutil.which("runc")
                   else "no CRIU >= 4.0 (./install.sh --with-criu)")
            say(f"container demo unavailable ({why}): running the process-level demo")
        from cudahook.sim.demo import main as process_demo

        return process_demo()
    with tempfile.TemporaryDirectory(prefix="cudahook-demo-") as tmp:
        return run(Path(tmp), criu)


def run(tmp: Path, criu: Path) -> int:
    import yaml

    from cudahook.core import manifest
    from cudahook.sim.lab import SimLab
    from cudahook.sim.runcbox import RuncBox

    from . import hookfiles

    lab = SimLab(tmp / "node", driver=580, gpus=2, attach_latency_s=0.2, bandwidth_mib_s=4000)
    say(f"simulated GPU node: driver {lab.config['driver_version']}, GPUs "
        + ", ".join(u[:12] + ".." for u in lab.uuids))
    lab.start()
    settings = lab.settings()
    config = tmp / "cudahook.yaml"
    config.write_text(yaml.safe_dump(dict(settings.__dict__)))
    hooks = tmp / "hooks"
    hookfiles.install(hooks, python=sys.executable, config=str(config))
    box = RuncBox(tmp / "runc", lab, hooks_dir=hooks, criu=criu)
    a, b = lab.uuids
    workloads = [("trainer", {"mib": 64}), ("ranks", {"mib": 16, "procs": 3})]
    try:
        bundle = box.bundle("bundle-a", workloads, others=["sleep 1000000"], visible=[a])
        cid = "cudahook-demo"
        say("runc run: a container with 4 simulated CUDA processes and a plain one, on GPU 0")
        r = box.run(cid, bundle)
        if r.returncode:
            say(f"runc run failed: {r.stderr.strip()}")
            return 1
        for t in TAGS:
            lab.wait_counter(t, 5)
        say("runc checkpoint (cudahook locks and checkpoints every CUDA process first)")
        image = tmp / "image"
        t0 = time.monotonic()
        r = box.checkpoint(cid, image)
        if r.returncode:
            say(f"runc checkpoint failed: {r.stderr.strip()}")
            return 1
        print(f"    done in {time.monotonic() - t0:.2f}s; image at {image}")
        data = manifest.read(image) or {}
        print(chart(data.get("timeline") or {}))
        frozen = {t: lab.status(t)["counter"] for t in TAGS}
        print("    counters at checkpoint: " + ", ".join(f"{t}={v}" for t, v in frozen.items()))

        say("runc restore into a bundle that sees GPU 1 (cudahook remaps GPU 0 -> GPU 1)")
        moved = box.bundle("bundle-b", workloads, others=["sleep 1000000"], visible=[b])
        t0 = time.monotonic()
        r = box.restore(cid, moved, image)
        if r.returncode:
            say(f"runc restore failed: {r.stderr.strip()}")
            return 1
        print(f"    done in {time.monotonic() - t0:.2f}s")
        say("verifying: counters continue from the checkpoint, device memory intact, on GPU 1")
        ok = True
        for t in TAGS:
            st = lab.wait_counter(t, frozen[t] + 11, timeout=30)
            good = st["intact"] and not st["errors"] and st["gpu"] == b
            ok &= good
            print(f"    {t:<9} {frozen[t]:>4} -> {st['counter']:<5} gpu {st['gpu'][:12]}..  "
                  f"{'intact' if good else 'BROKEN: ' + '; '.join(st['errors'])}")
        say("demo " + ("passed" if ok else "FAILED"))
        return 0 if ok else 1
    finally:
        box.close()
        lab.stop()
