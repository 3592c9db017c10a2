"""Runtime registration and the journal behind it: every change reversible."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import jsonschema
import pytest

from cudahook.admin.configure import ConfigureError, configure
from cudahook.admin.journal import Change, Journal
from cudahook.platform.config import config_dir

from . import nodefiles

HOOKS = Path("/opt/cudahook/libexec")


def tree(root: Path) -> dict[str, str | bytes]:
    return nodefiles.tree(root, skip="var/lib/cudahook")


@pytest.fixture
def root(tmp_path: Path) -> Path:
    (tmp_path / "etc/criu").mkdir(parents=True)
    (tmp_path / "etc/criu/runc.conf").write_text("tcp-established")  # no final newline
    os.chmod(tmp_path / "etc/criu/runc.conf", 0o600)
    (tmp_path / "etc/docker").mkdir(parents=True)
    (tmp_path / "etc/docker/daemon.json").write_text('{"data-root": "/srv/docker"}\n')
    return tmp_path


@pytest.mark.parametrize("runtime", ["runc", "containerd", "docker", "podman", "crio"])
def test_each_runtime_applies_and_reverts_byte_for_byte(root: Path, runtime: str) -> None:
    before = tree(root)
    configure(runtime, HOOKS, root=str(root))
    conf = (root / "etc/criu/runc.conf").read_text()
    assert conf.startswith("tcp-established\n")  # kept, newline added before our line
    assert conf.endswith(f"action-script {HOOKS}/cudahook-criu-action\n")
    assert tree(root) != before
    again = configure(runtime, HOOKS, root=str(root))
    assert f"{runtime}: already configured" in again
    configure(runtime, HOOKS, root=str(root), revert=True)
    assert tree(root) == before
    assert not (root / "var/lib/cudahook/journal.json").exists()


def test_docker_keeps_other_keys_and_can_be_default(root: Path) -> None:
    lines = configure("docker", HOOKS, root=str(root), default=True)
    cfg = json.loads((root / "etc/docker/daemon.json").read_text())
    assert cfg["data-root"] == "/srv/docker"
    assert cfg["runtimes"]["cudahook"] == {"path": f"{HOOKS}/cudahook-runtime"}
    assert cfg["default-runtime"] == "cudahook"
    assert any("experimental" in x for x in lines) and any("restart docker" in x for x in lines)


def test_hooks_d_definitions_match_the_oci_hooks_schema(root: Path) -> None:
    configure("podman", HOOKS, root=str(root))
    schema = json.loads((config_dir() / "oci-hooks.schema.json").read_text())
    stages = set()
    for f in (root / "usr/share/containers/oci/hooks.d").iterdir():
        d = json.loads(f.read_text())
        jsonschema.validate(d, schema)
        assert d["hook"]["args"][-1] == d["stages"][0]  # the hook learns its stage from argv
        stages |= set(d["stages"])
    assert stages == {"prestart", "poststop"}
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate({"version": "1.0.0", "hook": {"path": "relative"}, "when": {},
                             "stages": ["prestart"]}, schema)


def test_dry_run_changes_nothing_and_shows_the_diff(root: Path) -> None:
    before = tree(root)
    lines = configure("containerd", HOOKS, root=str(root), dry_run=True)
    text = "\n".join(lines)
    assert "+action-script" in text and "50-cudahook.conf" in text
    assert tree(root) == before


def test_shared_action_script_stays_while_another_runtime_needs_it(root: Path) -> None:
    configure("docker", HOOKS, root=str(root))
    configure("podman", HOOKS, root=str(root))
    configure("docker", HOOKS, root=str(root), revert=True)
    assert "cudahook-criu-action" in (root / "etc/criu/runc.conf").read_text()
    configure("podman", HOOKS, root=str(root), revert=True)
    assert (root / "etc/criu/runc.conf").read_text() == "tcp-established"


def test_a_file_changed_since_is_left_alone(root: Path) -> None:
    configure("docker", HOOKS, root=str(root))
    daemon = root / "etc/docker/daemon.json"
    daemon.write_text('{"edited": "by hand"}\n')
    lines = configure("docker", HOOKS, root=str(root), revert=True)
    assert any("changed since cudahook wrote it; left as is" in x for x in lines)
    assert daemon.read_text() == '{"edited": "by hand"}\n'


def test_invalid_daemon_json_is_a_one_line_usage_error(root: Path) -> None:
    (root / "etc/docker/daemon.json").write_text("{not json")
    with pytest.raises(ConfigureError, match="not valid JSON"):
        configure("docker", HOOKS, root=str(root))
    r = subprocess.run([sys.executable, "-m", "cudahook", "configure", "--runtime", "docker",
                        "--hooks-dir", str(HOOKS), "--root", str(root)],
                       capture_output=True, text=True)
    assert r.returncode == 2 and r.stderr.count("\n") == 1 and "not valid JSON" in r.stderr


def test_journal_restores_symlinks_and_absent_files(tmp_path: Path) -> None:
    j = Journal(tmp_path)
    link = tmp_path / "usr/local/bin/x"
    j.apply("install", [Change(link, None, symlink="/opt/x"),
                        Change(tmp_path / "etc/new/file", b"data")])
    assert os.readlink(link) == "/opt/x" and (tmp_path / "etc/new/file").read_bytes() == b"data"
    restored, kept = j.revert(None)
    assert kept == [] and len(restored) == 2
    assert not link.exists() and not (tmp_path / "etc/new").exists()
    assert not (tmp_path / "usr/local/bin").exists()  # directories it made are gone too


def test_criu_registration_gpu_only_and_back_to_global(root: Path) -> None:
    """gpu-only leaves runc.conf's own options and only a comment naming the
    script (the wrapper registers it per GPU container); switching back, or
    reverting, puts the file back as it was."""
    from cudahook.admin import registrations
    from cudahook.platform import criuconf

    before = tree(root)
    script = f"{HOOKS}/cudahook-criu-action"
    lines = configure("runc", HOOKS, root=str(root), criu_registration="gpu-only")
    conf = (root / "etc/criu/runc.conf").read_text()
    assert conf.startswith("tcp-established\n")
    assert criuconf.action_scripts(conf) == []  # no container's CRIU runs it from here
    assert criuconf.registration(conf) == ("gpu-only", script)
    assert any("gpu-only" in x and "not covered" in x for x in lines)
    # Without the flag, a later configure keeps the mode it finds.
    assert "runc: already configured" in configure("runc", HOOKS, root=str(root))
    configure("docker", HOOKS, root=str(root))
    assert (root / "etc/criu/runc.conf").read_text() == conf
    configure("runc", HOOKS, root=str(root), criu_registration="global")
    conf = (root / "etc/criu/runc.conf").read_text()
    assert criuconf.registration(conf) == ("global", script)
    assert conf.splitlines()[1:] == [criuconf.COMMENT, f"action-script {script}"]  # no gpu-only line
    # strip (uninstall of a file changed since) removes either form.
    gpu_only = f"x\n{criuconf.gpu_only_line(script)}\n".encode()
    assert registrations.strip("criu", gpu_only, lambda exe: True) == b"x\n"
    configure("docker", HOOKS, root=str(root), revert=True)
    configure("runc", HOOKS, root=str(root), revert=True)
    assert tree(root) == before
    lines = configure("podman", HOOKS, root=str(root), criu_registration="gpu-only",
                      dry_run=True)
    assert any("podman creates containers without the wrapper" in x for x in lines)
    with pytest.raises(ConfigureError, match="unknown CRIU registration"):
        configure("runc", HOOKS, root=str(root), criu_registration="some")
