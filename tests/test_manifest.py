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
