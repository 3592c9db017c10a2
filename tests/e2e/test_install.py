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

from ..nodefiles import site_node, tree
from .conftest import CRIU, needs_runc, private_node, real_node_env

pytestmark = [*needs_runc, private_node]

REPO = Path(__file__).resolve().parents[2]
WATCHED = [
    "/etc/criu/runc.conf", "/etc/docker/daemon.json", "/etc/cudahook/config.yaml",
    "/etc/systemd/system/containerd.service.d/50-cudahook.conf",
    "/usr/share/containers/oci/hooks.d/50-cudahook-create.json",
    "/usr/share/containers/oci/hooks.d/50-cudahook-poststop.json",
    "/usr/local/bin/cudahook", "/usr/local/bin/cudahook-sim", "/usr/local/bin/cudahook-runtime",
    "/var/lib/cudahook/journal.json", "/etc/logrotate.d/cudahook",
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


DIRS = ["/etc/criu", "/etc/docker", "/etc/cudahook", "/var/lib/cudahook", "/etc/logrotate.d",
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


def at_root(root: Path, *args: str, timeout: float = 300) -> subprocess.CompletedProcess[str]:
    """install.sh (or an installed command) for a whole node kept in `root`."""
    env = {**os.environ, "CUDAHOOK_ROOT": str(root)}
    return subprocess.run(list(args), capture_output=True, text=True, timeout=timeout, env=env)


@pytest.fixture
def node_root(tmp_path: Path) -> Path:
    """Files other tools own, with content and modes of their own."""
    return site_node(tmp_path / "node")


def test_install_and_uninstall_restore_every_byte(node_root: Path) -> None:
    root = node_root
    before = tree(root)
    prefix = root / "opt/cudahook"
    install = str(REPO / "install.sh")

    r = at_root(root, install, "--dry-run", "--runtime", "docker")
    assert r.returncode == 0, r.stderr
    assert "+action-script" in r.stdout and f"{root}/etc/docker/daemon.json" in r.stdout
    assert tree(root) == before and not prefix.exists()  # a dry run changes nothing

    args = ["--runtime", "docker", "--runtime", "containerd", "--runtime", "podman",
            "--default-runtime"]
    r = at_root(root, install, *args)
    assert r.returncode == 0, r.stderr
    r2 = at_root(root, install, *args)
    assert r2.returncode == 0 and "already configured" in r2.stdout  # idempotent

    conf = (root / "etc/criu/runc.conf").read_text()
    assert conf.startswith("# site settings\ntcp-established\n")
    assert f"action-script {prefix}/libexec/cudahook-criu-action" in conf
    daemon = json.loads((root / "etc/docker/daemon.json").read_text())
    assert daemon["log-level"] == "warn" and daemon["experimental"] is True
    assert daemon["runtimes"]["cudahook"]["path"] == f"{prefix}/libexec/cudahook-runtime"
    assert daemon["default-runtime"] == "cudahook"
    schema = json.loads((config_dir() / "oci-hooks.schema.json").read_text())
    hooks_d = root / "usr/share/containers/oci/hooks.d"
    for name in ("create", "poststop"):
        hook = json.loads((hooks_d / f"50-cudahook-{name}.json").read_text())
        jsonschema.validate(hook, schema)
        assert os.access(hook["hook"]["path"], os.X_OK)
    assert os.readlink(f"{prefix}/libexec/runc-path/runc").endswith("cudahook-runtime")
    assert "runc-path" in (root / "etc/systemd/system/containerd.service.d/50-cudahook.conf"
                           ).read_text()
    assert str(root / "var/log/cudahook.log") in (root / "etc/logrotate.d/cudahook").read_text()

    for argv in (["--json", "doctor"], ["doctor", "--json"]):
        r = at_root(root, str(root / "usr/local/bin/cudahook"), *argv)
        checks = {c["name"]: c for c in json.loads(r.stdout)}
        assert checks["runc/criu registration"]["status"] == "ok"
        assert checks["docker registration"]["status"] == "ok"
        assert checks["dangling registrations"]["status"] == "ok"
        assert checks["cuda-checkpoint"]["status"] == "fail"  # no GPU driver on this machine
        assert r.returncode == 1

    (root / "run/cudahook/containers").mkdir(parents=True)
    (root / "run/cudahook-marks/gpu").mkdir(parents=True)
    r = at_root(root, install, "--uninstall")
    assert r.returncode == 0, r.stderr
    assert f"removed {prefix}/venv" in r.stdout and f"removed {root}/run/cudahook" in r.stdout
    assert not (root / "run/cudahook").exists() and not (root / "run/cudahook-marks").exists()
    (root / "run").rmdir()
    (root / "opt").rmdir()
    assert tree(root) == before
    assert not prefix.exists()


PROVISION = """#!/bin/sh
# Stands in for provision-criu.sh: the same arguments, a CRIU that only says its version.
set -e
[ "$1" = --prefix ] && [ "$3" = --link ] && [ -z "$4" ]
mkdir -p "$2/bin"
printf '#!/bin/sh\necho "Version: 4.1.1"\n' > "$2/bin/criu"
chmod 755 "$2/bin/criu"
"""


def test_install_sh_provides_criu_repairs_itself_and_uninstalls_it(
        node_root: Path, tmp_path: Path) -> None:
    root = node_root
    before = tree(root)
    prefix = root / "opt/cudahook"
    install = str(REPO / "install.sh")
    provision = tmp_path / "provision.sh"
    provision.write_text(PROVISION)
    provision.chmod(0o755)
    env = {"CUDAHOOK_PROVISION_CRIU": str(provision)}
    r = at_root(root, "env", *[f"{k}={v}" for k, v in env.items()], install, "--with-criu")
    assert r.returncode == 0, r.stderr
    link = root / "usr/local/sbin/criu"
    assert os.readlink(link) == f"{prefix}/criu/bin/criu"

    # Another prefix is refused in one line, before anything changes.
    installed = tree(root)
    r = at_root(root, install, "--prefix", str(root / "opt/other"))
    assert r.returncode == 2 and r.stderr.count("\n") == 1, r.stderr
    assert f"already installed at {prefix}" in r.stderr and "--force" in r.stderr
    assert tree(root) == installed

    # Half removed by hand: running install.sh again repairs it.
    shutil.rmtree(prefix / "libexec")
    r = at_root(root, str(root / "usr/local/bin/cudahook"), "doctor", "--json")
    dangling = [c for c in json.loads(r.stdout) if c["name"] == "dangling registration"]
    assert dangling and dangling[0]["status"] == "fail" and r.returncode == 1
    assert "install.sh" in dangling[0]["hint"]
    r = at_root(root, install)
    assert r.returncode == 0, r.stderr
    assert os.access(prefix / "libexec/cudahook-criu-action", os.X_OK)
    r = at_root(root, str(root / "usr/local/bin/cudahook"), "doctor", "--json")
    assert [c for c in json.loads(r.stdout) if c["name"] == "dangling registration"] == []

    r = at_root(root, install, "--uninstall")
    assert r.returncode == 0, r.stderr
    assert not os.path.lexists(link) and not prefix.exists()
    for d in ("opt", "usr/local/sbin", "usr/local", "usr"):
        with contextlib.suppress(OSError):
            (root / d).rmdir()
    assert tree(root) == before


def test_installed_wrapper_and_hooks_round_trip_and_demo(machine, tmp_path) -> None:  # type: ignore[no-untyped-def]
    prefix = tmp_path / "opt"
    # --force: on a node where cudahook is installed, this one stands in for
    # it until its uninstall puts that one back.
    r = sh(str(REPO / "install.sh"), "--prefix", str(prefix), "--force")
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
        r = sh("/usr/local/bin/cudahook", "status", "c1", "--no-live")
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


def test_install_sh_agent_under_systemd_enables_restarts_on_upgrade_and_uninstall_disables(
        node_root: Path, tmp_path: Path) -> None:
    """install.sh itself (the venv, pip, the installer) on a node whose PID 1
    is systemd (its proc/1/comm); systemctl is a stand-in on PATH that
    records its calls (the init system is not under test)."""
    root = node_root
    (root / "proc/1").mkdir(parents=True)
    (root / "proc/1/comm").write_text("systemd\n")
    calls = tmp_path / "systemctl-calls"
    fakebin = tmp_path / "fakebin"
    fakebin.mkdir()
    (fakebin / "systemctl").write_text(f'#!/bin/sh\necho "$*" >> {calls}\nexit 0\n')
    (fakebin / "systemctl").chmod(0o755)
    path = f"PATH={fakebin}:{os.environ['PATH']}"
    install = str(REPO / "install.sh")
    unit = "cudahook-agent.service"

    def seen() -> list[str]:
        out = [c for c in calls.read_text().splitlines() if not c.startswith("show ")]
        calls.unlink()
        return out

    r = at_root(root, "env", path, install, "--agent")
    assert r.returncode == 0, r.stderr
    assert seen() == ["daemon-reload", f"try-restart {unit}", f"enable --now {unit}"]
    assert (root / "etc/systemd/system" / unit).is_file()
    r = at_root(root, "env", path, install)  # the upgrade: a running agent gets the new code
    assert r.returncode == 0, r.stderr
    assert seen() == ["daemon-reload", f"try-restart {unit}"]
    r = at_root(root, "env", path, install, "--uninstall")
    assert r.returncode == 0, r.stderr
    assert seen() == [f"disable --now {unit}", "daemon-reload"]
    assert not (root / "etc/systemd/system" / unit).exists()
