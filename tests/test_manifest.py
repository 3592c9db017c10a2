"""manifest: what cudahook adds to a CRIU image directory, versioned and checked on read."""

from __future__ import annotations

import hashlib
import json
import os
import stat
from pathlib import Path
from typing import Any

import pytest

from cudahook.core import manifest
from cudahook.core.manifest import FileSum, GpuModel, Manifest, ManifestError, Process

from .conftest import count_opens

DATA = {
    "container_id": "gpu-1",
    "driver_version": "580.65.06",
    "gpus": ["GPU-11111111-2222-3333-4444-555555555555"],
    "processes": [{"nspid": 7, "pid": 4242, "state": "running"}, {"nspid": 9, "pid": 4250}],
}


def test_round_trip(tmp_path: Path) -> None:
    path = manifest.write(tmp_path, DATA)
    assert path == tmp_path / manifest.NAME
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    m = manifest.read(tmp_path)
    assert m is not None and m.to_dict() == {
        "version": manifest.VERSION, **DATA, "gpu_models": {}, "vmm": False,
        "gpu_memory_bytes": None,
        "processes": [{"nspid": 7, "pid": 4242, "state": "running"},
                      {"nspid": 9, "pid": 4250, "state": None}]}
    assert (m.container_id, m.gpus, m.processes) == ("gpu-1", tuple(DATA["gpus"]), (
        Process(7, 4242, "running"), Process(9, 4250)))
    assert [p.name for p in tmp_path.iterdir()] == [manifest.NAME]  # no temp file left


def test_absent_is_none(tmp_path: Path) -> None:
    assert manifest.read(tmp_path) is None


def test_version_is_written_even_if_data_claims_another(tmp_path: Path) -> None:
    manifest.write(tmp_path, {**DATA, "version": 99})
    # **data comes last, so the caller's key would win: the reader then refuses it.
    with pytest.raises(ManifestError, match="version 99"):
        manifest.read(tmp_path)


def write_raw(tmp_path: Path, data: Any) -> None:
    text = data if isinstance(data, str) else json.dumps(data)
    (tmp_path / manifest.NAME).write_text(text)


@pytest.mark.parametrize("data, words", [
    ({**DATA, "version": 2}, "version 2"),
    ({**DATA, "version": "1"}, "version '1'"),
    (DATA, "version None"),
    ({**DATA, "version": 1, "processes": None}, "malformed process list"),
    ({**DATA, "version": 1, "processes": {"nspid": 7}}, "malformed process list"),
    ({**DATA, "version": 1, "processes": [{"pid": 7}]}, "malformed process list"),
    ({**DATA, "version": 1, "processes": [{"nspid": "7"}]}, "malformed process list"),
    ({**DATA, "version": 1, "processes": [7]}, "malformed process list"),
    ({**DATA, "version": 1, "gpus": "GPU-x"}, "malformed GPU list"),
    ("{\"version\": 1, ", "unreadable"),
    ("[1]", "unreadable"),
    ("", "unreadable"),
])
def test_bad_manifest_is_a_manifest_error(tmp_path: Path, data: Any, words: str) -> None:
    write_raw(tmp_path, data)
    with pytest.raises(ManifestError) as exc:
        manifest.read(tmp_path)
    assert words in str(exc.value) and "\n" not in str(exc.value)


def test_unreadable_directory_in_its_place(tmp_path: Path) -> None:
    (tmp_path / manifest.NAME).mkdir()
    with pytest.raises(ManifestError, match="unreadable"):
        manifest.read(tmp_path)


def test_empty_process_list_is_valid(tmp_path: Path) -> None:
    manifest.write(tmp_path, {"processes": []})
    m = manifest.read(tmp_path)
    assert m is not None and m.processes == () and m.nspids == []


GPU = "GPU-11111111-2222-3333-4444-555555555555"


@pytest.mark.parametrize("extra, raw", [
    ({"container_id": "bad\ud800"}, None),
    ({"container_id": "abc\n"}, None),
    ({"container_id": "x" * 251}, None),
    ({"container_id": "\x1b]0;pwned\x07"}, None),
    ({"driver_version": "580.65.06\n"}, None),
    ({"gpus": [GPU + "\n"]}, None),
    ({"gpu_models": {GPU: {"name": "X" * (2 << 20), "memory_mib": 81559}}}, None),
    ({"gpu_models": {GPU: {"name": "H100\ud800", "memory_mib": 81559}}}, None),
    ({"gpu_models": {GPU: {"name": "\x1b[2J", "memory_mib": 81559}}}, None),
    ({"gpu_models": {GPU: "H100"}}, None),
    ({"gpu_models": {"not-a-gpu": {"name": "H100"}}}, None),
    ({"gpu_models": {GPU: {"name": "H100", "memory_mib": 10 ** 30}}}, None),
    ({"processes": [{"nspid": 7, "state": "running\n"}]}, None),
    ({"timeline": {"steps": [{"pid": 7, "step": "\x1b]0;x\x07", "start": 0, "end": 1}]}}, None),
    ({"timeline": {"steps": "x"}}, None),
    ({}, '"created": NaN'),
    ({}, '"created": Infinity'),
])
def test_untrusted_strings_bounded__manifest_values_are_validated_and_capped(
        tmp_path: Path, extra: dict[str, Any], raw: str | None) -> None:
    data = {**DATA, "version": 1, **extra}
    text = json.dumps(data)
    if raw:
        text = text[:-1] + ", " + raw + "}"
    (tmp_path / manifest.NAME).write_text(text, errors="surrogatepass")
    with pytest.raises(ManifestError) as exc:
        manifest.read(tmp_path)
    message = str(exc.value)
    assert message.isprintable() and len(message) < 2000, message


def test_untrusted_strings_bounded__a_manifest_as_written_passes(tmp_path: Path) -> None:
    data = {**DATA, "created": 1.7e9, "vmm": False, "gpu_memory_bytes": 1 << 30,
            "gpu_models": {GPU: {"name": "NVIDIA H100 80GB HBM3", "memory_mib": 81559}},
            "timeline": {"origin": 1.7e9, "total_s": 0.5, "steps": [
                {"pid": 4242, "step": "get-state", "start": 0.0, "end": 0.1},
                {"pid": 4242, "step": "checkpoint", "start": 0.1, "end": 0.5, "ok": False,
                 "error": "pid 4242: checkpoint exit 1: out of memory"}]}}
    manifest.write(tmp_path, data)
    m = manifest.read(tmp_path)
    assert m is not None and m.gpu_models[GPU].name == "NVIDIA H100 80GB HBM3"


# -- the typed manifest ------------------------------------------------------------

# A manifest as pre-dump writes it (hooks/criu_action.py): every key.
WRITTEN = {
    "container_id": "gpu-1", "created": 1767225600.123456, "driver_version": "580.65.06",
    "gpus": [GPU], "gpu_models": {GPU: {"name": "NVIDIA H100 80GB HBM3", "memory_mib": 81559}},
    "vmm": True, "gpu_memory_bytes": 3 << 30,
    "processes": [{"nspid": 7, "pid": 4242, "state": "running"},
                  {"nspid": 9, "pid": 4250, "state": None}],
    "timeline": {"origin": 1767225600.0, "total_s": 0.5, "steps": [
        {"pid": 4242, "step": "lock", "start": 0.0, "end": 0.1, "ok": True, "error": ""}]},
}


def test_parse_gives_every_field_typed(tmp_path: Path) -> None:
    (tmp_path / "cuda-vmm.state").write_bytes(b"state")
    manifest.write(tmp_path, WRITTEN, files=["cuda-vmm.state"])
    raw = (tmp_path / manifest.NAME).read_bytes()
    m = manifest.parse(raw)
    assert m == Manifest(
        version=1, container_id="gpu-1", created=1767225600.123456, driver_version="580.65.06",
        gpus=(GPU,), gpu_models={GPU: GpuModel("NVIDIA H100 80GB HBM3", 81559)}, vmm=True,
        gpu_memory_bytes=3 << 30,
        processes=(Process(7, 4242, "running"), Process(9, 4250, None)),
        timeline=WRITTEN["timeline"],
        files={"cuda-vmm.state": FileSum(hashlib.sha256(b"state").hexdigest(), 5)},
        digest=hashlib.sha256(raw).hexdigest())
    assert m.nspids == [7, 9] and m.gpu_model() == "NVIDIA H100 80GB HBM3"
    assert manifest.read(tmp_path) == m


def test_a_manifest_is_written_back_byte_for_byte(tmp_path: Path) -> None:
    """The on-disk format is the one pre-dump has always written: a Manifest
    written out gives the same bytes, so older readers read newer images."""
    a, b = tmp_path / "a", tmp_path / "b"
    a.mkdir(), b.mkdir()
    for d in (a, b):
        (d / "cuda-vmm.state").write_bytes(b"state")
    manifest.write(a, WRITTEN, files=["cuda-vmm.state"])  # as pre-dump writes it today
    m = manifest.read(a)
    assert m is not None
    manifest.write(b, m.replace(files={}), files=["cuda-vmm.state"])
    assert (b / manifest.NAME).read_bytes() == (a / manifest.NAME).read_bytes()
    assert manifest.read(b) == m


def test_an_old_manifest_reads_with_defaults(tmp_path: Path) -> None:
    """A manifest of an older cudahook: no created, models, VMM, memory,
    timeline or checksums, processes without pid or state."""
    write_raw(tmp_path, {"version": 1, "container_id": None, "driver_version": "550.54.15",
                         "gpus": [GPU], "processes": [{"nspid": 7}]})
    m = manifest.read(tmp_path)
    assert m is not None
    assert (m.created, m.gpu_models, m.vmm, m.gpu_memory_bytes, m.timeline, m.files) == (
        None, {}, False, None, None, {})
    assert m.processes == (Process(7, None, None),) and m.gpu_model() is None
    assert manifest.parse(json.dumps(m.to_dict()).encode()).replace(digest=None) == \
        m.replace(digest=None)


@pytest.mark.parametrize("field, value", [
    ("container_id", 7),
    ("container_id", "-bad"),
    ("created", "yesterday"),
    ("created", -1),
    ("driver_version", 580),
    ("gpus", [7]),
    ("gpus", GPU),
    ("gpu_models", {GPU: {"name": 1}}),
    ("gpu_models", {GPU: {"memory_mib": 1}}),
    ("gpu_models", {GPU: {"name": "H100", "memory_mib": "80G"}}),
    ("vmm", "yes"),
    ("vmm", 1),
    ("gpu_memory_bytes", "1G"),
    ("gpu_memory_bytes", -1),
    ("gpu_memory_bytes", 1.5),
    ("files", {"cuda-vmm.state": {"sha256": "x", "size": 1}}),
    ("files", {"cuda-vmm.state": {"sha256": "0" * 64, "size": "1"}}),
    ("files", {"../etc/passwd": {"sha256": "0" * 64, "size": 1}}),
    ("files", []),
    ("processes", [{"nspid": 0}]),
    ("processes", [{"nspid": True}]),
    ("processes", [{"nspid": 7, "pid": "7"}]),
    ("processes", [{"nspid": 7, "state": 5}]),
    ("timeline", {"total_s": -1}),
    ("timeline", []),
])
def test_one_line_errors__each_bad_manifest_field_is_one_line(
        field: str, value: Any) -> None:
    data = json.dumps({**WRITTEN, "version": 1, field: value}).encode()
    with pytest.raises(ManifestError) as exc:
        manifest.parse(data)
    message = str(exc.value)
    assert "\n" not in message and message.isprintable() and len(message) < 2000, message
    assert message.startswith(manifest.NAME) and field in message, message
    assert exc.value.exit_code == manifest.Exit.USAGE


@pytest.mark.parametrize("data, words", [
    (b"\xff\xfe", "unreadable (not UTF-8)"),
    (b"{", "unreadable (not JSON"),
    (b"null", "unreadable (not a JSON object)"),
    (b" " * (manifest.MAX_BYTES + 1), "unreadable (larger than"),
])
def test_one_line_errors__manifest_bytes_that_are_not_one(data: bytes, words: str) -> None:
    with pytest.raises(ManifestError) as exc:
        manifest.parse(data)
    assert str(exc.value).startswith(f"{manifest.NAME} in the checkpoint is {words}")
    assert "\n" not in str(exc.value)


def test_integers_written_as_floats_are_held_as_integers() -> None:
    """JSON Schema counts 7.0 as an integer, so the manifest accepts it (as
    before it was typed): the Manifest holds it as an int."""
    m = manifest.parse(json.dumps({**WRITTEN, "version": 1, "gpu_memory_bytes": 1024.0,
                                   "processes": [{"nspid": 7.0, "pid": 42.0}]}).encode())
    assert m.processes == (Process(7, 42, None),) and type(m.processes[0].nspid) is int
    assert type(m.gpu_memory_bytes) is int


def test_unknown_keys_of_a_newer_version_are_accepted_and_kept(tmp_path: Path) -> None:
    """As before the manifest was typed: keys this version does not know
    are no error; the top-level ones stay with it (`status --manifest
    --json` shows them)."""
    newer = {**WRITTEN, "version": 1, "numa": {"node": 1}, "processes": [
        {"nspid": 7, "pid": 4242, "state": "running", "cmd": "python train.py"}],
        "gpu_models": {GPU: {"name": "H100", "memory_mib": 81559, "arch": "hopper"}}}
    write_raw(tmp_path, newer)
    m = manifest.read(tmp_path)
    assert m is not None and m.extra == {"numa": {"node": 1}}
    assert m.processes == (Process(7, 4242, "running"),)
    assert m.gpu_models == {GPU: GpuModel("H100", 81559)}
    assert m.to_dict()["numa"] == {"node": 1}


def test_outside_files_read_safely__the_manifest_is_opened_once(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """One open for the Manifest and its digest: no second open can see
    another file put in the first one's place."""
    manifest.write(tmp_path, WRITTEN)
    path = str(tmp_path / manifest.NAME)
    opened = count_opens(monkeypatch, path)
    m = manifest.read(tmp_path)
    assert m is not None and m.digest is not None
    assert len(opened) == 1
    monkeypatch.undo()
    assert m.digest == hashlib.sha256(Path(path).read_bytes()).hexdigest()


def test_outside_files_read_safely__digest_is_of_the_bytes_read(tmp_path: Path) -> None:
    """The file replaced after the read: the Manifest's digest is still that
    of the bytes it was parsed from, not of the file now in its place."""
    manifest.write(tmp_path, WRITTEN)
    first = (tmp_path / manifest.NAME).read_bytes()
    m = manifest.read(tmp_path)
    assert m is not None
    other = tmp_path / "other"
    other.mkdir()
    manifest.write(other, {**WRITTEN, "container_id": "someone-else"})
    os.replace(other / manifest.NAME, tmp_path / manifest.NAME)
    assert manifest.digest(tmp_path) != hashlib.sha256(first).hexdigest()
    assert m.digest == hashlib.sha256(first).hexdigest() and m.container_id == "gpu-1"


def test_outside_files_read_safely__a_linked_manifest_is_refused(tmp_path: Path) -> None:
    target = tmp_path / "elsewhere.json"
    target.write_text(json.dumps({**WRITTEN, "version": 1}))
    (tmp_path / manifest.NAME).symlink_to(target)
    with pytest.raises(ManifestError, match="unreadable \\(is a symlink\\)"):
        manifest.read(tmp_path)


def test_a_written_manifest_reads_back_as_the_file_holds_it(tmp_path: Path) -> None:
    manifest.write(tmp_path, WRITTEN)
    m = manifest.read(tmp_path)
    on_disk = json.loads((tmp_path / manifest.NAME).read_text())
    assert m is not None and m.to_dict() == on_disk
    assert m.processes[0].nspid == 7 and m.container_id == "gpu-1"
    assert "files" not in on_disk and m.files == {}


def test_the_manifest_post_restore_keeps_reaches_post_resume_typed(tmp_path: Path) -> None:
    """post-restore keeps the Manifest in the CRIU run's progress file (the
    image directory is gone by post-resume) as the image holds it; the next
    script reads it back typed. One damaged inside stays as it was, so that
    post-resume fails closed on it instead of taking it for none."""
    from cudahook.flow.criu_run import CriuRun
    from cudahook.platform.host import Host
    from cudahook.platform.store import Store

    manifest.write(tmp_path, WRITTEN)
    m = manifest.read(tmp_path)
    assert m is not None
    store = Store(tmp_path / "state")
    run = CriuRun(store, Host(), os.getpid())
    run["manifest"] = m
    run.finish("post-restore", 0)
    kept = json.loads(run.path.read_text())["manifest"]
    assert kept == json.loads((tmp_path / manifest.NAME).read_text())
    again = CriuRun(store, Host(), os.getpid()).get("manifest")
    assert isinstance(again, Manifest) and again == m.replace(digest=None)
    damaged = {**kept, "processes": [{"nspid": "x"}]}
    run.progress["manifest"] = damaged
    run.finish("post-restore", 0)
    assert CriuRun(store, Host(), os.getpid()).get("manifest") == damaged


def stored(nspids: tuple[int, ...] = (7, 9), size: int = 10000,
           chunks: int = 3, digest: str = "sha256",
           zstd: tuple[int, ...] = ()) -> manifest.GpuStorage:
    return manifest.GpuStorage(dir=manifest.STORAGE_DIR, digest=digest, processes=tuple(
        manifest.StoredProcess(nspid=n, chunk=4096, manifest_sha256="a" * 64, manifest_size=99,
                               ranges=(manifest.StorageRange(size=size,
                                                             chunks=("b" * 64,) * chunks,
                                                             zstd=zstd),))
        for n in nspids))


def test_gpu_memory_in_storage_is_version_2_and_round_trips(tmp_path: Path) -> None:
    manifest.write(tmp_path, {**DATA, "gpu_storage": stored()})
    raw = json.loads((tmp_path / manifest.NAME).read_text())
    assert raw["version"] == manifest.STORAGE_VERSION == 2
    assert raw["gpu_storage"]["processes"][0]["ranges"] == [{"size": 10000,
                                                             "chunks": ["b" * 64] * 3}]
    m = manifest.read(tmp_path)
    assert m is not None and m.gpu_storage == stored() and m.gpu_storage.bytes == 20000
    assert [(f.name, f.size) for f in m.gpu_storage.processes[0].files()] == [
        ("gpu0-000000.chunk", 4096), ("gpu0-000001.chunk", 4096), ("gpu0-000002.chunk", 1808)]
    assert manifest.parse(json.dumps(m.to_dict()).encode()) == m.replace(digest=digest_of(m))


def test_blake3_or_compressed_chunks_are_version_3_and_round_trip(tmp_path: Path) -> None:
    """An older cudahook refuses such an image by its version; this one reads
    each chunk's compressed size, and the raw size stays what a restore needs."""
    packed = stored(digest="blake3", zstd=(100, 0, 1807))
    manifest.write(tmp_path, {**DATA, "gpu_storage": packed})
    raw = json.loads((tmp_path / manifest.NAME).read_text())
    assert raw["version"] == manifest.PACKED_VERSION == 3
    assert raw["gpu_storage"]["digest"] == "blake3"
    assert raw["gpu_storage"]["processes"][0]["ranges"][0]["zstd"] == [100, 0, 1807]
    m = manifest.read(tmp_path)
    assert m is not None and m.gpu_storage == packed and m.gpu_storage.bytes == 20000
    assert [(f.size, f.zstd, f.kind) for f in m.gpu_storage.processes[0].files("blake3")] == [
        (4096, 100, "blake3"), (4096, 0, "blake3"), (1808, 1807, "blake3")]
    # Compression alone, with sha256, is version 3 too.
    assert stored(zstd=(1, 0, 0)).version == 3 and stored().version == 2


def digest_of(m: Manifest) -> str:
    return hashlib.sha256(json.dumps(m.to_dict()).encode()).hexdigest()


def test_version_1_images_still_read(tmp_path: Path) -> None:
    write_raw(tmp_path, {**DATA, "version": 1})
    m = manifest.read(tmp_path)
    assert m is not None and m.version == 1 and m.gpu_storage is None


@pytest.mark.parametrize("data, words", [
    ({**DATA, "version": 1, "gpu_storage": stored().to_dict()}, "version 1"),
    ({**DATA, "version": 2, "gpu_storage": stored(nspids=(7,)).to_dict()},
     "are not the image's"),
    ({**DATA, "version": 2, "gpu_storage": stored(chunks=2).to_dict()}, "2 chunks for 10000"),
    ({**DATA, "version": 2, "gpu_storage": {**stored().to_dict(), "dir": "../etc"}},
     "gpu_storage"),
    ({**DATA, "version": 2, "gpu_storage": stored(digest="blake3").to_dict()}, "need version 3"),
    ({**DATA, "version": 2, "gpu_storage": stored(zstd=(1, 1, 1)).to_dict()}, "need version 3"),
    ({**DATA, "version": 3, "gpu_storage": stored(digest="md5").to_dict()}, "digest"),
    ({**DATA, "version": 3, "gpu_storage": stored(zstd=(1, 1)).to_dict()}, "one per chunk"),
    ({**DATA, "version": 3, "gpu_storage": stored(zstd=(1, 4096, 1)).to_dict()},
     "smaller than the chunk"),
    ({**DATA, "version": 3, "gpu_storage": stored(zstd=(1, -1, 1)).to_dict()}, "zstd"),
    ({**DATA, "version": 3}, "only it"),
])
def test_bad_gpu_storage_is_a_manifest_error(tmp_path: Path, data: Any, words: str) -> None:
    write_raw(tmp_path, data)
    with pytest.raises(ManifestError) as exc:
        manifest.read(tmp_path)
    assert words in str(exc.value) and "\n" not in str(exc.value)
