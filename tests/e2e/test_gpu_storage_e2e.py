"""GPU memory in storage (CUDA 13.4+ custom storage) through runc and CRIU:
a GPU container checkpoints with its GPU memory as chunk files inside the
CRIU image, restores from them intact, and a flipped bit in a chunk is
refused at restore with the image unchanged."""

from __future__ import annotations

import os
from pathlib import Path

import yaml

from cudahook.core import manifest

from .conftest import needs_runc, tree_digest
from .outcomes import fresh_reports

pytestmark = needs_runc

WORKLOADS = [("solo", {"mib": 40, "check_after_restore": True}),
             ("mp", {"mib": 2, "procs": 2, "check_after_restore": True})]
TAGS = ["solo", "mp.0", "mp.1"]


def configure(env, gpu_memory: str) -> None:  # type: ignore[no-untyped-def]
    settings = env.lab.settings(backend="driver-api", gpu_memory=gpu_memory)
    env.config.write_text(yaml.safe_dump(dict(settings.__dict__)))


def size(path: Path, skip: str | None = None) -> int:
    total = 0
    for root, dirs, files in os.walk(path):
        if skip in dirs:
            dirs.remove(skip)  # type: ignore[arg-type]
        total += sum(os.lstat(os.path.join(root, f)).st_size for f in files)
    return total


def round_trip(env, name: str, image: Path) -> tuple[str, Path]:  # type: ignore[no-untyped-def]
    bundle = env.box.bundle(name, WORKLOADS)
    cid = env.cid()
    r = env.box.run(cid, bundle)
    assert r.returncode == 0, r.stderr
    env.wait_running(TAGS, steps=3)
    r = env.box.checkpoint(cid, image)
    assert r.returncode == 0, r.stderr
    return cid, bundle


def test_storage_path_round_trip_sizes_and_a_flipped_bit(make_env, tmp_path, capsys) -> None:  # type: ignore[no-untyped-def]
    env = make_env()
    env.lab.set(cuda_version=13040)

    # The host path: GPU memory in the processes' pages, in CRIU's image.
    configure(env, "host")
    host_image = tmp_path / "host-img"
    cid, bundle = round_trip(env, "b1", host_image)
    m = manifest.read(host_image)
    assert m is not None and m.gpu_storage is None
    frozen = env.frozen(cid, TAGS)
    assert env.box.restore(cid, bundle, host_image).returncode == 0
    env.wait_running(TAGS, frozen)
    env.box.delete(cid)
    fresh_reports(env.lab, TAGS)

    # The storage path: GPU memory in cudahook-gpu/ of the same image.
    configure(env, "storage")
    image = tmp_path / "img"
    cid, bundle = round_trip(env, "b2", image)
    m = manifest.read(image)
    assert m is not None and m.gpu_storage is not None
    assert len(m.gpu_storage.processes) == len(TAGS)
    gpu_bytes = m.gpu_storage.bytes
    assert gpu_bytes >= (44 << 20)
    criu_host, criu_storage = size(host_image), size(image, skip="cudahook-gpu")
    with capsys.disabled():
        print(f"\nCRIU image with GPU memory (host path): {criu_host / 2**20:.1f} MiB; "
              f"without (storage path): {criu_storage / 2**20:.1f} MiB; "
              f"cudahook-gpu/: {size(image / 'cudahook-gpu') / 2**20:.1f} MiB "
              f"({gpu_bytes / 2**20:.1f} MiB of GPU memory)")
    assert criu_host - criu_storage >= gpu_bytes * 0.9  # the GPU memory left CRIU's pages
    frozen = env.frozen(cid, TAGS)

    # A flipped bit in one chunk: refused at post-restore, nothing runs,
    # the image unchanged.
    solo = next(p for p in m.gpu_storage.processes if len(p.files()) > 1)
    chunk = image / "cudahook-gpu" / str(solo.nspid) / "gpu0-000001.chunk"
    data = bytearray(chunk.read_bytes())
    data[12345] ^= 0x20
    chunk.write_bytes(bytes(data))
    digest = tree_digest(image)
    r = env.box.restore(cid, bundle, image)
    assert r.returncode != 0
    assert tree_digest(image) == digest
    assert env.box.state(cid) is None or env.box.state(cid)["status"] != "running"
    assert env.counters(TAGS) == frozen  # nothing ran on
    refusal = env.events("post-restore")[-1]
    assert "IMAGE_CHECKSUM" in str(refusal), refusal

    # Put right, the same image restores, intact.
    data[12345] ^= 0x20
    chunk.write_bytes(bytes(data))
    env.box.delete(cid)
    r = env.box.restore(cid, bundle, image)
    assert r.returncode == 0, r.stderr
    env.wait_running(TAGS, frozen)
    assert env.box.state(cid)["status"] == "running"
    for t in TAGS:
        st = env.lab.status(t)
        assert st["intact"] and not st["errors"] and st.get("checked_restores", 0) >= 1, st


# Three processes holding the same weights (random: nothing to compress), and
# one whose memory compresses well.
SHARED = [("replica", {"mib": 20, "procs": 3, "same_weights": True, "content": "random",
                       "check_after_restore": True}),
          ("packed", {"mib": 20, "check_after_restore": True})]
SHARED_TAGS = ["replica.0", "replica.1", "replica.2", "packed"]


def test_storage_path_with_dedupe_and_zstd_round_trips_smaller(make_env, tmp_path, capsys) -> None:  # type: ignore[no-untyped-def]
    """runc + CRIU with `gpu_storage_compression: zstd`: the replicas' full
    chunk is stored once, the compressible process's chunks shrink, the
    image checks clean and restores every process intact."""
    import subprocess
    import sys

    env = make_env()
    env.lab.set(cuda_version=13040)
    settings = env.lab.settings(backend="driver-api", gpu_memory="storage",
                                gpu_storage_compression="zstd")
    env.config.write_text(yaml.safe_dump(dict(settings.__dict__)))
    bundle = env.box.bundle("b3", SHARED)
    cid = env.cid()
    assert env.box.run(cid, bundle).returncode == 0
    env.wait_running(SHARED_TAGS, steps=3)
    image = tmp_path / "img"
    r = env.box.checkpoint(cid, image)
    assert r.returncode == 0, r.stderr
    m = manifest.read(image)
    assert m is not None and m.gpu_storage is not None
    assert m.version == manifest.PACKED_VERSION and m.gpu_storage.digest == "blake3"
    seen: set[int] = set()
    stored = 0
    for f in (image / "cudahook-gpu").rglob("*.chunk"):
        st = f.stat()
        if st.st_ino not in seen:
            seen.add(st.st_ino)
            stored += st.st_size
    raw = m.gpu_storage.bytes
    with capsys.disabled():
        print(f"\ncudahook-gpu/: {stored / 2**20:.1f} MiB stored for {raw / 2**20:.1f} MiB of "
              f"GPU memory ({stored / raw:.3f}x)")
    # One 16 MiB chunk for three replicas, the packed process's almost nothing:
    # about 16 + 3 x 4 MiB of the 80 MiB.
    assert stored < raw * 0.45
    assert not (image / "cudahook-gpu" / "by-digest").exists()
    r = subprocess.run([sys.executable, "-m", "cudahook", "--config", str(env.config), "check",
                        "--image", str(image)], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stdout + r.stderr
    frozen = env.frozen(cid, SHARED_TAGS)
    env.box.delete(cid)
    r = env.box.restore(cid, bundle, image)
    assert r.returncode == 0, r.stderr
    env.wait_running(SHARED_TAGS, frozen)
    for t in SHARED_TAGS:
        st = env.lab.status(t)
        assert st["intact"] and not st["errors"] and st.get("checked_restores", 0) >= 1, st
