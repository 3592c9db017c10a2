"""The driver-API backend finds CUDA 13.4's custom storage by asking the
driver (cuGetProcAddress), and `cudahook features` and doctor say which
GPU-memory path a container gets under `gpu_memory`, and why."""

from __future__ import annotations

import json

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
