"""The action script SIGKILLed at each step of pre-dump (a runtime's or the
kubelet's timeout, the OOM killer), through real runc and CRIU with the
simulated GPU.

One CUDA call of one process (mp.1) is made to hang with the simulator's
"hang" fault at the chosen step; once it hangs, the test kills the action
script - and, as a killed hook's children would be, the hung call. CRIU
aborts the dump because its action script failed. Whatever the step, the
workload must end running on its GPU and intact (counters read after the
kill advance, memory checks pass), the container must not be left frozen,
and a checkpoint retried once the fault is cleared must succeed and restore.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import threading
import time
from pathlib import Path
from typing import Any

import pytest

from cudahook.core import manifest
from cudahook.platform.host import Host
from cudahook.sim import wire

from .conftest import needs_runc
from .outcomes import assert_running_and_intact, restore_and_check, workload_pids

pytestmark = needs_runc

WORKLOADS = [("solo", {"mib": 4}), ("mp", {"mib": 2, "procs": 3})]
TAGS = ["solo", "mp.0", "mp.1", "mp.2"]
VICTIM = "mp.1"

# step -> (the call that hangs, calls of that kind let through first, what
# the other processes are when the hook dies, with the VMM interposer).
# Discovery probes each process with get-state; the checkpoint reads every
# state back (its verify step) after the last checkpoint call and before the
# manifest is written.
CASES: dict[str, tuple[str, int, set[str], bool]] = {
    "discovery": ("get-state", 0, {"running"}, False),
    "lock": ("lock", 0, {"locked"}, False),
    "checkpoint": ("checkpoint", 0, {"checkpointed"}, False),
    "before-manifest": ("get-state", 1, {"checkpointed"}, False),
    "checkpoint-vmm": ("checkpoint", 0, {"checkpointed"}, True),
}


def _sim_state(host_pid: int) -> str:
    """A process's CUDA state straight from its restore thread: no
    cuda-checkpoint call, so no injected fault is consumed."""
    nspid = Host().nspid(host_pid)
    sock = f"/proc/{host_pid}/root/dev/shm/cuda-sim-{nspid}.sock"
    reply = wire.request(sock, (wire.dumps({"op": "get-state"}) + "\n").encode(), timeout=10)
    return str(wire.loads(reply.decode())["state"])


def _fault_hit(env: Any) -> bool:
    try:  # read while the simulator rewrites it: an empty file is no answer
        rules = json.loads((env.lab.root / "faults.json").read_text())
    except ValueError:
        return False
    return all(r.get("times", 1) <= 0 for r in rules)


def _processes(needle: str, env_var: tuple[str, str] | None = None) -> list[int]:
    """PIDs whose command line holds `needle` (and environment `env_var`)."""
    found = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            cmd = Path(f"/proc/{entry}/cmdline").read_bytes().replace(b"\0", b" ").decode()
            if needle not in cmd:
                continue
            if env_var is not None:
                environ = Path(f"/proc/{entry}/environ").read_bytes().split(b"\0")
                if f"{env_var[0]}={env_var[1]}".encode() not in environ:
                    continue
        except OSError:
            continue
        found.append(int(entry))
    return found


def _cmdline(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()
    except OSError:
        return ""


def _descendants(root: int) -> list[int]:
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                stat = Path(f"/proc/{entry}/stat").read_text()
            except OSError:
                continue
            children.setdefault(int(stat[stat.rindex(")") + 2:].split()[1]), []).append(int(entry))
    out, todo = [], list(children.get(root, []))
    while todo:
        pid = todo.pop()
        out.append(pid)
        todo.extend(children.get(pid, []))
    return out


def _kill(pids: list[int]) -> None:
    for pid in pids:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)


@pytest.mark.parametrize("step", list(CASES))
def test_action_script_sigkilled_during_pre_dump(make_env, tmp_path, step: str) -> None:  # type: ignore[no-untyped-def]
    call, skip, others_at_kill, vmm = CASES[step]
    env = make_env()
    extra: dict[str, Any] = {}
    workloads = WORKLOADS
    if vmm:
        extra["snapshot_control"] = tmp_path / "control"
        extra["snapshot_control"].mkdir()
        workloads = [(name, {**opts, "vmm": True}) for name, opts in WORKLOADS]
    bundle = env.box.bundle("b1", workloads, others=["sleep 100000"], **extra)
    cid = env.cid()
    r = env.box.run(cid, bundle)
    assert r.returncode == 0, r.stderr
    env.wait_running(TAGS, steps=3)
    found = workload_pids(env.lab, cid, TAGS)
    assert all(found.values()), found
    pids: dict[str, int] = {t: p for t, p in found.items() if p}
    env.lab.fault(call, "hang", tag=VICTIM, times=1, **({"skip": skip} if skip else {}))

    done: dict[str, Any] = {}
    dump = threading.Thread(target=lambda: done.update(r=env.box.checkpoint(cid, tmp_path / "img")))
    dump.start()
    try:
        deadline = time.monotonic() + 60
        while not _fault_hit(env):
            assert dump.is_alive(), done
            assert time.monotonic() < deadline, "the injected hang was never reached"
            time.sleep(0.02)
        # The others have reached the step's state (locks run all at once,
        # checkpoints in parallel): wait for them, as the kill must find them.
        others = [pids[t] for t in TAGS if t != VICTIM]
        deadline = time.monotonic() + 30
        while {_sim_state(p) for p in others} != others_at_kill:
            assert time.monotonic() < deadline, {p: _sim_state(p) for p in others}
            time.sleep(0.02)
        hooks = _processes("cudahook.hooks.criu_action import main",
                           ("CRTOOLS_SCRIPT_ACTION", "pre-dump"))
        hooks = [p for p in hooks
                 if f"CUDAHOOK_CONFIG={env.config}".encode()
                 in Path(f"/proc/{p}/environ").read_bytes().split(b"\0")]
        assert len(hooks) == 1, hooks
        # The hook, and with it its hung call (a cuda-checkpoint run, or the
        # driver-API helper) - not the guardian, which runs in its own session.
        calls = [p for p in _descendants(hooks[0])
                 if "cudahook.hooks.guardian" not in _cmdline(p)]
        _kill(hooks + calls)
    finally:
        dump.join(120)
    assert not dump.is_alive()
    assert done["r"].returncode != 0  # CRIU aborted: its action script failed

    # The runtime lets the container run again: it runs, not frozen, and
    # every CUDA process is back on its GPU, intact (the suite's shared
    # failed-checkpoint outcome), still the same processes.
    assert_running_and_intact(env, cid, TAGS)
    assert workload_pids(env.lab, cid, TAGS) == pids
    assert not any(Host().is_frozen(p) for p in pids.values())
    assert not (tmp_path / "img" / manifest.NAME).exists()  # the hook died before it
    # CRIU ran its duplicate pre-dump call all the same (CRIU 4.1.1): it
    # touched nothing, seeing the first call had not finished.
    assert any("stopped without finishing" in e.get("error", "")
               for e in env.events("pre-dump")), env.events("pre-dump")
    assert env.events("checkpoint") == []  # no checkpoint was ever recorded
    if step == "discovery":
        # Killed before anything was touched: no guardian was ever armed.
        assert env.events("guardian") == []
    else:
        g = env.wait_event("guardian", lambda e: "outcome" in e or "error" in e, timeout=60)
        assert "error" not in g, g
        assert "resumed" in g["outcome"], g
        moved = {pids[t] for t in TAGS if t != VICTIM}
        if call != "lock":
            moved.add(pids[VICTIM])  # locked (or checkpointed) when the hook died
        assert set(g["pids"]) == moved, (pids, [e for e in env.events() if e["event"] != "guardian"])
        assert "last step: locking and checkpointing" in g["run"], g
    if vmm:
        # The VMM prepare ran before the first lock; the guardian replayed
        # its state into the processes it brought back from checkpointed
        # (the victim was only locked: its mappings never left).
        calls = env.lab.vmm_calls()
        assert [c["op"] for c in calls] == ["prepare", "restore"], calls
        assert sorted(p for p, _ in calls[1]["processes"]) == sorted(
            pids[t] for t in TAGS if t != VICTIM)

    # A retry once the fault is cleared checkpoints and restores.
    env.lab.clear_faults()
    image = tmp_path / "img2"
    r = env.box.checkpoint(cid, image)
    assert r.returncode == 0, r.stderr
    data = manifest.read(image)
    assert data is not None and sorted(p["pid"] for p in data["processes"]) == sorted(
        pids.values())
    frozen = env.frozen(cid, TAGS)
    restore_and_check(env, cid, bundle, image, TAGS, frozen)
