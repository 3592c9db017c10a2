"""The driver-API backend finds CUDA 13.4's custom storage by asking the
driver (cuGetProcAddress), and `cudahook features` and doctor say which
GPU-memory path a container gets under `gpu_memory`, and why."""

from __future__ import annotations

import json
import shutil
import tempfile
from pathlib import Path
from typing import Any

import pytest

from cudahook.core.backends import Features, gpu_memory_path, make_backend, probe
from cudahook.core.backends.driver_api import DriverAPI
from cudahook.platform.host import Host

from .test_cli import cli, write_config


def storage_node(make_node, **kw):  # type: ignore[no-untyped-def]
    node = make_node(**kw)
    node.lab.set(cuda_version=13040)  # a CUDA 13.4+ driver
    return node


@pytest.mark.parametrize(("cuda_version", "have", "why"), [
    (13040, True, "cuCheckpointOperationComplete found for CUDA 13.4"),
    (13050, True, "cuCheckpointOperationComplete found for CUDA 13.4"),
    (None, False, "the driver supports CUDA 13.1; custom storage needs 13.4"),
])
def test_the_driver_is_asked_for_custom_storage(make_node, cuda_version, have, why) -> None:  # type: ignore[no-untyped-def]
    node = make_node(driver=590)
    if cuda_version:
        node.lab.set(cuda_version=cuda_version)
    backend = make_backend(node.lab.settings(backend="driver-api"), Host())
    assert isinstance(backend, DriverAPI)
    try:
        f = probe(backend)
    finally:
        backend.close()
    assert (f.custom_storage, f.custom_storage_why) == (have, why)
    assert ("custom_storage" in f.describe()) is have


def test_the_cli_backend_has_no_custom_storage(make_node) -> None:  # type: ignore[no-untyped-def]
    node = storage_node(make_node)
    f = probe(make_backend(node.lab.settings(backend="cli"), Host()))
    assert not f.custom_storage and "driver-API call" in f.custom_storage_why


@pytest.mark.parametrize(("setting", "have", "path"), [
    ("host", True, "host"), ("host", False, "host"),
    ("auto", True, "storage"), ("auto", False, "host"),
    ("storage", True, "storage"), ("storage", False, None),
])
def test_the_gpu_memory_setting_decides_the_path(setting: str, have: bool, path: str | None) -> None:
    f = Features(version="600.1", actions=True, custom_storage=have, custom_storage_why="because")
    got, why = gpu_memory_path(setting, f)
    assert got == path and f"gpu_memory: {setting}" in why
    assert ("because" in why) is (setting != "host")


@pytest.mark.parametrize(("cuda_version", "setting", "path", "doctor"), [
    (13040, "host", "host", "ok"),
    (13040, "auto", "storage", "warn"),
    (None, "auto", "host", "ok"),
    (None, "storage", None, "fail"),
])
def test_features_and_doctor_say_which_gpu_memory_path(make_node, tmp_path, cuda_version, setting,
                                                        path, doctor) -> None:  # type: ignore[no-untyped-def]
    node = make_node(driver=590)
    if cuda_version:
        node.lab.set(cuda_version=cuda_version)
    cfg = write_config(node, backend="auto", gpu_memory=setting)
    f = json.loads(cli("--json", "features", config=cfg).stdout)
    assert (f["gpu_memory"], f["custom_storage"]) == (path, bool(cuda_version))
    assert f"gpu_memory: {setting}" in f["gpu_memory_why"]
    text = cli("features", config=cfg).stdout
    assert f"gpu memory: {path or 'refused'} (gpu_memory: {setting}" in text
    assert f"custom storage: {'yes' if cuda_version else 'no'} (" in text
    root = tmp_path / "root"
    root.mkdir()
    checks = {c["name"]: c for c in json.loads(
        cli("--json", "doctor", "--root", str(root), config=cfg).stdout)}
    assert checks["gpu memory"]["status"] == doctor
    assert f"gpu_memory: {setting}" in checks["gpu memory"]["detail"]


# -- the custom-storage path in the helper ------------------------------------


def storage_api(node, **settings):  # type: ignore[no-untyped-def]
    backend = make_backend(node.lab.settings(backend="driver-api", **settings), Host())
    assert isinstance(backend, DriverAPI)
    return backend


def state_of(node, pid: int) -> str:  # type: ignore[no-untyped-def]
    import subprocess

    return subprocess.run([str(node.lab.cuda_checkpoint), "--get-state", "--pid", str(pid)],
                          capture_output=True, text=True).stdout.strip()


def checkpointed_to_storage(node, tmp_path, mib: int = 4, content: str = "random",
                            **settings):  # type: ignore[no-untyped-def]
    """A workload checkpointed through custom storage in 1 MiB chunks: its pid,
    the image directory and the backend. Random content by default: no two
    chunks alike, nothing to compress."""
    node.spawn("w", mib=mib, check_after_restore=True, content=content)
    pid = node.lab.wait_counter("w", 2)["pid"]
    api = storage_api(node, **settings)
    api.lock(pid, 0)
    image = tmp_path / "image" / f"gpu-memory-{pid}"
    image.parent.mkdir()
    done = api.checkpoint_to_storage(pid, str(image), chunk=1 << 20)
    assert (done["ranges"], done["bytes"], done["digest"]) == (1, (mib << 20) + 8, "blake3")
    return pid, image, api


def healthy_after_restore(node, tag: str) -> dict:  # type: ignore[no-untyped-def]
    import time

    before = node.lab.status(tag)["counter"]
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline:
        st = node.lab.status(tag)
        if st.get("checked_restores", 0) >= 1 and st["counter"] > before + 2:
            assert st["intact"] and not st["errors"], st  # its memory check, after the restore
            return st
        time.sleep(0.05)
    raise AssertionError(f"not running on after the restore: {node.lab.status(tag)}")


def test_checkpoint_and_restore_through_custom_storage(make_node, tmp_path) -> None:  # type: ignore[no-untyped-def]
    node = storage_node(make_node, bandwidth_mib_s=400)
    pid, image, api = checkpointed_to_storage(node, tmp_path)
    try:
        assert state_of(node, pid) == "checkpointed"
        info = node.lab.info()
        assert all(p["pid"] != pid for g in info["gpus"] for p in g["processes"])  # released
        names = sorted(p.name for p in image.iterdir())
        assert names == ["gpu0-000000.chunk", "gpu0-000001.chunk", "gpu0-000002.chunk",
                         "gpu0-000003.chunk", "gpu0-000004.chunk", "manifest.json"]
        manifest = json.loads((image / "manifest.json").read_text())
        assert manifest["digest"] == "blake3" and len(manifest["ranges"][0]["chunks"]) == 5
        assert "zstd" not in manifest["ranges"][0]  # compression is off by default
        api.restore_from_storage(pid, str(image))
        assert state_of(node, pid) == "locked"
        api.unlock(pid)
    finally:
        api.close()
    healthy_after_restore(node, "w")


def test_a_flipped_bit_in_a_chunk_is_refused_and_the_workload_stays_checkpointed(
        make_node, tmp_path) -> None:  # type: ignore[no-untyped-def]
    from cudahook.platform.errors import ToolError

    node = storage_node(make_node)
    pid, image, api = checkpointed_to_storage(node, tmp_path)
    try:
        chunk = image / "gpu0-000002.chunk"
        data = bytearray(chunk.read_bytes())
        data[4321] ^= 0x10
        chunk.write_bytes(bytes(data))
        before = {p.name: p.read_bytes() for p in image.iterdir()}
        counter = node.lab.status("w")["counter"]
        with pytest.raises(ToolError, match=r"gpu0-000002\.chunk: content does not match"):
            api.restore_from_storage(pid, str(image))
        assert state_of(node, pid) == "checkpointed"  # never touched, never released
        assert {p.name: p.read_bytes() for p in image.iterdir()} == before  # image unchanged
        import time

        time.sleep(0.3)
        assert node.lab.status("w")["counter"] == counter
        # Put right, the same image restores: the refusal changed nothing.
        data[4321] ^= 0x10
        chunk.write_bytes(bytes(data))
        api.restore_from_storage(pid, str(image))
        api.unlock(pid)
    finally:
        api.close()
    healthy_after_restore(node, "w")


def test_a_checked_restore_skips_the_first_read_but_refuses_a_chunk_bad_on_its_way_in(
        make_node, tmp_path) -> None:  # type: ignore[no-untyped-def]
    """`checked` (post-restore has just verified every chunk) spares the
    read before the restore, never the check of each chunk as it goes in:
    a chunk changed since is refused there, and the process, already
    touched, is left locked - never unlocked, never running."""
    import time

    from cudahook.platform.errors import ToolError

    node = storage_node(make_node)
    pid, image, api = checkpointed_to_storage(node, tmp_path)
    try:
        chunk = image / "gpu0-000004.chunk"  # the last: every other one goes in first
        data = bytearray(chunk.read_bytes())
        data[3] ^= 0x01
        chunk.write_bytes(bytes(data))
        counter = node.lab.status("w")["counter"]
        with pytest.raises(ToolError, match=r"gpu0-000004\.chunk: content does not match"):
            api.restore_from_storage(pid, str(image), checked=True)
        # Touched (the unchecked restore would have refused it untouched,
        # checkpointed: see above), and held.
        assert state_of(node, pid) == "locked"
        time.sleep(0.3)
        assert node.lab.status("w")["counter"] == counter
    finally:
        api.close()


def test_chunks_are_written_whole_with_o_direct_or_through_the_cache(tmp_path) -> None:
    """A chunk goes to the disk with O_DIRECT when its buffer is aligned and
    the filesystem takes it; tmpfs refuses O_DIRECT, and an unaligned tail
    cannot use it: both are written through the page cache, whole."""
    import mmap
    import os

    from cudahook.core.backends import driver_helper as dh

    shm = Path("/dev/shm")
    places = [tmp_path] + ([Path(tempfile.mkdtemp(dir=shm))] if shm.is_dir() else [])
    buf = mmap.mmap(-1, 3 * dh.DIRECT_ALIGN)
    buf.write(os.urandom(len(buf)))
    aligned = memoryview(buf)
    assert dh._aligned(aligned) and not dh._aligned(aligned[1:])
    try:
        for place in places:
            dirfd = os.open(place, os.O_RDONLY | os.O_DIRECTORY)
            try:
                dh._write(dirfd, "whole.chunk", aligned, sync=False)
                dh._write(dirfd, "tail.chunk", aligned[:dh.DIRECT_ALIGN + 5])
                dh._fsync(dirfd, "whole.chunk")
            finally:
                os.close(dirfd)
            assert (place / "whole.chunk").read_bytes() == bytes(buf)
            assert (place / "tail.chunk").read_bytes() == bytes(buf[:dh.DIRECT_ALIGN + 5])
    finally:
        aligned.release()
        buf.close()
        for place in places[1:]:
            shutil.rmtree(place, ignore_errors=True)


@pytest.mark.parametrize("case", ["symlink", "fifo", "short", "manifest"])
def test_outside_files_read_safely__custom_storage_image(make_node, tmp_path, case: str) -> None:  # type: ignore[no-untyped-def]
    import os

    from cudahook.platform.errors import ToolError

    node = storage_node(make_node)
    pid, image, api = checkpointed_to_storage(node, tmp_path)
    chunk = image / "gpu0-000001.chunk"
    try:
        if case == "symlink":  # the same bytes, through a link
            real = tmp_path / "elsewhere"
            real.write_bytes(chunk.read_bytes())
            chunk.unlink()
            chunk.symlink_to(real)
        elif case == "fifo":
            chunk.unlink()
            os.mkfifo(chunk)
        elif case == "short":
            chunk.write_bytes(chunk.read_bytes()[:-1])
        else:
            (image / "manifest.json").write_text('{"format": 1, "digest": "sha256", '
                                                 '"chunk": 1048576, "ranges": [[]]}')
        with pytest.raises(ToolError, match=r"gpu0-000001\.chunk|manifest\.json"):
            api.restore_from_storage(pid, str(image))
        assert state_of(node, pid) == "checkpointed"
    finally:
        api.close()


def test_custom_storage_is_refused_where_the_driver_lacks_it(make_node, tmp_path) -> None:  # type: ignore[no-untyped-def]
    from cudahook.platform.errors import ToolError

    node = make_node(driver=590)
    node.spawn("w", mib=2)
    pid = node.lab.wait_counter("w", 2)["pid"]
    api = storage_api(node)
    try:
        api.lock(pid, 0)
        with pytest.raises(ToolError, match=r"custom storage unavailable: the driver supports "
                                            r"CUDA 13\.1"):
            api.checkpoint_to_storage(pid, str(tmp_path / "image"))
        assert state_of(node, pid) == "locked" and not (tmp_path / "image").exists()
        api.unlock(pid)
    finally:
        api.close()


@pytest.mark.parametrize(("times", "outcome", "state"), [
    (1, "its GPU memory was put back: left locked", "locked"),
    (2, "putting its GPU memory back failed (unknown error (CUDA_ERROR_UNKNOWN)): left "
        "checkpointing", "checkpointing"),
])
def test_a_storage_checkpoint_that_fails_before_completion_puts_the_memory_back(
        make_node, tmp_path, times: int, outcome: str, state: str) -> None:  # type: ignore[no-untyped-def]
    """The API has no abort: the helper completes through host memory and
    restores the process from it, so the rollback can unlock it intact."""
    import re

    from cudahook.platform.errors import ToolError

    node = storage_node(make_node)
    node.spawn("w", mib=4, check_after_restore=True)
    pid = node.lab.wait_counter("w", 2)["pid"]
    api = storage_api(node)
    image = tmp_path / "image"
    try:
        api.lock(pid, 0)
        node.lab.fault("checkpoint-complete", "error", code=999, times=times)
        with pytest.raises(ToolError, match=re.escape(outcome)):
            api.checkpoint_to_storage(pid, str(image), chunk=1 << 20)
        assert state_of(node, pid) == state
        assert not image.exists()  # what it wrote is gone with it
        if state == "locked":
            api.unlock(pid)
    finally:
        api.close()
    if state == "locked":
        healthy_after_restore(node, "w")


# -- dedupe and compression ----------------------------------------------------


def _inodes(image) -> dict[str, int]:  # type: ignore[no-untyped-def]
    return {p.name: p.stat().st_ino for p in image.iterdir() if p.name.endswith(".chunk")}


def test_identical_chunks_are_stored_once_and_compressed_and_restore_intact(
        make_node, tmp_path) -> None:  # type: ignore[no-untyped-def]
    """The workload's buffer repeats one block: its four full chunks are one
    file (links), stored compressed; the digest is of the raw bytes, and the
    restore decompresses and verifies every chunk on its way in."""
    node = storage_node(make_node)
    pid, image, api = checkpointed_to_storage(node, tmp_path, content="pattern",
                                              gpu_storage_compression="zstd")
    try:
        inodes = _inodes(image)
        assert len(set(inodes.values())) == 2  # four identical chunks, and the tail
        assert len({inodes[f"gpu0-00000{k}.chunk"] for k in range(4)}) == 1
        rng = json.loads((image / "manifest.json").read_text())["ranges"][0]
        assert all(0 < z < 1 << 20 for z in rng["zstd"][:4])
        assert (image / "gpu0-000000.chunk").stat().st_size == rng["zstd"][0]
        import blake3

        assert rng["chunks"][0] == blake3.blake3(
            node_pattern(node, "w")[:1 << 20]).hexdigest()  # of the raw bytes
        api.restore_from_storage(pid, str(image))
        api.unlock(pid)
    finally:
        api.close()
    healthy_after_restore(node, "w")


def node_pattern(node, tag: str) -> bytes:  # type: ignore[no-untyped-def]
    from cudahook.sim.protocol import pattern

    return pattern(1, node.lab.status(tag)["mib"] << 20)


def test_chunks_that_do_not_shrink_are_stored_raw(make_node, tmp_path) -> None:  # type: ignore[no-untyped-def]
    node = storage_node(make_node)
    pid, image, api = checkpointed_to_storage(node, tmp_path, content="random",
                                              gpu_storage_compression="zstd")
    try:
        rng = json.loads((image / "manifest.json").read_text())["ranges"][0]
        assert "zstd" not in rng  # none shrank: all raw, as with compression off
        assert (image / "gpu0-000000.chunk").stat().st_size == 1 << 20
        api.restore_from_storage(pid, str(image))
        api.unlock(pid)
    finally:
        api.close()
    healthy_after_restore(node, "w")


def test_a_failed_process_never_takes_a_chunk_another_process_shares(
        make_node, tmp_path) -> None:  # type: ignore[no-untyped-def]
    """Two processes of one checkpoint hold the same weights: the second links
    the first's chunks. When the second one's checkpoint fails and is put
    back, its files go, and the first one's chunks (the same inodes) stay and
    restore intact."""
    import re

    from cudahook.platform.errors import ToolError

    node = storage_node(make_node)
    node.spawn("w", mib=4, procs=2, same_weights=True, content="random",
               check_after_restore=True)
    a = node.lab.wait_counter("w.0", 2)["pid"]
    b = node.lab.wait_counter("w.1", 2)["pid"]
    api = storage_api(node, gpu_storage_compression="zstd")
    root = tmp_path / "image"
    root.mkdir()
    try:
        api.lock(a, 0)
        api.lock(b, 0)
        done = api.checkpoint_to_storage(a, str(root / "1"), chunk=1 << 20)
        assert done["linked"] == 0
        node.lab.fault("checkpoint-complete", "error", code=999, times=1)
        with pytest.raises(ToolError, match=re.escape("its GPU memory was put back")):
            api.checkpoint_to_storage(b, str(root / "2"), chunk=1 << 20)
        assert not (root / "2").exists()
        # The index keeps only what a process still links: a's chunks.
        assert all(p.stat().st_nlink == 2 for p in (root / "by-digest").iterdir())
        # Now b again: every full chunk is a's.
        done = api.checkpoint_to_storage(b, str(root / "2"), chunk=1 << 20)
        # The 4 weight chunks are a's; the last one, the counter, is linked too
        # when the two locked counters happen to hold the same value.
        assert done["linked"] in (4, 5) and done["stored"] < 1 << 20
        assert {k: v for k, v in _inodes(root / "2").items() if k != "gpu0-000004.chunk"} == \
            {k: v for k, v in _inodes(root / "1").items() if k != "gpu0-000004.chunk"}
        for pid, sub in ((a, "1"), (b, "2")):
            api.restore_from_storage(pid, str(root / sub))
            api.unlock(pid)
    finally:
        api.close()
    for tag in ("w.0", "w.1"):
        healthy_after_restore(node, tag)


@pytest.mark.parametrize("case", ["bomb", "unsized-bomb", "short", "not-zstd", "two-frames",
                                  "oversized", "symlink", "fifo", "missing"])
def test_outside_files_read_safely__custom_storage_chunk(tmp_path, case: str) -> None:  # type: ignore[no-untyped-def]
    """One compressed chunk as the image supplies it: never more than its raw
    size comes out, a link or special file is never opened, and each bad
    case is one refusal (Mismatch: the chunk is not what its digest says)."""
    import os

    import blake3
    import zstandard

    from cudahook.core.backends import driver_helper as helper

    raw = bytes(range(256)) * 16 * 4  # 16 KiB
    z = zstandard.ZstdCompressor(level=3)
    frame = {
        "bomb": z.compress(raw * 4096),  # 64 MiB out of a few hundred bytes
        "unsized-bomb": zstandard.ZstdCompressor(write_content_size=False).compress(raw * 64),
        "short": z.compress(raw[:-1]),
        "not-zstd": b"\x00" * 64,
        "two-frames": z.compress(raw) + z.compress(raw),
        "oversized": z.compress(raw) + b"\x00",
    }.get(case, z.compress(raw))
    path = tmp_path / "gpu0-000000.chunk"
    if case == "symlink":
        (tmp_path / "real").write_bytes(frame)
        path.symlink_to(tmp_path / "real")
    elif case == "fifo":
        os.mkfifo(path)
    elif case != "missing":
        path.write_bytes(frame)
    stored = len(frame) - (1 if case == "oversized" else 0)  # the manifest's size
    fd = os.open(tmp_path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        with pytest.raises(helper.Refused) as exc:
            helper.read_chunk(fd, path.name, len(raw), stored, "blake3",
                              blake3.blake3(raw).hexdigest(), None)
        assert path.name in str(exc.value) and "\n" not in str(exc.value)
        if case in ("bomb", "unsized-bomb", "short", "not-zstd", "two-frames"):
            assert isinstance(exc.value, helper.Mismatch)
        # The good frame reads.
        if path.is_symlink() or case in ("fifo", "missing"):
            path.unlink(missing_ok=True)
        path.write_bytes(z.compress(raw))
        helper.read_chunk(fd, path.name, len(raw), len(z.compress(raw)), "blake3",
                          blake3.blake3(raw).hexdigest(), None)
    finally:
        os.close(fd)


@pytest.mark.parametrize(("mode", "digest"), [(0o755, "blake3"), (0o777, "sha256"), (0o1777, "sha256"),
                                              (0o775, "sha256")])
def test_outside_files_read_safely__helper_imports_only_from_a_trusted_directory(
        tmp_path, mode: int, digest: str) -> None:  # type: ignore[no-untyped-def]
    """The helper runs -I -S: blake3 comes only from the directory the parent
    names, and only if no one but root (or its user) can write there;
    otherwise a checkpoint falls back to sha256, the standard library's."""
    import shutil
    import subprocess
    import sys

    import blake3

    from cudahook.core.backends import driver_api

    lib = tmp_path / "lib"
    lib.mkdir()
    shutil.copytree(Path(blake3.__file__).parent, lib / "blake3")
    lib.chmod(mode)
    code = ("import sys; sys.path.insert(0, sys.argv[1]); import driver_helper as h; "
            "h.LIBS[:] = [sys.argv[2]]; print(h._new_digest())")
    r = subprocess.run([sys.executable, "-I", "-S", "-c", code,
                        str(Path(driver_api.HELPER).parent), str(lib)],
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == digest
    # The parent names where its own packages are, without importing them.
    assert str(Path(blake3.__file__).parent.parent) in driver_api.storage_libs().split(":")


def test_with_dedupe_off_every_chunk_is_a_file_of_its_own(make_node, tmp_path) -> None:  # type: ignore[no-untyped-def]
    node = storage_node(make_node)
    pid, image, api = checkpointed_to_storage(node, tmp_path, content="pattern",
                                              gpu_storage_dedupe=False)
    try:
        assert len(set(_inodes(image).values())) == 5  # four alike, yet five files
        assert not (tmp_path / "image" / "by-digest").exists()
        api.restore_from_storage(pid, str(image))
        api.unlock(pid)
    finally:
        api.close()
    healthy_after_restore(node, "w")


@pytest.mark.parametrize("side", ["checkpoint", "restore"])
def test_a_helper_killed_mid_copy_ends_the_operation_with_the_workload_intact(
        make_node, tmp_path, side: str) -> None:  # type: ignore[no-untyped-def]
    """SIGKILL of the helper holding a custom-storage operation open (mid
    copy-out, before cuCheckpointOperationComplete; or mid copy-in): the
    driver ends the operation with the caller's context, as one that failed
    inside its call - locked with its memory (checkpoint side) or still
    checkpointed from the image (restore side) - and a retry brings it back."""
    import os
    import signal
    import threading
    import time

    node = storage_node(make_node)
    if side == "checkpoint":
        node.spawn("w", mib=4, check_after_restore=True)
        pid = node.lab.wait_counter("w", 2)["pid"]
        api = storage_api(node)
        api.lock(pid, 0)
        image = tmp_path / "image"
        call = lambda: api.checkpoint_to_storage(pid, str(image), chunk=1 << 20)  # noqa: E731
    else:
        pid, image, api = checkpointed_to_storage(node, tmp_path)
        call = lambda: api.restore_from_storage(pid, str(image))  # noqa: E731
    copy = "copy-out" if side == "checkpoint" else "copy-in"
    node.lab.fault(copy, "delay", seconds=30, skip=2, times=1)
    errors: list[BaseException] = []

    def run() -> None:
        try:
            call()
        except Exception as exc:
            errors.append(exc)

    t = threading.Thread(target=run)
    t.start()
    mid = "checkpointing" if side == "checkpoint" else "restoring"

    def fired() -> bool:
        try:  # read while the simulator rewrites it: an empty file is no answer
            rules = json.loads((node.lab.root / "faults.json").read_text())
        except (OSError, ValueError):
            return False
        return bool(rules) and rules[0].get("times", 1) <= 0

    deadline = time.monotonic() + 20
    while not (fired() and state_of(node, pid) == mid):
        assert time.monotonic() < deadline and t.is_alive(), (errors, state_of(node, pid))
        time.sleep(0.02)
    helper = api._helper
    assert helper is not None
    os.killpg(helper.proc.pid, signal.SIGKILL)
    t.join(10)
    assert not t.is_alive() and errors, "the call did not fail with its helper"
    node.lab.clear_faults()
    deadline = time.monotonic() + 5
    want = "locked" if side == "checkpoint" else "checkpointed"
    while state_of(node, pid) != want:
        assert time.monotonic() < deadline, state_of(node, pid)
        time.sleep(0.02)
    try:
        if side == "restore":  # the image is as it was: a retry restores from it
            api.restore_from_storage(pid, str(image))
        api.unlock(pid)
    finally:
        api.close()
    st = healthy_after_restore(node, "w") if side == "restore" else None
    if st is None:
        st = node.lab.wait_counter("w", node.lab.status("w")["counter"] + 3)
    assert st["intact"] and not st["errors"], st


def test_a_chunk_published_just_before_a_claim_is_linked_not_written_again(
        tmp_path, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    """Two processes' threads reach the same chunk: the other one writes,
    publishes and lets go of its claim just before the first takes its
    claim. The first must link the published file, not store a second copy
    (under load, a look in the index made before claiming missed it, and a
    replica was stored twice)."""
    import os

    from cudahook.core.backends import driver_helper as dh

    data = memoryview(os.urandom(1 << 16))
    digest = "d" * 64
    (tmp_path / "1").mkdir()
    (tmp_path / "2").mkdir()
    outs = []
    for pid in ("1", "2"):
        out = dh._Out(os.open(tmp_path / pid, os.O_RDONLY | os.O_DIRECTORY), "sha256", 0)
        out.open_index(str(tmp_path / pid))
        outs.append(out)
    first, second = outs

    class TheOtherRunsWhole:
        """The claims' lock: the first time it is taken, the other thread
        runs its whole put (taking it again) before the lock is held."""

        def __init__(self, lock: Any) -> None:
            self.lock, self.ran = lock, False

        def __enter__(self) -> Any:
            if not self.ran:
                self.ran = True
                assert second.put("gpu0-000000.chunk", data, digest) == 0
            return self.lock.__enter__()

        def __exit__(self, *exc: Any) -> Any:
            return self.lock.__exit__(*exc)

    monkeypatch.setattr(dh, "_claims_lock", TheOtherRunsWhole(dh._claims_lock))
    try:
        assert first.put("gpu0-000000.chunk", data, digest) == 0
    finally:
        for out in outs:
            os.close(out.dirfd)
            if out.index is not None:
                os.close(out.index)
    a, b = (os.stat(tmp_path / pid / "gpu0-000000.chunk") for pid in ("1", "2"))
    assert (a.st_dev, a.st_ino) == (b.st_dev, b.st_ino), "the chunk was stored twice"
    assert first.linked == 1 and first.stored == 0 and second.stored == len(data)
    assert not dh._claims
