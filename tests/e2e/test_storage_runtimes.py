"""GPU memory in storage (`gpu_memory: storage`, CUDA 13.4+ custom storage)
through containerd (ctr), docker and podman, cudahook installed by
install.sh as in test_runtimes.py: the GPU memory goes into `cudahook-gpu/`
of CRIU's image directory, so each runtime's own way of keeping and moving a
checkpoint carries it - containerd's content store, docker's checkpoint
directory, podman's exported archive - and CRIU's pages no longer hold it.
A workload counts as healthy only if, read after the operation, its counter
advances and its memory check passes.

Skipped for the reasons test_runtimes.py is skipped.
"""

from __future__ import annotations

import hashlib
import io
import json
import os
import re
import shutil
import subprocess
import tarfile
import time
import uuid
from collections.abc import Iterable, Iterator
from pathlib import Path

import pytest

from cudahook.core import manifest
from cudahook.flow.guardian import KEPT_INFIX
from cudahook.platform.store import Store

from .conftest import tree_digest
from .daemons import Containerd, DaemonError, Dockerd
from .outcomes import process_tree
from .podman import PODMAN, Podman
from .test_podman import gpu_container, podman, restored_copy, rootfs  # noqa: F401  (fixtures)
from .test_runtimes import (  # noqa: F401  (image is a fixture)
    DAEMON_JSON,
    Node,
    assert_hooked,
    ctr_leave_running,
    docker_gpu_task,
    docker_leave_running,
    gpu_memory,
    gpu_spec,
    image,
    installed_node,
    pytestmark,
    run_gpu_task,
)

pytestmark = [*pytestmark, pytest.mark.skipif(
    not os.access(PODMAN, os.X_OK), reason=f"podman not installed ({PODMAN})")]


@pytest.fixture(scope="module")
def node(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Node]:
    """containerd, docker and podman registered."""
    with installed_node(tmp_path_factory.mktemp("storage"), "containerd", "docker",
                        "podman") as n:
        yield n

# Enough GPU memory for the sizes to tell (two 16 MiB chunks and a part),
# the memory checked after every restore.
WORKLOADS = [("solo", {"mib": 40, "check_after_restore": True}),
             ("mp", {"mib": 2, "procs": 2, "check_after_restore": True})]
CHECKPOINT_TAR = "application/vnd.containerd.container.criu.checkpoint.criu.tar"


def split_sizes(members: Iterable[tuple[str, int]]) -> tuple[int, int]:
    """(bytes of CRIU's own files, bytes under cudahook-gpu/) of an image's
    files, given as (path in the image, size)."""
    criu = gpu = 0
    for name, size in members:
        if manifest.STORAGE_DIR in Path(name).parts:
            gpu += size
        else:
            criu += size
    return criu, gpu


def tar_files(t: tarfile.TarFile, under: str = "") -> list[tuple[str, int]]:
    """The files of a tar (under `under`), with their sizes; a hard link (a
    deduplicated chunk) counts as the bytes it holds."""
    sizes = {m.name: m.size for m in t.getmembers() if m.isfile()}
    return [(m.name, sizes[m.linkname] if m.islnk() else m.size) for m in t.getmembers()
            if (m.isfile() or m.islnk()) and m.name.startswith(under)]


def dir_files(root: Path) -> list[tuple[str, int]]:
    return [(str(p.relative_to(root)), p.lstat().st_size) for p in root.rglob("*")
            if p.is_file()]


def report(capsys, runtime: str, criu: int, gpu: int, gpu_bytes: int) -> None:  # type: ignore[no-untyped-def]
    with capsys.disabled():
        print(f"\n{runtime}: CRIU image {criu / 2**20:.1f} MiB, cudahook-gpu/ "
              f"{gpu / 2**20:.1f} MiB ({gpu_bytes / 2**20:.1f} MiB of GPU memory)")


def assert_outside_criu(criu: int, gpu: int, gpu_bytes: int) -> None:
    """The GPU memory is in cudahook-gpu/, and CRIU's pages do not hold it
    (the workloads' host memory is a fraction of it: python itself)."""
    assert gpu >= gpu_bytes >= 44 << 20, (gpu, gpu_bytes)
    assert criu < gpu_bytes, (criu, gpu_bytes)


def intact(at: Node, tags: list[str]) -> None:
    """Every workload checked its GPU memory after the restore, and it was whole."""
    for t in tags:
        st = at.lab.status(t)
        assert st["intact"] and not st["errors"] and st.get("checked_restores", 0) >= 1, st


def content_checkpoint(c: Containerd, ref: str) -> list[tuple[str, int]]:
    """The files of the CRIU image containerd keeps in its content store for
    checkpoint image `ref` (a tar blob), with their sizes."""
    index_digest = next(line.split()[2] for line in c.ctr("images", "ls").stdout.splitlines()[1:]
                        if line.split()[0] == ref)
    index = json.loads(c.ctr("content", "get", index_digest).stdout)
    (blob,) = [m["digest"] for m in index["manifests"] if m["mediaType"] == CHECKPOINT_TAR]
    r = subprocess.run(c.ctr_cmd("content", "get", blob), env=c.env, stdin=subprocess.DEVNULL,
                       capture_output=True, timeout=120, check=True)
    with tarfile.open(fileobj=io.BytesIO(r.stdout)) as t:
        return tar_files(t)


def nothing_kept(*dirs: Path, timeout: float = 10) -> None:
    """The chunks' hard links pre-dump kept for the guardian are gone (it
    removes them as it exits, after its last event)."""
    deadline = time.monotonic() + timeout
    while left := [p for d in dirs for p in d.rglob(f"*{KEPT_INFIX}*")]:
        assert time.monotonic() < deadline, left
        time.sleep(0.05)


def test_containerd_ctr_storage_path(node: Node, image: Path, tmp_path: Path,  # noqa: F811
                                     capsys) -> None:  # type: ignore[no-untyped-def]
    """ctr (runc --leave-running): the guardian brings the workloads back
    from the chunks once containerd resumes the task (containerd has
    removed CRIU's image directory by then: the chunks must outlive it);
    the checkpoint in the content store holds the chunks, and a restore
    from it comes back intact. (ctr restores the spec stored in the
    checkpoint, so it cannot name other GPUs, and `ctr images export`
    refuses a checkpoint image: docker, podman through migrate, and runc
    move a checkpoint.)"""
    spec = gpu_spec(node.lab, "cs", WORKLOADS)
    tags, cid, ref = spec.tags, f"gpu-{uuid.uuid4().hex[:8]}", "cudahook/storage:1"
    with gpu_memory(node, "storage"), \
            Containerd(tmp_path / "containerd", path_prefix=node.libexec / "runc-path") as c:
        pid, bundle = run_gpu_task(node, c, image, spec, cid)
        before, after = ctr_leave_running(node, c, cid, ref, pid, tags)
        last = Store(str(node.state_dir)).history()[cid]["checkpoint"]
        assert last["gpu_memory"] == "storage", last
        nothing_kept(node.state_dir, c.root.parent)
        criu, gpu = split_sizes(content_checkpoint(c, ref))
        report(capsys, "containerd (content store)", criu, gpu, last["gpu_bytes"])
        assert_outside_criu(criu, gpu, last["gpu_bytes"])

        c.remove(cid)
        with node.resumed(tags) as reports:
            new_pid = c.restore(cid, ref)
            first = reports.assert_from(before, after)
        node.wait_running(tags, first)
        intact(node, tags)
        assert_hooked(node, cid, bundle, new_pid)
        node.assert_no_errors(cid)
        c.remove(cid)


def flip(chunk: Path, at: int = 12345) -> None:
    """One changed byte in a chunk (twice: put right again)."""
    data = bytearray(chunk.read_bytes())
    data[at] ^= 0x20
    chunk.write_bytes(bytes(data))


def refused_checksum(at: Node, cid: str, said: str) -> None:
    """Post-restore refused the image on a chunk's checksum, before the
    tasks ran, and `cudahook status` keeps why."""
    check = Store(str(at.state_dir)).history()[cid]["check"]
    assert (check["side"], check["ok"], check["exit_code"]) == ("restore", False, 6), check
    assert "IMAGE_CHECKSUM" in str(check), check
    assert at.events(cid, "restore") == []
    assert "criu failed" in said, said


def test_docker_storage_path_moves_onto_another_gpu(node: Node, image: Path,  # noqa: F811
                                                    tmp_path: Path, capsys) -> None:  # type: ignore[no-untyped-def]
    """docker: --leave-running (the guardian brings the workloads back from
    the chunks it kept); a checkpoint into a directory of our choosing,
    copied into a new container naming GPU b (README's recipe); a byte
    changed in one of its chunks is refused before the tasks run, the copy
    unchanged; put right, the copy restores onto GPU b intact."""
    runtimes = json.loads(DAEMON_JSON.read_text())["runtimes"]
    a, b = node.lab.uuids[:2]
    spec = gpu_spec(node.lab, "ds", WORKLOADS)
    tags = spec.tags
    with gpu_memory(node, "storage"), \
            Dockerd(tmp_path / "dockerd", extra_config={"runtimes": runtimes}) as d:
        name = d.load_image(image)
        src = d.docker("run", "-d", *spec.docker_args(), name, *spec.cmd).stdout.strip()
        pid, _ = docker_gpu_task(node, d, src, tags)
        docker_leave_running(node, d, src, pid, tags, "live")
        nothing_kept(node.state_dir, d.data_root, tmp_path)

        ckdir = tmp_path / "checkpoints"
        tree = process_tree(pid)
        d.docker("checkpoint", "create", "--checkpoint-dir", str(ckdir), src, "move", timeout=120)
        frozen = node.frozen(tags, tree)
        m = manifest.read(ckdir / "move")
        assert m is not None and m.gpu_storage is not None
        criu, gpu = split_sizes(dir_files(ckdir / "move"))
        report(capsys, "docker (checkpoint dir)", criu, gpu, m.gpu_storage.bytes)
        assert_outside_criu(criu, gpu, m.gpu_storage.bytes)

        dst = d.docker("create", *spec.docker_args(spec.env_on(b)), name, *spec.cmd).stdout.strip()
        moved = d.data_root / "containers" / dst / "checkpoints" / "move"
        shutil.copytree(ckdir / "move", moved)
        solo = next(p for p in m.gpu_storage.processes if len(p.files()) > 1)
        chunk = moved / manifest.STORAGE_DIR / str(solo.nspid) / "gpu0-000001.chunk"
        flip(chunk)
        digest = tree_digest(moved)
        with pytest.raises(DaemonError) as failed:
            d.start_checkpoint(dst, "move")
        refused_checksum(node, dst, str(failed.value))
        assert not d.inspect(dst)["State"]["Running"]
        assert node.counters(tags) == frozen  # nothing ran
        assert tree_digest(moved) == digest

        flip(chunk)
        with node.resumed(tags) as reports:
            d.start_checkpoint(dst, "move")
            first = reports.assert_from(frozen, frozen)
        node.wait_running(tags, first)
        intact(node, tags)
        assert {node.lab.status(t)["gpu"] for t in tags} == {b}
        restore = node.events(dst, "restore")[-1]
        assert restore["device_map"] == {a: b}
        d.docker("rm", "-f", src, dst)


def with_flipped_chunk(archive: Path, out: Path, member: str, at: int = 12345) -> Path:
    """A copy of tar `archive` with one byte of `member` changed: what a
    damaged or doctored export looks like, its tar structure whole."""
    with tarfile.open(archive) as src, tarfile.open(out, "w", format=tarfile.PAX_FORMAT) as dst:
        for m in src.getmembers():
            f = src.extractfile(m) if m.isfile() else None
            if m.name == member:
                assert f is not None
                data = bytearray(f.read())
                data[at] ^= 0x20
                f = io.BytesIO(bytes(data))
            dst.addfile(m, f)
    return out


def sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def test_podman_storage_export_and_a_flipped_chunk(node: Node, podman: Podman,  # noqa: F811
                                                   tmp_path: Path, capsys) -> None:  # type: ignore[no-untyped-def]
    """podman `checkpoint --export` carries cudahook-gpu/ (with
    --leave-running the guardian brings the workloads back from its kept
    chunks); an export with one byte changed in a chunk is refused at
    restore before the tasks run, the archive unchanged; the intact export
    restores as a copy."""
    with gpu_memory(node, "storage"):
        name, tags = gpu_container(podman, node.lab, "ps", workloads=WORKLOADS)
        node.wait_running(tags, steps=3)
        # --leave-running --export: the guardian restores the running
        # workloads from the chunks, as podman exports the image.
        cid = podman.inspect(name)["Id"]
        podman("container", "checkpoint", "--leave-running", "--export",
               str(tmp_path / "live.tar"), "--compress", "none", name)
        after = node.counters(tags)
        node.wait_event(cid, "guardian", lambda e: "resumed" in e.get("outcome", ""))
        node.wait_running(tags, after)
        nothing_kept(node.state_dir, Path(podman.inspect(name)["OCIConfigPath"]).parent)
        tree = process_tree(podman.pid(name))
        archive = tmp_path / "ckpt.tar"
        podman("container", "checkpoint", "--export", str(archive), "--compress", "none", name)
        frozen = node.frozen(tags, tree)
        with tarfile.open(archive) as t:
            stored = {x.name for x in t.getmembers() if x.isfile()}
            files = tar_files(t, "checkpoint/")
            raw = t.extractfile("checkpoint/" + manifest.NAME)
            assert raw is not None
            m = manifest.parse(raw.read())
        assert m.gpu_storage is not None
        criu, gpu = split_sizes(files)
        report(capsys, "podman (export)", criu, gpu, m.gpu_storage.bytes)
        assert_outside_criu(criu, gpu, m.gpu_storage.bytes)
        podman("rm", "-f", "-t", "0", name)

        solo = next(p for p in m.gpu_storage.processes if len(p.files()) > 1)
        # A chunk stored as a file (the solo's equal chunks are links to its first).
        member = next(f"checkpoint/{manifest.STORAGE_DIR}/{solo.nspid}/{f.name}"
                      for f in solo.files()[1:]
                      if f"checkpoint/{manifest.STORAGE_DIR}/{solo.nspid}/{f.name}" in stored)
        bad = with_flipped_chunk(archive, tmp_path / "bad.tar", member)
        digest = sha256(bad)
        r = podman("container", "restore", "--import", str(bad), "--name", f"{name}-bad",
                   check=False)
        assert r.returncode != 0
        said = r.stdout + r.stderr
        log = re.search(r"log file: (\S+restore\.log)", said)
        assert log, said
        reason = [x for x in Path(log.group(1)).read_text().splitlines() if "cudahook: " in x]
        assert any("IMAGE_CHECKSUM" in x or "sha256" in x for x in reason), reason
        assert "running" not in podman("ps", "-a", "--format", "{{.State}}").stdout
        time.sleep(0.3)
        assert node.counters(tags) == frozen  # nothing ran
        assert sha256(bad) == digest
        podman("rm", "-f", "-t", "0", f"{name}-bad", check=False)

        copy = f"{name}-copy"
        restored_copy(node, podman, archive, copy, tags, frozen)
        intact(node, tags)
        podman("rm", "-f", "-t", "0", copy)
