"""Simulated CUDA workloads through podman 4.3 (with runc and CRIU 4.1), with
cudahook installed by install.sh into a fresh prefix and registered the way
podman finds it: the hooks.d definitions (`install.sh --runtime podman`) and
the action script in /etc/criu/runc.conf, both at the node's real paths in
the suite's private mount namespace. Podman itself runs on storage of its
own (tests/e2e/podman.py).

A workload counts as healthy only if, read after the operation, its counter
advances and its GPU memory check passes.

Skipped, saying why, unless root with runc, CRIU >= 4.0 and podman
(scripts/provision-runtimes.sh installs it), and unless no cudahook
installation is journaled on this machine.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import tarfile
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

from cudahook.admin.journal import Journal
from cudahook.core import manifest
from cudahook.platform.store import Store
from cudahook.sim.lab import SimLab
from cudahook.sim.runcbox import STAND_IN_NODE, guest_binds, guest_env

from .conftest import needs_runc, private_node, tree_digest
from .outcomes import process_tree
from .podman import PODMAN, Podman
from .test_runtimes import (
    WORKLOADS,
    Node,
    comms_in_pidns,
    installed_node,
    python_rootfs,
    sh,
    workload_script,
)

pytestmark = [
    *needs_runc,
    private_node,
    pytest.mark.skipif(not os.access(PODMAN, os.X_OK),
                       reason=f"podman not installed ({PODMAN}; scripts/provision-runtimes.sh)"),
    pytest.mark.skipif(bool(Journal.all("/")), reason="cudahook is installed here"),
]

IMAGE = "localhost/cudahook/python-host:test"
HOOKS_D = Path("/usr/share/containers/oci/hooks.d")


@pytest.fixture(scope="module")
def node(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Node]:
    """cudahook installed by install.sh with podman registered (hooks.d and
    /etc/criu/runc.conf), its configuration pointing at a simulated GPU node."""
    with installed_node(tmp_path_factory.mktemp("podman"), "podman") as n:
        yield n


@pytest.fixture(scope="module")
def rootfs(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return python_rootfs(tmp_path_factory.mktemp("image") / "rootfs")


@pytest.fixture
def podman(rootfs: Path, tmp_path: Path) -> Iterator[Podman]:
    p = Podman(tmp_path / "podman")
    try:
        p.import_rootfs(rootfs, IMAGE)
        yield p
    finally:
        p.close()


def gpu_container(podman: Podman, lab: SimLab, prefix: str,
                  workloads: list[tuple[str, dict]] = WORKLOADS,  # type: ignore[type-arg]
                  visible: list[str] | None = None) -> tuple[str, list[str]]:
    """A container on the simulated GPU: real character nodes at /dev/nvidia*
    (`--device`, as the NVIDIA toolkit injects them), the GPU service bound in,
    NVIDIA_VISIBLE_DEVICES naming its GPU. Its name and workload tags."""
    cmd, tags = workload_script(prefix, workloads)
    binds = [("/usr", "/usr", True), ("/etc", "/etc", True),
             *guest_binds(lab, device_files=False)]
    devices = [(STAND_IN_NODE, f"/dev/{n}") for n in sorted(os.listdir(lab.dev))]
    name = f"{prefix}-{uuid.uuid4().hex[:6]}"
    podman.run(name, IMAGE, cmd,
               env=guest_env(visible or lab.uuids[:1]), binds=binds, devices=devices)
    return name, tags


def restored_copy(node: Node, podman: Podman, archive: Path, copy: str, tags: list[str],
                  frozen: dict[str, int]) -> None:
    """`restore --import` of `archive` as container `copy`: it runs, each
    workload continuing from its frozen counter and running on after."""
    with node.resumed(tags) as reports:
        podman("container", "restore", "--import", str(archive), "--name", copy)
        first = reports.assert_from(frozen, frozen)
    assert podman.state(copy) == "running"
    node.wait_running(tags, first)


def assert_hooked(node: Node, podman: Podman, name: str) -> None:
    """podman put the hooks.d prestart hook in the spec (its poststop hooks
    it runs itself, at cleanup); the hook recorded the container."""
    info = podman.inspect(name)
    cid, pid = info["Id"], int(info["State"]["Pid"])
    spec = json.loads(Path(info["OCIConfigPath"]).read_text())
    want = str(node.libexec / "cudahook-oci-hook")
    assert [h["path"] for h in spec["hooks"].get("prestart", [])] == [want], spec["hooks"]
    record = Store(node.state_dir).find(cid)
    assert record is not None and record["pid"] == pid and record["visible"] == node.lab.uuids[:1], record
    assert "sleep" in comms_in_pidns(pid)


def test_hooks_d_registration(node: Node) -> None:
    for stage, name in (("prestart", "create"), ("poststop", "poststop")):
        d = json.loads((HOOKS_D / f"50-cudahook-{name}.json").read_text())
        assert d["hook"]["path"] == str(node.libexec / "cudahook-oci-hook")
        assert d["stages"] == [stage]
    assert f"action-script {node.libexec / 'cudahook-criu-action'}" in \
        Path("/etc/criu/runc.conf").read_text()
    # doctor sees the registration, and the runtime podman runs here.
    r = sh("/usr/local/bin/cudahook", "doctor", "--json")
    checks = {c["name"]: c for c in json.loads(r.stdout)}
    assert checks["podman/CRI-O registration"]["status"] == "ok", checks
    want = "warn" if shutil.which("crun") else "ok"  # Debian's podman with runc: ok
    assert checks["podman runtime"]["status"] == want, checks["podman runtime"]


def test_checkpoint_then_restore(node: Node, podman: Podman) -> None:
    name, tags = gpu_container(podman, node.lab, "pm")
    node.wait_running(tags, steps=3)
    assert_hooked(node, podman, name)
    cid, pid = podman.inspect(name)["Id"], podman.pid(name)

    tree = process_tree(pid)
    podman("container", "checkpoint", name)
    assert podman.state(name) == "exited"
    frozen = node.frozen(tags, tree)
    (ckpt,) = node.events(cid, "checkpoint")
    assert sorted(ckpt["nspids"]) == sorted(node.lab.status(t)["pid"] for t in tags)
    node.wait_event(cid, "guardian", lambda e: "nothing to resume" in e.get("outcome", ""))

    with node.resumed(tags) as reports:
        podman("container", "restore", name)
        first = reports.assert_from(frozen, frozen)
    assert podman.state(name) == "running" and podman.pid(name) != pid
    node.wait_running(tags, first)
    (restore,) = node.wait_event(cid, "restore")
    assert len(restore["pids"]) == len(tags)
    assert_hooked(node, podman, name)  # the hook ran again on restore: the new PID
    node.assert_no_errors(cid)
    # podman runs the poststop hook itself when the container goes.
    podman("rm", "-f", "-t", "0", name)
    deadline = time.monotonic() + 20
    while Store(node.state_dir).find(cid) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert Store(node.state_dir).find(cid) is None, "poststop did not run"


def test_leave_running(node: Node, podman: Podman) -> None:
    name, tags = gpu_container(podman, node.lab, "lr")
    node.wait_running(tags, steps=3)
    cid, pid = podman.inspect(name)["Id"], podman.pid(name)
    podman("container", "checkpoint", "--leave-running", name)
    after = node.counters(tags)
    node.wait_event(cid, "guardian", lambda e: "resumed" in e.get("outcome", ""))
    assert podman.state(name) == "running" and podman.pid(name) == pid
    node.wait_running(tags, after)
    node.assert_no_errors(cid)


def test_export_then_import_as_a_copy(node: Node, podman: Podman, tmp_path: Path) -> None:
    name, tags = gpu_container(podman, node.lab, "ex")
    node.wait_running(tags, steps=3)
    archive = tmp_path / "ckpt.tar.gz"
    tree = process_tree(podman.pid(name))
    podman("container", "checkpoint", "--export", str(archive), "--compress", "gzip", name)
    frozen = node.frozen(tags, tree)
    assert podman.state(name) == "exited"
    with tarfile.open(archive) as t:
        assert "checkpoint/cudahook-manifest.json" in t.getnames()
    # The original goes; its copy is restored from the archive under a new name.
    podman("rm", "-f", "-t", "0", name)
    copy = f"{name}-copy"
    restored_copy(node, podman, archive, copy, tags, frozen)
    copy_id = podman.inspect(copy)["Id"]
    (restore,) = node.wait_event(copy_id, "restore")
    assert len(restore["pids"]) == len(tags)


def test_checkpoint_refused_by_a_fault_leaves_the_workload_intact(node: Node, podman: Podman) -> None:
    name, tags = gpu_container(podman, node.lab, "ft", workloads=[("mp", {"mib": 2, "procs": 3})])
    node.wait_running(tags, steps=3)
    cid, pid = podman.inspect(name)["Id"], podman.pid(name)
    node.lab.fault("checkpoint", tag=tags[1], code=2)
    try:
        before = node.counters(tags)
        r = podman("container", "checkpoint", name, check=False)
    finally:
        node.lab.clear_faults()
    assert r.returncode != 0
    assert podman.state(name) == "running" and podman.pid(name) == pid
    node.wait_running(tags, before)
    err = node.events(cid, "checkpoint")[-1]["error"]
    assert "out of memory" in err
    # and a checkpoint without the fault goes through
    podman("container", "checkpoint", "--leave-running", name)
    node.wait_event(cid, "guardian", lambda e: "resumed" in e.get("outcome", ""))
    node.wait_running(tags, node.counters(tags))


def test_restore_refused_by_the_gate_reaches_the_user(node: Node, podman: Podman) -> None:
    name, tags = gpu_container(podman, node.lab, "gt")
    node.wait_running(tags, steps=3)
    cid = podman.inspect(name)["Id"]
    tree = process_tree(podman.pid(name))
    podman("container", "checkpoint", "--keep", name)
    frozen = node.frozen(tags, tree)
    image = Path(podman.inspect(name)["OCIConfigPath"]).parent / "checkpoint"
    assert manifest.read(image) is not None
    digest = tree_digest(image)
    node.lab.set(driver=570)  # the node's driver moved to another branch meanwhile
    try:
        r = podman("container", "restore", name, check=False)
    finally:
        node.lab.set(driver=580)
    assert r.returncode != 0
    # podman names CRIU's log; the refusal is one `cudahook:` line in it.
    said = r.stdout + r.stderr
    log = re.search(r"log file: (\S+restore\.log)", said)
    assert log, said
    reason = [x for x in Path(log.group(1)).read_text().splitlines() if "cudahook: " in x]
    assert any("restore needs the same driver branch" in x for x in reason), reason
    assert podman.state(name) == "exited"
    time.sleep(0.3)
    assert node.counters(tags) == frozen  # nothing ran
    assert node.events(cid, "restore") == []
    assert tree_digest(image) == digest
    # Back on the right driver, the same checkpoint restores.
    with node.resumed(tags) as reports:
        podman("container", "restore", name)
        first = reports.assert_from(frozen, frozen)
    node.wait_running(tags, first)

