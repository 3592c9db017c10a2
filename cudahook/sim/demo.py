"""`cudahook demo`, on the simulated GPU.

The container demo: a GPU container checkpointed and restored onto another
GPU, through real runc and CRIU and cudahook's hooks. Without runc or a
CRIU >= 4.0 it says so and runs the process-level demo instead: a process
tree with CUDA workloads (one of them multi-process) and an NVML-only
monitor, found by discovery, checkpointed by the engine alone, restored
onto other GPUs and verified.
"""

from __future__ import annotations

import os
import shlex
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from cudahook.admin.chart import render
from cudahook.core.discovery import discover
from cudahook.core.engine import Engine
from cudahook.platform.host import Host

from .lab import SimLab

TAGS = ["trainer", "ranks.0", "ranks.1", "ranks.2"]


def say(text: str) -> None:
    print(f"==> {text}", flush=True)


def process_demo() -> int:
    with tempfile.TemporaryDirectory(prefix="cudahook-demo-") as root:
        lab = SimLab(root, driver=580, gpus=4, attach_latency_s=0.2, bandwidth_mib_s=2000)
        say(f"starting a simulated GPU node (driver {lab.config['driver_version']}, 4 GPUs)")
        lab.start()
        script = " ".join(
            shlex.join(lab.workload_argv(t, **o)) + " &"
            for t, o in (("trainer", {"mib": 64}), ("ranks", {"mib": 16, "procs": 3}),
                         ("monitor", {"nvml_only": True}))
        ) + " wait"
        init = subprocess.Popen(["bash", "-c", script], env=lab.workload_env(),
                                start_new_session=True, stdin=subprocess.DEVNULL)
        try:
            return run(lab, init.pid)
        finally:
            os.killpg(init.pid, signal.SIGKILL)
            init.wait()
            lab.stop()


def run(lab: SimLab, init_pid: int) -> int:
    for t in [*TAGS, "monitor"]:
        lab.wait_counter(t, 3)
    settings = lab.settings()
    host = Host()
    from cudahook.core.backends.cli import CudaCheckpointCLI

    engine = Engine(CudaCheckpointCLI(host, settings), settings, host)
    say(f"discovering CUDA processes under PID {init_pid}")
    found = discover(host, engine.backend, init_pid, settings.device_regex)
    for p in found.processes:
        print(f"    pid {p.pid:<7} {p.state}")
    for pid, why in found.skipped.items():
        print(f"    pid {pid:<7} skipped ({why})")

    say("checkpointing: lock all, then checkpoint all")
    res = engine.checkpoint(found.processes)
    print(render(res.timeline.to_dict()))
    used = sum(g["memory_used_mib"] for g in lab.info()["gpus"])
    print(f"    GPU memory in use while checkpointed: {used} MiB")
    frozen = {t: lab.status(t)["counter"] for t in TAGS}
    time.sleep(0.5)
    assert {t: lab.status(t)["counter"] for t in TAGS} == frozen, "work went on while checkpointed"

    u = lab.uuids
    mapping = {u[0]: u[2], u[1]: u[3]}
    say("restoring onto other GPUs: " + ", ".join(f"{a[:12]}..->{b[:12]}.." for a, b in
                                                  mapping.items()))
    procs = discover(host, engine.backend, init_pid, settings.device_regex,
                     require_device_fd=False).processes
    res = engine.restore(procs, mapping)
    print(render(res.timeline.to_dict()))

    say("verifying: counters continue, device memory intact")
    ok = True
    for t in TAGS:
        st = lab.wait_counter(t, frozen[t] + 11)
        good = st["intact"] and not st["errors"]
        ok &= good
        print(f"    {t:<9} counter {frozen[t]} -> {st['counter']}  gpu {st['gpu'][:12]}..  "
              f"{'intact' if good else 'BROKEN: ' + '; '.join(st['errors'])}")
    say("demo " + ("passed" if ok else "FAILED"))
    return 0 if ok else 1


def main(processes_only: bool = False) -> int:
    """`cudahook demo`: the container demo, or the process-level one."""
    from .bundle import find_criu

    criu = find_criu()
    if processes_only or os.geteuid() != 0 or not shutil.which("runc") or criu is None:
        if not processes_only:
            why = ("not root" if os.geteuid() != 0 else "runc not found" if not shutil.which("runc")
                   else "no CRIU >= 4.0 (./install.sh --with-criu)")
            say(f"container demo unavailable ({why}): running the process-level demo")
        return process_demo()
    with tempfile.TemporaryDirectory(prefix="cudahook-demo-") as tmp:
        return container_demo(Path(tmp), criu)


def container_demo(tmp: Path, criu: Path) -> int:
    import yaml

    from cudahook.admin import hookfiles
    from cudahook.core import manifest

    from .runcbox import RuncBox

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
        m = manifest.read(image)
        print(render((m.timeline if m else None) or {}))
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
