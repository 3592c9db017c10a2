"""install.sh from a fresh prefix: files, registrations, a real runc round trip
through the installed wrapper and hooks, the demo, and a byte-for-byte uninstall."""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import stat
import subprocess
from pathlib import Path

import jsonschema
import pytest
import yaml

from cudahook.platform.config import config_dir
from cudahook.sim.lab import SimLab
from cudahook.sim.runcbox import RuncBox

from .conftest import CRIU, needs_runc, private_node, real_node_env

pytestmark = [*needs_runc, private_node]

REPO = Path(__file__).resolve().parents[2]
WATCHED = [
    "/etc/criu/runc.conf", "/etc/docker/daemon.json", "/etc/cudahook/config.yaml",
    "/etc/systemd/system/containerd.service.d/50-cudahook.conf",
    "/usr/share/containers/oci/hooks.d/50-cudahook-create.json",
    "/usr/share/containers/oci/hooks.d/50-cudahook-poststop.json",
    "/usr/local/bin/cudahook", "/usr/local/bin/cudahook-sim", "/usr/local/bin/cudahook-runtime",
    "/var/lib/cudahook/journal.json",
]


def snapshot() -> dict[str, tuple[bytes, int] | None]:
    out: dict[str, tuple[bytes, int] | None] = {}
    for p in WATCHED:
        path = Path(p)
        if path.is_symlink():
            out[p] = (b"->" + os.readlink(path).encode(), 0)
        elif path.exists():
            out[p] = (path.read_bytes(), stat.S_IMODE(path.stat().st_mode))
        else:
            out[p] = None
    return out


def put_back(snap: dict[str, tuple[bytes, int] | None]) -> None:
    """Leave the machine as the test found it, whatever happened."""
    for p, v in snap.items():
        path = Path(p)
        if path.is_symlink() or path.exists():
            path.unlink()
        if v is not None and not v[0].startswith(b"->"):
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_bytes(v[0])
            os.chmod(path, v[1])


def sh(*args: str, timeout: float = 300) -> subprocess.CompletedProcess[str]:
    return subprocess.run(list(args), capture_output=True, text=True, timeout=timeout,
                          env=real_node_env())


DIRS = ["/etc/criu", "/etc/docker", "/etc/cudahook", "/var/lib/cudahook",
        "/etc/systemd/system/containerd.service.d", "/usr/share/containers/oci/hooks.d"]


@pytest.fixture
def machine():  # type: ignore[no-untyped-def]
    snap = snapshot()
    absent = [d for d in DIRS if not Path(d).exists()]
    yield snap
    put_back(snap)
    for d in absent:  # directories this test made: gone again, if empty
        with contextlib.suppress(OSError):
            Path(d).rmdir()


def test_install_and_uninstall_restore_every_byte(machine, tmp_path) -> None:  # type: ignore[no-untyped-def]
    # Files other tools own, with content and modes of their own.
    Path("/etc/criu").mkdir(exist_ok=True)
    Path("/etc/criu/runc.conf").write_text("# site settings\ntcp-established\n")
    os.chmod("/etc/criu/runc.conf", 0o640)
    Path("/etc/docker").mkdir(exist_ok=True)
    Path("/etc/docker/daemon.json").write_text('{"log-level": "warn", "experimental": true}')
    before = snapshot()
    prefix = tmp_path / "opt"

    r = sh(str(REPO / "install.sh"), "--prefix", str(prefix), "--dry-run", "--runtime", "docker")
    assert r.returncode == 0, r.stderr
    assert "+action-script" in r.stdout and "/etc/docker/daemon.json" in r.stdout
    assert snapshot() == before and not prefix.exists()  # a dry run changes nothing

    r = sh(str(REPO / "install.sh"), "--prefix", str(prefix), "--runtime", "docker",
           "--runtime", "containerd", "--runtime", "podman", "--default-runtime")
    assert r.returncode == 0, r.stderr
    r2 = sh(str(REPO / "install.sh"), "--prefix", str(prefix), "--runtime", "docker",
            "--runtime", "containerd", "--runtime", "podman", "--default-runtime")
    assert r2.returncode == 0 and "already configured" in r2.stdout  # idempotent

    conf = Path("/etc/criu/runc.conf").read_text()
    assert conf.startswith("# site settings\ntcp-established\n")
    assert f"action-script {prefix}/libexec/cudahook-criu-action" in conf
    daemon = json.loads(Path("/etc/docker/daemon.json").read_text())
    assert daemon["log-level"] == "warn" and daemon["experimental"] is True
    assert daemon["runtimes"]["cudahook"]["path"] == f"{prefix}/libexec/cudahook-runtime"
    assert daemon["default-runtime"] == "cudahook"
    schema = json.loads((config_dir() / "oci-hooks.schema.json").read_text())
    for name in ("create", "poststop"):
        hook = json.loads(Path(f"/usr/share/containers/oci/hooks.d/50-cudahook-{name}.json")
                          .read_text())
        jsonschema.validate(hook, schema)
        assert os.access(hook["hook"]["path"], os.X_OK)
    assert os.readlink(f"{prefix}/libexec/runc-path/runc").endswith("cudahook-runtime")
    assert "runc-path" in Path(
        "/etc/systemd/system/containerd.service.d/50-cudahook.conf").read_text()

    r = sh("/usr/local/bin/cudahook", "--json", "doctor")
    checks = {c["name"]: c for c in json.loads(r.stdout)}
    assert checks["runc/criu registration"]["status"] == "ok"
    assert checks["docker registration"]["status"] == "ok"
    assert checks["cuda-checkpoint"]["status"] == "fail"  # no GPU driver on this machine
    assert r.returncode == 1

    r = sh(str(REPO / "install.sh"), "--prefix", str(prefix), "--uninstall")
    assert r.returncode == 0, r.stderr
    assert snapshot() == before
    assert not prefix.exists()


def test_installed_wrapper_and_hooks_round_trip_and_demo(machine, tmp_path) -> None:  # type: ignore[no-untyped-def]
    prefix = tmp_path / "opt"
    r = sh(str(REPO / "install.sh"), "--prefix", str(prefix))
    assert r.returncode == 0, r.stderr
    installed = Path("/etc/cudahook/config.yaml").read_bytes()
    lab = SimLab(tmp_path / "node").start()
    box = None
    try:
        Path("/etc/cudahook/config.yaml").write_text(yaml.safe_dump(dict(lab.settings().__dict__)))
        box = RuncBox(tmp_path / "runc", lab, criu=CRIU, runc=f"{prefix}/libexec/cudahook-runtime")
        bundle = box.bundle("b", [("w", {"mib": 4}), ("mp", {"mib": 1, "procs": 2})],
                            oci_hooks=False, action_script="system")
        tags = ["w", "mp.0", "mp.1"]
        assert box.run("c1", bundle).returncode == 0
        hooks = json.loads((bundle / "config.json").read_text())["hooks"]
        assert hooks["createRuntime"][0]["path"] == f"{prefix}/libexec/cudahook-oci-hook"
        for t in tags:
            lab.wait_counter(t, 3)
        image = tmp_path / "img"
        r = box.checkpoint("c1", image)
        assert r.returncode == 0, r.stderr
        assert (image / "cudahook-manifest.json").exists()
        frozen = {t: lab.status(t)["counter"] for t in tags}
        r = box.restore("c1", bundle, image)
        assert r.returncode == 0, r.stderr
        for t in tags:
            st = lab.wait_counter(t, frozen[t] + 11)
            assert st["intact"] and not st["errors"]
        r = sh("/usr/local/bin/cudahook", "status", "--no-live")
        assert "c1" in r.stdout and "last checkpoint" in r.stdout
    finally:
        if box is not None:
            box.close()
        lab.stop()
        Path("/etc/cudahook/config.yaml").write_bytes(installed)

    r = sh("/usr/local/bin/cudahook", "demo", timeout=240)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "demo passed" in r.stdout
    r = sh(str(REPO / "install.sh"), "--prefix", str(prefix), "--uninstall")
    assert r.returncode == 0, r.stderr
    assert not Path("/usr/local/bin/cudahook").exists()
    shutil.rmtree(tmp_path / "runc", ignore_errors=True)
