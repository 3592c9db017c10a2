"""Checkpoint and restore simulated CUDA processes on the host, step by step.

This is the no-runtime demo: a simulated GPU node, a process tree with
CUDA workloads (one of them multi-process) and an NVML-only monitor, found
by discovery, checkpointed, restored onto other GPUs and verified.
"""

from __future__ import annotations

import os
import shlex
import signal
import subprocess
import tempfile
import time

from cudahook.admin.chart import render
from cudahook.core.discovery import discover
from cudahook.core.engine import Engine
from cudahook.platform.host import Host

from .lab import SimLab

TAGS = ["trainer", "ranks.0", "ranks.1", "ranks.2"]


def say(text: str) -> None:
    print(f"==> {text}", flush=True)


def main() -> int:
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
