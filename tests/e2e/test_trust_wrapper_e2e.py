"""The runtime wrapper's trust boundary through real runc and CRIU: a GPU
container's annotations name a CRIU configuration of the author's own, with
an action script; CRIU, run as root by `runc checkpoint`, runs cudahook's
action script only."""

from __future__ import annotations

from pathlib import Path

import pytest

from cudahook.admin.configure import configure
from cudahook.platform import criuconf
from cudahook.sim.runcbox import RuncBox

from .conftest import CRIU, needs_runc

pytestmark = needs_runc


def test_operator_only_criu_config__real_checkpoint_runs_no_foreign_script(
        make_env, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:  # type: ignore[no-untyped-def]
    root = tmp_path / "root"
    (root / "etc/criu").mkdir(parents=True)
    (root / "etc/criu/runc.conf").write_text("tcp-established\n")
    monkeypatch.setenv("CUDAHOOK_ROOT", str(root))
    env = make_env()
    configure("runc", env.hooks, root=str(root), criu_registration="gpu-only")
    script = str(env.hooks / criuconf.ACTION_NAME)
    # What the author controls: a file of its own (its overlay's upperdir,
    # say) naming a script of its own, which would leave a mark if run.
    marker = tmp_path / "foreign-script-ran"
    evil = tmp_path / "upper" / "evil.sh"
    evil.parent.mkdir()
    evil.write_text(f"#!/bin/sh\necho \"$CRTOOLS_SCRIPT_ACTION\" >> {marker}\n")
    evil.chmod(0o755)
    conf = tmp_path / "upper" / "criu.conf"
    conf.write_text(f"action-script {evil}\n")
    box = RuncBox(tmp_path / "wrapped", env.lab, criu=CRIU,
                  runc=str(env.hooks / "cudahook-runtime"))
    try:
        bundle = box.bundle("gpu", [("w", {"mib": 4})], action_script="system",
                            annotations={criuconf.ANNOTATION: str(conf),
                                         criuconf.BASE_ANNOTATION: str(conf)})
        cid = env.cid()
        r = box.run(cid, bundle)
        assert r.returncode == 0, r.stderr
        env.wait_running(["w"], steps=3)
        image = tmp_path / "img"
        r = box.checkpoint(cid, image)
        assert r.returncode == 0, r.stderr
        log = (Path(f"{image}.work") / "dump.log").read_text(errors="replace")
        assert script in log  # CRIU ran cudahook's action script
        assert str(evil) not in log
        assert not marker.exists(), marker.read_text()
        assert (image / "cudahook-manifest.json").exists()
    finally:
        box.close()
