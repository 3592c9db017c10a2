"""Moving a GPU container to another node, two nodes on one machine.

A node is a simulated GPU service (its own GPU UUIDs, count, model and
driver), cudahook's hooks and configuration, and podman storage, seen from a
mount namespace of its own: in node A's namespace /opt/cudahook-node names
node A's files, in node B's node B's. The container's spec names only those
common paths (the hooks.d hook, the action script through org.criu.config,
the GPU service bound in), as a spec names /opt/cudahook and the driver's
files on real nodes; the hooks and CRIU then run against the node the
command runs on.

The archive travels as it would between machines: a copy of the file (and
its checksum) into another directory. The recipes README's "Move a GPU
container to another node" gives are the ones run here: `cudahook migrate`
with podman, and runc's image directory packed into a tar.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import shutil
import subprocess
import sys
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import yaml

from cudahook.admin import hookfiles
from cudahook.admin.configure import plan as registration
from cudahook.core import manifest
from cudahook.platform import paths
from cudahook.platform.errors import Exit
from cudahook.sim.lab import PKG_PARENT, SimLab
from cudahook.sim.runcbox import GUEST_PKG, GUEST_SIM, STAND_IN_NODE, guest_env

from .conftest import needs_runc, private_node, tree_digest
from .outcomes import process_tree, still_alive
from .podman import PODMAN, NodeNamespace, Podman
from .test_runtimes import OTHERS, python_rootfs, workload_script

pytestmark = [
    *needs_runc,
    private_node,
    pytest.mark.skipif(not os.access(PODMAN, os.X_OK),
                       reason=f"podman not installed ({PODMAN}; scripts/provision-runtimes.sh)"),
    pytest.mark.skipif(shutil.which("nsenter") is None or shutil.which("unshare") is None,
                       reason="needs nsenter and unshare (util-linux)"),
]

#: Each node's own files, at one path, in that node's mount namespace.
COMMON = Path("/opt/cudahook-node")
IMAGE = "localhost/cudahook/python-host:test"
H100 = "NVIDIA H100 80GB HBM3 (simulated)"


@dataclass
class SimNode:
    name: str
    dir: Path
    lab: SimLab
    ns: NodeNamespace
    podman: Podman

    @property
    def log(self) -> Path:
        return Path(self.lab.settings().log_file)

    def events(self, name: str) -> list[dict[str, Any]]:
        if not self.log.exists():
            return []
        lines = [json.loads(x) for x in self.log.read_text().splitlines() if x.strip()]
        return [e for e in lines if e["event"] == name]

    def cudahook(self, *args: str, timeout: float = 300) -> subprocess.CompletedProcess[str]:
        """`cudahook` run on this node: its namespace, its configuration."""
        argv = [sys.executable, "-m", "cudahook", "--config", str(COMMON / "etc/config.yaml"),
                *args]
        return subprocess.run(self.ns.wrap(argv), env=self.podman.env, capture_output=True,
                              text=True, timeout=timeout, stdin=subprocess.DEVNULL, check=False)

    def migrate(self, *args: str) -> subprocess.CompletedProcess[str]:
        return self.cudahook("migrate", *args, "--podman", self.podman.command())

    def run(self, visible: list[str], workloads: list[tuple[str, dict[str, Any]]]
            ) -> tuple[str, list[str]]:
        """A GPU container on this node; its name and workload tags."""
        prefix = f"{self.name}-{uuid.uuid4().hex[:6]}"
        cmd, tags = workload_script(prefix, workloads)
        binds = [("/usr", "/usr", True), ("/etc", "/etc", True), (PKG_PARENT, GUEST_PKG, True),
                 (str(COMMON / "gpu"), GUEST_SIM, False)]
        devices = [(STAND_IN_NODE, f"/dev/{n}") for n in sorted(os.listdir(self.lab.dev))]
        self.podman.run(prefix, IMAGE, cmd, env=guest_env(visible),
                        binds=binds, devices=devices,
                        extra=["--annotation", f"org.criu.config={COMMON / 'etc/criu.conf'}"])
        return prefix, tags

    def containers(self) -> list[str]:
        return self.podman("ps", "-a", "--format", "{{.Names}}").stdout.split()

    def close(self) -> None:
        try:
            self.podman.close()
        finally:
            self.ns.close()
            self.lab.stop()


def make_node(tmp: Path, image: Path, name: str, *, seed: str, gpus: int = 2,
              driver: int = 580, gpu_specs: list[dict[str, Any]] | None = None,
              with_image: bool = True, gpu_memory: str = "host") -> SimNode:
    """`gpu_memory` other than host: a CUDA 13.4 driver (custom storage), the
    driver-API backend, and that setting."""
    d = tmp / name
    lab = SimLab(d / "gpu", seed=seed, gpus=gpus, driver=driver, gpu_specs=gpu_specs).start()
    etc, libexec, root = d / "etc", d / "libexec", d / "root"
    for x in (etc / "hooks.d", libexec, root):
        x.mkdir(parents=True)
    settings = lab.settings()
    if gpu_memory != "host":
        lab.set(cuda_version=13040)
        settings = lab.settings(backend="driver-api", gpu_memory=gpu_memory)
    (etc / "config.yaml").write_text(yaml.safe_dump(dict(settings.__dict__)))
    # The hooks with this node's configuration and root baked in, at the common path.
    saved = os.environ.get(paths.ROOT_ENV)
    os.environ[paths.ROOT_ENV] = str(COMMON / "root")
    try:
        hookfiles.install(libexec, config=str(COMMON / "etc/config.yaml"))
    finally:
        if saved is None:
            os.environ.pop(paths.ROOT_ENV, None)
        else:
            os.environ[paths.ROOT_ENV] = saved
    # podman's registration, as `cudahook configure --runtime podman` writes it.
    for change in registration("podman", COMMON / "libexec", root=str(root)).changes[1:]:
        assert change.after is not None
        (etc / "hooks.d" / change.path.name).write_bytes(change.after)
    action = f"action-script {COMMON / 'libexec/cudahook-criu-action'}\n"
    (etc / "criu.conf").write_text(action)
    # The node's own CRIU registration (global, as install.sh writes it): a
    # migrated container's org.criu.config is dropped on restore, and runc
    # then hands CRIU this node's /etc/criu/runc.conf.
    (etc / "criu").mkdir()
    (etc / "criu/runc.conf").write_text(action)
    ns = NodeNamespace([(str(libexec), str(COMMON / "libexec")), (str(etc), str(COMMON / "etc")),
                        (str(lab.root), str(COMMON / "gpu")), (str(root), str(COMMON / "root")),
                        (str(etc / "criu"), "/etc/criu")])
    podman = Podman(d / "podman", ns=ns, hooks_dir=str(COMMON / "etc/hooks.d"))
    node = SimNode(name, d, lab, ns, podman)
    try:
        if with_image:
            podman.load(image)
    except BaseException:
        node.close()
        raise
    return node


@pytest.fixture(scope="module")
def image(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    """The image both nodes run, built once: the same image ID on each, as
    pulled from one registry."""
    d = tmp_path_factory.mktemp("image")
    builder = Podman(d / "builder")
    try:
        builder.import_rootfs(python_rootfs(d / "rootfs"), IMAGE)
        yield builder.save(IMAGE, d / "image.tar")
    finally:
        builder.close()


@pytest.fixture
def nodes(tmp_path: Path, image: Path) -> Iterator[Any]:
    made: list[SimNode] = []

    def make(name: str, **kw: Any) -> SimNode:
        made.append(make_node(tmp_path, image, name, **kw))
        return made[-1]

    try:
        yield make
    finally:
        for n in made:
            with contextlib.suppress(Exception):
                n.close()
        with contextlib.suppress(OSError):
            for sub in ("libexec", "etc", "gpu", "root"):
                (COMMON / sub).rmdir()
            COMMON.rmdir()


def wait_healthy(lab: SimLab, tags: list[str], above: dict[str, int], steps: int = 11
                 ) -> dict[str, dict[str, Any]]:
    """Each workload's report on `lab`, read after the operation: its counter
    advanced `steps` past `above`, its GPU memory intact."""
    out = {}
    for t in tags:
        st = lab.wait_counter(t, above.get(t, 0) + steps, timeout=30)
        assert st["intact"] and st["errors"] == [] and st["state"] == "running", st
        out[t] = st
    return out


def counters(lab: SimLab, tags: list[str]) -> dict[str, int]:
    return {t: lab.status(t).get("counter", 0) for t in tags}


def checkpoint_on(node: SimNode, visible: list[str], transit: Path,
                  workloads: list[tuple[str, dict[str, Any]]] | None = None
                  ) -> tuple[str, list[str], Path, dict[str, int]]:
    """A container on `node`, checkpointed by `cudahook migrate checkpoint`,
    its archive copied into `transit`. Its name, tags, the copy, the counters
    it stopped at."""
    name, tags = node.run(visible, workloads or [("solo", {"mib": 4}),
                                                 ("mp", {"mib": 2, "procs": 2})])
    wait_healthy(node.lab, tags, {}, steps=3)
    archive = node.dir / "out" / f"{name}.tar.gz"
    archive.parent.mkdir(exist_ok=True)
    tree = process_tree(node.podman.pid(name))
    r = node.migrate("checkpoint", name, str(archive), "--json")
    assert r.returncode == 0, r.stdout + r.stderr
    out = json.loads(r.stdout)
    assert out["gpus"] == visible and out["bytes"] == archive.stat().st_size
    assert hashlib.sha256(archive.read_bytes()).hexdigest() == out["sha256"]
    assert archive.with_name(archive.name + ".sha256").read_text() == \
        f"{out['sha256']}  {archive.name}\n"
    assert node.podman.state(name) == "exited"
    assert not still_alive(tree), "the container's processes outlived the dump"
    frozen = counters(node.lab, tags)
    transit.mkdir(exist_ok=True)
    copy = transit / archive.name
    shutil.copyfile(archive, copy)
    shutil.copyfile(archive.with_name(archive.name + ".sha256"), copy.with_name(copy.name + ".sha256"))
    return name, tags, copy, frozen


def test_migrate_same_count_other_uuids(nodes: Any, tmp_path: Path) -> None:
    a = nodes("a", seed="node-a")
    b = nodes("b", seed="node-b")
    assert set(a.lab.uuids).isdisjoint(b.lab.uuids)
    name, tags, archive, frozen = checkpoint_on(a, a.lab.uuids[:1], tmp_path / "transit")

    # --dry-run: the same decision, nothing restored.
    r = b.migrate("restore", str(archive), "--name", f"{name}-b", "--json", "--dry-run")
    assert r.returncode == 0, r.stdout + r.stderr
    assert json.loads(r.stdout)["device_map"] == {a.lab.uuids[0]: b.lab.uuids[0]}
    assert b.containers() == []
    r = b.migrate("restore", str(archive), "--name", f"{name}-b", "--json")
    assert r.returncode == 0, r.stdout + r.stderr
    out = json.loads(r.stdout)
    assert out["gpus"] == b.lab.uuids[:1] and out["source_gpus"] == a.lab.uuids[:1]
    assert out["device_map"] == {a.lab.uuids[0]: b.lab.uuids[0]}
    assert b.podman.state(f"{name}-b") == "running"
    # The workloads go on from where they stopped, on node B's GPU, memory intact.
    reports = wait_healthy(b.lab, tags, frozen)
    assert {st["gpu"] for st in reports.values()} == {b.lab.uuids[0]}
    used = {g["uuid"]: g["memory_used_mib"] for g in b.lab.info()["gpus"]}
    assert used[b.lab.uuids[0]] > 0 and used[b.lab.uuids[1]] == 0
    # Node B's cudahook did the restore, with the device map the gate computed.
    (restore,) = b.events("restore")
    assert restore["device_map"] == {a.lab.uuids[0]: b.lab.uuids[0]}
    assert len(restore["pids"]) == len(tags) and not restore.get("error")
    spec = json.loads(Path(b.podman.inspect(f"{name}-b")["OCIConfigPath"]).read_text())
    assert f"NVIDIA_VISIBLE_DEVICES={b.lab.uuids[0]}" in spec["process"]["env"]
    # Node A's CRIU configuration did not come along: node B's own applied.
    assert out["dropped_annotations"] == ["org.criu.config"]
    assert "org.criu.config" not in spec.get("annotations", {})
    assert a.events("restore") == []
    # Node A's GPU holds nothing of it any more.
    assert all(g["memory_used_mib"] == 0 for g in a.lab.info()["gpus"])


def assert_refused_cleanly(b: SimNode, r: subprocess.CompletedProcess[str], code: int,
                           reason: str) -> None:
    assert r.returncode == code, (r.returncode, r.stdout, r.stderr)
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("cudahook: ") and reason in lines[0], r.stderr
    assert "Traceback" not in r.stderr
    assert b.containers() == []  # nothing created, nothing running
    assert b.events("restore") == []


def test_fewer_gpus_on_the_target_is_refused_with_exit_6(nodes: Any, tmp_path: Path) -> None:
    a = nodes("a", seed="node-a", gpus=2)
    b = nodes("b", seed="node-b", gpus=1)
    _, _, archive, _ = checkpoint_on(a, a.lab.uuids, tmp_path / "transit")
    digest = hashlib.sha256(archive.read_bytes()).hexdigest()
    for dry in ([], ["--dry-run"]):
        r = b.migrate("restore", str(archive), *dry)
        assert_refused_cleanly(b, r, Exit.NOT_HERE, "used 2 GPU(s); this node has 1")
    assert hashlib.sha256(archive.read_bytes()).hexdigest() == digest
    # Straight through podman, the restore gate refuses at post-restore, before
    # the tasks run, and says why in the CRIU log podman names.
    r = b.podman("container", "restore", "--import", str(archive), check=False)
    assert r.returncode != 0
    log = Path(r.stderr.split("log file: ")[1].split()[0]).read_text()
    assert "GPU(s) not present on this node" in log and "(exit 6)" in log, log
    assert "running" not in b.podman("ps", "-a", "--format", "{{.State}}").stdout


A100 = [{"name": "NVIDIA A100-SXM4-80GB (simulated)"}] * 2
SMALLER = [{"memory_mib": 40960}] * 2
REFUSALS = {
    # case: (node A's driver, node B's driver, B's GPUs, what the refusal says)
    "driver-branch": (580, 570, None, "restore needs the same driver branch"),
    "gpu-model": (580, 580, A100, "A100"),
    "gpu-memory": (580, 580, SMALLER, "40960"),
    "remap-below-r580": (570, 570, None, "has no --device-map"),
}


@pytest.mark.parametrize("case", sorted(REFUSALS))
def test_a_node_that_cannot_run_the_image_is_refused_with_exit_6(nodes: Any, tmp_path: Path,
                                                                  case: str) -> None:
    driver_a, driver_b, specs_b, reason = REFUSALS[case]
    a = nodes("a", seed="node-a", driver=driver_a)
    b = nodes("b", seed="node-b", driver=driver_b, gpu_specs=specs_b)
    _, tags, archive, frozen = checkpoint_on(a, a.lab.uuids[:1], tmp_path / "transit")
    r = b.migrate("restore", str(archive))
    assert_refused_cleanly(b, r, Exit.NOT_HERE, reason)
    assert counters(b.lab, tags) == {t: 0 for t in tags}
    # Node A, on its own GPUs, restores the same archive.
    r = a.migrate("restore", str(archive), "--name", "back")
    assert r.returncode == 0, r.stdout + r.stderr
    wait_healthy(a.lab, tags, frozen)


def test_a_node_without_the_image_is_told_to_pull_it(nodes: Any, tmp_path: Path,
                                                      image: Path) -> None:
    a = nodes("a", seed="node-a")
    b = nodes("b", seed="node-b", with_image=False)
    _, tags, archive, frozen = checkpoint_on(a, a.lab.uuids[:1], tmp_path / "transit")
    r = b.migrate("restore", str(archive))
    assert_refused_cleanly(b, r, Exit.ENVIRONMENT, f"image {IMAGE}")
    assert "pull" in r.stderr
    b.podman.load(image)  # as from the registry
    r = b.migrate("restore", str(archive))
    assert r.returncode == 0, r.stdout + r.stderr
    wait_healthy(b.lab, tags, frozen)


def test_gpus_chosen_on_the_same_node(nodes: Any, tmp_path: Path) -> None:
    """--gpus picks the target GPUs; on the node the checkpoint came from,
    another GPU than the one it ran on."""
    a = nodes("a", seed="node-a")
    first, second = a.lab.uuids
    _, tags, archive, frozen = checkpoint_on(a, [first], tmp_path / "transit")
    r = a.migrate("restore", str(archive), "--name", "moved", "--gpus", second, "--json")
    assert r.returncode == 0, r.stdout + r.stderr
    assert json.loads(r.stdout)["device_map"] == {first: second}
    reports = wait_healthy(a.lab, tags, frozen)
    assert {st["gpu"] for st in reports.values()} == {second}
    r = a.migrate("restore", str(archive), "--name", "again", "--gpus", "GPU-nope")
    assert r.returncode == Exit.USAGE and "this node has no GPU GPU-nope" in r.stderr, r.stderr


@pytest.mark.parametrize("damage", ["flipped", "truncated", "truncated-unverified"])
def test_a_damaged_archive_is_refused_cleanly(nodes: Any, tmp_path: Path, damage: str) -> None:
    a = nodes("a", seed="node-a")
    b = nodes("b", seed="node-b")
    _, tags, archive, frozen = checkpoint_on(a, a.lab.uuids[:1], tmp_path / "transit")
    data = bytearray(archive.read_bytes())
    if damage == "flipped":
        data[len(data) // 2] ^= 0xFF
    else:
        del data[len(data) * 2 // 3:]
    archive.write_bytes(bytes(data))
    args = ["restore", str(archive)] + (["--no-verify"] if damage.endswith("unverified") else [])
    r = b.migrate(*args)
    why = "not a complete checkpoint archive" if damage.endswith("unverified") else "does not match"
    assert_refused_cleanly(b, r, Exit.USAGE, why)
    assert counters(b.lab, tags) == {t: 0 for t in tags}  # nothing ran on B
    assert counters(a.lab, tags) == frozen


def test_remove_only_own__a_failed_restore_removes_its_own_container(nodes: Any,
                                                                    tmp_path: Path) -> None:
    """podman creates the container, then CRIU fails (node B's CRIU runs an
    action script that refuses): that container, this restore's, goes."""
    a = nodes("a", seed="node-a")
    b = nodes("b", seed="node-b")
    _, tags, archive, _ = checkpoint_on(a, a.lab.uuids[:1], tmp_path / "transit")
    (b.dir / "etc/criu/runc.conf").write_text("action-script /bin/false\n")
    r = b.migrate("restore", str(archive), "--name", "moved")
    assert r.returncode == Exit.FAILED, r.stdout + r.stderr
    assert b.containers() == []
    assert counters(b.lab, tags) == {t: 0 for t in tags}


def test_remove_only_own__a_container_made_meanwhile_under_that_name_stays(
        nodes: Any, tmp_path: Path) -> None:
    """Someone creates a container of the same name while the restore starts
    (podman then fails: the name is taken): theirs is not removed."""
    a = nodes("a", seed="node-a")
    b = nodes("b", seed="node-b")
    _, _, archive, _ = checkpoint_on(a, a.lab.uuids[:1], tmp_path / "transit")
    racer = tmp_path / "racing-podman"
    racer.write_text("#!/bin/sh\n"
                     f'[ "$1 $2" = "container restore" ] && {b.podman.command()} create '
                     f"--name taken {IMAGE} true >/dev/null\n"
                     f'exec {b.podman.command()} "$@"\n')
    racer.chmod(0o755)
    r = b.cudahook("migrate", "restore", str(archive), "--name", "taken", "--podman", str(racer))
    assert r.returncode == Exit.FAILED, r.stdout + r.stderr
    assert b.containers() == ["taken"]
    assert b.podman.state("taken") == "created"  # theirs, untouched


# -- runc: the image directory packed into a tar --------------------------------


def sh(*argv: str, cwd: Path | None = None) -> None:
    r = subprocess.run(list(argv), capture_output=True, text=True, cwd=cwd, timeout=300,
                       check=False)
    assert r.returncode == 0, (argv, r.stdout, r.stderr)


@pytest.mark.parametrize("gpu_memory", ["host", "storage"])
def test_runc_recipe_moves_the_container(make_env: Any, tmp_path: Path, gpu_memory: str) -> None:
    """README's runc recipe: runc checkpoint, tar + sha256sum, copy, check,
    unpack, runc restore with node B's bundle naming node B's GPU. On the
    storage path the tar carries cudahook-gpu/, and the memory comes back
    intact through the device map."""
    from .test_gpu_storage_e2e import configure

    a = make_env(seed="node-a")
    b = make_env(seed="node-b")
    check = gpu_memory == "storage"
    if check:
        for env in (a, b):
            env.lab.set(cuda_version=13040)
            configure(env, gpu_memory)
    workloads = [("solo", {"mib": 4, "check_after_restore": check}),
                 ("mp", {"mib": 2, "procs": 2, "check_after_restore": check})]
    tags = ["solo", "mp.0", "mp.1"]
    cid = f"gpu-{uuid.uuid4().hex[:8]}"
    r = a.box.run(cid, a.box.bundle("b1", workloads, others=OTHERS, visible=a.lab.uuids[:1]))
    assert r.returncode == 0, r.stderr
    a.wait_running(tags, steps=3)
    image = tmp_path / "a-image"
    r = a.box.checkpoint(cid, image)
    assert r.returncode == 0, r.stderr
    frozen = a.frozen(cid, tags)
    m = manifest.read(image)
    assert m is not None and (m.gpu_storage is not None) == check
    # node A: pack and sum; the copy; node B: check and unpack
    sh("tar", "-C", str(image), "-czf", str(tmp_path / "ckpt.tar.gz"), ".")
    sh("sh", "-c", "sha256sum ckpt.tar.gz > ckpt.tar.gz.sha256", cwd=tmp_path)
    transit = tmp_path / "transit"
    transit.mkdir()
    for f in ("ckpt.tar.gz", "ckpt.tar.gz.sha256"):
        shutil.copyfile(tmp_path / f, transit / f)
    sh("sha256sum", "-c", "ckpt.tar.gz.sha256", cwd=transit)
    restored = tmp_path / "b-image"
    restored.mkdir()
    sh("tar", "-C", str(restored), "-xzf", str(transit / "ckpt.tar.gz"))
    assert tree_digest(restored) == tree_digest(image)
    bundle = b.box.bundle("b2", workloads, others=OTHERS, visible=b.lab.uuids[:1])
    r = b.box.restore(cid, bundle, restored)
    assert r.returncode == 0, r.stderr
    for t in tags:
        st = b.lab.wait_counter(t, frozen[t] + 11, timeout=30)
        assert st["intact"] and st["errors"] == [] and st["gpu"] == b.lab.uuids[0], st
        assert st.get("checked_restores", 0) >= int(check), st
    (restore,) = b.events("restore")
    assert restore["device_map"] == {a.lab.uuids[0]: b.lab.uuids[0]}
    assert a.events("restore") == []


def test_runc_recipe_onto_too_few_gpus_is_refused_before_tasks_run(make_env: Any,
                                                                   tmp_path: Path) -> None:
    a = make_env(seed="node-a", gpus=2)
    b = make_env(seed="node-b", gpus=1)
    workloads = [("solo", {"mib": 4})]
    cid = f"gpu-{uuid.uuid4().hex[:8]}"
    r = a.box.run(cid, a.box.bundle("b1", workloads, others=OTHERS, visible=a.lab.uuids))
    assert r.returncode == 0, r.stderr
    a.wait_running(["solo"], steps=3)
    image = tmp_path / "img"
    assert a.box.checkpoint(cid, image).returncode == 0
    frozen = a.frozen(cid, ["solo"])
    bundle = b.box.bundle("b2", workloads, others=OTHERS, visible=b.lab.uuids)
    r = b.box.restore(cid, bundle, image)
    assert r.returncode != 0
    log = (tmp_path / "img.rwork" / "restore.log").read_text()
    assert "(exit 6)" in log, log
    st = b.box.state(cid)
    assert st is None or st["status"] == "stopped"
    assert b.lab.status("solo").get("counter", frozen["solo"]) == frozen["solo"]
    assert b.events("restore") == []



def test_a_failed_checkpoint_leaves_the_workload_then_leave_running_clones_it(
        nodes: Any, tmp_path: Path) -> None:
    a = nodes("a", seed="node-a")
    b = nodes("b", seed="node-b")
    name, tags = a.run(a.lab.uuids[:1], [("mp", {"mib": 2, "procs": 3})])
    wait_healthy(a.lab, tags, {}, steps=3)
    archive = tmp_path / "out" / "job.tar.gz"
    archive.parent.mkdir()
    a.lab.fault("checkpoint", tag=tags[1], code=2)
    try:
        r = a.migrate("checkpoint", name, str(archive))
    finally:
        a.lab.clear_faults()
    assert r.returncode == Exit.FAILED, r.stdout + r.stderr
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and "out of memory" in lines[0], r.stderr
    assert sorted(p.name for p in archive.parent.iterdir()) == []  # no archive, no .partial
    assert a.podman.state(name) == "running"
    wait_healthy(a.lab, tags, counters(a.lab, tags))

    # --leave-running: the checkpoint's copy starts on B while A's goes on.
    r = a.migrate("checkpoint", "--leave-running", name, str(archive))
    assert r.returncode == 0, r.stdout + r.stderr
    at_checkpoint = counters(a.lab, tags)
    r = b.migrate("restore", str(archive), "--name", "clone")
    assert r.returncode == 0, r.stdout + r.stderr
    assert a.podman.state(name) == "running" and b.podman.state("clone") == "running"
    wait_healthy(a.lab, tags, counters(a.lab, tags))
    reports = wait_healthy(b.lab, tags, {t: at_checkpoint[t] - 3 for t in tags})
    assert {st["gpu"] for st in reports.values()} == {b.lab.uuids[0]}


def test_storage_path_archive_carries_the_chunks(nodes: Any, tmp_path: Path, capsys) -> None:  # type: ignore[no-untyped-def]
    """`gpu_memory: storage`: the archive carries cudahook-gpu/ (its chunks
    pass the reader's member rules and caps); one byte changed in a chunk,
    the archive re-packed and its checksum made anew (as whoever supplied
    it would), is refused by the chunk's digest before podman creates
    anything; the intact archive restores onto node B's GPU, intact."""
    import tarfile

    from .test_storage_runtimes import split_sizes, with_flipped_chunk

    a = nodes("a", seed="node-a", gpu_memory="storage")
    b = nodes("b", seed="node-b", gpu_memory="storage")
    workloads = [("solo", {"mib": 40, "check_after_restore": True}),
                 ("mp", {"mib": 2, "procs": 2, "check_after_restore": True})]
    _, tags, archive, frozen = checkpoint_on(a, a.lab.uuids[:1], tmp_path / "transit", workloads)
    with tarfile.open(archive) as t:
        sizes = {x.name: x.size for x in t.getmembers() if x.isfile()}
        # A deduplicated chunk (a hard link) counts as the bytes it holds.
        files = [(x.name, sizes[x.linkname] if x.islnk() else x.size) for x in t.getmembers()
                 if (x.isfile() or x.islnk()) and x.name.startswith("checkpoint/")]
        raw = t.extractfile("checkpoint/" + manifest.NAME)
        assert raw is not None
        m = manifest.parse(raw.read())
    assert m.gpu_storage is not None
    criu, gpu = split_sizes(files)
    with capsys.disabled():
        print(f"\nmigrate (podman export): CRIU image {criu / 2**20:.1f} MiB, cudahook-gpu/ "
              f"{gpu / 2**20:.1f} MiB ({m.gpu_storage.bytes / 2**20:.1f} MiB of GPU memory)")
    assert gpu >= m.gpu_storage.bytes >= 44 << 20 and criu < m.gpu_storage.bytes

    solo = next(p for p in m.gpu_storage.processes if len(p.files()) > 1)
    # A chunk stored as a file (the solo's equal chunks are links to its first).
    chunk = next(f"{manifest.STORAGE_DIR}/{solo.nspid}/{f.name}" for f in solo.files()
                 if f"checkpoint/{manifest.STORAGE_DIR}/{solo.nspid}/{f.name}" in sizes)
    bad = with_flipped_chunk(archive, tmp_path / "bad.tar", f"checkpoint/{chunk}")
    sh("sh", "-c", "sha256sum bad.tar > bad.tar.sha256", cwd=tmp_path)
    digest = hashlib.sha256(bad.read_bytes()).hexdigest()
    r = b.migrate("restore", str(bad), "--name", "bad")
    assert_refused_cleanly(b, r, Exit.NOT_HERE,
                           f"{chunk!r}: {m.gpu_storage.digest} or size differs")
    assert b.events("post-restore") == []  # refused before podman ran
    assert hashlib.sha256(bad.read_bytes()).hexdigest() == digest
    assert counters(b.lab, tags) == {t: 0 for t in tags}

    r = b.migrate("restore", str(archive), "--json")
    assert r.returncode == 0, r.stdout + r.stderr
    assert json.loads(r.stdout)["device_map"] == {a.lab.uuids[0]: b.lab.uuids[0]}
    reports = wait_healthy(b.lab, tags, frozen)
    assert {st["gpu"] for st in reports.values()} == {b.lab.uuids[0]}
    assert all(st.get("checked_restores", 0) >= 1 for st in reports.values()), reports


#: podman, with `--keep` added to a restore: the checkpoint it imported stays
#: in the container's directory for the test to look at.
KEEP_PODMAN = """
import os, sys
argv = sys.argv[1:]
for i in range(len(argv) - 1):
    if argv[i:i + 2] == ["container", "restore"]:
        argv.insert(i + 2, "--keep")
        break
os.execv(argv[0], argv)
"""


def test_storage_path_deduplicated_chunks_cross_as_hard_links(nodes: Any, tmp_path: Path,
                                                             capsys) -> None:  # type: ignore[no-untyped-def]
    """`gpu_storage_dedupe` (the default): processes holding the same weights
    store each shared chunk once, the others hard links to it, and podman's
    export holds those as tar hard links. migrate carries them as links (each
    checked as the chunk the manifest names) and node B restores every
    process intact from an image where the shared chunks are still one file."""
    import tarfile

    a = nodes("a", seed="node-a", gpu_memory="storage")
    b = nodes("b", seed="node-b", gpu_memory="storage")
    workloads = [("replica", {"mib": 20, "procs": 3, "same_weights": True, "content": "random",
                              "check_after_restore": True})]
    _, tags, archive, frozen = checkpoint_on(a, a.lab.uuids[:1], tmp_path / "transit", workloads)
    with tarfile.open(archive) as t:
        members = t.getmembers()
        raw = t.extractfile("checkpoint/" + manifest.NAME)
        assert raw is not None
        m = manifest.parse(raw.read())
    assert m.gpu_storage is not None and len(m.gpu_storage.processes) == 3
    gpu = f"checkpoint/{manifest.STORAGE_DIR}/"
    links = {x.name: x.linkname for x in members if x.islnk()}
    chunks = [x.name for x in members if x.isfile() and x.name.endswith(".chunk")]
    # Three processes, the same weights: their first (full) chunk stored once,
    # the others' a link to it.
    assert len(links) >= 2, (links, chunks)
    assert all(n.startswith(gpu) and t in chunks for n, t in links.items())
    names = {t: 1 + list(links.values()).count(t) for t in links.values()}
    with capsys.disabled():
        print(f"\nmigrate (deduplicated): {len(chunks)} chunk file(s), {len(links)} hard link(s) "
              f"in the export, {archive.stat().st_size / 2**20:.1f} MiB")

    wrapper = tmp_path / "keep-podman.py"
    wrapper.write_text(KEEP_PODMAN)
    r = b.cudahook("migrate", "restore", str(archive), "--json", "--podman",
                   f"{sys.executable} {wrapper} {b.podman.command()}")
    assert r.returncode == 0, r.stdout + r.stderr
    out = json.loads(r.stdout)
    assert out["device_map"] == {a.lab.uuids[0]: b.lab.uuids[0]}
    reports = wait_healthy(b.lab, tags, frozen)
    assert {st["gpu"] for st in reports.values()} == {b.lab.uuids[0]}
    assert all(st.get("checked_restores", 0) >= 1 for st in reports.values()), reports

    # The image podman unpacked on B: each shared chunk one file, a name per process.
    kept = Path(b.podman.inspect(out["container"])["StaticDir"]) / "checkpoint"
    count = ("import os, sys, json; d = sys.argv[1]; print(json.dumps({os.path.relpath(os.path"
             ".join(r, f), d): (os.lstat(os.path.join(r, f)).st_nlink, os.lstat(os.path.join(r, "
             "f)).st_ino) for r, _, fs in os.walk(d) for f in fs if f.endswith('.chunk')}))")
    res = subprocess.run(b.ns.wrap([sys.executable, "-c", count, str(kept)]),
                         capture_output=True, text=True, timeout=60, check=True)
    on_b = json.loads(res.stdout)
    assert len(on_b) == len(chunks) + len(links), on_b
    for name, target in links.items():
        here, there = on_b[name.removeprefix("checkpoint/")], on_b[target.removeprefix(
            "checkpoint/")]
        assert here[1] == there[1] and here[0] == names[target], (name, here, there)

    # podman's own --import takes the export as it is, links and all (on A,
    # whose GPUs its spec names).
    a.podman("container", "restore", "--import", str(archive), "--name", "plain-import")
    reports = wait_healthy(a.lab, tags, frozen)
    assert all(st.get("checked_restores", 0) >= 1 for st in reports.values()), reports
