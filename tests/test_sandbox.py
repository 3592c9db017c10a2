"""The suite's guard of the node (tests/sandbox.py) sees what it must see."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from . import conftest
from .sandbox import Sandbox, diff, snapshot


def test_the_snapshot_sees_every_kind_of_change(tmp_path: Path) -> None:
    conf = tmp_path / "etc/criu/runc.conf"
    conf.parent.mkdir(parents=True)
    conf.write_text("tcp-established\n")
    (tmp_path / "usr/local/bin").mkdir(parents=True)
    (tmp_path / "usr/local/bin/docker").write_text("not ours")
    (tmp_path / "var/lib/docker").mkdir(parents=True)
    before = snapshot(str(tmp_path))
    assert diff(before, snapshot(str(tmp_path))) == []

    conf.write_text("tcp-established\naction-script /opt/cudahook/libexec/x\n")
    os.symlink("/opt/cudahook/venv/bin/cudahook", tmp_path / "usr/local/bin/cudahook")
    (tmp_path / "usr/local/bin/docker").write_text("someone else's business")
    (tmp_path / "run/cudahook-marks/gpu").mkdir(parents=True)
    (tmp_path / "var/lib/docker/volumes").mkdir()
    changes = diff(before, snapshot(str(tmp_path)))
    base = str(tmp_path)
    assert changes == [
        f"changed {base}/etc/criu/runc.conf",
        f"created {base}/usr/local/bin/cudahook",
        f"changed {base}/var/lib/docker/*",
    ]
    os.chmod(conf, 0o600)
    assert f"changed {base}/etc/criu/runc.conf" in diff(before, snapshot(base))


@pytest.mark.skipif(not conftest._SANDBOX.private, reason="needs the private namespace (root)")
def test_writes_in_the_sandbox_never_reach_the_node() -> None:
    conf = Path("/etc/criu/runc.conf")
    assert not conf.exists()  # the suite starts from a node without cudahook's files
    conf.parent.mkdir(exist_ok=True)
    conf.write_text("action-script /nowhere\n")
    try:
        node = conftest._SANDBOX._node_snapshot()  # seen from the node's own namespace
        assert conftest._SANDBOX.before is not None
        assert node.get(str(conf)) == conftest._SANDBOX.before.get(str(conf))
        assert os.environ["CUDAHOOK_ROOT"] == str(conftest._SANDBOX.root)
    finally:
        conf.unlink()


def _node(root: Path) -> Path:
    """A node with cudahook installed and registered, running a GPU container."""
    for rel, text in (("etc/criu/runc.conf", "action-script /opt/cudahook/libexec/cudahook-criu-action\n"),
                      ("etc/cudahook/config.yaml", "log_file: /var/log/cudahook.log\n"),
                      ("opt/cudahook/libexec/cudahook-criu-action", "#!/bin/sh\n"),
                      ("usr/share/containers/oci/hooks.d/50-cudahook-create.json", "{}\n"),
                      ("var/lib/cudahook/journal.json", "{}\n"),
                      ("run/cudahook/containers/web@0123456789abcdef.json",
                       json.dumps({"id": "web", "bundle": "/run/containerd/web"})),
                      ("var/log/cudahook.log", '{"event": "oci-createRuntime"}\n')):
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).write_text(text)
    return root


def test_the_nodes_own_live_state_changing_is_not_the_suites(tmp_path: Path) -> None:
    """The node's cudahook checkpoints a container of its own while a
    (sub)session runs: its state, marks and log change; the guard is quiet."""
    node = _node(tmp_path / "node")
    sub = Sandbox(node=str(node))
    try:
        sub.watch()
        (node / "run/cudahook/runs").mkdir()
        (node / "run/cudahook/runs/4242-99.json").write_text(json.dumps({"done": {"pre-dump": 0}}))
        (node / "run/cudahook/containers/web@0123456789abcdef.json").write_text(
            json.dumps({"id": "web", "bundle": "/run/containerd/web", "restores": 1}))
        (node / "run/cudahook/guardians").mkdir()
        (node / "run/cudahook/guardians/web@0123456789abcdef.json").write_text("{}")
        (node / "run/cudahook-marks/gpu").mkdir(parents=True)
        (node / "run/cudahook-marks/gpu/web").touch()
        with open(node / "var/log/cudahook.log", "a") as f:
            f.write('{"event": "checkpoint", "container": "web"}\n')
        (node / "var/log/cudahook.log.1").write_text("rotated\n")
        assert sub.changes() == []
    finally:
        sub.close()


def test_the_suites_writes_to_the_node_are_reported(tmp_path: Path) -> None:
    """Its installation or registrations changed, or its live state holding
    what only the suite writes (the session's or pytest's directories)."""
    node = _node(tmp_path / "node")
    sub = Sandbox(node=str(node))
    try:
        sub.watch()
        leak = node / "run/cudahook/containers/gpu-1@fedcba9876543210.json"
        leak.write_text(json.dumps({"id": "gpu-1", "bundle": f"{sub.dir}/root/b"}))
        log = node / "var/log/cudahook.log"
        log.write_text(log.read_text() + json.dumps({"bundle": str(tmp_path / "b")}) + "\n")
        # Another session's suite (its own pytest directory) is not this one.
        other = node / "run/cudahook-marks/config-cache.json"
        other.parent.mkdir(parents=True)
        other.write_text(json.dumps({f"{tmp_path.parent}/pytest-9999/x/config.yaml": {}}))
        assert sub.changes(own=(str(tmp_path),)) == [f"the suite wrote {leak}",
                                                     f"the suite wrote {log}"]
        assert sub.changes() == [f"the suite wrote {leak}"]
        leak.unlink()
        log.write_text('{"event": "oci-createRuntime"}\n')
        assert sub.changes(own=(str(tmp_path),)) == []
        conf = node / "etc/criu/runc.conf"
        conf.write_text("action-script /tmp/x/cudahook-criu-action\n")
        hooks_d = node / "usr/share/containers/oci/hooks.d/50-cudahook-poststop.json"
        hooks_d.write_text("{}")
        (node / "etc/cudahook/config.yaml").unlink()
        assert sub.changes() == [f"changed {conf}", f"removed {node}/etc/cudahook/config.yaml",
                                 f"created {hooks_d}"]
    finally:
        sub.close()
