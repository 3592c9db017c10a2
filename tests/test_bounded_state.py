"""The state directory lives in /run (RAM): whatever the number of containers
and checkpoints, it holds a bounded number of entries.

Each cycle goes through the hooks' Python entry points as runc and CRIU call
them: the OCI hook at create, the CRIU action script's pre-dump (one CRIU
process) and post-restore/post-resume (another), the results pre-dump keeps
for a container with CUDA processes, and the OCI hook at poststop. The
containers' inits are real processes without CUDA processes, as are the
CRIU processes (each exits after its run); some containers die without a
poststop.
"""

from __future__ import annotations

import io
import json
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from cudahook.flow import results
from cudahook.flow.context import Context
from cudahook.hooks import criu_action as criuhook
from cudahook.hooks import oci_hook as ocihook
from cudahook.hooks.criu_env import CriuCall
from cudahook.platform import config, paths, store

CONTAINERS = 50
CYCLES = 200
BOUND = 16  # entries under the state and marks directories, at any time


def sleeper() -> subprocess.Popen[bytes]:
    return subprocess.Popen(["sleep", "600"], stdin=subprocess.DEVNULL, start_new_session=True)


def stop(p: subprocess.Popen[bytes]) -> None:
    p.kill()
    p.wait()


@pytest.fixture
def node(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Path]:
    root = tmp_path / "node"
    monkeypatch.setenv(paths.ROOT_ENV, str(root))
    monkeypatch.delenv(config.ENV_PATH, raising=False)
    cfg = paths.at(paths.CONFIG)
    cfg.parent.mkdir(parents=True)
    # The CRIU runs of a test all finish within seconds: no grace period.
    monkeypatch.setattr(store, "RUN_GRACE_S", 0.0)
    cfg.write_text(f"state_retention_s: 0\nlog_file: {tmp_path / 'cudahook.log'}\n"
                   "cuda_checkpoint: /nonexistent/cuda-checkpoint\n")
    yield root


def oci(stage: str, state: dict[str, object], monkeypatch: pytest.MonkeyPatch) -> int:
    monkeypatch.setattr(sys, "stdin", io.TextIOWrapper(io.BytesIO(json.dumps(state).encode())))
    return ocihook.main([stage])


def criu(action: str, criu_pid: int, init_pid: int, image: Path) -> int:
    return criuhook.run(Context(config.load()), CriuCall(action, image, init_pid, criu_pid))


def entries(root: Path) -> list[str]:
    out = []
    for d in (paths.at(paths.STATE_DIR), paths.at(paths.MARKS_DIR)):
        out += [str(p.relative_to(root)) for p in d.rglob("*")] if d.exists() else []
    return out


def test_state_stays_bounded_over_many_checkpoints_of_many_containers(
        node: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    bundle = tmp_path / "bundle"
    bundle.mkdir()
    (bundle / "config.json").write_text(json.dumps({
        "ociVersion": "1.0.2", "root": {"path": "rootfs"},
        "process": {"args": ["sleep"], "env": ["NVIDIA_VISIBLE_DEVICES=all"]}}))
    image = tmp_path / "image"
    image.mkdir()
    most = 0
    start = time.monotonic()
    for cycle in range(CYCLES):
        cid = f"gpu-{cycle % CONTAINERS:02d}"
        init = sleeper()
        state = {"ociVersion": "1.0.2", "id": cid, "status": "created", "pid": init.pid,
                 "bundle": str(bundle)}
        try:
            assert oci("createRuntime", state, monkeypatch) == 0
            dump = sleeper()  # the CRIU process of the checkpoint
            assert criu("pre-dump", dump.pid, init.pid, image) == 0
            # What pre-dump keeps for a container with CUDA processes.
            results.remember(Context(config.load()), cid, "checkpoint", ok=True,
                               pids=[init.pid])
            stop(dump)
            restore = sleeper()  # the CRIU process of the restore
            for action in ("post-restore", "post-resume"):
                assert criu(action, restore.pid, init.pid, image) == 0
            stop(restore)
            most = max(most, len(entries(node)))
        finally:
            stop(init)
        if cycle % 7:  # now and then a container dies without its poststop
            assert oci("poststop", {**state, "status": "stopped"}, monkeypatch) == 0
        most = max(most, len(entries(node)))
    elapsed = time.monotonic() - start
    left = entries(node)
    assert most <= BOUND, left
    assert len(left) <= BOUND, left
    # The cycles did leave their marks: records, runs and results were written.
    log = (tmp_path / "cudahook.log").read_text()
    assert log.count('"oci-createRuntime"') == CYCLES
    assert elapsed < 60, elapsed


def test_without_pruning_the_same_cycles_would_grow(node: Path, tmp_path: Path,
                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    """The bound above is no accident of the test: with the retention and the
    grace period long, the same cycles leave an entry per run and per container."""
    monkeypatch.setattr(store, "RUN_GRACE_S", 3600.0)
    cfg = paths.at(paths.CONFIG)
    cfg.write_text(cfg.read_text().replace("state_retention_s: 0", "state_retention_s: 3600"))
    bundle = tmp_path / "bundle"
    bundle.mkdir()
    (bundle / "config.json").write_text(json.dumps({
        "process": {"env": ["NVIDIA_VISIBLE_DEVICES=all"]}}))
    for cycle in range(20):
        init = sleeper()
        state = {"ociVersion": "1.0.2", "id": f"c{cycle}", "status": "created",
                 "pid": init.pid, "bundle": str(bundle)}
        try:
            assert oci("createRuntime", state, monkeypatch) == 0
            dump = sleeper()
            assert criu("pre-dump", dump.pid, init.pid, tmp_path) == 0
            results.remember(Context(config.load()), f"c{cycle}", "checkpoint", ok=True)
            stop(dump)
        finally:
            stop(init)
    runs = list(paths.at(paths.STATE_DIR).joinpath("runs").iterdir())
    history = list(paths.at(paths.STATE_DIR).joinpath("history").iterdir())
    assert len(runs) == 20 and len(history) == 20
