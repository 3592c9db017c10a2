"""Checkpoints of a container cudahook holds no record of (created before
cudahook, or by a runtime without the OCI hook) serialise on its init
process: two CRIU dumps of it never lock each other's processes, and a new
pre-dump waits for the guardian of an earlier one.

The installed action script runs as CRIU runs it, its parent playing CRIU:
the parent stays until the test ends it (a dump still under way, or one
that failed with the tasks alive: the guardian then acts)."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import yaml

from cudahook.admin import hookfiles
from cudahook.core import manifest
from cudahook.platform.store import Store

from .conftest import Node

SCRUBBED = {"PATH": "/usr/sbin:/usr/bin:/sbin:/bin"}
# A CRIU stand-in: runs the action script once, prints its exit status,
# then lives on until killed.
CRIU = ("import subprocess, sys, time; r = subprocess.run(sys.argv[1:]); "
        "print(r.returncode, flush=True); time.sleep(600)")


def script(node: Node, tmp_path: Path, **settings: Any) -> Path:
    config = tmp_path / "cudahook.yaml"
    config.write_text(yaml.safe_dump({**node.settings().__dict__, **settings}))
    return hookfiles.install(tmp_path / "hooks", python=sys.executable,
                             config=str(config))["cudahook-criu-action"]


def pre_dump(node: Node, action: Path, init_pid: int, image: Path) -> subprocess.Popen[str]:
    image.mkdir()
    env = {**SCRUBBED, "CRTOOLS_SCRIPT_ACTION": "pre-dump", "CRTOOLS_INIT_PID": str(init_pid),
           "CRTOOLS_IMAGE_DIR": str(image)}
    p = subprocess.Popen([sys.executable, "-c", CRIU, str(action)], env=env, text=True,
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                         start_new_session=True)  # the node kills its process group at the end
    node.procs.append(p)  # type: ignore[arg-type]
    return p


def exit_status(criu: subprocess.Popen[str], timeout: float = 120) -> int:
    """The action script's exit status, once it has ended (CRIU lives on)."""
    assert criu.stdout is not None
    deadline = time.monotonic() + timeout
    line = criu.stdout.readline()
    assert time.monotonic() < deadline and line.strip(), "the action script did not end"
    return int(line)


def end(criu: subprocess.Popen[str]) -> str:
    criu.kill()
    _, err = criu.communicate(timeout=30)
    return err


def events(node: Node, name: str) -> list[dict[str, Any]]:
    log = Path(node.settings().log_file)
    lines = [json.loads(x) for x in log.read_text().splitlines()] if log.exists() else []
    return [e for e in lines if e["event"] == name]


def wait_resumed(node: Node, tags: list[str], n: int = 1) -> None:
    """The guardians brought every workload back: running, going on, intact."""
    deadline = time.monotonic() + 60
    while len([e for e in events(node, "guardian") if "resumed" in e.get("outcome", "")]) < n:
        assert time.monotonic() < deadline, events(node, "guardian")
        time.sleep(0.05)
    for t in tags:
        before = node.lab.status(t)["counter"]
        st = node.lab.wait_counter(t, before + 11)
        assert st["intact"] and st["errors"] == [], st


def test_two_dumps_of_a_recordless_container_never_interleave(node: Node, tmp_path: Path) -> None:
    action = script(node, tmp_path, guardian_wait_s=2)
    init = node.spawn_tree(("a", {"mib": 8}), ("b", {"mib": 8}))
    tags = ["a", "b"]
    pids = sorted(node.lab.wait_counter(t)["pid"] for t in tags)
    assert Store(node.settings().state_dir).records() == []  # no OCI record
    node.lab.set(bandwidth_mib_s=8)  # each checkpoint takes about a second
    first = pre_dump(node, action, init.pid, tmp_path / "img1")
    second = pre_dump(node, action, init.pid, tmp_path / "img2")
    try:
        rcs = sorted([exit_status(first), exit_status(second)])
        # One checkpointed everything; the other waited for it (the busy
        # lock), then for its guardian, and refused touching nothing.
        assert rcs == [0, 5], (rcs, events(node, "checkpoint"), events(node, "pre-dump"))
        assert len(events(node, "checkpoint")) == 1
        assert "error" not in events(node, "checkpoint")[0]
        engine = node.engine()
        assert {engine.read_state(p) for p in pids} == {"checkpointed"}
        done = [d for d in (tmp_path / "img1", tmp_path / "img2") if manifest.read(d)]
        assert len(done) == 1
        m = manifest.read(done[0])
        assert m is not None and sorted(p.pid for p in m.processes) == pids
    finally:
        errs = end(first) + end(second)  # as if both dumps failed with the tasks alive
    assert "guardian of an earlier checkpoint" in errs, errs
    wait_resumed(node, tags)


def test_pre_dump_waits_for_the_guardian_of_a_recordless_container(
        node: Node, tmp_path: Path) -> None:
    action = script(node, tmp_path, guardian_wait_s=120)
    init = node.spawn_tree(("a", {"mib": 1}), ("b", {"mib": 1}))
    tags = ["a", "b"]
    pids = sorted(node.lab.wait_counter(t)["pid"] for t in tags)
    first = pre_dump(node, action, init.pid, tmp_path / "img1")
    assert exit_status(first) == 0  # checkpointed; CRIU still "dumps", its guardian waits
    engine = node.engine()
    assert {engine.read_state(p) for p in pids} == {"checkpointed"}
    second = pre_dump(node, action, init.pid, tmp_path / "img2")
    try:
        time.sleep(1.5)
        # Waiting for the earlier guardian, touching nothing.
        assert second.poll() is None and not list((tmp_path / "img2").iterdir())
        assert {engine.read_state(p) for p in pids} == {"checkpointed"}
    finally:
        end(first)  # that dump failed with the tasks alive: its guardian brings them back
    assert exit_status(second) == 0, end(second)
    m = manifest.read(tmp_path / "img2")
    assert m is not None and sorted(p.pid for p in m.processes) == pids
    assert len([e for e in events(node, "checkpoint") if "error" not in e]) == 2
    end(second)
    wait_resumed(node, tags, n=2)


def test_admin_checkpoint_waits_for_the_guardian_of_a_recordless_container(node: Node) -> None:
    """`cudahook checkpoint --init-pid` of a container without a record waits
    for a live guardian of it (by its init), then refuses, touching nothing."""
    from cudahook.flow import guardian
    from cudahook.platform.host import Host
    from cudahook.platform.store import init_key, write_json_atomic

    from .test_cli import cli, one_line_error, write_config

    init = node.spawn_tree(("a", {"mib": 1}))
    a = node.lab.wait_counter("a")["pid"]
    cfg = write_config(node, guardian_wait_s=1)
    state_dir = node.settings().state_dir
    earlier = subprocess.Popen(["sleep", "600"], start_new_session=True)
    node.procs.append(earlier)
    host = Host()
    key = init_key(init.pid, host.start_time(init.pid))
    write_json_atomic(guardian._marker(state_dir, key),
                      {"pid": earlier.pid, "start": host.start_time(earlier.pid), "criu_pid": 1})
    engine = node.engine()
    try:
        one_line_error(cli("checkpoint", "--init-pid", str(init.pid), config=cfg), 5,
                       f"checkpoint: the guardian of an earlier checkpoint of container {key}")
        assert engine.read_state(a) == "running"
        earlier.kill()
        earlier.wait()
        r = cli("checkpoint", "--init-pid", str(init.pid), config=cfg)
        assert r.returncode == 0, r.stderr
        assert engine.read_state(a) == "checkpointed"
    finally:
        if engine.read_state(a) == "checkpointed":  # the workload back on its GPU, whatever failed
            engine.restore([a])
