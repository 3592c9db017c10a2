"""The engine against a real GPU and NVIDIA's real `cuda-checkpoint`.

Skipped unless an NVIDIA GPU answers `nvidia-smi -L` and a native
`cuda-checkpoint` is found (PATH, the driver's usual folders, .gpu-carry/, or
$CUDAHOOK_REAL_CUDA_CHECKPOINT). With CUDAHOOK_GPU_TEST_SIM=1 the same checks
run against the simulator instead, which keeps their logic honest on machines
without a GPU.

The tests share one set of workloads and run in file order (run with -x): a
2 GiB `memory` process, a `multi` parent with two CUDA children, an
NVML-only monitor and a `busy` process with long kernels in flight. What the
real tool said is appended as JSON lines to $CUDAHOOK_GPU_RECORD when set.
"""

from __future__ import annotations

import json
import os
import time
import warnings
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import pytest

from cudahook.core.backends import CHECKPOINTED, RUNNING
from cudahook.core.backends.cli import CudaCheckpointCLI
from cudahook.core.discovery import discover
from cudahook.core.engine import PhaseResult
from cudahook.platform.errors import EnvironmentProblem, PhaseError
from cudahook.platform.host import Host

from .gpulib import (
    ENV_SIM,
    NULL_UUID,
    Rig,
    Workload,
    compute_apps,
    custom_storage_probe,
    device_fds,
    find_cuda_checkpoint,
    real_gpu_skip_reason,
    wait_for,
)

SIM = os.environ.get(ENV_SIM) == "1"
SKIP = None if SIM else real_gpu_skip_reason()
pytestmark = [pytest.mark.gpu, pytest.mark.skipif(SKIP is not None, reason=SKIP or "")]

START_TIMEOUT = 240.0  # torch import, CUDA init and filling 2 GiB, all workloads at once


@dataclass
class Lab:
    rig: Rig
    memory: Workload
    multi: Workload
    nvml: Workload
    busy: Workload
    smi_sees: bool = True  # does nvidia-smi list our processes at all here?
    seen: dict[str, Any] = field(default_factory=dict)

    @property
    def cuda(self) -> list[Workload]:
        return [self.memory, self.multi, self.busy]

    def pids(self, *wls: Workload) -> list[int]:
        return [p for wl in wls for p in wl.pids()]


@pytest.fixture(scope="module")
def lab(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Lab]:
    workdir = tmp_path_factory.mktemp("gpu")
    if SIM:
        rig = Rig.simulated(workdir)
    else:
        tool, _ = find_cuda_checkpoint()
        assert tool is not None
        rig = Rig.real(tool, workdir)
    try:
        # Started together so their start-up overlaps; waited for one by one.
        lab = Lab(
            rig,
            memory=rig.spawn("memory", "memory", gib=2.0),
            multi=rig.spawn("multi", "multi", gib=0.5, procs=2),
            nvml=rig.spawn("nvml", "nvml"),
            busy=rig.spawn("busy", "busy", gib=0.25, kernel_ms=1000),
        )
        for wl in (lab.memory, lab.multi, lab.nvml, lab.busy):
            wl.wait_ready(START_TIMEOUT)
        yield lab
    finally:
        rig.close()


@pytest.fixture(scope="module")
def record() -> Callable[..., None]:
    """Keep what the real tool said: JSON lines in $CUDAHOOK_GPU_RECORD, and stdout."""
    path = os.environ.get("CUDAHOOK_GPU_RECORD")

    def write(name: str, **data: Any) -> None:
        line = json.dumps({"test": name, "time": time.time(), "sim": SIM, **data}, default=str)
        print(line)
        if path:
            with open(path, "a") as f:
                f.write(line + "\n")

    return write


def backend(lab: Lab) -> CudaCheckpointCLI:
    return CudaCheckpointCLI(Host(), lab.rig.settings)


def states(lab: Lab, pids: list[int]) -> dict[int, str]:
    # In parallel: every call pays the driver attach, seconds on some machines.
    b = backend(lab)
    with ThreadPoolExecutor(max(1, len(pids))) as pool:
        return dict(zip(pids, pool.map(b.get_state, pids), strict=True))


def result_of(exc: PhaseError) -> PhaseResult:
    res = exc.result
    assert isinstance(res, PhaseResult), exc
    return res


def assert_intact(wl: Workload) -> None:
    for st in wl.statuses():
        assert st.get("state") == "running", wl.describe()
        assert st.get("intact") is True, wl.describe()
        assert not st.get("errors"), wl.describe()


def wait_checked_since(wl: Workload, checks: list[int], timeout: float = 60) -> None:
    """Wait for a memory check that started after the given check counts."""
    def checked() -> bool:
        now = [int(s.get("checks", 0)) for s in wl.statuses()]
        return all(n > c for n, c in zip(now, checks, strict=True))

    wait_for(checked, timeout, lambda: f"no memory check after {checks}: {wl.describe()}")


def gpu_listed(lab: Lab, pids: list[int]) -> dict[int, int]:
    apps, raw = compute_apps(lab.rig.smi)
    assert apps is not None, f"nvidia-smi --query-compute-apps failed: {raw}"
    return {p: apps[p] for p in pids if p in apps}


# -- the checks, in order ----------------------------------------------------------


def test_workloads_hold_gpu_memory_and_device_nodes(lab: Lab, record: Callable[..., None]) -> None:
    regex = lab.rig.device_regex
    cuda_pids = lab.pids(*lab.cuda)
    assert len(cuda_pids) == 4  # memory, two multi children, busy
    fds = {pid: device_fds(pid, regex) for pid in cuda_pids}
    assert all(fds.values()), f"a CUDA process holds no NVIDIA device node: {fds}"
    listed = gpu_listed(lab, cuda_pids)
    lab.smi_sees = bool(listed)
    nvml_pid = lab.nvml.pids()[0]
    record("workloads", fds={str(k): v for k, v in fds.items()}, gpu_mib=listed,
           nvml_fds=device_fds(nvml_pid, regex), statuses=[wl.statuses() for wl in lab.cuda])
    if not listed:
        warnings.warn("nvidia-smi lists none of the CUDA workloads here (PID namespace?): "
                      "GPU-memory checks fall back to device nodes alone", stacklevel=1)
        return
    assert set(listed) == set(cuda_pids), f"nvidia-smi lists {listed}, expected {cuda_pids}"


def test_discovery_keeps_cuda_processes_and_filters_nvml(lab: Lab, record: Callable[..., None]) -> None:
    host, b = Host(), backend(lab)
    regex = lab.rig.device_regex
    found = {wl.name: discover(host, b, wl.pid, regex) for wl in (*lab.cuda, lab.nvml)}
    record("discovery", features=b.features.describe(),
           found={k: {"candidates": d.candidates, "pids": d.pids, "skipped": d.skipped,
                      "scope": d.scope, "warnings": d.warnings} for k, d in found.items()})
    assert b.features.actions and b.features.get_state, b.features.describe()
    for wl in lab.cuda:
        assert sorted(found[wl.name].pids) == sorted(wl.pids()), (wl.name, found[wl.name])
        assert all(p.state == RUNNING for p in found[wl.name].processes)
    nvml = found["nvml"]
    nvml_pid = lab.nvml.pids()[0]
    assert nvml.pids == [], f"the NVML-only process was taken for a CUDA process: {nvml}"
    if nvml_pid in nvml.candidates:  # it holds device nodes: the driver had to say no
        assert nvml_pid in nvml.skipped, nvml


def test_checkpoint_releases_gpu_memory_and_device_nodes(lab: Lab, record: Callable[..., None]) -> None:
    wls = [lab.memory, lab.multi]
    pids = lab.pids(*wls)
    lab.seen["ckpt_pids"] = pids
    res = lab.rig.engine().checkpoint(pids)
    record("checkpoint", result=res.to_dict())
    assert res.ok and res.final == {p: CHECKPOINTED for p in pids}, res.to_dict()
    assert states(lab, pids) == {p: CHECKPOINTED for p in pids}

    regex = lab.rig.device_regex
    wait_for(lambda: not any(device_fds(p, regex) for p in pids), 10,
             lambda: f"device nodes still open: { {p: device_fds(p, regex) for p in pids} }")
    if lab.smi_sees:
        wait_for(lambda: not gpu_listed(lab, pids), 15,
                 lambda: f"nvidia-smi still lists {gpu_listed(lab, pids)}")
    # No GPU work can run while checkpointed: the counters stand still.
    frozen = [wl.counters() for wl in wls]
    time.sleep(1.0)
    assert [wl.counters() for wl in wls] == frozen
    lab.seen["counters"] = frozen
    lab.seen["checks"] = [[int(s.get("checks", 0)) for s in wl.statuses()] for wl in wls]


def test_restore_brings_them_back_intact(lab: Lab, record: Callable[..., None]) -> None:
    wls = [lab.memory, lab.multi]
    pids = lab.seen["ckpt_pids"]
    res = lab.rig.engine().restore(pids)
    record("restore", result=res.to_dict())
    assert res.ok and res.final == {p: RUNNING for p in pids}, res.to_dict()
    for wl, before, checks in zip(wls, lab.seen["counters"], lab.seen["checks"], strict=True):
        wl.wait_progress(before, steps=3)
        wait_checked_since(wl, checks)
        assert_intact(wl)
    regex = lab.rig.device_regex
    assert all(device_fds(p, regex) for p in pids)
    if lab.smi_sees:
        wait_for(lambda: set(gpu_listed(lab, pids)) == set(pids), 15,
                 lambda: f"nvidia-smi lists {gpu_listed(lab, pids)}, expected {pids}")


def test_lock_timeout_on_busy_process_leaves_it_running(lab: Lab, record: Callable[..., None]) -> None:
    pid = lab.busy.pids()[0]
    before = lab.busy.counters()
    engine = lab.rig.engine(lock_timeout_ms=1)
    try:
        res = engine.checkpoint([pid])
    except PhaseError as exc:
        res = result_of(exc)
        record("lock-timeout", error=str(exc), safe=exc.safe, result=res.to_dict())
        assert exc.safe, str(exc)
        assert res.final == {pid: RUNNING}, res.to_dict()
        assert res.errors and "lock" in res.errors[pid], res.errors
    else:
        # The lock did not wait for the in-flight kernels: put it back, then fail.
        record("lock-timeout", error=None, result=res.to_dict())
        lab.rig.engine().restore([pid])
        pytest.fail(f"a 1 ms lock on a process with long kernels in flight succeeded: {res.to_dict()}")
    assert states(lab, [pid]) == {pid: RUNNING}
    lab.busy.wait_progress(before, steps=2)
    assert_intact(lab.busy)


def test_restore_onto_unknown_gpu_fails_then_plain_restore_works(
    lab: Lab, record: Callable[..., None]
) -> None:
    pid = lab.memory.pids()[0]
    engine = lab.rig.engine()
    source = lab.rig.gpu_of(lab.memory)
    assert source.startswith("GPU-"), source
    res = engine.checkpoint([pid])
    assert res.ok, res.to_dict()
    before = lab.memory.counters()
    checks = [int(s.get("checks", 0)) for s in lab.memory.statuses()]

    # A tool without --device-map makes the engine refuse before touching anything
    # (EnvironmentProblem); with it, the driver must refuse the unknown GPU (PhaseError).
    with pytest.raises((PhaseError, EnvironmentProblem)) as caught:
        engine.restore([pid], device_map={source: NULL_UUID})
    after_bad = states(lab, [pid])
    err = caught.value
    bad = result_of(err) if isinstance(err, PhaseError) else None
    record("bad-device-map", error=str(err), kind=type(err).__name__, state_after=after_bad,
           device_map_supported=backend(lab).features.device_map,
           result=bad.to_dict() if bad else None)
    if bad is not None:
        assert not bad.ok and pid in bad.errors
        assert after_bad[pid] in (CHECKPOINTED, "locked"), after_bad
    else:
        assert after_bad[pid] == CHECKPOINTED, after_bad

    res = engine.restore([pid])
    record("plain-restore-after-bad-map", result=res.to_dict())
    assert res.ok and res.final == {pid: RUNNING}, res.to_dict()
    lab.memory.wait_progress(before, steps=3)
    wait_checked_since(lab.memory, checks)
    assert_intact(lab.memory)


def test_gpu_memory_straight_to_storage(lab: Lab, record: Callable[..., None],
                                        tmp_path: Any) -> None:
    """CUDA 13.4+ custom storage, if this node's driver has it: one small
    CUDA process checkpointed into chunk files and restored from them
    through the driver-API helper, GB/s each way recorded for its GPU, and
    the process computes on with its memory intact. Skipped, with the
    driver's answer, where the driver lacks it (the answer is recorded)."""
    if SIM:
        lab.rig.lab.set(cuda_version=13040)  # the simulated node as a CUDA 13.4 driver

    def start() -> Workload:
        wl = lab.rig.spawn("storage", "memory", gib=0.25)
        wl.wait_ready(START_TIMEOUT)
        return wl

    got = custom_storage_probe(lab.rig, start, tmp_path / "storage")
    record("custom-storage", **got)
    if not got["supported"]:
        pytest.skip(f"no custom storage on this node: {got['why']} "
                    f"(driver {got['driver']}, CUDA {got['cuda_version']})")
    assert (got["state_after_checkpoint"], got["state_after_restore"]) == (
        CHECKPOINTED, "locked"), got
    assert got["put_back"] == [] and got["intact"], got
    ((_, m),) = got["per_gpu"].items()
    assert m["bytes"] > 0 and m["checkpoint_gb_s"] and m["restore_gb_s"], m


def test_everything_ends_running_and_intact(lab: Lab, record: Callable[..., None]) -> None:
    pids = lab.pids(*lab.cuda)
    assert states(lab, pids) == {p: RUNNING for p in pids}
    for wl in lab.cuda:
        assert wl.proc.poll() is None, wl.describe()  # a multi parent exits if a child died
        wl.wait_progress(wl.counters(), steps=2)
        assert_intact(wl)
    nvml_before = lab.nvml.counters()
    lab.nvml.wait_progress(nvml_before, steps=2)
    record("end", statuses={wl.name: wl.statuses() for wl in (*lab.cuda, lab.nvml)})

