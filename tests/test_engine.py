"""The engine against real processes on every emulated driver branch, through
both backends: the cuda-checkpoint CLI and the driver API (the fake libcuda)."""

from __future__ import annotations

import itertools
import json
import threading
import time

import pytest

from cudahook.core.discovery import discover
from cudahook.platform.errors import EnvironmentProblem, Exit, PhaseError

from .conftest import DRIVERS


@pytest.fixture(params=["cli", "driver-api"])
def backend_kind(request: pytest.FixtureRequest) -> str:
    return str(request.param)


WORKLOADS = (
    ("solo", {"mib": 8}),
    ("pair", {"mib": 4, "procs": 3}),  # multi-process: three CUDA contexts
    ("small", {"mib": 1, "gpu": 1}),
    ("nvml", {"nvml_only": True}),  # holds device nodes, never a CUDA process
)
CUDA_TAGS = ["solo", "pair.0", "pair.1", "pair.2", "small"]


def start(node):  # type: ignore[no-untyped-def]
    init = node.spawn_tree(*WORKLOADS)
    reports = {t: node.lab.wait_counter(t, 2) for t in [*CUDA_TAGS, "nvml"]}
    return init, {t: r["pid"] for t, r in reports.items()}


def find(node, engine, init_pid, **kw):  # type: ignore[no-untyped-def]
    return discover(engine.host, engine.backend, init_pid, engine.settings.device_regex, **kw)


def counters(node) -> dict[str, int]:  # type: ignore[no-untyped-def]
    return {t: node.lab.status(t)["counter"] for t in CUDA_TAGS}


def assert_all_running_and_intact(node, engine, pids, since: dict[str, int]) -> None:  # type: ignore[no-untyped-def]
    for pid in pids:
        assert engine.read_state(pid) == "running"
    for tag, before in since.items():
        st = node.lab.wait_counter(tag, before + 11)  # past one more memory check
        assert st["intact"], st
        assert st["errors"] == [], st


@pytest.mark.parametrize("driver", DRIVERS)
def test_round_trip_every_driver(make_node, driver: int) -> None:
    node = make_node(driver=driver)
    engine = node.engine()
    init, pids = start(node)
    found = find(node, engine, init.pid)
    cuda_pids = sorted(pids[t] for t in CUDA_TAGS)
    assert found.pids == cuda_pids
    assert pids["nvml"] in found.skipped and init.pid not in found.candidates
    assert found.scope == "tree-scan"
    assert {p.nspid for p in found.processes} == set(cuda_pids)  # host: same namespace

    res = engine.checkpoint(found.processes)
    assert res.ok and res.changed == cuda_pids
    assert all(engine.read_state(p) == "checkpointed" for p in cuda_pids)
    assert all(g["memory_used_mib"] == 0 for g in node.lab.info()["gpus"])
    frozen = counters(node)
    time.sleep(0.3)
    assert counters(node) == frozen  # no GPU work while checkpointed
    steps = {(s.pid, s.step) for s in res.timeline.steps}
    if driver >= 555:
        assert {(p, "lock") for p in cuda_pids} | {(p, "checkpoint") for p in cuda_pids} <= steps
    else:
        assert {(p, "toggle") for p in cuda_pids} <= steps

    # Checkpointed processes hold no device node, but keep their CUDA
    # restore thread: discovery still sees them (a checkpoint must not dump
    # one unawares).
    assert find(node, engine, init.pid).pids == cuda_pids
    again = find(node, engine, init.pid, require_device_fd=False)
    assert again.pids == cuda_pids
    res = engine.restore(again.processes)
    assert res.ok and res.final == {p: "running" for p in cuda_pids}
    assert_all_running_and_intact(node, engine, cuda_pids, frozen)
    assert node.lab.status("nvml")["errors"] == []


@pytest.mark.parametrize("driver", [550, 580])
def test_phases_are_idempotent(make_node, driver: int) -> None:
    node = make_node(driver=driver)
    engine = node.engine()
    init, _pids = start(node)
    procs = find(node, engine, init.pid).processes
    assert engine.checkpoint(procs).changed
    second = engine.checkpoint(procs)  # CRIU runs every action script twice
    assert second.ok and second.changed == []
    assert all(engine.read_state(p.pid) == "checkpointed" for p in procs)
    frozen = counters(node)
    assert engine.restore(procs).changed
    second = engine.restore(procs)
    assert second.ok and second.changed == []
    assert_all_running_and_intact(node, engine, [p.pid for p in procs], frozen)


@pytest.mark.parametrize(("action", "mode"), [
    ("lock", "error"), ("checkpoint", "error"), ("lock", "hang"), ("checkpoint", "hang"),
])
def test_failure_on_one_process_rolls_every_process_back(make_node, action: str, mode: str) -> None:
    node = make_node(driver=580)
    engine = node.engine(call_timeout_s=1.5)
    init, pids = start(node)
    procs = find(node, engine, init.pid).processes
    victim = pids["pair.1"]  # the k-th of N
    node.lab.fault(action, mode=mode, pid=victim, code=2)
    before = counters(node)
    t = time.monotonic()
    with pytest.raises(PhaseError) as err:
        engine.checkpoint(procs)
    assert time.monotonic() - t < 10
    assert err.value.safe and err.value.exit_code == Exit.FAILED
    res = err.value.result
    assert res.rolled_back and list(res.errors) == [victim]
    msg = res.errors[victim]
    assert f"pid {victim}" in msg and action in msg
    assert ("timed out" in msg) if mode == "hang" else ('"out of memory"' in msg)
    assert res.final == {p.pid: "running" for p in procs}
    node.lab.clear_faults()
    assert_all_running_and_intact(node, engine, [p.pid for p in procs], before)


def test_target_dying_mid_phase_leaves_the_rest_running(make_node) -> None:  # type: ignore[no-untyped-def]
    node = make_node(driver=570)
    engine = node.engine()
    init, pids = start(node)
    procs = find(node, engine, init.pid).processes
    victim = pids["solo"]
    node.lab.fault("checkpoint", mode="crash", pid=victim)
    before = counters(node)
    with pytest.raises(PhaseError) as err:
        engine.checkpoint(procs)
    assert err.value.result.errors[victim].endswith("process exited")
    assert err.value.safe  # every survivor verified running
    del before["solo"]
    node.lab.clear_faults()
    assert_all_running_and_intact(node, engine, [p.pid for p in procs if p.pid != victim], before)


def test_a_state_the_driver_cannot_tell_is_still_rolled_back(make_node) -> None:  # type: ignore[no-untyped-def]
    """get-state fails for one process from the final check on: the rollback
    takes it the whole way back anyway (left checkpointed, it would stay off
    its GPU while CRIU resumes it), and reports it unverified, not safe."""
    node = make_node(driver=580)
    engine = node.engine()
    init, pids = start(node)
    procs = find(node, engine, init.pid).processes  # the states, read just now
    victim = pids["solo"]
    node.lab.fault("get-state", pid=victim)  # from here on, for good
    before = counters(node)
    with pytest.raises(PhaseError) as err:
        engine.checkpoint(procs, fresh_states=True)
    assert not err.value.safe
    assert "rollback failed" in err.value.result.errors[victim]
    steps = {s.step for s in err.value.result.timeline.steps if s.pid == victim and s.ok}
    assert {"rollback-restore", "rollback-unlock"} <= steps
    node.lab.clear_faults()
    assert_all_running_and_intact(node, engine, [p.pid for p in procs], before)


def test_restore_failure_holds_everything_then_a_retry_succeeds(make_node) -> None:  # type: ignore[no-untyped-def]
    node = make_node(driver=580)
    engine = node.engine()
    init, pids = start(node)
    procs = find(node, engine, init.pid).processes
    engine.checkpoint(procs)
    frozen = counters(node)
    victim = pids["small"]
    node.lab.fault("restore", pid=victim, code=2, times=1)
    with pytest.raises(PhaseError) as err:
        engine.restore(procs)
    assert not err.value.safe and err.value.exit_code == Exit.UNSAFE
    assert list(err.value.result.errors) == [victim]
    assert "restore" in err.value.result.errors[victim]
    states = {p.pid: engine.read_state(p.pid) for p in procs}
    assert "running" not in states.values()  # nothing half-restored was released
    assert states[victim] == "checkpointed"
    time.sleep(0.2)
    assert counters(node) == frozen
    res = engine.restore(procs)  # the fault is used up: retry from where it stopped
    assert res.ok and res.changed
    assert_all_running_and_intact(node, engine, [p.pid for p in procs], frozen)


def test_restore_onto_other_gpus_with_a_device_map(make_node) -> None:  # type: ignore[no-untyped-def]
    node = make_node(driver=580, gpus=4)
    engine = node.engine()
    init, _pids = start(node)
    procs = find(node, engine, init.pid).processes
    engine.checkpoint(procs)
    frozen = counters(node)
    u = node.lab.uuids
    # Host processes see all four GPUs: the driver wants every one of them named.
    with pytest.raises(PhaseError, match='"invalid argument"'):
        engine.restore(procs, {u[0]: u[2], u[1]: u[3]})
    mapping = {u[0]: u[2], u[1]: u[3], u[2]: u[0], u[3]: u[1]}
    res = engine.restore(procs, mapping)
    assert res.ok and res.device_map == mapping
    assert_all_running_and_intact(node, engine, [p.pid for p in procs], frozen)
    assert node.lab.status("solo")["gpu"] == u[2]
    assert node.lab.status("small")["gpu"] == u[3]
    used = [g["memory_used_mib"] for g in node.lab.info()["gpus"]]
    assert used[0] == used[1] == 0 and used[2] > 0 and used[3] > 0


@pytest.mark.parametrize("driver", [550, 570])
def test_remap_is_refused_before_touching_anything_without_device_map(make_node, driver: int) -> None:
    node = make_node(driver=driver, gpus=3)
    engine = node.engine()
    init, _pids = start(node)
    procs = find(node, engine, init.pid).processes
    engine.checkpoint(procs)
    u = node.lab.uuids
    with pytest.raises(EnvironmentProblem, match="--device-map"):
        engine.restore(procs, {u[0]: u[2], u[1]: u[1]})
    assert all(engine.read_state(p.pid) == "checkpointed" for p in procs)
    assert engine.restore(procs).ok


def test_sequential_mode(make_node) -> None:  # type: ignore[no-untyped-def]
    node = make_node(driver=580)
    engine = node.engine(sequential=True)
    init, _ = start(node)
    procs = find(node, engine, init.pid).processes
    res = engine.checkpoint(procs)
    ckpt = sorted((s.start, s.end) for s in res.timeline.steps if s.step == "checkpoint")
    assert all(a[1] <= b[0] for a, b in itertools.pairwise(ckpt))  # one at a time
    frozen = counters(node)
    engine.restore(procs)
    assert_all_running_and_intact(node, engine, [p.pid for p in procs], frozen)


def test_unlock_left_to_the_caller(make_node) -> None:  # type: ignore[no-untyped-def]
    node = make_node(driver=580)
    engine = node.engine()
    init, _ = start(node)
    procs = find(node, engine, init.pid).processes
    engine.checkpoint(procs)
    frozen = counters(node)
    res = engine.restore(procs, unlock=False)
    # Held, as the driver says it, every one of them (alive: a dead one
    # would answer nothing), and doing no GPU work meanwhile.
    held = {p.pid: engine.read_state(p.pid) for p in procs}
    assert held == {p.pid: "locked" for p in procs} and res.final == held
    time.sleep(0.2)
    assert counters(node) == frozen
    engine.unlock(procs)
    assert_all_running_and_intact(node, engine, [p.pid for p in procs], frozen)


def test_fresh_states_from_discovery_save_a_round_of_calls(make_node) -> None:  # type: ignore[no-untyped-def]
    node = make_node(driver=580)
    engine = node.engine()
    init, _ = start(node)
    procs = find(node, engine, init.pid).processes
    res = engine.checkpoint(procs, fresh_states=True)
    assert res.ok and not [s for s in res.timeline.steps if s.step == "get-state"]
    # Kept states are not fresh: the default reads again, and acts on what it reads.
    again = engine.checkpoint(procs)
    assert again.changed == [] and {s.step for s in again.timeline.steps} == {"get-state", "verify"}
    engine.restore(procs)


def test_features_follow_the_driver_not_the_binary(node, tmp_path) -> None:  # type: ignore[no-untyped-def]
    from cudahook.core.backends.cli import CudaCheckpointCLI
    from cudahook.platform.errors import EnvironmentProblem
    from cudahook.platform.host import Host

    class Counting(Host):
        runs: list[list[str]] = []

        def run(self, argv, timeout):  # type: ignore[no-untyped-def]
            Counting.runs.append(list(argv))
            return super().run(argv, timeout)

    settings = node.settings()
    first = CudaCheckpointCLI(Counting(), settings)
    assert first.features.device_map and first.features.version == "580.65.06"
    assert Counting.runs == []  # one file read, no tool started
    # A driver downgrade under the very same binary: the next hook sees it.
    node.lab.set(driver=570)
    second = CudaCheckpointCLI(Counting(), settings)
    assert second.features.version == "570.86.10" and not second.features.device_map
    assert second.features.actions

    # Without the /proc file, nvidia-smi's driver_version answers.
    missing = settings.with_overrides(driver_version_file=str(tmp_path / "absent"))
    assert CudaCheckpointCLI(Host(), missing).features.version == "570.86.10"

    # Neither: refused, and the failure is not remembered.
    version = tmp_path / "version"
    blind = missing.with_overrides(driver_version_file=str(version),
                                   nvidia_smi=str(tmp_path / "no-smi"))
    backend = CudaCheckpointCLI(Host(), blind)
    with pytest.raises(EnvironmentProblem, match="driver version unknown"):
        backend.features  # noqa: B018
    version.write_text("NVRM version: NVIDIA UNIX x86_64 Kernel Module  580.95.05  "
                       "Tue Sep 23 09:55:41 UTC 2025\n")
    assert backend.features.version == "580.95.05" and backend.features.device_map


@pytest.mark.parametrize("bad", ["failed", "unknown", "checkpointing"])
def test_a_cuda_process_in_trouble_stops_the_checkpoint_and_is_named(make_node, bad: str) -> None:  # type: ignore[no-untyped-def]
    node = make_node(driver=580)
    engine = node.engine()
    init, pids = start(node)
    victim = pids["small"]
    node.lab.force_state(victim, bad)
    found = find(node, engine, init.pid)
    assert victim in found.pids and victim not in found.skipped  # never "not CUDA"
    assert {p.state for p in found.processes if p.pid == victim} == {bad}
    with pytest.raises(PhaseError) as err:
        engine.checkpoint(found.processes, fresh_states=True)
    assert list(err.value.result.errors) == [victim]
    assert f"pid {victim}: CUDA process is" in str(err.value) and bad in str(err.value)
    assert not err.value.result.changed
    others = [p for p in found.pids if p != victim]
    assert {engine.read_state(p) for p in others} == {"running"}  # nothing was locked

    # The same process met at restore stops it before anything is restored,
    # and a restore that ends there says so.
    node.lab.force_state(victim, "running")
    engine.checkpoint(found.processes)
    node.lab.force_state(victim, bad)
    with pytest.raises(PhaseError) as err:
        engine.restore(found.processes)
    assert list(err.value.result.errors) == [victim] and bad in str(err.value)
    assert {engine.read_state(p) for p in others} == {"checkpointed"}
    node.lab.force_state(victim, "checkpointed")
    node.lab.fault("unlock", pid=victim, times=1)
    with pytest.raises(PhaseError):
        engine.restore(found.processes)
    node.lab.force_state(victim, bad)
    with pytest.raises(PhaseError) as err:
        engine.unlock(found.processes)
    assert bad in str(err.value)


def test_a_probe_error_other_than_not_cuda_is_not_a_skip(make_node) -> None:  # type: ignore[no-untyped-def]
    from cudahook.core.discovery import DiscoveryError

    node = make_node(driver=580)
    engine = node.engine()
    init, pids = start(node)
    node.lab.fault("get-state", tag="small", code=999)
    with pytest.raises(DiscoveryError) as err:
        find(node, engine, init.pid)
    assert f"pid {pids['small']}" in str(err.value) and '"unknown error"' in str(err.value)
    node.lab.clear_faults()
    found = find(node, engine, init.pid)
    assert pids["small"] in found.pids and pids["nvml"] in found.skipped  # NVML-only: not CUDA


def test_r590_job_members_one_at_a_time_beside_an_independent_process(make_node, tmp_path) -> None:  # type: ignore[no-untyped-def]
    import shlex
    import subprocess

    node = make_node(driver=590, bandwidth_mib_s=40)
    job = tmp_path / "job"
    job.write_text("{}\n")
    tool = str(node.lab.cuda_checkpoint)
    members = " ".join(f"{tool} --launch-job {job} {shlex.join(node.lab.workload_argv(t, mib=8))} &"
                       for t in ("j0", "j1"))
    solo = shlex.join(node.lab.workload_argv("free", mib=8))
    init = subprocess.Popen(["bash", "-c", f"{members} {solo} & wait"], env=node.lab.workload_env(),
                            stdin=subprocess.DEVNULL, start_new_session=True)
    node.procs.append(init)
    pids = {t: node.lab.wait_counter(t, 2)["pid"] for t in ("j0", "j1", "free")}

    # The driver cannot drive two members of one job at once.
    for t in ("j0", "j1"):
        assert subprocess.run([tool, "--action", "lock", "--pid", str(pids[t])]).returncode == 0
    calls = [subprocess.Popen([tool, "--action", "checkpoint", "--pid", str(pids[t])],
                              stderr=subprocess.PIPE, text=True) for t in ("j0", "j1")]
    outs = [(c.wait(timeout=30), c.stderr.read()) for c in calls]  # type: ignore[union-attr]
    assert sorted(rc for rc, _ in outs) == [0, 1]
    assert any('"the operation cannot be performed in the present state"' in e for _, e in outs)
    engine = node.engine()
    engine.restore([pids["j0"], pids["j1"]])

    frozen = {t: node.lab.status(t)["counter"] for t in pids}
    procs = find(node, engine, init.pid).processes
    assert sorted(p.pid for p in procs) == sorted(pids.values())
    res = engine.checkpoint(procs)
    assert res.ok, res.errors
    spans = {pid: [(s.start, s.end) for s in res.timeline.steps if s.pid == pid and
                   s.step in ("lock", "checkpoint")] for pid in pids.values()}
    steps = sorted(spans[pids["j0"]] + spans[pids["j1"]])
    assert all(a[1] <= b[0] for a, b in itertools.pairwise(steps))  # one member at a time
    free = spans[pids["free"]]
    assert any(s < e2 and s2 < e for s, e in free for s2, e2 in steps)  # beside them
    engine.restore(procs)
    for t in pids:
        st = node.lab.wait_counter(t, frozen[t] + 11)
        assert st["intact"] and not st["errors"]


def test_a_checkpoint_in_progress_elsewhere_is_named_not_touched(make_node) -> None:  # type: ignore[no-untyped-def]
    import subprocess

    node = make_node(driver=580, bandwidth_mib_s=10)
    node.lab.set(transient_states=True)
    p = node.spawn("w", mib=16)
    node.lab.wait_counter("w")
    engine = node.engine()
    tool = str(node.lab.cuda_checkpoint)
    assert subprocess.run([tool, "--action", "lock", "--pid", str(p.pid)]).returncode == 0
    other = subprocess.Popen([tool, "--action", "checkpoint", "--pid", str(p.pid)])
    time.sleep(0.3)
    with pytest.raises(PhaseError, match=f"pid {p.pid}: CUDA process is still checkpointing"):
        engine.checkpoint([p.pid])
    assert other.wait(timeout=30) == 0
    engine.restore([p.pid])
    assert node.lab.wait_counter("w", node.lab.status("w")["counter"] + 11)["intact"]


def _wrap(engine, name: str, before) -> None:  # type: ignore[no-untyped-def]
    """Call `before(pid)` ahead of each backend `name` call."""
    real = getattr(engine.backend, name)

    def call(pid, *a):  # type: ignore[no-untyped-def]
        before(pid)
        return real(pid, *a)

    setattr(engine.backend, name, call)


@pytest.mark.parametrize("step", ["lock", "checkpoint"])
def test_any_exception_in_a_parallel_call_fails_that_process(make_node, step: str) -> None:  # type: ignore[no-untyped-def]
    node = make_node(driver=580)
    engine = node.engine()
    init, pids = start(node)
    procs = find(node, engine, init.pid).processes
    victim = pids["pair.2"]

    def boom(pid: int) -> None:
        if pid == victim:
            raise KeyError("unexpected")

    _wrap(engine, step, boom)
    before = counters(node)
    with pytest.raises(PhaseError) as err:
        engine.checkpoint(procs)
    res = err.value.result
    assert list(res.errors) == [victim] and "KeyError" in res.errors[victim]
    assert err.value.safe and res.rolled_back
    assert res.final == {p.pid: "running" for p in procs}
    assert_all_running_and_intact(node, engine, [p.pid for p in procs], before)


def test_checkpoint_reads_the_states_back(make_node) -> None:  # type: ignore[no-untyped-def]
    """A checkpoint call that returns success without acting is caught."""
    node = make_node(driver=580)
    engine = node.engine()
    init, pids = start(node)
    procs = find(node, engine, init.pid).processes
    victim = pids["solo"]
    real = engine.backend.checkpoint
    engine.backend.checkpoint = lambda pid: None if pid == victim else real(pid)  # type: ignore[method-assign]
    before = counters(node)
    with pytest.raises(PhaseError) as err:
        engine.checkpoint(procs)
    res = err.value.result
    assert list(res.errors) == [victim] and "ended locked, not checkpointed" in res.errors[victim]
    assert err.value.safe and res.final == {p.pid: "running" for p in procs}
    assert_all_running_and_intact(node, engine, [p.pid for p in procs], before)


def test_locks_go_to_all_processes_at_once_whatever_max_parallel(make_node) -> None:  # type: ignore[no-untyped-def]
    node = make_node(driver=580)
    engine = node.engine(max_parallel=1)
    init, _ = start(node)
    procs = find(node, engine, init.pid).processes
    # Each lock waits until every lock has started: one at a time never gets there.
    barrier = threading.Barrier(len(procs), timeout=5)
    _wrap(engine, "lock", lambda pid: barrier.wait())
    res = engine.checkpoint(procs)
    assert res.ok and res.final == {p.pid: "checkpointed" for p in procs}
    # Checkpoints stay capped at max_parallel.
    ckpt = sorted((s.start, s.end) for s in res.timeline.steps if s.step == "checkpoint")
    assert all(a[1] <= b[0] for a, b in itertools.pairwise(ckpt))
    frozen = counters(node)
    engine.restore(procs)
    assert_all_running_and_intact(node, engine, [p.pid for p in procs], frozen)


def test_restore_failure_reports_the_states_read_back(make_node) -> None:  # type: ignore[no-untyped-def]
    node = make_node(driver=580)
    engine = node.engine()
    init, pids = start(node)
    procs = find(node, engine, init.pid).processes
    engine.checkpoint(procs)
    frozen = counters(node)
    victim = pids["solo"]

    def boom(pid: int) -> None:
        if pid == victim:
            raise OSError("unexpected")

    _wrap(engine, "restore", boom)
    with pytest.raises(PhaseError) as err:
        engine.restore(procs)
    res = err.value.result
    assert not err.value.safe and list(res.errors) == [victim]
    assert res.final[victim] == "checkpointed"
    assert set(res.final.values()) <= {"locked", "checkpointed"}
    assert set(res.final) == {p.pid for p in procs}
    engine.backend.restore = type(engine.backend).restore.__get__(engine.backend)  # type: ignore[method-assign]
    assert engine.restore(procs).ok
    assert_all_running_and_intact(node, engine, [p.pid for p in procs], frozen)


def test_the_rollback_waits_out_an_operation_still_in_progress(make_node) -> None:  # type: ignore[no-untyped-def]
    """A checkpoint call that failed can leave the driver still working on
    the process (CUDA 13.4+ says `checkpointing`): the rollback waits for
    that to end and brings the process back, rather than find it "still
    checkpointing" and give up."""
    import threading

    node = make_node(driver=580)
    node.lab.set(transient_states=True)
    p = node.spawn("w", mib=2)
    node.lab.wait_counter("w")
    engine = node.engine()
    node.lab.fault("checkpoint", pid=p.pid, code=2, times=1)
    timers: list[threading.Timer] = []

    def in_progress(pid: int) -> None:  # the rollback's first read finds it busy
        rules = json.loads((node.lab.root / "faults.json").read_text() or "[]")
        if not timers and all(r.get("times", 1) <= 0 for r in rules):
            node.lab.force_state(pid, "checkpointing")
            timers.append(threading.Timer(0.8, node.lab.force_state, (pid, "locked")))
            timers[0].start()

    _wrap(engine, "get_state", in_progress)
    try:
        with pytest.raises(PhaseError) as err:
            engine.checkpoint([p.pid])
    finally:
        for t in timers:
            t.join()
    res = err.value.result
    assert timers, "the rollback never read the state"
    assert err.value.safe and res.rolled_back, res.errors
    assert res.final == {p.pid: "running"}
    st = node.lab.wait_counter("w", node.lab.status("w")["counter"] + 11)
    assert st["intact"] and not st["errors"], st
