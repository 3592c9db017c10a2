"""GPU memory in storage (CUDA 13.4+ custom storage) through the CRIU action
script: pre-dump checkpoints each process into `<image>/cudahook-gpu/<nspid>/`,
the manifest records every chunk, post-restore verifies them all and
post-resume restores from them; a failure at any chunk, on either side,
leaves the workload running intact (checkpoint) or fails closed with the
image unchanged (restore). The installed script, a simulated CUDA 13.4 node."""

from __future__ import annotations

import hashlib
import json
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
import yaml

from cudahook.admin import hookfiles
from cudahook.core import manifest

from .conftest import Node
from .test_criu_action import SCRUBBED, events

MIB = 40  # three 16 MiB chunks: 16, 16, 8 MiB (+8 bytes)
CHUNKS = 3
# Two processes that hold the same weights (the same seed): their first two
# chunks are alike, and alike across them, so every image here is deduped.
TAGS = ("a", "b")
COMPRESSION = ("off", "zstd")

# Plays CRIU for a dump: pre-dump twice (CRIU 3.19-4.1.1), then lives on
# until told, as CRIU does while it dumps.
DUMPER = """
import json, subprocess, sys
script, env = sys.argv[1], json.loads(sys.argv[2])
r = [subprocess.run([script], env=env, capture_output=True, text=True) for _ in range(2)]
print(json.dumps([[x.returncode, x.stderr] for x in r]), flush=True)
sys.stdin.readline()
"""

# Plays CRIU for a restore: post-restore, then (if it passed) post-resume.
RESTORER = """
import json, subprocess, sys
script, env = sys.argv[1], json.loads(sys.argv[2])
out = []
for action in ("post-restore", "post-resume"):
    r = subprocess.run([script], env={**env, "CRTOOLS_SCRIPT_ACTION": action},
                       capture_output=True, text=True)
    out.append([r.returncode, r.stderr])
    if r.returncode:
        break
print(json.dumps(out))
"""


@pytest.fixture
def backend_kind() -> str:
    return "driver-api"


def storage_node(make_node: Any) -> Node:
    node = make_node(driver=590)
    node.lab.set(cuda_version=13040)  # a CUDA 13.4+ driver: custom storage
    return node


def install(tmp: Path, node: Node, gpu_memory: str = "storage", **over: Any) -> Path:
    config = tmp / "cudahook.yaml"
    config.write_text(yaml.safe_dump(dict(node.settings(gpu_memory=gpu_memory,
                                                        **over).__dict__)))
    return hookfiles.install(tmp / "hooks", python=sys.executable,
                             config=str(config))["cudahook-criu-action"]


class Dump:
    """One CRIU dump run (its parent process), alive until `end`."""

    def __init__(self, script: Path, image: Path, init: int):
        env = {**SCRUBBED, "CRTOOLS_SCRIPT_ACTION": "pre-dump", "CRTOOLS_INIT_PID": str(init),
               "CRTOOLS_IMAGE_DIR": str(image)}
        self.proc = subprocess.Popen([sys.executable, "-c", DUMPER, str(script), json.dumps(env)],
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        assert self.proc.stdout is not None
        self.calls = json.loads(self.proc.stdout.readline())

    def end(self) -> None:
        self.proc.communicate("\n", timeout=30)


def restore(script: Path, image: Path, init: int) -> list[list[Any]]:
    env = {**SCRUBBED, "CRTOOLS_INIT_PID": str(init), "CRTOOLS_IMAGE_DIR": str(image)}
    r = subprocess.run([sys.executable, "-c", RESTORER, str(script), json.dumps(env)],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    return json.loads(r.stdout)  # type: ignore[no-any-return]


def tree(image: Path) -> dict[str, str]:
    """Every file of the image by its sha256: unchanged means unchanged."""
    return {str(p.relative_to(image)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(image.rglob("*")) if p.is_file()}


def state(node: Node, pid: int) -> str:
    return subprocess.run([str(node.lab.cuda_checkpoint), "--get-state", "--pid", str(pid)],
                          capture_output=True, text=True).stdout.strip()


def healthy(node: Node, tags: tuple[str, ...] = TAGS, restored: bool = False) -> None:
    """Read after: each counter advances and each memory check passes."""
    for t in tags:
        before = node.lab.status(t)["counter"]
        deadline = time.monotonic() + 30
        while True:
            st = node.lab.status(t)
            if st["counter"] > before + 3 and (not restored or st.get("checked_restores", 0) >= 1):
                break
            assert time.monotonic() < deadline, st
            time.sleep(0.05)
        assert st["intact"] and not st["errors"], st


def workloads(node: Node) -> tuple[int, list[int]]:
    init = node.spawn_tree(*((t, {"mib": MIB, "check_after_restore": True}) for t in TAGS))
    return init.pid, sorted(node.lab.wait_counter(t, 2)["pid"] for t in TAGS)


def test_checkpoint_and_restore_through_storage_in_the_image(make_node: Any,
                                                              tmp_path: Path) -> None:
    node = storage_node(make_node)
    script = install(tmp_path, node)
    image = tmp_path / "img"
    image.mkdir()
    init, pids = workloads(node)
    dump = Dump(script, image, init)
    try:
        assert dump.calls[0][0] == 0, dump.calls
        assert [state(node, p) for p in pids] == ["checkpointed"] * 2
        m = manifest.read(image)
        assert m is not None and m.version == manifest.PACKED_VERSION
        assert m.gpu_storage is not None and m.gpu_storage.dir == "cudahook-gpu"
        assert m.gpu_storage.digest == "blake3"
        assert sorted(p.nspid for p in m.gpu_storage.processes) == pids
        import blake3

        for p in m.gpu_storage.processes:
            assert [r.size for r in p.ranges] == [(MIB << 20) + 8]
            assert len(p.files()) == CHUNKS
            for f in p.files():
                data = (image / "cudahook-gpu" / str(p.nspid) / f.name).read_bytes()
                assert (len(data), blake3.blake3(data).hexdigest()) == (f.size, f.digest)
        # Stored once: the index is gone, the chunks alike are one file.
        assert sorted(x.name for x in (image / "cudahook-gpu").iterdir()) == \
            sorted(map(str, pids))
        def chunk(p: int, k: int) -> Path:
            return image / "cudahook-gpu" / str(p) / f"gpu0-00000{k}.chunk"

        # Each full chunk (the same weights) is one file for both processes;
        # the tails hold each one's counter: one file only when they agree.
        for k in range(CHUNKS - 1):
            assert len({chunk(p, k).stat().st_ino for p in pids}) == 1
        tails = [chunk(p, CHUNKS - 1) for p in pids]
        same = tails[0].read_bytes() == tails[1].read_bytes()
        assert (tails[0].stat().st_ino == tails[1].stat().st_ino) == same
        # The memory is in the image, not in the processes: the GPU let it go.
        assert not any(p["pid"] in pids for g in node.lab.info()["gpus"]
                       for p in g["processes"])
        before = tree(image)
        steps = restore(script, image, init)
        assert [s[0] for s in steps] == [0, 0], steps
        assert tree(image) == before  # a restore reads the image, never writes it
        healthy(node, restored=True)
    finally:
        dump.end()
    ok = [e for e in events(node, "checkpoint") if "error" not in e]
    assert ok, events(node)


def test_host_stays_the_default_path(make_node: Any, tmp_path: Path) -> None:
    """gpu_memory: host on the same CUDA 13.4 node: no storage, version 1."""
    node = storage_node(make_node)
    script = install(tmp_path, node, gpu_memory="host")
    image = tmp_path / "img"
    image.mkdir()
    init, pids = workloads(node)
    dump = Dump(script, image, init)
    try:
        assert dump.calls[0][0] == 0, dump.calls
        m = manifest.read(image)
        assert m is not None and m.version == manifest.VERSION and m.gpu_storage is None
        assert not (image / "cudahook-gpu").exists()
        assert [state(node, p) for p in pids] == ["checkpointed"] * 2
    finally:
        dump.end()
    healthy(node)  # the dump's "CRIU" exited: the guardian brought them back


@pytest.mark.parametrize(("sequential", "compression"),
                         [(False, "off"), (True, "off"), (False, "zstd"), (True, "zstd")])
@pytest.mark.parametrize("chunk", range(CHUNKS))
def test_a_failed_chunk_at_checkpoint_leaves_the_workload_running_intact(
        make_node: Any, tmp_path: Path, chunk: int, sequential: bool, compression: str) -> None:
    """`sequential`: the first process is wholly in storage when the second
    fails, and comes back from there; the second links the first's chunks
    (the same weights), and its put-back removes none of them."""
    node = storage_node(make_node)
    script = install(tmp_path, node, sequential=sequential,
                     gpu_storage_compression=compression)
    image = tmp_path / "img"
    image.mkdir()
    init, pids = workloads(node)
    # The second process fails at this chunk; the first may be done by then,
    # and must come back from its storage.
    node.lab.fault("copy-out", "error", code=999, pid=pids[1], skip=chunk, times=1)
    dump = Dump(script, image, init)
    try:
        assert dump.calls[0][0] != 0, dump.calls
        assert "put back" in dump.calls[0][1], dump.calls
        # Read while "CRIU" is still alive: no guardian has acted yet.
        assert [state(node, p) for p in pids] == ["running"] * 2
        healthy(node)
        assert manifest.read(image) is None
        assert not (image / "cudahook-gpu").exists()  # what it wrote is gone
        if sequential:  # the first was wholly in storage: restored from there
            steps = events(node, "checkpoint")[-1]["timeline"]["steps"]
            assert {(s["pid"], s["step"]) for s in steps if s.get("ok", True)} >= {
                (pids[0], "checkpoint"), (pids[0], "rollback-restore"),
                (pids[0], "rollback-unlock"), (pids[1], "rollback-unlock")}, steps
    finally:
        dump.end()


def test_storage_asked_for_without_the_driver_is_refused_untouched(make_node: Any,
                                                                   tmp_path: Path) -> None:
    node = make_node(driver=590)  # CUDA 13.1: no custom storage
    script = install(tmp_path, node)
    image = tmp_path / "img"
    image.mkdir()
    init, pids = workloads(node)
    counters = {t: node.lab.status(t)["counter"] for t in TAGS}
    dump = Dump(script, image, init)
    try:
        rc, err = dump.calls[0]
        assert rc == 5 and "GPU_STORAGE_UNAVAILABLE" in err and "nothing was locked" in err
        assert [state(node, p) for p in pids] == ["running"] * 2
        assert list(image.iterdir()) == []
    finally:
        dump.end()
    healthy(node)
    assert all(node.lab.status(t)["counter"] > counters[t] for t in TAGS)


def checkpointed(node: Node, tmp_path: Path, compression: str = "off"
                 ) -> tuple[Path, Path, int, list[int], Dump]:
    script = install(tmp_path, node, gpu_storage_compression=compression)
    image = tmp_path / "img"
    image.mkdir()
    init, pids = workloads(node)
    dump = Dump(script, image, init)
    assert dump.calls[0][0] == 0, dump.calls
    return script, image, init, pids, dump


@pytest.mark.parametrize("compression", COMPRESSION)
@pytest.mark.parametrize("chunk", range(CHUNKS))
def test_a_flipped_bit_in_any_chunk_is_refused_at_post_restore(make_node: Any, tmp_path: Path,
                                                                chunk: int,
                                                                compression: str) -> None:
    node = storage_node(make_node)
    script, image, init, pids, dump = checkpointed(node, tmp_path, compression)
    try:
        path = image / "cudahook-gpu" / str(pids[1]) / f"gpu0-{chunk:06d}.chunk"
        data = bytearray(path.read_bytes())
        data[len(data) // 2] ^= 0x01
        path.write_bytes(bytes(data))
        before = tree(image)
        steps = restore(script, image, init)
        assert len(steps) == 1 and steps[0][0] == 6, steps  # refused at post-restore
        assert "IMAGE_CHECKSUM" in steps[0][1] and path.name in steps[0][1], steps
        assert [state(node, p) for p in pids] == ["checkpointed"] * 2  # nothing released
        assert tree(image) == before
        # Put right, the same image restores.
        data[len(data) // 2] ^= 0x01
        path.write_bytes(bytes(data))
        steps = restore(script, image, init)
        assert [s[0] for s in steps] == [0, 0], steps
        healthy(node, restored=True)
    finally:
        dump.end()


@pytest.mark.parametrize("compression", COMPRESSION)
@pytest.mark.parametrize("chunk", range(CHUNKS))
def test_a_failed_chunk_at_restore_fails_closed_with_the_image_unchanged(
        make_node: Any, tmp_path: Path, chunk: int, compression: str) -> None:
    node = storage_node(make_node)
    script, image, init, pids, dump = checkpointed(node, tmp_path, compression)
    try:
        before = tree(image)
        node.lab.fault("copy-in", "error", code=999, pid=pids[1], skip=chunk, times=1)
        steps = restore(script, image, init)
        assert steps[0][0] == 0 and steps[1][0] != 0, steps
        assert "container killed" in steps[1][1], steps
        deadline = time.monotonic() + 10
        while not all(gone(p) for p in [init, *pids]):
            assert time.monotonic() < deadline, "a half-restored workload was left alive"
            time.sleep(0.05)
        assert tree(image) == before
    finally:
        dump.end()
    # The image is as good as it was: the checks a retry runs pass it.
    from .test_cli import cli

    r = cli("check", "--image", str(image), config=script.parent.parent / "cudahook.yaml")
    assert "IMAGE_CHECKSUM" not in r.stdout + r.stderr, r.stdout + r.stderr


def gone(pid: int) -> bool:
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return True
    return stat[stat.rindex(")") + 2] == "Z"


def resumed_by_the_guardian(node: Any, pids: list[int]) -> None:
    """The guardian's one event names every process, with no error, and each
    is running again, healthy after."""
    deadline = time.monotonic() + 30
    while not events(node, "guardian"):
        assert time.monotonic() < deadline, events(node)
        time.sleep(0.05)
    g = events(node, "guardian")[0]
    assert "error" not in g and sorted(g["pids"]) == pids, g
    assert [state(node, p) for p in pids] == ["running"] * 2
    healthy(node, restored=True)


def test_a_dump_that_fails_after_pre_dump_is_mended_from_storage(make_node: Any,
                                                                 tmp_path: Path) -> None:
    """CRIU gone after a storage pre-dump (a failed dump): the guardian
    brings every process back from the image's chunks."""
    node = storage_node(make_node)
    _, _, _, pids, dump = checkpointed(node, tmp_path, "zstd")
    dump.end()
    resumed_by_the_guardian(node, pids)


def test_a_runtime_that_removes_the_image_early_is_mended_from_the_kept_chunks(
        make_node: Any, tmp_path: Path) -> None:
    """containerd's task service removes CRIU's image directory (copied into
    its content store) before the task runs again: the guardian restores
    from the hard links pre-dump kept, and removes them when done."""
    import shutil

    from cudahook.flow.guardian import KEPT_INFIX

    node = storage_node(make_node)
    _, image, _, pids, dump = checkpointed(node, tmp_path)
    shutil.rmtree(image)
    assert [p.name for p in tmp_path.iterdir() if KEPT_INFIX in p.name]
    dump.end()
    resumed_by_the_guardian(node, pids)
    deadline = time.monotonic() + 10
    while [p for root in (tmp_path, Path(node.settings().state_dir))
           for p in root.rglob(f"*{KEPT_INFIX}*")]:
        assert time.monotonic() < deadline, "the kept chunks outlived the guardian"
        time.sleep(0.05)


def small_disk(tmp_path: Path, mib: int) -> Path:
    """An image directory on a file system of `mib` MiB of its own."""
    image = tmp_path / "small-img"
    image.mkdir()
    if subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={mib}m", "tmpfs",
                       str(image)]).returncode:
        pytest.skip("cannot mount a tmpfs")
    return image


def test_a_full_disk_is_refused_before_anything_is_locked(make_node: Any,
                                                          tmp_path: Path) -> None:
    node = storage_node(make_node)
    script = install(tmp_path, node)
    init, pids = workloads(node)
    image = small_disk(tmp_path, 2 * MIB)  # two processes of MIB each: no room
    try:
        dump = Dump(script, image, init)
        try:
            rc, err = dump.calls[0]
            assert rc != 0 and "IMAGE_SPACE" in err and "nothing was locked" in err, dump.calls
            assert [state(node, p) for p in pids] == ["running"] * 2
            assert list(image.iterdir()) == []
        finally:
            dump.end()
        healthy(node)
    finally:
        subprocess.run(["umount", str(image)])


def test_the_reserved_space_holds_while_the_processes_are_locked(make_node: Any,
                                                                 tmp_path: Path) -> None:
    """The disk fills (someone else's writes) after pre-dump preallocated the
    GPU memory's space and while the processes are being locked: the
    copy-out still has its space, and the checkpoint completes."""
    node = storage_node(make_node)
    script = install(tmp_path, node)
    init, pids = workloads(node)
    image = small_disk(tmp_path, 2 * MIB + 24)
    node.lab.fault("lock", "delay", seconds=2, pid=pids[0], times=1)
    filled: list[int] = []

    def fill() -> None:
        root = image / manifest.STORAGE_DIR
        deadline = time.monotonic() + 60
        while not root.exists():  # pre-dump's reservation is being made
            assert time.monotonic() < deadline
            time.sleep(0.01)
        time.sleep(0.5)  # made; the first lock now waits out its delay
        with open(image / "someone-else", "wb") as f:
            try:
                while True:
                    f.write(b"\xff" * (1 << 20))
                    f.flush()
                    filled.append(1)
            except OSError:
                pass

    import threading

    filler = threading.Thread(target=fill)
    filler.start()
    try:
        dump = Dump(script, image, init)
        filler.join()
        try:
            assert filled, "the disk was never filled"
            assert dump.calls[0][0] == 0, dump.calls
            assert [state(node, p) for p in pids] == ["checkpointed"] * 2
            m = manifest.read(image)
            assert m is not None and m.gpu_storage is not None
            import blake3

            assert m.gpu_storage.digest == "blake3"
            for p in m.gpu_storage.processes:
                for f in p.files():
                    data = (image / "cudahook-gpu" / str(p.nspid) / f.name).read_bytes()
                    assert (len(data), blake3.blake3(data).hexdigest()) == (f.size, f.digest)
            assert not (image / "cudahook-gpu" / manifest.STORAGE_RESERVE).exists()
            (image / "someone-else").unlink()  # room for CRIU's own image again
            steps = restore(script, image, init)
            assert [s[0] for s in steps] == [0, 0], steps
            healthy(node, restored=True)
        finally:
            dump.end()
    finally:
        subprocess.run(["umount", str(image)])
