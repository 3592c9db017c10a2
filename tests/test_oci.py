"""oci: the container state on stdin, and what config.json says about GPUs."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from cudahook.core.gpus import Gpu
from cudahook.flow import gpu_request, oci_bundle
from cudahook.hooks import oci_state
from cudahook.platform.errors import UsageError

U0 = "GPU-11111111-2222-3333-4444-555555555555"
U1 = "GPU-aaaaaaaa-bbbb-cccc-dddd-eeeeeeeeeeee"

RUNC_STATE = {
    "ociVersion": "1.2.0",
    "id": "gpu-1234abcd",
    "status": "creating",
    "pid": 4242,
    "bundle": "/run/containerd/io.containerd.runtime.v2.task/k8s.io/gpu-1234abcd",
    "annotations": {"io.kubernetes.cri.container-type": "container"},
}


def one_line(exc: pytest.ExceptionInfo[UsageError]) -> str:
    text = str(exc.value)
    assert "\n" not in text and text
    return text


# -- read_state -----------------------------------------------------------------


@pytest.mark.parametrize("text, expect", [
    ("not json", "not JSON"),
    ("", "not JSON"),
    ("[1, 2]", "not a JSON object"),
    ('"id"', "not a JSON object"),
    ("null", "not a JSON object"),
    ('{"bundle": "/b"}', "'id'"),
    ('{"id": "", "bundle": "/b"}', "'id'"),
    ('{"id": 7, "bundle": "/b"}', "'id'"),
    ('{"id": "c"}', "'bundle'"),
    ('{"id": "c", "bundle": ["/b"]}', "'bundle'"),
    ("[" * 200_000, "not JSON"),  # deep nesting: RecursionError in the decoder
])
def test_read_state_rejects_with_one_line(text: str, expect: str) -> None:
    with pytest.raises(UsageError) as exc:
        oci_state.read_state(text)
    assert expect in one_line(exc)


def test_read_state_too_large() -> None:
    text = json.dumps({"id": "c", "bundle": "/b", "pad": "x" * oci_state.MAX_STATE})
    with pytest.raises(UsageError) as exc:
        oci_state.read_state(text)
    assert "too large" in one_line(exc)


def test_read_state_returns_the_object() -> None:
    assert oci_state.read_state(json.dumps(RUNC_STATE)) == RUNC_STATE


# -- read_bundle / visible_devices -------------------------------------------------


def bundle(tmp_path: Path, cfg: Any, name: str = "b") -> str:
    d = tmp_path / name
    d.mkdir()
    (d / "config.json").write_text(cfg if isinstance(cfg, str) else json.dumps(cfg))
    return str(d)


def env_cfg(*env: str, **extra: Any) -> dict[str, Any]:
    return {"ociVersion": "1.2.0", "process": {"env": ["PATH=/bin", *env]},
            "root": {"path": "rootfs"}, **extra}


@pytest.mark.parametrize("value, visible", [
    (f"{U0},{U1}", [U0, U1]),
    (f" {U0} , ", [U0]),
    ("0,1", ["0", "1"]),
    ("all", ["all"]),
    ("none", []),
    ("void", []),
    ("", []),
])
def test_nvidia_visible_devices(tmp_path: Path, value: str, visible: list[str]) -> None:
    info = oci_bundle.read_bundle(bundle(tmp_path, env_cfg(f"NVIDIA_VISIBLE_DEVICES={value}")))
    assert info.visible == visible
    assert info.wants_gpu is bool(visible)


def test_visible_devices_env_wins_over_device_entries(tmp_path: Path) -> None:
    cfg = env_cfg("NVIDIA_VISIBLE_DEVICES=void",
                  linux={"devices": [{"path": "/dev/nvidia0", "type": "c"}]})
    assert oci_bundle.read_bundle(bundle(tmp_path, cfg)).visible == []


@pytest.mark.parametrize("value, visible", [
    ("nvidia.com/gpu=0,1", ["0", "1"]),  # short form
    ("nvidia.com/gpu=0,nvidia.com/gpu=1", ["0", "1"]),  # CDI's own form: qualified names
    (f"vendor.com/fpga=a,nvidia.com/gpu={U1}", [U1]),  # another vendor beside it
    ("nvidia.com/gpu=all", ["all"]),
    ("vendor.com/fpga=0,1", []),
])
def test_cdi_annotation(tmp_path: Path, value: str, visible: list[str]) -> None:
    cfg = env_cfg(annotations={"cdi.k8s.io/nvidia-device-plugin_x": value})
    assert oci_bundle.read_bundle(bundle(tmp_path, cfg)).visible == visible


def test_cdi_needs_the_cdi_prefix(tmp_path: Path) -> None:
    cfg = env_cfg(annotations={"example.com/x": "nvidia.com/gpu=0"})
    assert oci_bundle.read_bundle(bundle(tmp_path, cfg)).visible == []


def test_linux_device_entries(tmp_path: Path) -> None:
    devices = [{"path": p, "type": "c"} for p in
               ("/dev/nvidiactl", "/dev/nvidia-uvm", "/dev/nvidia3", "/dev/nvidia1", "/dev/null")]
    info = oci_bundle.read_bundle(bundle(tmp_path, env_cfg(linux={"devices": [*devices, "junk", None]})))
    assert info.visible == ["3", "1"]
    assert info.wants_gpu


def test_plain_container_wants_no_gpu(tmp_path: Path) -> None:
    info = oci_bundle.read_bundle(bundle(tmp_path, env_cfg(linux={"devices": [{"path": "/dev/fuse"}]})))
    assert info.visible == [] and not info.wants_gpu
    assert info.snapshot_control is None


def test_snapshot_control_source_and_annotations(tmp_path: Path) -> None:
    mounts = [{"destination": "/proc", "source": "proc", "type": "proc"},
              {"destination": "/snapshot-control", "source": "/var/lib/x/ctl",
               "type": "bind", "options": ["rbind"]}]
    b = bundle(tmp_path, env_cfg(mounts=mounts, annotations={"a": "b", "n": 3}))
    info = oci_bundle.read_bundle(b)
    assert info.snapshot_control == "/var/lib/x/ctl"
    assert info.annotations == {"a": "b", "n": "3"}


@pytest.mark.parametrize("cfg, words", [
    ("{not json", "not JSON"),
    ("[]", "not a JSON object"),
    ({"process": "x"}, "malformed"),
    ({"linux": ["x"]}, "malformed"),
    ({"mounts": 5}, "malformed"),
    ({"mounts": [{"destination": "/snapshot-control", "source": 7}]}, "snapshot-control"),
])
def test_bad_config_json_is_a_usage_error(tmp_path: Path, cfg: Any, words: str) -> None:
    with pytest.raises(UsageError) as exc:
        oci_bundle.read_bundle(bundle(tmp_path, cfg))
    text = one_line(exc)
    assert "config.json" in text and words in text


def test_missing_or_unreadable_config_json(tmp_path: Path) -> None:
    with pytest.raises(UsageError) as exc:
        oci_bundle.read_bundle(str(tmp_path / "nope"))
    assert "no such file" in one_line(exc)
    d = tmp_path / "dir"
    (d / "config.json").mkdir(parents=True)  # a directory where the file should be
    with pytest.raises(UsageError) as exc:
        oci_bundle.read_bundle(str(d))
    assert "unreadable" in one_line(exc)


# -- resolve_uuids ------------------------------------------------------------------


GPUS = [Gpu(0, U0, "H100", 81559, "580.65.06", True), Gpu(1, U1, "H100", 81559, "580.65.06", True)]


def test_resolve_uuids() -> None:
    assert gpu_request.resolve_uuids(["all"], GPUS) == [U0, U1]
    assert gpu_request.resolve_uuids(["1", "0"], GPUS) == [U1, U0]
    assert gpu_request.resolve_uuids([U1, "0"], GPUS) == [U1, U0]
    assert gpu_request.resolve_uuids(["MIG-x"], GPUS) == ["MIG-x"]
    assert gpu_request.resolve_uuids([], GPUS) == []


@pytest.mark.parametrize("visible", [["2"], ["0", "7"], ["gpu0"]])
def test_resolve_unknown_index_is_an_error(visible: list[str]) -> None:
    with pytest.raises(UsageError) as exc:
        gpu_request.resolve_uuids(visible, GPUS)
    assert "does not have" in one_line(exc)
