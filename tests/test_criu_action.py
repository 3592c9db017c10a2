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

from cudahook import criu_env, hookfiles, manifest
from cudahook.errors import UsageError
from cudahook.sim.lab import wait_for
from cudahook.store import mark

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


def install(tmp: Path, node: Node | None = None, python: str = sys.executable) -> Path:
    config = None
    if node is not None:
        config = tmp / "cudahook.yaml"
        config.write_text(yaml.safe_dump(dict(node.settings().__dict__)))
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
                        "import sys; from cudahook.criuhook import main; sys.exit(main())"],
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


def test_pre_dump_without_cuda_processes(node: Node, tmp_path: Path) -> None:
    script = install(tmp_path, node)
    image = tmp_path / "img"
    image.mkdir()
    init = node.spawn_tree(("n", {"nvml_only": True}))  # holds device nodes, is no CUDA process
    wait_for(lambda: node.lab.status("n").get("state") == "running", 15, "nvml workload")
    plain = subprocess.Popen(["bash", "-c", "sleep 60 & wait"], start_new_session=True)
    node.procs.append(plain)  # type: ignore[arg-type]
    for pid in (init.pid, plain.pid):
        r = action(script, "pre-dump", new_run=True, CRTOOLS_INIT_PID=str(pid),
                   CRTOOLS_IMAGE_DIR=str(image))
        assert r.returncode == 0, r.stderr
    assert os.listdir(image) == []
    assert [e["cuda_processes"] for e in events(node, "pre-dump")] == [0, 0]
    assert events(node, "checkpoint") == []


PARENT = """
import json, subprocess, sys
script, env, pids, tool = sys.argv[1], json.loads(sys.argv[2]), json.loads(sys.argv[3]), sys.argv[4]
rcs = [subprocess.run([script], env=env).returncode for _ in range(2)]
states = [subprocess.run([tool, "--get-state", "--pid", str(p)], capture_output=True,
                         text=True).stdout.strip() for p in pids]
print(json.dumps([rcs, states]))
"""


def test_pre_dump_runs_once_per_criu_run(node: Node, tmp_path: Path) -> None:
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
    data = manifest.read(image)
    assert data is not None
    assert sorted(p["pid"] for p in data["processes"]) == pids
    assert data["driver_version"].startswith("580.")
    assert data["gpus"] == node.lab.uuids  # no OCI record: every GPU of the node
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
