"""The CRIU action script as CRIU runs it: the installed script, no arguments,
CRTOOLS_* in a scrubbed environment, against a simulated GPU node."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
import yaml

from cudahook.admin import hookfiles
from cudahook.core import manifest
from cudahook.hooks import criu_env
from cudahook.platform.errors import UsageError
from cudahook.platform.marks import mark

from .conftest import Node

SCRUBBED = {"PATH": "/usr/sbin:/usr/bin:/sbin:/bin"}
UNHANDLED = ["network-lock", "post-dump", "network-unlock", "pre-restore", "setup-namespaces",
             "post-setup-namespaces", "pre-resume", "orphan-pts-master", "frobnicate"]


# -- criu_env.from_env ----------------------------------------------------------------------


def test_from_env_parses_values() -> None:
    call = criu_env.from_env({"CRTOOLS_SCRIPT_ACTION": "pre-dump",
                              "CRTOOLS_IMAGE_DIR": "/proc/77/fd/5",
                              "CRTOOLS_INIT_PID": "4242"}, criu_pid=77)
    assert call == criu_env.CriuCall("pre-dump", Path("/proc/77/fd/5"), 4242, 77)


def test_from_env_optional_values_and_parent_pid() -> None:
    call = criu_env.from_env({"CRTOOLS_SCRIPT_ACTION": "pre-restore", "CRTOOLS_IMAGE_DIR": ""})
    assert (call.image_dir, call.init_pid) == (None, None)
    assert call.criu_pid == os.getppid()  # the CRIU process that runs the script


@pytest.mark.parametrize("env", [{}, {"CRTOOLS_SCRIPT_ACTION": ""}, {"CRTOOLS_INIT_PID": "5"}])
def test_from_env_without_action(env: dict[str, str]) -> None:
    with pytest.raises(UsageError, match="CRTOOLS_SCRIPT_ACTION is not set"):
        criu_env.from_env(env)


@pytest.mark.parametrize("pid", ["abc", "-5", "5 ", "0x10", "1.0", "²", "٣"])
def test_from_env_non_numeric_init_pid(pid: str) -> None:
    with pytest.raises(UsageError, match="CRTOOLS_INIT_PID is not a PID"):
        criu_env.from_env({"CRTOOLS_SCRIPT_ACTION": "pre-dump", "CRTOOLS_INIT_PID": pid})


# -- the installed script -----------------------------------------------------------------


def install(tmp: Path, node: Node | None = None, python: str = sys.executable,
            **settings: object) -> Path:
    """The action script, installed with the node's settings (and `settings`)."""
    config = None
    if node is not None:
        config = tmp / "cudahook.yaml"
        config.write_text(yaml.safe_dump(dict(node.settings(**settings).__dict__)))
    paths = hookfiles.install(tmp / "hooks", python=python,
                              config=str(config) if config else None)
    return paths["cudahook-criu-action"]


def action(script: Path, name: str | None, new_run: bool = False,
           **env: str) -> subprocess.CompletedProcess[str]:
    """Run the script as CRIU does. Its parent process identifies the CRIU run,
    so calls from this test process are one run; new_run puts a parent between."""
    full = dict(SCRUBBED)
    if name is not None:
        full["CRTOOLS_SCRIPT_ACTION"] = name
    full.update(env)
    argv = [str(script)]
    if new_run:
        argv = [sys.executable, "-c", "import subprocess, sys; "
                "sys.exit(subprocess.run(sys.argv[1:]).returncode)", *argv]
    return subprocess.run(argv, env=full, capture_output=True, text=True, timeout=60)


@pytest.mark.parametrize("name", [*UNHANDLED, "", None])
def test_unhandled_actions_exit_0_without_python(tmp_path: Path, name: str | None) -> None:
    # An interpreter that does not exist: only the shell's fast path can succeed.
    script = install(tmp_path, python="/nonexistent/python")
    r = action(script, name, CRTOOLS_INIT_PID="1")
    assert r.returncode == 0 and r.stdout == r.stderr == ""


def test_handled_actions_start_python_only_when_cuda_state_may_be_involved(
        node: Node, tmp_path: Path) -> None:
    """The proof above can fail: where CUDA state may be involved, the script
    starts the (here missing) interpreter and exits 127."""
    script = install(tmp_path, node, python="/nonexistent/python")
    image = tmp_path / "img"
    image.mkdir()
    assert action(script, "pre-dump").returncode == 127  # no init PID: Python reports it
    assert action(script, "post-restore", CRTOOLS_IMAGE_DIR=str(image)).returncode == 0
    (image / manifest.NAME).write_text("{}")
    assert action(script, "post-restore", CRTOOLS_IMAGE_DIR=str(image)).returncode == 127
    assert action(script, "post-resume").returncode == 0
    mark("restore", str(os.getpid()))  # what post-restore leaves for this run
    try:
        assert action(script, "post-resume").returncode == 127
    finally:
        mark("restore", str(os.getpid()), on=False)


def test_python_entry_point_without_action_is_a_usage_error() -> None:
    """Past the shell (not reachable through the script), main() refuses a bare run."""
    r = subprocess.run([sys.executable, "-I", "-c",
                        "import sys; from cudahook.hooks.criu_action import main; sys.exit(main())"],
                       env=SCRUBBED, capture_output=True, text=True, timeout=60)
    assert r.returncode == 2 and r.stderr.count("\n") == 1
    assert "CRTOOLS_SCRIPT_ACTION is not set" in r.stderr


def test_bad_init_pid_is_one_line(node: Node, tmp_path: Path) -> None:
    r = action(install(tmp_path, node), "pre-dump", CRTOOLS_INIT_PID="12abc",
               CRTOOLS_IMAGE_DIR=str(tmp_path))
    assert r.returncode == 2 and r.stderr == "cudahook: CRTOOLS_INIT_PID is not a PID: '12abc'\n"


def events(node: Node, name: str | None = None) -> list[dict[str, Any]]:
    log = Path(node.settings().log_file)
    if not log.exists():
        return []
    lines = [json.loads(x) for x in log.read_text().splitlines()]
    return [e for e in lines if name is None or e["event"] == name]


def _pre_dump_without_cuda(node: Node, script: Path, image: Path
                           ) -> subprocess.CompletedProcess[str]:
    """pre-dump of a container whose processes hold no GPU."""
    image.mkdir(exist_ok=True)
    plain = subprocess.Popen(["bash", "-c", "sleep 60 & wait"], start_new_session=True)
    node.procs.append(plain)  # type: ignore[arg-type]
    return action(script, "pre-dump", new_run=True, CRTOOLS_INIT_PID=str(plain.pid),
                  CRTOOLS_IMAGE_DIR=str(image))


def test_pre_dump_without_cuda_processes(node: Node, tmp_path: Path) -> None:
    image = tmp_path / "img"
    r = _pre_dump_without_cuda(node, install(tmp_path, node), image)
    assert r.returncode == 0, r.stderr
    assert os.listdir(image) == []
    assert [e["cuda_processes"] for e in events(node, "pre-dump")] == [0]
    assert events(node, "checkpoint") == []


def test_pre_dump_asks_nvidia_smi_only_when_a_process_holds_a_gpu(
        node: Node, tmp_path: Path) -> None:
    """A container without CUDA is the common case: its pre-dump makes no
    nvidia-smi call. One process holding NVIDIA device files is enough for
    the GPU queries to start (beside discovery)."""
    calls = tmp_path / "smi-calls"
    smi = tmp_path / "nvidia-smi"
    smi.write_text(f'#!/bin/sh\necho "$*" >> {calls}\nexec {node.lab.nvidia_smi} "$@"\n')
    smi.chmod(0o755)
    script = install(tmp_path, node, nvidia_smi=str(smi))
    image = tmp_path / "img"
    r = _pre_dump_without_cuda(node, script, image)
    assert r.returncode == 0, r.stderr
    assert not calls.exists()
    monitor = node.spawn_tree(("n", {"nvml_only": True}))
    node.lab.wait_counter("n")
    r = action(script, "pre-dump", new_run=True, CRTOOLS_INIT_PID=str(monitor.pid),
               CRTOOLS_IMAGE_DIR=str(image))
    assert r.returncode == 1 and "nothing was locked" in r.stderr, r.stderr
    assert "--query-compute-apps" in calls.read_text()


def test_pre_dump_refuses_nvidia_files_criu_cannot_dump(node: Node, tmp_path: Path) -> None:
    """An NVML monitor (device files, no CUDA) is refused before anything is
    locked; a CUDA process that also holds NVML handles keeps them past the CUDA
    checkpoint, so it is put back on its GPU and named. CRIU would fail on both."""
    script = install(tmp_path, node)
    image = tmp_path / "img"
    image.mkdir()
    init = node.spawn_tree(("n", {"nvml_only": True}), ("c", {"mib": 1}))
    mon = node.lab.wait_counter("n")["pid"]
    cuda = node.lab.wait_counter("c")["pid"]
    r = action(script, "pre-dump", new_run=True, CRTOOLS_INIT_PID=str(init.pid),
               CRTOOLS_IMAGE_DIR=str(image))
    assert r.returncode == 1 and r.stderr.count("\n") == 1, r.stderr
    dev = node.lab.dev
    assert (f"pid {mon} (not a CUDA process, e.g. NVML) holds {dev}/nvidia0, {dev}/nvidiactl"
            in r.stderr and "nothing was locked" in r.stderr)
    assert os.listdir(image) == [] and events(node, "checkpoint") == []
    c = node.lab.status("c")["counter"]
    node.lab.wait_counter("c", c + 3)  # never locked

    both = node.spawn_tree(("b", {"mib": 1, "nvml": True}))
    st = node.lab.wait_counter("b")
    assert st["nvml_fds"] == 2
    r = action(script, "pre-dump", new_run=True, CRTOOLS_INIT_PID=str(both.pid),
               CRTOOLS_IMAGE_DIR=str(image))
    assert r.returncode == 1 and r.stderr.count("\n") == 1, r.stderr
    assert f"pid {st['pid']} (CUDA process) holds {dev}/nvidia0, {dev}/nvidiactl" in r.stderr
    assert "every process was restored and runs" in r.stderr
    assert os.listdir(image) == []  # no manifest, no guardian
    b = node.lab.status("b")["counter"]
    st = node.lab.wait_counter("b", b + 11)
    assert st["intact"] and not st["errors"]
    assert cuda != st["pid"]


PARENT = """
import json, subprocess, sys
script, env, pids, tool = sys.argv[1], json.loads(sys.argv[2]), json.loads(sys.argv[3]), sys.argv[4]
rcs = [subprocess.run([script], env=env).returncode for _ in range(2)]
states = [subprocess.run([tool, "--get-state", "--pid", str(p)], capture_output=True,
                         text=True).stdout.strip() for p in pids]
print(json.dumps([rcs, states]))
"""


@pytest.mark.parametrize("backend_kind", ["cli", "driver-api"])
def test_pre_dump_runs_once_per_criu_run(node: Node, tmp_path: Path, backend_kind: str) -> None:
    """CRIU runs each action twice; the run is keyed by the parent (CRIU) PID."""
    script = install(tmp_path, node)
    image = tmp_path / "img"
    image.mkdir()
    init = node.spawn_tree(("a", {"mib": 2}), ("b", {"mib": 1, "procs": 2}))
    tags = ["a", "b.0", "b.1"]
    pids = sorted(node.lab.wait_counter(t)["pid"] for t in tags)
    env = {**SCRUBBED, "CRTOOLS_SCRIPT_ACTION": "pre-dump", "CRTOOLS_INIT_PID": str(init.pid),
           "CRTOOLS_IMAGE_DIR": str(image)}
    # One parent process plays CRIU for both calls, then exits as CRIU would.
    r = subprocess.run([sys.executable, "-c", PARENT, str(script), json.dumps(env),
                        json.dumps(pids), str(node.lab.cuda_checkpoint)],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    rcs, states = json.loads(r.stdout)
    assert rcs == [0, 0]
    assert states == ["checkpointed"] * 3  # as the dump leaves them, seen before CRIU exits
    assert len(events(node, "checkpoint")) == 1
    m = manifest.read(image)
    assert m is not None
    assert sorted(p.pid for p in m.processes) == pids
    assert m.driver_version is not None and m.driver_version.startswith("580.")
    assert list(m.gpus) == node.lab.uuids  # no OCI record: every GPU of the node
    assert m.gpu_models[node.lab.uuids[0]] == manifest.GpuModel(
        "NVIDIA H100 80GB HBM3 (simulated)", 81559)
    runs = list((Path(node.settings().state_dir) / "runs").glob("*.json"))
    assert len(runs) == 1 and json.loads(runs[0].read_text())["done"] == {"pre-dump": 0}

    # CRIU (the parent) is gone and the tasks live on, as after a failed dump:
    # the guardian brings them back onto the GPU.
    deadline = time.monotonic() + 30
    while not events(node, "guardian"):
        assert time.monotonic() < deadline, events(node)
        time.sleep(0.05)
    g = events(node, "guardian")[0]
    assert "error" not in g and sorted(g["pids"]) == pids
    frozen = {t: node.lab.status(t)["counter"] for t in tags}
    for t in tags:
        st = node.lab.wait_counter(t, frozen[t] + 5)
        assert st["intact"] and not st["errors"], st


def test_post_restore_refuses_another_driver_branch(node: Node, tmp_path: Path) -> None:
    script = install(tmp_path, node)
    image = tmp_path / "img"
    image.mkdir()
    manifest.write(image, {"container_id": "c", "driver_version": "550.54.15",
                           "gpus": node.lab.uuids[:1], "processes": [{"nspid": 7, "pid": 7}]})
    init = subprocess.Popen(["sleep", "60"], start_new_session=True)
    node.procs.append(init)  # type: ignore[arg-type]
    r = action(script, "post-restore", CRTOOLS_INIT_PID=str(init.pid),
               CRTOOLS_IMAGE_DIR=str(image))
    assert r.returncode != 0
    assert r.stderr.count("\n") == 1 and r.stderr.startswith("cudahook: "), r.stderr
    assert "driver 550.54.15" in r.stderr and "580.65.06" in r.stderr and "Traceback" not in r.stderr
    assert init.poll() is None  # refused, nothing killed
    # The same manifest from this branch passes the check.
    manifest.write(image, {"container_id": "c", "driver_version": "580.1.2",
                           "gpus": node.lab.uuids[:1], "processes": [{"nspid": 7, "pid": 7}]})
    parent = action(script, "post-restore", new_run=True, CRTOOLS_INIT_PID=str(init.pid),
                    CRTOOLS_IMAGE_DIR=str(image))
    assert parent.returncode == 0, parent.stderr
    # Its "CRIU" exited with no post-resume: the restore watcher kills the container.
    assert init.wait(10) == -9
    init = subprocess.Popen(["sleep", "60"], start_new_session=True)
    node.procs.append(init)  # type: ignore[arg-type]
    # A manifest without a driver version, or a node whose driver cannot be
    # told, is refused rather than waved through.
    manifest.write(image, {"container_id": "c", "driver_version": "",
                           "gpus": node.lab.uuids[:1], "processes": [{"nspid": 7, "pid": 7}]})
    r = action(script, "post-restore", new_run=True, CRTOOLS_INIT_PID=str(init.pid),
               CRTOOLS_IMAGE_DIR=str(image))
    assert r.returncode == 5 and "does not record the driver version" in r.stderr, r.stderr
    manifest.write(image, {"container_id": "c", "driver_version": "580.1.2",
                           "gpus": node.lab.uuids[:1], "processes": [{"nspid": 7, "pid": 7}]})
    node.lab.driver_version_file.unlink()
    node.lab.stop()  # nvidia-smi cannot answer either
    r = action(script, "post-restore", new_run=True, CRTOOLS_INIT_PID=str(init.pid),
               CRTOOLS_IMAGE_DIR=str(image))
    assert r.returncode == 5 and "driver version unknown" in r.stderr, r.stderr
    assert init.poll() is None


def test_post_restore_without_manifest_or_with_a_bad_one(node: Node, tmp_path: Path) -> None:
    script = install(tmp_path, node)
    image = tmp_path / "img"
    image.mkdir()
    init = subprocess.Popen(["sleep", "60"], start_new_session=True)
    node.procs.append(init)  # type: ignore[arg-type]
    r = action(script, "post-restore", CRTOOLS_INIT_PID=str(init.pid), CRTOOLS_IMAGE_DIR=str(image))
    assert r.returncode == 0, r.stderr
    (image / manifest.NAME).write_text('{"version": 1, "processes": "x"}')
    r = action(script, "post-restore", new_run=True, CRTOOLS_INIT_PID=str(init.pid),
               CRTOOLS_IMAGE_DIR=str(image))
    assert r.returncode != 0
    assert "malformed process list" in r.stderr and r.stderr.count("\n") == 1


def test_criu_cuda_plugin_refuses_dump_and_restore(node: Node, tmp_path: Path) -> None:
    """CRIU's own CUDA plugin would lock, checkpoint and restore the same
    processes: with it installed, cudahook refuses before touching any."""
    script = install(tmp_path, node)
    image = tmp_path / "img"
    image.mkdir()
    init = node.spawn_tree(("c", {"mib": 1}))
    node.lab.wait_counter("c")
    root = tmp_path / "root"
    plugin = root / "usr/lib/criu/cuda_plugin.so"
    plugin.parent.mkdir(parents=True)
    plugin.write_bytes(b"\x7fELF")
    r = action(script, "pre-dump", new_run=True, CRTOOLS_INIT_PID=str(init.pid),
               CRTOOLS_IMAGE_DIR=str(image), CUDAHOOK_ROOT=str(root))
    assert r.returncode == 5 and r.stderr.count("\n") == 1, r.stderr
    assert f"CRIU's own CUDA plugin is installed ({plugin})" in r.stderr
    assert "nothing was locked" in r.stderr and os.listdir(image) == []
    node.lab.wait_counter("c", node.lab.status("c")["counter"] + 3)

    libs = tmp_path / "libs"  # CRIU run with CRIU_LIBS_DIR: the same
    libs.mkdir()
    (libs / "cuda_plugin.so").write_bytes(b"\x7fELF")
    manifest.write(image, {"container_id": "c", "driver_version": "580.65.06",
                           "gpus": node.lab.uuids[:1], "processes": [{"nspid": 7, "pid": 7}]})
    r = action(script, "post-restore", new_run=True, CRTOOLS_INIT_PID=str(init.pid),
               CRTOOLS_IMAGE_DIR=str(image), CRIU_LIBS_DIR=str(libs))
    assert r.returncode == 5 and "would restore the same processes" in r.stderr, r.stderr
    # Without the plugin both go ahead.
    r = action(script, "post-restore", new_run=True, CRTOOLS_INIT_PID=str(init.pid),
               CRTOOLS_IMAGE_DIR=str(image), CUDAHOOK_ROOT=str(tmp_path / "empty"))
    assert r.returncode == 0, r.stderr


def test_post_restore_of_a_mig_instance_in_place(make_node, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    """A container on a MIG instance comes back on it: nvidia-smi's GPU query
    does not list MIG instances, `-L` does."""
    mig = "MIG-5a2f2d1e-8c3b-5e0a-9d7c-1b2c3d4e5f60"
    node = make_node(gpus=2, gpu_specs=[{"uuid": mig}])
    script = install(tmp_path, node)
    image = tmp_path / "img"
    image.mkdir()
    init = subprocess.Popen(["sleep", "60"], start_new_session=True)
    node.procs.append(init)  # type: ignore[arg-type]
    manifest.write(image, {"container_id": "c", "driver_version": "580.65.06",
                           "gpus": [mig], "processes": [{"nspid": 7, "pid": 7}]})
    r = action(script, "post-restore", new_run=True, CRTOOLS_INIT_PID=str(init.pid),
               CRTOOLS_IMAGE_DIR=str(image))
    assert r.returncode == 0, r.stderr
    gone = "MIG-00000000-0000-0000-0000-000000000000"
    manifest.write(image, {"container_id": "c", "driver_version": "580.65.06",
                           "gpus": [gone], "processes": [{"nspid": 7, "pid": 7}]})
    r = action(script, "post-restore", new_run=True, CRTOOLS_INIT_PID=str(init.pid),
               CRTOOLS_IMAGE_DIR=str(image))
    assert r.returncode == 6 and f"not present on this node: {gone}" in r.stderr, r.stderr


@pytest.mark.parametrize(("driver", "left"), [(580, "checkpointed"), (580, "locked"),
                                              (550, "checkpointed"), (590, "checkpointed"),
                                              (590, "locked")])
def test_pre_dump_refuses_a_process_it_did_not_lock_or_checkpoint(
        make_node, tmp_path: Path, driver: int, left: str) -> None:  # type: ignore[no-untyped-def]
    """A process already checkpointed holds no device file, but keeps its
    CUDA restore thread: pre-dump sees it, and refuses (its reason code,
    exit 1) before anything is locked - dumped, it would be restored without
    its GPU state."""
    node = make_node(driver=driver)
    script = install(tmp_path, node)
    image = tmp_path / "img"
    image.mkdir()
    init = node.spawn_tree(("a", {"mib": 1}), ("b", {"mib": 1}))
    a = node.lab.wait_counter("a")["pid"]
    b = node.lab.wait_counter("b")["pid"]
    engine = node.engine()
    if left == "locked":
        engine.backend.lock(b, 1000)
    else:
        engine.checkpoint([b])
    r = action(script, "pre-dump", new_run=True, CRTOOLS_INIT_PID=str(init.pid),
               CRTOOLS_IMAGE_DIR=str(image))
    assert r.returncode == 1 and r.stderr.count("\n") == 1, r.stderr
    assert f"PROCESS_{left.upper()}: pid {b} is {left}" in r.stderr, r.stderr
    assert "nothing was locked" in r.stderr
    assert os.listdir(image) == [] and events(node, "checkpoint") == []
    node.lab.wait_counter("a", node.lab.status("a")["counter"] + 3)  # never locked
    assert engine.read_state(b) == left  # nor moved
    # Brought back first, the checkpoint takes both.
    engine.restore([b])
    r = action(script, "pre-dump", new_run=True, CRTOOLS_INIT_PID=str(init.pid),
               CRTOOLS_IMAGE_DIR=str(image))
    assert r.returncode == 0, r.stderr
    m = manifest.read(image)
    assert m is not None and sorted(p.pid for p in m.processes) == sorted([a, b])


def test_pre_dump_waits_for_the_guardian_of_an_earlier_checkpoint(
        node: Node, tmp_path: Path) -> None:
    """A guardian still alive for the same container may be about to bring
    processes back: a new checkpoint waits for it (without the busy lock,
    which the guardian needs), and refuses after guardian_wait_s."""
    from cudahook.flow import guardian
    from cudahook.platform.host import Host
    from cudahook.platform.store import Store, write_json_atomic

    config = tmp_path / "cudahook.yaml"
    settings = dict(node.settings().__dict__)
    config.write_text(yaml.safe_dump({**settings, "guardian_wait_s": 1}))
    script = hookfiles.install(tmp_path / "hooks", python=sys.executable,
                               config=str(config))["cudahook-criu-action"]
    image = tmp_path / "img"
    image.mkdir()
    init = node.spawn_tree(("a", {"mib": 1}))
    a = node.lab.wait_counter("a")["pid"]
    Store(settings["state_dir"]).update("c1", pid=init.pid, pid_start=None)
    earlier = subprocess.Popen(["sleep", "600"])  # stands for the earlier run's guardian
    node.procs.append(earlier)
    marker = guardian._marker(settings["state_dir"], "c1")
    write_json_atomic(marker, {"pid": earlier.pid, "start": Host().start_time(earlier.pid),
                               "criu_pid": 1})
    r = action(script, "pre-dump", new_run=True, CRTOOLS_INIT_PID=str(init.pid),
               CRTOOLS_IMAGE_DIR=str(image))
    assert r.returncode == 5 and r.stderr.count("\n") == 1, r.stderr
    assert f"guardian of an earlier checkpoint of container c1 (pid {earlier.pid})" in r.stderr
    assert "nothing was locked" in r.stderr and os.listdir(image) == []
    node.lab.wait_counter("a", node.lab.status("a")["counter"] + 3)

    # Within the wait: the checkpoint goes ahead once that guardian is gone.
    config.write_text(yaml.safe_dump({**settings, "guardian_wait_s": 120}))
    env = {**SCRUBBED, "CRTOOLS_SCRIPT_ACTION": "pre-dump", "CRTOOLS_INIT_PID": str(init.pid),
           "CRTOOLS_IMAGE_DIR": str(image)}
    waiting = subprocess.Popen([sys.executable, "-c", "import subprocess, sys; "
                                "sys.exit(subprocess.run(sys.argv[1:]).returncode)", str(script)],
                               env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        time.sleep(1.5)
        assert waiting.poll() is None  # still waiting, nothing touched
        assert node.engine().read_state(a) == "running" and os.listdir(image) == []
    finally:
        earlier.kill()
        earlier.wait()
    _, err = waiting.communicate(timeout=120)
    assert waiting.returncode == 0, err
    assert manifest.read(image) is not None
    # It armed its own guardian, which brings the workload back once "CRIU"
    # is gone, then removes its marker.
    deadline = time.monotonic() + 30
    while not events(node, "guardian") or marker.exists():
        assert time.monotonic() < deadline, (events(node), marker.exists())
        time.sleep(0.05)
    assert "resumed" in events(node, "guardian")[-1]["outcome"]
