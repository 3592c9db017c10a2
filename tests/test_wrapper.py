"""The runtime wrapper: hooks added to GPU containers only, runc exec'd unchanged."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest

from cudahook.admin import hookfiles
from cudahook.flow.registration import add_hooks
from cudahook.hooks.runtime_wrapper import bundle_of, split
from cudahook.platform.errors import UsageError
from cudahook.platform.store import container_key


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


def _criu_setup(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, runc_conf: str | None
                ) -> Path:
    """A node root with a config whose state_dir is in it (and runc.conf)."""
    import yaml

    root = tmp_path / "root"
    (root / "etc/criu").mkdir(parents=True)
    if runc_conf is not None:
        (root / "etc/criu/runc.conf").write_text(runc_conf)
    cfg = tmp_path / "cfg.yaml"
    cfg.write_text(yaml.safe_dump({"state_dir": str(tmp_path / "state")}))
    monkeypatch.setenv("CUDAHOOK_ROOT", str(root))
    monkeypatch.setenv("CUDAHOOK_CONFIG", str(cfg))
    (tmp_path / "b").mkdir()
    return tmp_path / "state"


def test_gpu_only_a_gpu_container_gets_its_own_criu_config(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from cudahook.platform import criuconf

    state = _criu_setup(tmp_path, monkeypatch, "tcp-established\n"
                        + criuconf.gpu_only_line("/opt/h/cudahook-criu-action") + "\n")
    b = bundle(tmp_path / "b", ["NVIDIA_VISIBLE_DEVICES=0"])
    assert add_hooks(str(b), "/opt/h/cudahook-oci-hook", "c-1")
    notes = json.loads((b / "config.json").read_text())["annotations"]
    copy = state / "criu" / f"{container_key('c-1', str(b))}.conf"
    assert notes == {"org.criu.config": str(copy)}
    assert copy.read_text().splitlines() == [
        "tcp-established", criuconf.COMMENT, "action-script /opt/h/cudahook-criu-action"]
    assert copy.stat().st_mode & 0o777 == 0o600
    # runc restore of the same bundle after poststop removed the copy: written again.
    copy.unlink()
    assert not add_hooks(str(b), "/opt/h/cudahook-oci-hook", "c-1")
    assert "action-script /opt/h/cudahook-criu-action" in copy.read_text()
    # A non-GPU container: no copy, config.json untouched.
    (tmp_path / "p").mkdir()
    p = bundle(tmp_path / "p", [])
    before = (p / "config.json").read_bytes()
    assert not add_hooks(str(p), "/opt/h/cudahook-oci-hook", "plain")
    assert (p / "config.json").read_bytes() == before
    assert sorted(os.listdir(state / "criu")) == [copy.name]


def test_a_containers_own_criu_config_is_kept_and_global_needs_no_copy(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from cudahook.platform import criuconf

    state = _criu_setup(tmp_path, monkeypatch, f"{criuconf.COMMENT}\n"
                        "action-script /opt/h/cudahook-criu-action\n")
    own = tmp_path / "root/etc/criu/own.conf"  # the operator's directory
    own.write_text("ghost-limit 1M\n")
    b = bundle(tmp_path / "b", ["NVIDIA_VISIBLE_DEVICES=0"], {"org.criu.config": str(own)})
    # Global registration, but the container names its own file, which lacks the script.
    assert add_hooks(str(b), "/opt/h/cudahook-oci-hook", "c-2")
    notes = json.loads((b / "config.json").read_text())["annotations"]
    copy = state / "criu" / f"{container_key('c-2', str(b))}.conf"
    assert notes == {"org.criu.config": str(copy), "cudahook.io/criu-config": str(own)}
    assert copy.read_text().startswith("ghost-limit 1M\n")
    # Its own file names the script now: runc's choice covers it, the copy goes.
    own.write_text("action-script /opt/h/cudahook-criu-action\n")
    assert add_hooks(str(b), "/opt/h/cudahook-oci-hook", "c-2")
    assert json.loads((b / "config.json").read_text())["annotations"] == {
        "org.criu.config": str(own)}
    assert not copy.exists()
    # Global, no annotation: nothing to add for CRIU.
    (tmp_path / "g").mkdir()
    g = bundle(tmp_path / "g", ["NVIDIA_VISIBLE_DEVICES=0"])
    add_hooks(str(g), "/opt/h/cudahook-oci-hook", "c-3")
    assert json.loads((g / "config.json").read_text())["annotations"] == {}
    # The annotation the wrapper adds is one cudahook accepts at createRuntime.
    from cudahook.flow.annotations import parse

    parse({"cudahook.io/criu-config": str(own)})


def test_criu_copies_are_bounded_and_pruned(tmp_path: Path, monkeypatch: pytest.MonkeyPatch
                                            ) -> None:
    from cudahook.platform import criuconf

    state = tmp_path / "state"
    monkeypatch.setattr(criuconf, "MAX_FILES", 3)
    for cid in ("a", "b", "c"):
        criuconf.write(state, cid, "x\n")
    (state / "containers").mkdir()
    (state / "containers" / "a.json").write_text("{}")
    with pytest.raises(OSError, match="already holds 3"):
        criuconf.write(state, "d", "x\n")  # all three are fresh
    old = 1_000_000.0
    for cid in ("a", "b"):
        os.utime(state / "criu" / f"{cid}.conf", (old, old))
    criuconf.write(state, "d", "x\n")  # b (old, no record) made room; a has a record
    assert sorted(os.listdir(state / "criu")) == ["a.conf", "c.conf", "d.conf"]
    for bad in ("../x", "a\n"):  # the store's own id rule: "$" would let "a\n" through
        with pytest.raises(UsageError, match="invalid container id"):
            criuconf.conf_path(state, bad)
