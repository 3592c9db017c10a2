"""The runtime wrapper: hooks added to GPU containers only, runc exec'd unchanged."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest

from cudahook.admin import hookfiles
from cudahook.hooks.runtime_wrapper import add_hooks, bundle_of, split


def test_split_global_options_command_and_args() -> None:
    opts, cmd, rest = split(["--root", "/r", "--log=/l", "--log-format", "json", "--debug",
                             "create", "--bundle", "/b", "id"])
    assert opts == {"--root": "/r", "--log": "/l", "--log-format": "json", "--debug": ""}
    assert cmd == "create" and rest == ["--bundle", "/b", "id"]
    assert bundle_of(rest) == "/b" and bundle_of(["-b=/x", "id"]) == "/x"
    assert bundle_of(["id"]) == "."


def bundle(tmp_path: Path, env: list[str], annotations: dict[str, str] | None = None) -> Path:
    cfg = {"ociVersion": "1.0.2", "process": {"env": env, "args": ["sh"]},
           "annotations": annotations or {}, "hooks": {"poststop": [{"path": "/other"}]}}
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    os.chmod(tmp_path / "config.json", 0o640)
    return tmp_path


def test_gpu_container_gets_the_hooks_once(tmp_path: Path) -> None:
    b = bundle(tmp_path, ["NVIDIA_VISIBLE_DEVICES=0"])
    assert add_hooks(str(b), "/opt/h")
    assert not add_hooks(str(b), "/opt/h")  # runc restore of the same bundle: no duplicates
    hooks = json.loads((b / "config.json").read_text())["hooks"]
    assert hooks["createRuntime"] == [{"path": "/opt/h", "args": ["cudahook-oci-hook",
                                                                 "createRuntime"]}]
    assert hooks["poststop"][0] == {"path": "/other"} and len(hooks["poststop"]) == 2
    assert (b / "config.json").stat().st_mode & 0o777 == 0o640


@pytest.mark.parametrize(("env", "notes", "expect"), [
    ([], {}, False),
    (["NVIDIA_VISIBLE_DEVICES=void"], {}, False),
    ([], {"cudahook.io/enabled": "true"}, True),
    (["NVIDIA_VISIBLE_DEVICES=all"], {"cudahook.io/enabled": "false"}, False),
])
def test_only_gpu_or_enabled_containers_change(tmp_path: Path, env, notes, expect) -> None:  # type: ignore[no-untyped-def]
    b = bundle(tmp_path, env, notes)
    before = (b / "config.json").read_bytes()
    assert add_hooks(str(b), "/opt/h") is expect
    assert ((b / "config.json").read_bytes() == before) is (not expect)


def test_installed_wrapper_passes_everything_to_runc(tmp_path: Path) -> None:
    fake = tmp_path / "runc"
    log = tmp_path / "argv"
    fake.write_text(f"#!/bin/sh\necho \"$@\" >> {log}\n")
    fake.chmod(0o755)
    paths = hookfiles.install(tmp_path / "hooks", runc=str(fake))
    wrapper = paths["cudahook-runtime"]
    (tmp_path / "b").mkdir()
    b = bundle(tmp_path / "b", ["NVIDIA_VISIBLE_DEVICES=GPU-1"])
    runc_log = tmp_path / "runc.log"
    for args in (["--root", "/r", "state", "id"],
                 ["--log", str(runc_log), "--log-format", "json", "create", "--bundle", str(b),
                  "id"]):
        r = subprocess.run([str(wrapper), *args], capture_output=True, text=True)
        assert r.returncode == 0, r.stderr
    assert log.read_text().splitlines() == [
        "--root /r state id",
        f"--log {runc_log} --log-format json create --bundle {b} id"]
    entry = json.loads(runc_log.read_text())
    assert entry["level"] == "info" and "added OCI hooks" in entry["msg"]
    hooks = json.loads((b / "config.json").read_text())["hooks"]
    assert hooks["createRuntime"][0]["path"] == str(paths["cudahook-oci-hook"])
