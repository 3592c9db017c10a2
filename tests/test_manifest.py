"""manifest: what cudahook adds to a CRIU image directory, versioned and checked on read."""

from __future__ import annotations

import json
import stat
from pathlib import Path
from typing import Any

import pytest

from cudahook.core import manifest
from cudahook.core.manifest import ManifestError

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
    assert manifest.read(tmp_path) == {"version": manifest.VERSION, **DATA}
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
    assert manifest.read(tmp_path) == {"version": 1, "processes": []}


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
    assert manifest.read(tmp_path)["gpu_models"][GPU]["name"] == "NVIDIA H100 80GB HBM3"
