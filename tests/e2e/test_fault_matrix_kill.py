"""The kill matrix: the CRIU action script SIGKILLed - alone (the OOM killer,
a kill of the hook's PID), or with its whole process group, runc and CRIU
included (a runtime's or kubelet's timeout) - at every step of pre-dump,
post-restore and post-resume, with both backends, through real runc and
CRIU with the simulated GPU. CASES is the matrix; each case is one test id.

At the chosen step, one call on one process (mp.1) is made slow (the
simulator's `delay` fault: it waits, then is carried out as asked - so a call
that outlived its hook would still change the workload afterwards) or, for
post-restore's nvidia-smi, hung. Once the call is in flight, the hook is
killed. The simulated driver reports `checkpointing` and `restoring` while
those operations run (CUDA 13.4+): on here, as a guardian must never take
them for running. Whatever the case:

- within 5 s no driver call or driver-API helper of the killed phase is
  left (the guardian's or restore watcher's own calls are a phase of their
  own);
- a failed checkpoint leaves every workload running and intact on its GPU
  (outcomes.py), the same processes, the container not frozen;
- a failed restore leaves nothing of the container alive and the image byte
  for byte unchanged, and a retry restores the workload healthy.

The same kills reach the node agent and the storage path (MODES): with the
agent up, its worker serving the phase, or the agent's main process, is
killed at every step of both phases, and between them (an idle worker, or
the agent, after the checkpoint handed its worker back); the phase then
fails and its rollback runs in a fresh per-phase helper, or the restore
fails closed. With the GPU memory going to storage (CUDA 13.4+ custom
storage), the hook, its group, its helper or the agent's worker is killed
mid copy-out (before cuCheckpointOperationComplete), after it (the
checkpoint read back, the manifest not yet written), and mid copy-in.

Containers are shared, which cannot hide a failure: the checkpoint side's
container is proven healthy by each case that used it (and recreated when a
case failed); the restore side's image is hashed before each case, and each
retry restores it afresh, after the workloads' old status files are gone.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import threading
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import yaml

from cudahook.core import agent, manifest
from cudahook.platform.config import Settings
from cudahook.platform.host import Host
from cudahook.platform.tools import CALLS_ENV
from cudahook.sim import wire

from .conftest import Env, needs_runc
from .outcomes import (
    SharedBoxes,
    assert_nothing_restored,
    assert_running_and_intact,
    fresh_reports,
    image_hashes,
    restore_and_check,
    workload_pids,
)
from .test_agent_e2e import running_agent

pytestmark = needs_runc

WORKLOADS = [("solo", {"mib": 2}), ("mp", {"mib": 2, "procs": 3})]
TAGS = ["solo", "mp.0", "mp.1", "mp.2"]
VICTIM = "mp.1"
# Long enough that a call left alive would still be in flight at the 5 s
# check, and would then carry its operation out.
DELAY_S = 8.0
LEFT_S = 5.0  # a killed phase's calls must be gone within this
DEADLINES = {"call_timeout_s": 5.0, "lock_timeout_ms": 2000}

# (phase, step) -> (the call made slow, matching calls let through first).
# Discovery probes each process with get-state; the checkpoint reads every
# state back (verify) before the manifest is written; a restore reads the
# states first and verifies them running last; post-restore's checks ask
# nvidia-smi for the GPUs.
STEPS: dict[tuple[str, str], tuple[str, int]] = {
    ("pre-dump", "discovery"): ("get-state", 0),
    ("pre-dump", "lock"): ("lock", 0),
    ("pre-dump", "checkpoint"): ("checkpoint", 0),
    ("pre-dump", "verify"): ("get-state", 1),
    ("post-restore", "checks"): ("nvidia-smi", 0),
    ("post-resume", "restore"): ("restore", 0),
    ("post-resume", "unlock"): ("unlock", 0),
    ("post-resume", "verify"): ("get-state", 1),
    # The storage path: one chunk of the middle process on its way out (the
    # process `checkpointing`, the operation open) or in (`restoring`).
    ("pre-dump", "copy-out"): ("copy-out", 0),
    ("post-resume", "copy-in"): ("copy-in", 0),
}
# How the node runs the case: the GPU memory into host memory or storage,
# with or without the node agent serving the driver calls.
MODES = {"host": {}, "agent": {}, "storage": {"gpu_memory": "storage"},
         "agent-storage": {"gpu_memory": "storage"}}


@dataclass(frozen=True)
class Case:
    phase: str
    step: str
    backend: str  # "cli" (cuda-checkpoint) or "driver-api" (the helper)
    # "script": the action script's PID; "group": its process group;
    # "helper": the phase's driver-API helper; "worker": the agent's worker
    # serving the phase; "agent": the agent's main process (its workers die
    # with it)
    kill: str
    workload: str = "plain"  # or "vmm": the CUDA VMM interposer in every process
    mode: str = "host"  # MODES

    @property
    def id(self) -> str:
        vmm = "-vmm" if self.workload == "vmm" else ""
        mode = "" if self.mode == "host" else f"-{self.mode}"
        return f"{self.phase}-{self.step}{vmm}{mode}-{self.backend}-{self.kill}"

    @property
    def agent(self) -> bool:
        return self.mode.startswith("agent")


BOTH = [(backend, kill) for backend in ("cli", "driver-api") for kill in ("script", "group")]
CASES = [
    *[Case(phase, step, backend, kill) for (phase, step) in STEPS if "copy" not in step
      for backend, kill in BOTH],
    # With the VMM interposer: the guardian also replays the mappings the
    # checkpoint dropped from the processes it brings back.
    *[Case("pre-dump", "checkpoint", backend, kill, "vmm") for backend, kill in BOTH],
]
# The agent: its worker or itself killed at every step that makes a driver
# call (discovery's get-state is the session's first call, after its hello),
# and between the phases, once the checkpoint's worker went back to the pool.
AGENT_STEPS = [("pre-dump", s) for s in ("discovery", "lock", "checkpoint", "verify")] + [
    ("post-resume", s) for s in ("restore", "unlock", "verify")] + [("between", "handed-back")]
AGENT_CASES = [Case(phase, step, "driver-api", kill, mode="agent")
               for phase, step in AGENT_STEPS for kill in ("worker", "agent")]
# The storage path: the operation left open mid-copy by whoever holds it
# (the hook's death takes its helper with it; the helper or the agent's
# worker alone), and the hook killed once every process is checkpointed
# into storage, before the manifest (verify).
STORAGE_CASES = [
    *[Case("pre-dump", "copy-out", "driver-api", k, mode="storage")
      for k in ("script", "group", "helper")],
    # With the agent: its worker alone, or the hook (the agent then ends
    # the worker of the session it left with a call in flight).
    *[Case("pre-dump", "copy-out", "driver-api", k, mode="agent-storage")
      for k in ("worker", "script")],
    Case("pre-dump", "verify", "driver-api", "script", mode="storage"),
    # Then the guardian, mid copy-in of its restore from storage: its
    # successor brings the workload back.
    Case("pre-dump", "verify", "driver-api", "guardian", mode="storage"),
    *[Case("post-resume", "copy-in", "driver-api", k, mode="storage") for k in ("script", "helper")],
    Case("post-resume", "copy-in", "driver-api", "worker", mode="agent-storage"),
]
CASES += AGENT_CASES + STORAGE_CASES
assert len({c.id for c in CASES}) == len(CASES)


# -- processes ---------------------------------------------------------------------


def _read(pid: int, name: str) -> bytes:
    try:
        return Path(f"/proc/{pid}/{name}").read_bytes()
    except OSError:
        return b""


def _pids() -> list[int]:
    return [int(e) for e in os.listdir("/proc") if e.isdigit()]


def _hooks(env: Env, action: str) -> list[int]:
    """The live action scripts of this node running `action`."""
    found = []
    for pid in _pids():
        if b"cudahook.hooks.criu_action" not in _read(pid, "cmdline"):
            continue
        environ = _read(pid, "environ").split(b"\0")
        if (f"CRTOOLS_SCRIPT_ACTION={action}".encode() in environ
                and f"CUDAHOOK_CONFIG={env.config}".encode() in environ):
            found.append(pid)
    return found


def _ppid(pid: int) -> int:
    ppid = [x for x in _read(pid, "status").split(b"\n") if x.startswith(b"PPid:")]
    return int(ppid[0].split()[1]) if ppid else 0


def phase_calls(env: Env, agent_pid: int | None = None) -> list[str]:
    """The node's driver calls and driver-API helpers that are alive, other
    than those a guardian or restore watcher started for itself (which name
    their phase `<run>.guardian`) and the workers of a live node agent
    `agent_pid` (whose calls in flight its status counts): cuda-checkpoint,
    nvidia-smi, helpers."""
    tools = (str(env.lab.cuda_checkpoint).encode(), str(env.lab.nvidia_smi).encode(),
             f"driver_helper.py {env.lab.libcuda}".encode())
    found = []
    for pid in _pids():
        # The program (the simulator's tools are Python scripts: the first
        # arguments), not a path some other command line mentions.
        cmd = b" ".join(_read(pid, "cmdline").split(b"\0")[:4])
        if not any(t in cmd for t in tools):
            continue
        stat = _read(pid, "stat")
        if not stat or stat[stat.rindex(b")") + 2:][:1] in b"ZX":
            continue
        marks = [v for v in _read(pid, "environ").split(b"\0")
                 if v.startswith(CALLS_ENV.encode() + b"=")]
        if (marks and marks[0].endswith(b".guardian")) or (agent_pid and _ppid(pid) == agent_pid):
            continue
        found.append(f"{pid}: {cmd.decode(errors='replace')[:120]}")
    return found


def _smi_calls(env: Env) -> dict[int, int]:
    """Every live nvidia-smi of the simulated node: pid -> parent pid."""
    found = {}
    for pid in _pids():
        if str(env.lab.nvidia_smi).encode() in _read(pid, "cmdline"):
            found[pid] = _ppid(pid)
    return found


def _in_flight(env: Env, call: str, phase: str) -> bool:
    """The slow call has been reached (its rule fired), or an action script
    of `phase` runs nvidia-smi (the hung one: every nvidia-smi from now on
    hangs, so one some other process started is not the step's)."""
    if call == "nvidia-smi":
        hooks = set(_hooks(env, phase))
        return any(parent in hooks for parent in _smi_calls(env).values())
    try:  # read while the simulator rewrites it: an empty file is no answer
        rules = json.loads((env.lab.root / "faults.json").read_text())
    except (OSError, ValueError):
        return False
    mine = [r for r in rules if r.get("action") == call]
    return bool(mine) and all(r.get("times", 1) <= 0 for r in mine)


def _sim_state(host_pid: int) -> str:
    """A process's CUDA state straight from its restore thread: no driver
    call, so no injected fault is consumed."""
    nspid = Host().nspid(host_pid)
    sock = f"/proc/{host_pid}/root/dev/shm/cuda-sim-{nspid}.sock"
    reply = wire.request(sock, (wire.dumps({"op": "get-state"}) + "\n").encode(), timeout=10)
    return str(wire.loads(reply.decode())["state"])


def _kill_hook(node: Node, case: Case, worker: threading.Thread, done: dict[str, Any],
               others: Sequence[int] = (), victim: int | None = None) -> int:
    """Once the slow call is in flight (and `others` are checkpointed),
    SIGKILL the hook (or its group), its helper, or the agent's worker
    serving it or the agent itself."""
    env = node.env
    call, _ = STEPS[(case.phase, case.step)]
    deadline = time.monotonic() + 60
    while not _in_flight(env, call, case.phase) or any(
            _sim_state(p) != "checkpointed" for p in others):
        assert worker.is_alive(), done
        assert time.monotonic() < deadline, (
            "the slow call was never reached", _smi_calls(env),
            {p: _read(p, "cmdline")[:200] for p in _smi_calls(env).values()})
        time.sleep(0.02)
    # One action script runs the phase; CRIU may have started its duplicate
    # call by now: both are killed.
    hooks = _hooks(env, case.phase)
    assert hooks, "no action script running"
    if call == "copy-out" and victim:  # the operation is open: no abort call from here
        assert _sim_state(victim) == "checkpointing"
    if case.kill in ("worker", "agent"):
        # The call went to the agent: its session, of this run, has it in flight.
        info = agent.status(node.settings(), 5.0)
        assert info and info["in_flight"] and len(info["busy_worker_pids"]) == 1, info
        victim = info["busy_worker_pids"][0] if case.kill == "worker" else info["pid"]
        os.kill(victim, signal.SIGKILL)
        return hooks[0]
    if case.kill == "helper":
        helpers = [p for p in _pids() if _ppid(p) in hooks and f"driver_helper.py {env.lab.libcuda}"
                   .encode() in _read(p, "cmdline").replace(b"\0", b" ")]
        assert len(helpers) == 1, helpers
        os.kill(helpers[0], signal.SIGKILL)
        return hooks[0]
    for hook in hooks:
        with contextlib.suppress(ProcessLookupError):
            if case.kill == "group":
                pgid = os.getpgid(hook)
                assert pgid != os.getpgid(0)  # runc runs in a session of its own here
                os.killpg(pgid, signal.SIGKILL)
            else:
                os.kill(hook, signal.SIGKILL)
    return hooks[0]


def assert_calls_end(node: Node) -> None:
    """Within LEFT_S no call of the killed phase is left: no process making
    one, and no session of a live agent with one in flight."""
    deadline = time.monotonic() + LEFT_S
    while True:
        pid = agent.running_pid(node.settings())
        info = agent.status(node.settings(), 1.0) if pid else None
        left = phase_calls(node.env, pid)
        if info and info["in_flight"]:
            left.append(f"agent {pid}: {info['in_flight']} calls in flight")
        if not left:
            return
        assert time.monotonic() < deadline, f"driver calls outlived their hook: {left}"
        time.sleep(0.05)


# -- the node, its shared container and image -----------------------------------


@dataclass
class Box:
    cid: str
    bundle: Path
    pids: dict[str, int]
    image: Path | None = None
    frozen: dict[str, int] | None = None


class Node(SharedBoxes):
    deadlines = DEADLINES

    def __init__(self, env: Env, tmp: Path):
        super().__init__(env, tmp)
        self.live: dict[str, Box] = {}
        self.saved: dict[bool, Box] = {}  # by whether its GPU memory is in storage
        self.spoiled: list[str] = []  # containers of failed cases: deleted before the next
        self.agent = contextlib.ExitStack()
        env.box.own_session = True  # as a runtime runs runc: a group of its own
        # CUDA 13.4+: `checkpointing` and `restoring` are reported meanwhile,
        # and custom storage is there.
        env.lab.set(transient_states=True, cuda_version=13040)

    def settings(self) -> Settings:
        """The settings the hooks read now (the agent is started with them)."""
        return Settings(**yaml.safe_load(self.env.config.read_text()))

    def set_mode(self, case: Case) -> None:
        """The case's backend and mode; the agent up (warm: a worker attached
        and idle, so that the phase is its) or down."""
        self.configure(case.backend, **{"gpu_memory": "host", **MODES[case.mode]})
        settings = self.settings()
        if not case.agent:
            self.agent.close()
            return
        if agent.running_pid(settings) is None:
            self.agent.close()
            self.agent.enter_context(running_agent(settings))
        deadline = time.monotonic() + 30
        while not ((info := agent.status(settings, 1.0)) and info["idle_workers"]
                   and not info["warming"] and not info["sessions"]):
            assert time.monotonic() < deadline, f"the agent is not warm: {info}"
            time.sleep(0.05)

    def start(self, workload: str = "plain") -> Box:
        self.count += 1
        extra: dict[str, Any] = {}
        workloads = WORKLOADS
        if workload == "vmm":
            extra["snapshot_control"] = self.tmp / f"control-{self.count}"
            extra["snapshot_control"].mkdir()
            workloads = [(name, {**opts, "vmm": True}) for name, opts in WORKLOADS]
        bundle = self.env.box.bundle(f"k{self.count}", workloads, others=["sleep 100000"],
                                     **extra)
        cid = self.run(bundle, TAGS)
        found = workload_pids(self.env.lab, cid, TAGS)
        assert all(found.values()), found
        return Box(cid, bundle, {t: p for t, p in found.items() if p})

    def clean(self) -> None:
        while self.spoiled:
            self.env.box.delete(self.spoiled.pop())

    def live_box(self, workload: str) -> Box:
        self.clean()
        for other in [w for w in self.live if w != workload]:  # same tags: one at a time
            self.env.box.delete(self.live.pop(other).cid)
        if workload not in self.live:
            self.live[workload] = self.start(workload)
        return self.live[workload]

    def image_box(self, storage: bool) -> Box:
        """The shared image (its GPU memory in storage or not), dumped once
        by the case's settings."""
        for box in self.live.values():  # their workloads report under the same tags
            self.env.box.delete(box.cid)
        self.live.clear()
        if storage not in self.saved:
            box = self.start()
            box.image = self.tmp / f"image-{'storage' if storage else 'host'}"
            box.frozen = self.dump(box.cid, box.image, TAGS)
            m = manifest.read(box.image)
            assert m is not None and (m.gpu_storage is not None) == storage
            self.saved[storage] = box
        return self.saved[storage]


@pytest.fixture(scope="module")
def node(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Node]:
    tmp = tmp_path_factory.mktemp("kill")
    env = Env(tmp / "env")
    node = Node(env, tmp)
    try:
        yield node
    finally:
        node.agent.close()
        env.close()


# -- the cases -------------------------------------------------------------------


def _slow(env: Env, case: Case) -> None:
    call, skip = STEPS[(case.phase, case.step)]
    if call == "nvidia-smi":
        env.lab.fault("nvidia-smi", "hang")
    else:
        env.lab.fault(call, "delay", seconds=DELAY_S, tag=VICTIM, times=1,
                      **({"skip": skip} if skip else {}))
    if case.kill == "guardian":  # its restore from storage, once the hook is dead
        env.lab.fault("copy-in", "delay", seconds=DELAY_S, tag=VICTIM, times=1)


def _kill_guardian(env: Env) -> None:
    """Once the guardian's copy-in is in flight, SIGKILL the guardian making
    it (the one with a driver-API helper)."""
    deadline = time.monotonic() + 60
    while not _in_flight(env, "copy-in", "pre-dump"):
        assert time.monotonic() < deadline, "the guardian never restored from storage"
        time.sleep(0.02)
    helper = f"driver_helper.py {env.lab.libcuda}".encode()
    making = {_ppid(p) for p in _pids() if helper in _read(p, "cmdline").replace(b"\0", b" ")}
    guardians = [p for p in making if b"cudahook.flow.guardian" in _read(p, "cmdline")]
    assert len(guardians) == 1, guardians
    os.kill(guardians[0], signal.SIGKILL)


@pytest.mark.parametrize("case", [pytest.param(c, id=c.id) for c in CASES])
def test_kill(node: Node, case: Case, tmp_path: Path) -> None:
    node.set_mode(case)
    if case.phase == "pre-dump":
        _killed_checkpoint(node, case, tmp_path)
    elif case.phase == "between":
        _killed_between(node, case, tmp_path)
    else:
        _killed_restore(node, case)


def _killed_checkpoint(node: Node, case: Case, tmp_path: Path) -> None:
    env = node.env
    box = node.live_box(case.workload)
    del node.live[case.workload]  # until this case proves it healthy again
    node.spoiled.append(box.cid)
    vmm_calls = len(env.lab.vmm_calls())
    _slow(env, case)
    done: dict[str, Any] = {}
    image = tmp_path / "img"
    dump = threading.Thread(target=lambda: done.update(r=env.box.checkpoint(box.cid, image)))
    dump.start()
    # With VMM, the others are caught checkpointed (their mappings dropped):
    # the replay below must then reach exactly them.
    others = [box.pids[t] for t in TAGS if t != VICTIM] if case.workload == "vmm" else []
    try:
        _kill_hook(node, case, dump, done, others, box.pids[VICTIM])
        assert_calls_end(node)
        if case.kill == "guardian":
            _kill_guardian(env)
    finally:
        env.lab.clear_faults()
        dump.join(120)
    assert not dump.is_alive()
    assert done["r"].returncode != 0  # the dump failed: its action script was killed

    # The runtime lets the container run again: every CUDA process is back
    # on its GPU, intact, still the same processes, not frozen.
    assert_running_and_intact(env, box.cid, TAGS)
    assert workload_pids(env.lab, box.cid, TAGS) == box.pids
    assert not any(Host().is_frozen(p) for p in box.pids.values())
    assert not (image / manifest.NAME).exists()  # the hook died before it
    assert [e for e in env.events("checkpoint") if "error" not in e] == []
    guardians = [e for e in env.events("guardian") if "error" in e or "unsafe" in e]
    assert guardians == [], guardians
    if case.kill == "guardian":  # its successor did its work
        resumed = [e for e in env.events("guardian") if "resumed" in e.get("outcome", "")]
        assert len(resumed) == 1, env.events("guardian")
    if case.kill in ("helper", "worker", "agent"):
        # The hook lived on: its phase failed on the lost call, and rolled
        # back (in a fresh per-phase helper when the agent's session was
        # lost), every process verified running: nothing for the guardian.
        failed = [e for e in env.events() if e["event"] in ("pre-dump", "checkpoint")
                  and "error" in e]
        assert len(failed) == 1 and not failed[0].get("unsafe"), failed
        lost = "the driver agent" if case.agent else "the driver helper exited"
        assert lost in failed[0]["error"], failed
        assert not [e for e in env.events("guardian") if "resumed" in e.get("outcome", "")]
    if case.workload == "vmm":
        # The prepare ran before the first lock; the guardian replayed its
        # state into the processes it brought back from checkpointed (the
        # victim was only locked: its mappings never left).
        calls = env.lab.vmm_calls()[vmm_calls:]
        assert [c["op"] for c in calls] == ["prepare", "restore"], calls
        assert sorted(p for p, _ in calls[1]["processes"]) == sorted(
            box.pids[t] for t in TAGS if t != VICTIM)
    node.live[case.workload] = box
    node.spoiled.remove(box.cid)
    # Each case reads its own events: the log starts afresh.
    env.log_file.unlink(missing_ok=True)


def _killed_restore(node: Node, case: Case) -> None:
    env = node.env
    node.clean()
    box = node.image_box(storage="storage" in case.mode)
    assert box.image is not None and box.frozen is not None
    before = image_hashes(box.image)
    fresh_reports(env.lab, TAGS)  # only the restored processes may report from here on
    _slow(env, case)
    done: dict[str, Any] = {}
    cid = env.cid()  # each case restores a container of its own
    node.spoiled.append(cid)
    worker = threading.Thread(
        target=lambda: done.update(r=env.box.restore(cid, box.bundle, box.image)))
    worker.start()
    try:
        _kill_hook(node, case, worker, done)
        assert_calls_end(node)
    finally:
        env.lab.clear_faults()
        worker.join(120)
    assert not worker.is_alive()
    # Whatever runc said (CRIU only logs a post-resume failure), nothing of
    # the container is left alive, and the image is as it was.
    assert_nothing_restored(env, cid, box.image, before)
    # A retry restores it, healthy, from the checkpoint. runc killed in the
    # middle of a restore leaves its own record of the container behind (a
    # mount it never undid): that is the runtime's to clean, so the retry
    # then runs under a new container id.
    if case.kill == "group":
        env.box.delete(cid)
        cid = env.cid()
        node.spoiled.append(cid)
    restore_and_check(env, cid, box.bundle, box.image, TAGS, box.frozen)
    node.clean()
    env.log_file.unlink(missing_ok=True)


def _killed_between(node: Node, case: Case, tmp_path: Path) -> None:
    """The checkpoint's session ended and its worker went back to the pool;
    then that idle worker, or the agent itself, is killed. The restore
    after it goes on: another warm worker, or the phase's own helper (the
    agent's socket left behind answers nothing)."""
    env = node.env
    box = node.live_box(case.workload)
    del node.live[case.workload]
    node.spoiled.append(box.cid)
    settings = node.settings()
    image = tmp_path / "img"
    frozen = node.dump(box.cid, image, TAGS)
    info = agent.status(settings, 5.0)
    assert info and info["served"] >= 1 and not info["sessions"] and info["idle_workers"], info
    if case.kill == "agent":
        os.kill(info["pid"], signal.SIGKILL)
        deadline = time.monotonic() + LEFT_S
        while agent.running_pid(settings):
            assert time.monotonic() < deadline, "the agent outlived SIGKILL"
            time.sleep(0.02)
    else:
        workers = [p for p in _pids() if _ppid(p) == info["pid"]]
        assert workers, info
        for w in workers:  # the one handed back, and every other idle one
            os.kill(w, signal.SIGKILL)
    restore_and_check(env, box.cid, box.bundle, image, TAGS, frozen)
    restores = env.events("restore")
    assert len(restores) == 1 and "error" not in restores[0], restores
    assert phase_calls(env, agent.running_pid(settings)) == []
    env.log_file.unlink(missing_ok=True)
