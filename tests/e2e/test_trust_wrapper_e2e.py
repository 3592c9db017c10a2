"""The runtime wrapper's trust boundary through real runc and CRIU: a GPU
container's annotations name a CRIU configuration of the author's own, with
an action script; CRIU, run as root by `runc checkpoint`, runs cudahook's
action script only."""

from __future__ import annotations

from pathlib import Path

from cudahook.platform import criuconf

from .conftest import Env, dump_log, needs_runc, wrapped_runc

pytestmark = needs_runc


def test_operator_only_criu_config__real_checkpoint_runs_no_foreign_script(
        gpu_only_env: Env, tmp_path: Path) -> None:
    env = gpu_only_env
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
    box = wrapped_runc(tmp_path / "wrapped", env.lab, env.hooks)
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
        log = dump_log(image)
        assert script in log  # CRIU ran cudahook's action script
        assert str(evil) not in log
        assert not marker.exists(), marker.read_text()
        assert (image / "cudahook-manifest.json").exists()
    finally:
        box.close()
