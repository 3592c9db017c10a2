"""Simulated CUDA workloads through each runtime version of the matrix:
containerd 1.7 (``ctr``) and docker 26, the versions people run today,
unpacked beside Debian 12's packages by scripts/provision-runtimes.sh, and
Debian 12's containerd 1.6 and docker 20.10; cudahook installed by install.sh
as in test_runtimes.py.

Through each: a checkpoint that leaves the container running (ctr always
passes runc ``--leave-running``; docker's ``--leave-running``), a checkpoint
that stops it (docker), a restore the gate refuses (the node's driver moved to
another branch: exit 6 kept for `cudahook status`, nothing ran, the image
unchanged), the same checkpoint then restored (docker: onto another GPU), and
a container without a GPU that passes through untouched (no record, no event,
no manifest).

Skipped unless scripts/provision-runtimes.sh unpacked the versions, and for
the reasons test_runtimes.py is skipped.
"""

from __future__ import annotations

import json
import re
import shutil
import time
import uuid
from pathlib import Path
from typing import Any

import pytest

from cudahook.core import manifest
from cudahook.platform.store import Store

from .conftest import needs_runc, private_node, tree_digest
from .daemons import PACKAGED, Binaries, Containerd, DaemonError, Dockerd, private_binaries
from .outcomes import process_tree
from .test_runtimes import (  # noqa: F401  (image and node are fixtures)
    DAEMON_JSON,
    Node,
    assert_hooked,
    ctr_leave_running,
    docker_gpu_task,
    docker_leave_running,
    docker_restore_moved,
    gpu_spec,
    image,
    node,
)

NEW = private_binaries("1.7", "26")

pytestmark = [*needs_runc, private_node]


def version(bins: Binaries, containerd: bool) -> Any:
    """One version of the matrix, skipped where provisioning did not bring it."""
    missing = bins.missing()
    name = f"containerd-{bins.containerd_version}" if containerd else f"docker-{bins.docker_version}"
    return pytest.param(bins, id=name, marks=pytest.mark.skipif(
        bool(missing), reason=f"missing {', '.join(missing)} (scripts/provision-runtimes.sh)"))



def untouched(at: Node, cid: str) -> None:
    """cudahook kept nothing of a container without a GPU."""
    assert not (at.state_dir / "containers" / f"{cid}.json").exists()
    assert at.events(cid) == []


def no_errors_since(at: Node, cid: str, t0: float) -> None:
    """No error or warning logged since `t0` (the refusal's own came before)."""
    bad = [e for e in at.events(cid) + at.events(None)
           if e["ts"] >= t0 and (e.get("error") or e.get("warning"))]
    assert not bad, bad


def refused(at: Node, cid: str, said: str) -> None:
    """The runtime failed the restore in CRIU, and cudahook kept why: the
    runtime's shim removes its bundle, CRIU's restore.log with it, once the
    restore failed, so the verdict (reason, exit code) is read where
    `cudahook status` reads it."""
    assert re.search(r"criu failed: type NOTIFY", said), said
    last = Store(str(at.state_dir)).history()[cid]
    check, restore = last["check"], last["restore"]
    assert (check["side"], check["ok"], check["exit_code"]) == ("restore", False, 6), check
    assert "restore needs the same driver branch" in restore["error"], restore
    assert at.events(cid, "restore") == []


@pytest.mark.parametrize("bins", [version(PACKAGED, True), version(NEW, True)])
def test_ctr_checkpoint_refusal_and_restore(node: Node, image: Path, tmp_path: Path,  # noqa: F811
                                          bins: Binaries) -> None:
    """ctr (1.6 and 1.7 alike): `ctr c checkpoint --task` (runc
    `--leave-running`), `ctr c restore --live`. The restore recreates the
    container from the spec stored in the checkpoint image: ctr cannot give
    it other GPUs (docker below, podman and runc do)."""
    spec = gpu_spec(node.lab, "c" + bins.containerd_version.replace(".", ""))
    tags, cid, ref = spec.tags, f"gpu-{uuid.uuid4().hex[:8]}", "cudahook/ctr-ckpt:1"
    shim_path = node.libexec / "runc-path"
    with Containerd(tmp_path / "containerd", path_prefix=shim_path, binaries=bins) as c:
        assert c.server_version().startswith(bins.containerd_version + ".")
        name = c.import_image(image)
        extra = [x for e in spec.env for x in ("--env", e)]
        pid = c.run(name, cid, *spec.cmd, mounts=spec.binds, extra=extra)
        node.wait_running(tags, steps=3)
        bundle = c.state / "io.containerd.runtime.v2.task" / c.namespace / cid
        assert_hooked(node, cid, bundle, pid)

        # A plain container beside it, through the same wrapper: untouched.
        plain = f"plain-{uuid.uuid4().hex[:8]}"
        c.run(name, plain, "/bin/sleep", "100000", mounts=[("/usr", "/usr", True)])
        c.checkpoint(plain, "cudahook/plain:1")
        assert c.tasks()[plain][1] == "RUNNING"
        untouched(node, plain)
        c.remove(plain)

        # 1. Checkpoint; ctr leaves the task running: back on its GPU.
        before, after = ctr_leave_running(node, c, cid, ref, pid, tags)
        c.remove(cid)
        last = node.counters(tags)

        # 2. The node's driver moved to another branch: the gate refuses.
        node.lab.set(driver=570)
        try:
            r = c.ctr("containers", "restore", "--live", cid, ref, check=False, timeout=120)
        finally:
            node.lab.set(driver=580)
        assert r.returncode != 0
        refused(node, cid, r.stderr)
        assert node.counters(tags) == last  # nothing ran
        c.remove(cid)

        # 3. Back on the right driver, the same checkpoint restores.
        t0 = time.time()
        with node.resumed(tags) as reports:
            new_pid = c.restore(cid, ref)
            first = reports.assert_from(before, after)
        assert new_pid != pid
        node.wait_running(tags, first)
        (restore,) = node.wait_event(cid, "restore")
        assert len(restore["pids"]) == len(tags) and not restore.get("device_map")
        assert_hooked(node, cid, bundle, new_pid)
        no_errors_since(node, cid, t0)
        c.remove(cid)


@pytest.mark.parametrize("bins", [version(PACKAGED, False), version(NEW, False)])
def test_docker_checkpoint_refusal_and_remap(node: Node, image: Path, tmp_path: Path,  # noqa: F811
                                             bins: Binaries) -> None:
    """docker (20.10 and 26 alike): `checkpoint create [--leave-running]
    [--checkpoint-dir]`, `start --checkpoint`; both refuse `start --checkpoint-dir`, so a
    checkpoint taken elsewhere is copied into the new container's
    checkpoints directory (README's recipe)."""
    runtimes = json.loads(DAEMON_JSON.read_text())["runtimes"]
    a, b = node.lab.uuids[:2]
    spec = gpu_spec(node.lab, "d" + bins.docker_version.replace(".", ""))
    tags = spec.tags

    with Dockerd(tmp_path / "dockerd", extra_config={"runtimes": runtimes}, binaries=bins) as d:
        server = d.docker("version", "--format", "{{.Server.Version}}").stdout.strip()
        assert server.startswith(bins.docker_version + "."), server
        name = d.load_image(image)

        # A container without a GPU, through cudahook's runtime: untouched.
        plain = d.docker("run", "-d", "--runtime", "cudahook", "--network", "none",
                         "--mount", "type=bind,source=/usr,target=/usr,readonly",
                         name, "/bin/sleep", "100000").stdout.strip()
        d.docker("checkpoint", "create", "--leave-running", plain, "p1", timeout=120)
        assert d.inspect(plain)["State"]["Running"]
        p1 = d.data_root / "containers" / plain / "checkpoints" / "p1"
        assert (p1 / "inventory.img").is_file() and manifest.read(p1) is None
        untouched(node, plain)

        src = d.docker("run", "-d", *spec.docker_args(), name, *spec.cmd).stdout.strip()
        pid, _ = docker_gpu_task(node, d, src, tags)

        # 1. --leave-running: the same processes go on, back on their GPU.
        docker_leave_running(node, d, src, pid, tags, "live")

        # 2. A checkpoint into a directory of our choosing stops the container.
        ckdir = tmp_path / "checkpoints"
        tree = process_tree(pid)
        d.docker("checkpoint", "create", "--checkpoint-dir", str(ckdir), src, "move", timeout=120)
        assert not d.inspect(src)["State"]["Running"]
        frozen = node.frozen(tags, tree)
        assert manifest.read(ckdir / "move") is not None
        dst = d.docker("create", *spec.docker_args(spec.env_on(b)), name, *spec.cmd).stdout.strip()
        r = d.docker("start", "--checkpoint-dir", str(ckdir), "--checkpoint", "move", dst,
                     check=False)
        assert r.returncode != 0 and "custom checkpointdir is not supported" in r.stderr, r
        moved = d.data_root / "containers" / dst / "checkpoints" / "move"
        shutil.copytree(ckdir / "move", moved)
        digest = tree_digest(moved)

        # 3. The node's driver moved to another branch: the gate refuses.
        node.lab.set(driver=570)
        try:
            with pytest.raises(DaemonError) as failed:
                d.start_checkpoint(dst, "move")
        finally:
            node.lab.set(driver=580)
        refused(node, dst, str(failed.value))
        assert not d.inspect(dst)["State"]["Running"]
        assert node.counters(tags) == frozen  # nothing ran
        assert tree_digest(moved) == digest

        # 4. Back on the right driver, the copy restores onto GPU b.
        t0 = time.time()
        docker_restore_moved(node, d, dst, "move", tags, frozen, {a: b})
        no_errors_since(node, dst, t0)
        untouched(node, plain)
        d.docker("rm", "-f", src, dst, plain)
