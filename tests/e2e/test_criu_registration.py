"""gpu-only CRIU registration through real runc and CRIU: the runtime
wrapper gives GPU containers a CRIU configuration of their own that names the
action script; every other container's CRIU runs without it."""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

import pytest

from cudahook.admin.configure import configure
from cudahook.platform import criuconf
from cudahook.platform.store import container_key
from cudahook.sim.runcbox import RuncBox

from .conftest import CRIU, needs_runc
from .outcomes import assert_dumped

pytestmark = needs_runc

SITE_OPTION = "tcp-established"  # the site's own runc.conf option, kept in every copy


@pytest.fixture
def node(make_env, tmp_path: Path, monkeypatch: pytest.MonkeyPatch):  # type: ignore[no-untyped-def]
    """A node root of its own registered gpu-only (hooks installed with that
    root baked in), and runc run through the installed wrapper."""
    root = tmp_path / "root"
    (root / "etc/criu").mkdir(parents=True)
    (root / "etc/criu/runc.conf").write_text(SITE_OPTION + "\n")
    monkeypatch.setenv("CUDAHOOK_ROOT", str(root))
    env = make_env()
    configure("runc", env.hooks, root=str(root), criu_registration="gpu-only")
    conf = (root / "etc/criu/runc.conf").read_text()
    assert criuconf.registration(conf) == ("gpu-only", str(env.hooks / "cudahook-criu-action"))
    box = RuncBox(tmp_path / "wrapped", env.lab, criu=CRIU,
                  runc=str(env.hooks / "cudahook-runtime"))
    yield env, box, root
    box.close()


def dumped(env, box: RuncBox, cid: str, tags: list[str]) -> dict[str, int]:  # type: ignore[no-untyped-def]
    """After the dump: every process of the container gone; the counters the
    workloads last reported (a restore must go on from them)."""
    return assert_dumped(SimpleNamespace(box=box, counters=env.counters), cid, tags)


def dump_log(image: Path) -> str:
    return (Path(f"{image}.work") / "dump.log").read_text(errors="replace")


def test_gpu_only_covers_gpu_containers_and_spares_the_rest(node, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    env, box, root = node
    script = str(env.hooks / "cudahook-criu-action")

    # A GPU container created through the wrapper: its own CRIU configuration.
    bundle = box.bundle("gpu", [("w", {"mib": 4}), ("mp", {"mib": 1, "procs": 2})],
                        action_script="system")
    tags = ["w", "mp.0", "mp.1"]
    cid = env.cid()
    r = box.run(cid, bundle)
    assert r.returncode == 0, r.stderr
    copy = env.state_dir / "criu" / f"{container_key(cid, str(bundle))}.conf"
    notes = json.loads((bundle / "config.json").read_text())["annotations"]
    assert notes["org.criu.config"] == str(copy)
    assert copy.read_text().splitlines() == [SITE_OPTION, criuconf.COMMENT,
                                             f"action-script {script}"]
    env.wait_running(tags, steps=3)
    image = tmp_path / "img"
    r = box.checkpoint(cid, image)
    assert r.returncode == 0, r.stderr
    assert (image / "cudahook-manifest.json").exists()
    assert len(env.events("checkpoint")) == 1
    assert script in dump_log(image)  # CRIU ran it
    assert not copy.exists()  # poststop (the dump ended the container) removed it
    frozen = dumped(env, box, cid, tags)
    r = box.restore(cid, bundle, image)
    assert r.returncode == 0, r.stderr
    assert copy.exists()  # the wrapper wrote it again for the restored container
    env.wait_running(tags, frozen)  # counters advance, memory checks pass
    restores = env.events("restore")
    assert len(restores) == 1 and not restores[0].get("error")

    # A second cycle: the restored container's CRIU still gets the copy.
    image2 = tmp_path / "img2"
    assert box.checkpoint(cid, image2).returncode == 0
    assert len(env.events("checkpoint")) == 2
    frozen = dumped(env, box, cid, tags)
    assert box.restore(cid, bundle, image2).returncode == 0
    env.wait_running(tags, frozen)

    # A container without a GPU, created through the same wrapper: runc hands
    # CRIU the node's runc.conf (named explicitly: this node lives under a
    # root), which does not name the script.
    events = len(env.events())
    plain = box.bundle("plain", [], others=["sleep 100000"], visible=[], action_script="system",
                       annotations={"org.criu.config": str(root / "etc/criu/runc.conf")})
    before = (plain / "config.json").read_bytes()
    pid = env.cid()
    assert box.run(pid, plain).returncode == 0
    assert (plain / "config.json").read_bytes() == before  # the wrapper left it alone
    pimage = tmp_path / "plain-img"
    assert box.checkpoint(pid, pimage).returncode == 0
    assert box.restore(pid, plain, pimage).returncode == 0
    assert box.state(pid)["status"] == "running"
    log = dump_log(pimage)
    assert "runc.conf" in log or "tcp" in log  # CRIU did read the node's configuration
    assert script not in log and "action-script" not in log
    assert "action-script" not in (Path(f"{pimage}.rwork") / "restore.log").read_text(
        errors="replace")
    assert len(env.events()) == events  # no hook of cudahook's ran for it
    assert sorted(p.name for p in (env.state_dir / "criu").iterdir()) == [copy.name]
