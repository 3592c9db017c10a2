"""The driver-API backend against the fake libcuda.so.1 (C, built by the suite)."""

from __future__ import annotations

import ctypes
import os
import subprocess
import time

import pytest

from cudahook.core.backends import make_backend
from cudahook.core.backends.cli import CudaCheckpointCLI
from cudahook.core.backends.driver_api import DriverAPI, uuid_hex
from cudahook.core.backends.driver_helper import (
    CUcheckpointCheckpointArgs,
    CUcheckpointGpuPair,
    CUcheckpointLockArgs,
    CUcheckpointRestoreArgs,
    CUcheckpointUnlockArgs,
)
from cudahook.platform.errors import EnvironmentProblem, PhaseError, ToolError
from cudahook.platform.host import Host


def workers(node, n: int) -> list[int]:  # type: ignore[no-untyped-def]
    for i in range(n):
        node.spawn(f"w{i}", mib=2)
    return [node.lab.wait_counter(f"w{i}", 2)["pid"] for i in range(n)]


def api(node, **over) -> DriverAPI:  # type: ignore[no-untyped-def]
    backend = make_backend(node.lab.settings(backend="driver-api", **over), Host())
    assert isinstance(backend, DriverAPI)
    return backend


def test_argument_structs_are_laid_out_as_cuda_h() -> None:
    for struct in (CUcheckpointLockArgs, CUcheckpointCheckpointArgs, CUcheckpointRestoreArgs,
                   CUcheckpointUnlockArgs):
        assert ctypes.sizeof(struct) == 64, struct
    assert ctypes.sizeof(CUcheckpointGpuPair) == 32
    assert CUcheckpointLockArgs.reserved1.offset == 8
    assert CUcheckpointRestoreArgs.gpuPairsCount.offset == 8
    assert CUcheckpointRestoreArgs.reserved1.offset == 56


def test_the_library_exports_the_driver_api_and_names_its_errors(node) -> None:  # type: ignore[no-untyped-def]
    lib = ctypes.CDLL(str(node.lab.libcuda))
    name, text = ctypes.c_char_p(), ctypes.c_char_p()
    assert lib.cuGetErrorName(909, ctypes.byref(name)) == 0
    assert lib.cuGetErrorString(909, ctypes.byref(text)) == 0
    assert (name.value, text.value) == (b"CUDA_ERROR_TIMEOUT", b"the operation timed out")
    assert lib.cuGetErrorName(12345, ctypes.byref(name)) == 1 and name.value is None
    version = ctypes.c_int()
    assert lib.cuDriverGetVersion(ctypes.byref(version)) == 0 and version.value == 13000
    state = ctypes.c_int()
    # Not initialised yet: every checkpoint call says so.
    assert lib.cuCheckpointProcessGetState(os.getpid(), ctypes.byref(state)) == 3


def helpers(node) -> list[str]:  # type: ignore[no-untyped-def]
    """The driver helper processes running for this node's libcuda."""
    out = subprocess.run(["pgrep", "-f", "driver_helper.py " + str(node.lab.libcuda)],
                         capture_output=True, text=True)
    return out.stdout.split()


def test_one_attach_per_phase_and_shared_state_with_the_tool(make_node) -> None:  # type: ignore[no-untyped-def]
    node = make_node(driver=580, attach_latency_s=0.5)
    pids = workers(node, 4)
    settings = node.lab.settings(backend="driver-api")
    host = Host()
    engine_backend = make_backend(settings, host)
    from cudahook.core.engine import Engine

    t = time.monotonic()
    result = Engine(engine_backend, settings, host).checkpoint(pids)
    took = time.monotonic() - t
    assert result.ok and engine_backend.attaches == 1  # type: ignore[attr-defined]
    # 4 processes x 3 calls through the CLI would pay 12 attaches of 0.5 s.
    assert took < 2 * 0.5 + 1.0, took
    # The phase's helper exited with the phase, not with this process.
    assert engine_backend._helper is None  # type: ignore[attr-defined]
    assert helpers(node) == []
    cli = CudaCheckpointCLI(host, settings)
    assert {cli.get_state(p) for p in pids} == {"checkpointed"}
    # Restored by the tool, unlocked through the library, and the other way round.
    cli.restore(pids[0])
    backend = api(node)
    assert backend.get_state(pids[0]) == "locked"
    backend.unlock(pids[0])
    backend.restore(pids[1])
    cli.unlock(pids[1])
    for p in pids[2:]:
        backend.restore(p)
        backend.unlock(p)
    assert backend.attaches == 1
    for i, p in enumerate(pids):
        assert cli.get_state(p) == "running"
        st = node.lab.wait_counter(f"w{i}", node.lab.status(f"w{i}")["counter"] + 11)
        assert st["intact"] and st["errors"] == [], st


def test_errors_carry_pid_action_and_the_drivers_name(node) -> None:  # type: ignore[no-untyped-def]
    pid = workers(node, 1)[0]
    backend = api(node)
    node.lab.fault("lock", pid=pid, code=2, times=1)
    with pytest.raises(ToolError) as err:
        backend.lock(pid, 1000)
    e = err.value
    assert (e.pid, e.action, e.returncode, e.timed_out) == (pid, "lock", 2, False)
    assert f"pid {pid}: lock CUresult 2: Could not lock on process ID {pid}" in str(e)
    assert '"out of memory"' in e.stderr and "CUDA_ERROR_OUT_OF_MEMORY" in e.stderr
    backend.lock(pid, 1000)  # the fault was for one call
    with pytest.raises(ToolError) as err:
        backend.lock(pid, 1000)
    assert err.value.returncode == 401 and "CUDA_ERROR_ILLEGAL_STATE" in err.value.stderr
    backend.unlock(pid)
    # A process without CUDA: the driver's "initialization error", as the tool says it.
    with pytest.raises(ToolError) as err:
        backend.get_state(os.getpid())
    assert '"initialization error"' in err.value.stderr


def test_a_hung_driver_call_is_abandoned_and_the_phase_rolls_back(make_node) -> None:  # type: ignore[no-untyped-def]
    node = make_node(driver=580)
    pids = workers(node, 3)
    settings = node.lab.settings(backend="driver-api", call_timeout_s=1.0, lock_timeout_ms=500)
    host = Host()
    backend = make_backend(settings, host)
    from cudahook.core.engine import Engine

    node.lab.fault("checkpoint", mode="hang", pid=pids[1], times=1)
    t = time.monotonic()
    with pytest.raises(PhaseError) as err:
        Engine(backend, settings, host).checkpoint(pids)
    assert time.monotonic() - t < 8
    res = err.value.result
    assert err.value.safe and res.rolled_back
    assert "timed out" in res.errors[pids[1]]
    assert res.final == {p: "running" for p in pids}
    # The hung helper's group is gone; the rollback ran in a fresh one,
    # which exited with the phase.
    assert backend.attaches == 2  # type: ignore[attr-defined]
    assert helpers(node) == []


def test_restore_with_gpu_pairs_moves_the_process(make_node) -> None:  # type: ignore[no-untyped-def]
    node = make_node(driver=580, gpus=2)
    pid = workers(node, 1)[0]
    old, new = node.lab.uuids
    backend = api(node)
    backend.lock(pid, 1000)
    backend.checkpoint(pid)
    backend.restore(pid, {old: new, new: old})
    backend.unlock(pid)
    from cudahook.sim import wire

    reply = wire.request(str(node.lab.ctl / f"cuda-sim-{pid}.sock"), b'{"op": "status"}\n', 10)
    status = wire.loads(reply.decode())
    assert status["gpu"] == new and status["state"] == "running", status  # type: ignore[index]
    assert uuid_hex(new) == new[4:].replace("-", "")


def test_the_driver_api_is_r570_and_newer(make_node) -> None:  # type: ignore[no-untyped-def]
    node = make_node(driver=555)
    with pytest.raises(EnvironmentProblem, match="does not support"):
        api(node).lock(1, 0)


@pytest.mark.parametrize(("driver", "library", "chosen", "why"), [
    (580, "fake", "driver-api", "auto: driver-api"),
    (570, "fake", "driver-api", "auto: driver-api"),
    (555, "fake", "cuda-checkpoint", "predates the checkpoint driver API"),
    (580, "missing", "cuda-checkpoint", "not loadable"),
    (580, "libc.so.6", "cuda-checkpoint", "does not export cuInit"),
])
def test_auto_picks_the_driver_api_only_where_it_runs(make_node, driver, library, chosen, why) -> None:  # type: ignore[no-untyped-def]
    node = make_node(driver=driver)
    path = {"fake": str(node.lab.libcuda), "missing": "/nonexistent/libcuda.so.1"}.get(
        library, library)
    backend = make_backend(node.lab.settings(backend="auto", libcuda=path), Host())
    assert backend.name == chosen
    assert why in backend.why


def test_explicit_choices_are_kept(node) -> None:  # type: ignore[no-untyped-def]
    assert make_backend(node.lab.settings(backend="cli"), Host()).name == "cuda-checkpoint"
    missing = make_backend(node.lab.settings(backend="driver-api", libcuda="/nonexistent.so"),
                           Host())
    with pytest.raises(EnvironmentProblem, match="libcuda not usable"):
        missing.get_state(os.getpid())


@pytest.mark.parametrize(("driver", "name", "why"), [
    (580, "driver-api", "auto: driver-api, driver 580.65.06"),
    (555, "cuda-checkpoint", "auto: cli, driver 555.58.02 predates"),
])
def test_features_and_doctor_say_which_backend_runs_and_why(make_node, tmp_path, driver, name,
                                                            why) -> None:  # type: ignore[no-untyped-def]
    import json

    from .test_cli import cli, write_config

    node = make_node(driver=driver)
    cfg = write_config(node, backend="auto")
    r = cli("--json", "features", config=cfg)
    f = json.loads(r.stdout)
    assert (f["backend"], f["version"]) == (name, node.lab.config["driver_version"])
    assert why in f["backend_why"]
    assert f"backend: {name} (" in cli("features", config=cfg).stdout
    root = tmp_path / "root"
    root.mkdir()
    r = cli("--json", "doctor", "--root", str(root), config=cfg)
    backend = {c["name"]: c for c in json.loads(r.stdout)}["backend"]
    assert backend["status"] == "ok" and backend["detail"].startswith(name) and why in backend["detail"]


# A helper that answers cuInit, then writes `reply` for the first request:
# the backend must take nothing but its own reply objects from it.
ODD_HELPER = """
import sys
sys.stdout.write('{"ready": true, "cuda_version": 13000}\\n'); sys.stdout.flush()
sys.stdin.readline()
sys.stdout.write(%r + "\\n"); sys.stdout.flush()
sys.stdin.readline()
"""


@pytest.mark.parametrize("reply", ["42", '"text"', "[1]", "null", "not json", '{"id": 99}'])
def test_an_unexpected_helper_line_fails_the_pending_call_at_once(  # type: ignore[no-untyped-def]
        node, tmp_path, monkeypatch, reply: str) -> None:
    from cudahook.core.backends import driver_api

    script = tmp_path / "odd_helper.py"
    script.write_text(ODD_HELPER % reply)
    monkeypatch.setattr(driver_api, "HELPER", str(script))
    backend = api(node, call_timeout_s=30.0)
    t = time.monotonic()
    with pytest.raises(ToolError) as err:
        backend.get_state(os.getpid())
    # Failed by the line itself, not by the call's 30 s deadline.
    assert time.monotonic() - t < 5
    assert "unexpected line" in str(err.value) and not err.value.timed_out, err.value
    backend.close()


# A stand-in hook: it makes its first driver call from a worker thread that
# then ends (as the engine's do), a second one from the main thread, then
# starts a call that the simulator keeps in flight, and prints the helper's
# PID and its own before it blocks.
BOUND_HOOK = """
import json, sys, threading
from cudahook.core.backends import make_backend
from cudahook.platform.config import Settings
from cudahook.platform.host import Host
backend = make_backend(Settings(**json.loads(sys.argv[1])), Host())
pid = int(sys.argv[2])
t = threading.Thread(target=backend.get_state, args=(pid,))
t.start(); t.join()
assert backend.get_state(pid) == "running"
helper = getattr(getattr(backend, "_helper", None), "proc", None)
print(json.dumps({"attaches": getattr(backend, "attaches", None),
                  "helper": helper.pid if helper else None}), flush=True)
backend.lock(pid, 0)
"""


@pytest.mark.parametrize("kind", ["driver-api", "cli"])
def test_a_call_dies_with_its_hook_not_with_the_thread_that_started_it(  # type: ignore[no-untyped-def]
        node, kind: str) -> None:
    """The parent-death signal fires on the death of the forking THREAD:
    the helper started by a worker thread that ended still serves the
    phase; the hook's death ends the helper, or a cuda-checkpoint run, at
    once."""
    import json
    import signal
    import sys

    pid = workers(node, 1)[0]
    settings = node.lab.settings(backend=kind).as_dict()
    node.lab.fault("lock", "delay", seconds=30, pid=pid, times=1)
    hook = subprocess.Popen([sys.executable, "-c", BOUND_HOOK, json.dumps(settings), str(pid)],
                            stdout=subprocess.PIPE, text=True)
    try:
        said = json.loads(hook.stdout.readline())  # type: ignore[union-attr]
        if kind == "driver-api":
            assert said["attaches"] == 1 and said["helper"], said  # one helper, still alive
        tool = (str(node.lab.cuda_checkpoint) if kind == "cli"
                else f"driver_helper.py {node.lab.libcuda}")
        deadline = time.monotonic() + 10
        while not _children_running(hook.pid, tool):
            assert time.monotonic() < deadline, "the lock call never started"
            time.sleep(0.02)
        os.kill(hook.pid, signal.SIGKILL)
        hook.wait(5)
        deadline = time.monotonic() + 2
        while _descendants_named(tool):
            assert time.monotonic() < deadline, f"calls outlived their hook: {_descendants_named(tool)}"
            time.sleep(0.02)
    finally:
        hook.kill()
        hook.wait()
    node.lab.clear_faults()
    assert CudaCheckpointCLI(Host(), node.lab.settings()).get_state(pid) == "running"


def _cmdlines() -> dict[int, str]:
    out = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/cmdline", "rb") as f:
                    out[int(entry)] = f.read().replace(b"\0", b" ").decode(errors="replace")
            except OSError:
                continue
    return out


def _children_running(parent: int, needle: str) -> bool:
    return any(needle in cmd and Host().ppid(p) == parent
               for p, cmd in _cmdlines().items() if Host().alive(p))


def _descendants_named(needle: str) -> list[int]:
    return [p for p, cmd in _cmdlines().items() if needle in cmd and Host().alive(p)]
