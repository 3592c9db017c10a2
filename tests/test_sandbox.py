"""The suite's guard of the node (tests/sandbox.py) sees what it must see."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from . import conftest
from .sandbox import diff, snapshot


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
        f"created {base}/run/cudahook-marks",
        f"created {base}/run/cudahook-marks/gpu",
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
