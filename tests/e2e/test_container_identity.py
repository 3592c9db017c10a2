"""Two GPU containers of one name under two runc roots, through real runc and
CRIU, registered gpu-only: each has its own CRIU configuration (the second
one's with its own options), both checkpoint and restore intact, and the
poststop of one (its dump ends it) leaves the other's configuration, so the
other's checkpoint still runs the action script."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from cudahook.admin.journal import Journal
from cudahook.platform import criuconf, paths
from cudahook.platform.store import Store, container_key
from cudahook.sim.runcbox import RuncBox

from .conftest import Env, dump_log, needs_runc, private_node, wrapped_runc

pytestmark = needs_runc

NAME = "web"


@pytest.fixture
def node(gpu_only_env: Env, tmp_path: Path):  # type: ignore[no-untyped-def]
    env = gpu_only_env
    boxes = [wrapped_runc(tmp_path / f"runc-{n}", env.lab, env.hooks) for n in "ab"]
    yield env, boxes
    for box in boxes:
        box.close()


def own_cgroup(bundle: Path, where: str) -> None:
    """runc's default cgroup is /<id>: containers of one name under two roots
    need their own (as containerd, docker and podman give each)."""
    path = bundle / "config.json"
    cfg = json.loads(path.read_text())
    cfg.setdefault("linux", {})["cgroupsPath"] = f"/cudahook-test-{where}/{NAME}"
    path.write_text(json.dumps(cfg))


def test_two_runc_roots_one_name(node, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    env, (box_a, box_b) = node
    script = str(env.hooks / "cudahook-criu-action")
    # b names its own CRIU configuration, one of the operator's (in /etc/criu):
    # its option is in its copy only.
    own = paths.at("/etc/criu/b.conf")
    own.write_text("ghost-limit 2M\n")
    tags = {"a": ["a.w"], "b": ["b.w"]}
    bundles = {}
    for n, box, notes in (("a", box_a, {}), ("b", box_b, {criuconf.ANNOTATION: str(own)})):
        bundles[n] = box.bundle("gpu", [(f"{n}.w", {"mib": 2})], action_script="system",
                                annotations=notes)
        own_cgroup(bundles[n], n)
        r = box.run(NAME, bundles[n])
        assert r.returncode == 0, r.stderr
    copies = {n: env.state_dir / "criu" / f"{container_key(NAME, str(b))}.conf"
              for n, b in bundles.items()}
    assert copies["a"] != copies["b"]
    for n, b in bundles.items():
        notes = json.loads((b / "config.json").read_text())["annotations"]
        assert notes[criuconf.ANNOTATION] == str(copies[n])
        assert f"action-script {script}" in copies[n].read_text()
    assert "ghost-limit" in copies["b"].read_text() and "ghost-limit" not in copies["a"].read_text()
    assert len(Store(env.state_dir).records()) == 2
    env.wait_running(tags["a"] + tags["b"], steps=3)

    def dumped(n: str, box: RuncBox) -> Path:
        """`n`'s checkpoint, run by CRIU with its own copy's options and
        cudahook's action script; the dump ended the container. The image."""
        image = tmp_path / f"img-{n}"
        r = box.checkpoint(NAME, image)
        assert r.returncode == 0, r.stderr
        log = dump_log(image)
        assert script in log and f"Parsing config file {copies[n]}" in log
        assert (image / "cudahook-manifest.json").exists()
        assert box.state(NAME) is None
        return image

    # a's dump ends a, and a's poststop runs: b's copy and record stay.
    image_a = dumped("a", box_a)
    assert not copies["a"].exists()
    assert copies["b"].exists()
    assert [r["bundle"] for r in Store(env.state_dir).records()] == [str(bundles["b"])]
    frozen_a = env.counters(tags["a"])

    # b's checkpoint still runs the action script, with b's own options.
    image_b = dumped("b", box_b)
    frozen_b = env.counters(tags["b"])
    assert len(env.events("checkpoint")) == 2

    # Both restore, each from its own image, and go on from where they were.
    for n, box, image in (("a", box_a, image_a), ("b", box_b, image_b)):
        r = box.restore(NAME, bundles[n], image)
        assert r.returncode == 0, r.stderr
        assert copies[n].exists()
    env.wait_running(tags["a"], frozen_a)
    env.wait_running(tags["b"], frozen_b)
    restores = env.events("restore")
    assert len(restores) == 2 and not any(e.get("error") for e in restores)
    assert len(Store(env.state_dir).records()) == 2


def _runtimes_missing() -> list[str]:
    import os

    from .daemons import CONTAINERD, CTR, RUNC, SHIM

    return [b for b in (CONTAINERD, CTR, SHIM, RUNC) if not os.access(b, os.X_OK)]


@private_node
@pytest.mark.skipif(bool(_runtimes_missing()), reason="containerd 1.6 not installed")
@pytest.mark.skipif(bool(Journal.all("/")), reason="cudahook is installed here")
def test_runc_and_containerd_one_name(tmp_path: Path) -> None:
    """A runc container and a containerd task of one name, both GPU
    containers through cudahook as install.sh registers it: each keeps its
    record through the other's checkpoint, poststop and restore."""
    from .daemons import Containerd, image_tar
    from .test_runtimes import IMAGE, gpu_spec, installed_node, python_rootfs, run_gpu_task

    image = image_tar(tmp_path / "python-host.tar", python_rootfs(tmp_path / "rootfs"),
                      name=IMAGE, cmd=("/bin/sh",))
    with installed_node(tmp_path / "n", "containerd") as node, \
            Containerd(tmp_path / "containerd", path_prefix=node.libexec / "runc-path") as c:
        spec = gpu_spec(node.lab, "ctd")
        _, task_bundle = run_gpu_task(node, c, image, spec, NAME)
        box = wrapped_runc(tmp_path / "runc", node.lab, node.libexec)
        try:
            bundle = box.bundle("gpu", [("rc.w", {"mib": 2})], action_script="system")
            r = box.run(NAME, bundle)
            assert r.returncode == 0, r.stderr
            node.wait_running(["rc.w"], steps=3)
            store = Store(node.state_dir)
            keys = {container_key(NAME, str(b)) for b in (bundle, task_bundle)}
            assert {r["key"] for r in store.records()} == keys

            # runc's dump ends its container: its poststop leaves the task's record.
            image_r = tmp_path / "img-runc"
            r = box.checkpoint(NAME, image_r)
            assert r.returncode == 0, r.stderr
            assert (image_r / "cudahook-manifest.json").exists()
            frozen = node.counters(["rc.w"])
            assert [r["key"] for r in store.records()] == [container_key(NAME, str(task_bundle))]

            # The task checkpoints (left running: its guardian resumes it),
            # then goes; its poststop leaves nothing of the runc container's.
            ref = "cudahook/one-name:1"
            c.checkpoint(NAME, ref)
            node.wait_event(NAME, "guardian", lambda e: "resumed" in e.get("outcome", ""))
            after = node.wait_running(spec.tags, steps=5)
            c.remove(NAME)
            assert store.records() == []

            # Both come back, each from its own image, each with its own record.
            r = box.restore(NAME, bundle, image_r)
            assert r.returncode == 0, r.stderr
            c.restore(NAME, ref)
            node.wait_running(["rc.w"], frozen)
            node.wait_running(spec.tags, {t: 0 for t in after})
            assert {r["key"] for r in store.records()} == keys
            restores = node.events(NAME, "restore")
            assert len(restores) == 2 and not any(e.get("error") for e in restores)
            c.remove(NAME)
        finally:
            box.close()
