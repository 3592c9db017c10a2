"""The installer on a whole node kept in a directory: one journal per prefix,
registrations that never outlive their files, and an uninstall that removes
what it installed and says what it kept."""

from __future__ import annotations

import contextlib
import io
import json
import os
import re
import shutil
import subprocess
from pathlib import Path

import pytest

from cudahook.admin import installer, journal, registrations
from cudahook.admin.doctor import run_checks
from cudahook.flow.context import Context
from cudahook.platform import paths
from cudahook.platform.config import Settings

from . import nodefiles

REPO = Path(__file__).resolve().parents[1]
RUNTIMES = ["--runtime", "docker", "--runtime", "containerd", "--runtime", "podman"]


def tree(root: Path) -> dict[str, str | bytes]:
    return nodefiles.tree(root, empty_dirs=True)


@pytest.fixture
def node(tmp_path: Path) -> Path:
    """A node's files as another admin left them."""
    root = nodefiles.site_node(tmp_path / "node")
    (root / "usr/local/bin").mkdir(parents=True)
    (root / "opt").mkdir()
    return root


def run(root: Path, action: str, prefix: Path | None, *args: str) -> tuple[int, str, str]:
    """installer.main as install.sh calls it (no venv: the hooks name a made-up Python)."""
    argv = [action, "--root", str(root), *(["--prefix", str(prefix)] if prefix else [])]
    if action == "install":
        argv += ["--python", str((prefix or root / "opt/cudahook") / "venv/bin/python"),
                 "--source", str(REPO)]
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        rc = installer.main([*argv, *args])
    return rc, out.getvalue(), err.getvalue()


def install(root: Path, prefix: Path, *args: str) -> str:
    """An install as install.sh makes it: prefix and venv, then the installer."""
    if not prefix.exists():
        prefix.mkdir(parents=True)
        (prefix / installer.MARKER).touch()
    venv = prefix / "venv/bin"
    owns = [] if venv.exists() else ["--owns", str(prefix / "venv")]
    venv.mkdir(parents=True, exist_ok=True)
    for name in ("python", "cudahook", "cudahook-sim"):
        (venv / name).write_text("#!/bin/sh\n")
        (venv / name).chmod(0o755)
    rc, out, err = run(root, "install", prefix, *owns, *args)
    assert rc == 0, err
    return out


def criu_scripts(root: Path) -> list[str]:
    return registrations.action_scripts((root / "etc/criu/runc.conf").read_text())


def test_a_second_prefix_is_refused_in_one_line_and_changes_nothing(node: Path) -> None:
    a, b = node / "opt/cudahook", node / "opt/other"
    install(node, a, *RUNTIMES)
    before = tree(node)
    rc, out, err = run(node, "check", b)
    assert rc == 2 and err.count("\n") == 1
    assert f"already installed at {a}" in err and "--force" in err
    rc, out, err = run(node, "install", b)
    assert rc == 2 and err.count("\n") == 1 and out == ""
    assert tree(node) == before
    # The same prefix again is no conflict.
    assert run(node, "check", a)[0] == 0


def test_uninstall_at_another_prefix_touches_nothing(node: Path) -> None:
    a = node / "opt/cudahook"
    install(node, a, *RUNTIMES)
    before = tree(node)
    rc, out, _ = run(node, "uninstall", node / "opt/other")
    assert rc == 0 and "nothing installed at" in out
    assert tree(node) == before


def test_force_records_what_it_replaced_and_uninstall_puts_it_back(node: Path) -> None:
    original = tree(node)
    a, b = node / "opt/cudahook", node / "opt/other"
    install(node, a, "--runtime", "docker")
    first = tree(node)
    install(node, b, "--runtime", "docker", "--force")
    # One cudahook action script at a time: CRIU would run both.
    assert criu_scripts(node) == [f"{b}/libexec/cudahook-criu-action"]
    assert os.readlink(node / "usr/local/bin/cudahook") == f"{b}/venv/bin/cudahook"
    daemon = json.loads((node / "etc/docker/daemon.json").read_text())
    assert daemon["runtimes"]["cudahook"]["path"] == f"{b}/libexec/cudahook-runtime"
    assert len(journal.Journal.all(node)) == 2
    install(node, b, "--runtime", "docker")  # running it again there needs no --force

    rc, _out, _ = run(node, "uninstall", b)
    assert rc == 0
    assert not b.exists()
    assert tree(node) == first  # the first installation, as it was
    assert registrations.dangling(node) == []

    rc, _out, _ = run(node, "uninstall", a)
    assert rc == 0 and tree(node) == original


def test_uninstalling_the_replaced_one_leaves_the_other_whole(node: Path) -> None:
    original = tree(node)
    a, b = node / "opt/cudahook", node / "opt/other"
    install(node, a, "--runtime", "docker", "--runtime", "podman")
    install(node, b, "--runtime", "docker", "--runtime", "podman", "--force")
    state = node / "run/cudahook"
    state.mkdir(parents=True)
    rc, out, _ = run(node, "uninstall", a)
    assert rc == 0 and not a.exists()
    # b still has its registrations, its configuration and the state directory.
    assert criu_scripts(node) == [f"{b}/libexec/cudahook-criu-action"]
    assert (node / "etc/cudahook/config.yaml").exists() and state.exists()
    assert f"kept {state}: the installation at {b} uses it" in out
    assert registrations.dangling(node) == []
    assert json.loads((node / "etc/docker/daemon.json").read_text())["runtimes"]["cudahook"]
    # ...and its uninstall then removes everything, with nothing dangling
    # (what it had replaced named a's executables, gone since).
    rc, out, _ = run(node, "uninstall", b)
    assert rc == 0
    assert registrations.dangling(node) == []
    (node / "run").rmdir()  # made above
    assert tree(node) == original


def test_an_old_style_journal_is_the_default_prefix(node: Path) -> None:
    a = node / "opt/cudahook"
    install(node, a)
    j = journal.Journal(node)
    entries = j.entries()
    # As every earlier version wrote it: a bare list of entries.
    j.path.write_text(json.dumps(entries))
    assert [x.prefix for x in journal.Journal.all(node)] == [a]
    assert run(node, "install", node / "opt/other")[0] == 2
    rc, _out, _ = run(node, "uninstall", a)
    assert rc == 0 and criu_scripts(node) == [] and not j.path.exists()


def test_registrations_go_before_the_files_they_name(node: Path,
                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    a = node / "opt/cudahook"
    install(node, a, *RUNTIMES)
    order: list[str] = []
    put = journal._put
    monkeypatch.setattr(journal, "_put", lambda p, *x: (order.append(str(p)), put(p, *x)))
    assert run(node, "uninstall", a)[0] == 0
    regs = {str(p) for p in registrations.files(node).values()}
    first_file = min(i for i, p in enumerate(order) if p not in regs)
    assert set(order[:first_file]) == regs  # all five, before any other file
    assert all(p not in regs for p in order[first_file:])


def test_registration_files_changed_since_lose_only_our_part(node: Path) -> None:
    a = node / "opt/cudahook"
    install(node, a, *RUNTIMES, "--default-runtime")
    conf = node / "etc/criu/runc.conf"
    conf.write_text(conf.read_text() + "log-file /var/log/criu.log\n")
    daemon = node / "etc/docker/daemon.json"
    cfg = json.loads(daemon.read_text())
    cfg["debug"] = True
    daemon.write_text(json.dumps(cfg))
    hook = node / "usr/share/containers/oci/hooks.d/50-cudahook-create.json"
    hook.write_text(hook.read_text().replace('"always": true', '"always": false'))
    dropin = node / "etc/systemd/system/containerd.service.d/50-cudahook.conf"
    dropin.write_text(dropin.read_text() + "# edited\n")

    rc, out, _ = run(node, "uninstall", a)
    assert rc == 0
    assert conf.read_text() == "# site settings\ntcp-established\nlog-file /var/log/criu.log\n"
    assert json.loads(daemon.read_text()) == {"log-level": "warn", "experimental": True,
                                              "debug": True}
    assert not hook.exists() and not dropin.exists()
    assert out.count("removed only cudahook's registration") == 4
    assert registrations.dangling(node) == []


def test_uninstall_removes_what_it_installed_and_says_what_it_kept(node: Path) -> None:
    original = tree(node)
    a = node / "opt/cudahook"
    (a / "criu/bin").mkdir(parents=True)
    (a / installer.MARKER).touch()
    (a / "criu/bin/criu").write_text("#!/bin/sh\n")
    install(node, a, "--owns", str(a / "criu"), "--criu-link", str(a / "criu/bin/criu"))
    assert os.readlink(node / "usr/local/sbin/criu") == str(a / "criu/bin/criu")
    rule = node / "etc/logrotate.d/cudahook"
    assert str(node / "var/log/cudahook.log") in rule.read_text()
    for d in ("run/cudahook/containers", "run/cudahook/runs", "run/cudahook-marks/gpu"):
        (node / d).mkdir(parents=True)
    (node / "var/log").mkdir(parents=True)
    (node / "var/log/cudahook.log").write_text("{}\n")

    rc, out, _ = run(node, "uninstall", a)
    assert rc == 0
    for gone in ("opt/cudahook", "run/cudahook", "run/cudahook-marks", "usr/local/sbin/criu",
                 "etc/logrotate.d/cudahook", "etc/cudahook", "var/lib/cudahook"):
        assert not os.path.lexists(node / gone), gone
    assert re.search(r"kept .*cudahook.log: the record of past", out)
    (node / "var/log/cudahook.log").unlink()
    for d in ("var/log", "var", "run"):  # made above, not by the installer
        (node / d).rmdir()
    assert tree(node) == original


def test_keep_criu_keeps_it_and_forgets_it(node: Path) -> None:
    a = node / "opt/cudahook"
    (a / "criu/bin").mkdir(parents=True)
    (a / installer.MARKER).touch()
    (a / "criu/bin/criu").write_text("#!/bin/sh\n")
    install(node, a, "--owns", str(a / "criu"), "--criu-link", str(a / "criu/bin/criu"))
    rc, out, _ = run(node, "uninstall", a, "--keep-criu")
    assert rc == 0 and "--keep-criu" in out
    assert os.readlink(node / "usr/local/sbin/criu") == str(a / "criu/bin/criu")
    assert sorted(os.listdir(a)) == ["criu"]
    assert journal.Journal.all(node) == []  # nothing left installed: another prefix may install


def test_a_criu_cudahook_did_not_provide_is_kept(node: Path) -> None:
    a = node / "opt/cudahook"
    (a / "criu/bin").mkdir(parents=True)  # there before: not ours, no marker
    install(node, a)
    rc, out, _ = run(node, "uninstall", a)
    assert rc == 0 and (a / "criu/bin").is_dir()
    assert f"kept {a} (criu): it was there before cudahook was installed" in out


def ctx_for(root: Path) -> Context:
    settings = Settings(cuda_checkpoint="/nonexistent", nvidia_smi="/nonexistent",
                        state_dir=str(root / "run/cudahook"), log_file="")
    return Context(settings)


def test_doctor_flags_a_dangling_registration_and_reinstall_repairs_it(node: Path) -> None:
    a = node / "opt/cudahook"
    install(node, a, "--runtime", "docker", "--runtime", "podman")
    checks = {c.name: c for c in run_checks(ctx_for(node), root=str(node))}
    assert checks["dangling registrations"].status == "ok"
    shutil.rmtree(a / "libexec")  # removed by hand
    found = [c for c in run_checks(ctx_for(node), root=str(node))
             if c.name == "dangling registration"]
    assert {c.status for c in found} == {"fail"} and len(found) == 4  # runc.conf, docker, 2 hooks.d
    runc = next(c for c in found if "runc.conf" in c.detail)
    assert "cudahook-criu-action" in runc.detail and "remove the line" in runc.hint
    assert "re-run install.sh" in runc.hint

    install(node, a, "--runtime", "docker", "--runtime", "podman")  # the repair
    assert registrations.dangling(node) == []
    checks = {c.name: c for c in run_checks(ctx_for(node), root=str(node))}
    assert checks["dangling registrations"].status == "ok"
    assert checks["runc/criu registration"].status == "ok"


def test_doctor_cli_flags_a_dangling_action_script_as_blocking(node: Path) -> None:
    (node / "etc/criu/runc.conf").write_text("action-script /gone/libexec/cudahook-criu-action\n")
    env = {**os.environ, paths.ROOT_ENV: str(node)}
    for argv in (["doctor", "--json"], ["--json", "doctor"]):
        r = subprocess.run([str(REPO / ".venv/bin/python"), "-m", "cudahook", *argv], env=env,
                           capture_output=True, text=True, timeout=120)
        assert r.returncode == 1
        checks = [c for c in json.loads(r.stdout) if c["name"] == "dangling registration"]
        assert checks and checks[0]["status"] == "fail"
        assert "/gone/libexec/cudahook-criu-action" in checks[0]["hint"]


def test_strip_removes_only_cudahook_and_only_what_drop_selects() -> None:
    text = (b"tcp-established\n" + registrations.CRIU_COMMENT.encode()
            + b"\naction-script /a/libexec/cudahook-criu-action\naction-script /x/other\n")
    out = registrations.strip("criu", text, lambda e: e.startswith("/a/"))
    assert out == b"tcp-established\naction-script /x/other\n"
    assert registrations.strip("criu", text, lambda e: False) == text
    d = b'{"runtimes": {"cudahook": {"path": "/a/r"}, "nvidia": {"path": "/n"}}, ' \
        b'"default-runtime": "cudahook"}'
    out = registrations.strip("docker", d, lambda e: True, b'{"default-runtime": "nvidia"}')
    assert json.loads(out or b"") == {"runtimes": {"nvidia": {"path": "/n"}},
                                      "default-runtime": "nvidia"}


def test_logrotate_rule_follows_debian_conventions(tmp_path: Path) -> None:
    log = tmp_path / "var/log/cudahook.log"
    text = installer.logrotate_rule(log)
    body = re.search(r"^(\S+) \{\n(.*)\n\}\n\Z", text.split("\n", 1)[1], re.S)
    assert body and body.group(1) == str(log)
    words = [line.split() for line in body.group(2).splitlines()]
    assert ["weekly"] in words and ["compress"] in words and ["missingok"] in words
    assert ["create", "0600", "root", "root"] in words and ["copytruncate"] not in words
    assert any(w[0] == "maxsize" for w in words) and any(w[0] == "rotate" for w in words)


@pytest.mark.skipif(shutil.which("logrotate") is None, reason="logrotate not installed")
def test_logrotate_accepts_the_rule_and_rotates(tmp_path: Path) -> None:
    log = tmp_path / "log/cudahook.log"
    log.parent.mkdir(mode=0o755)
    os.chmod(log.parent, 0o755)
    log.write_bytes(b'{"event": "x"}\n' * 10)
    rule = tmp_path / "cudahook.rule"
    rule.write_text(installer.logrotate_rule(log))
    os.chmod(rule, 0o644)
    state = tmp_path / "status"
    r = subprocess.run(["logrotate", "-d", "-s", str(state), str(rule)],
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 0 and "error" not in r.stderr.lower(), r.stderr
    r = subprocess.run(["logrotate", "-f", "-s", str(state), str(rule)],
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    assert (tmp_path / "log/cudahook.log.1").read_bytes().count(b"\n") == 10
    assert log.exists() and log.stat().st_size == 0 and log.stat().st_mode & 0o777 == 0o600


def test_uninstall_dry_run_changes_nothing(node: Path) -> None:
    a, b = node / "opt/cudahook", node / "opt/other"
    install(node, a, *RUNTIMES)
    install(node, b, *RUNTIMES, "--force")
    (node / "run/cudahook").mkdir(parents=True)
    before = tree(node)
    for prefix in (a, b):
        rc, out, _ = run(node, "uninstall", prefix, "--dry-run")
        assert rc == 0 and "would remove" in out
        assert tree(node) == before


# -- the node agent's service -------------------------------------------------------------------

FAKE_SYSTEMCTL = """#!/bin/sh
# Stands in for the init system: records each call; fails the verbs in $FAIL_VERBS.
echo "$*" >> "{calls}"
for v in $FAIL_VERBS; do [ "$1" = "$v" ] && {{ echo "Failed to $1: unit broken" >&2; exit 1; }}; done
exit 0
"""


@pytest.fixture
def systemd(node: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """`node` run by systemd (its proc/1/comm), a recording systemctl first
    on PATH; the calls file, outside the node."""
    (node / "proc/1").mkdir(parents=True)
    (node / "proc/1/comm").write_text("systemd\n")
    calls = tmp_path / "systemctl-calls"
    bindir = tmp_path / "fakebin"
    bindir.mkdir()
    (bindir / "systemctl").write_text(FAKE_SYSTEMCTL.format(calls=calls))
    (bindir / "systemctl").chmod(0o755)
    monkeypatch.setenv("PATH", f"{bindir}:{os.environ['PATH']}")
    monkeypatch.delenv("FAIL_VERBS", raising=False)
    return calls


def systemctl_calls(calls: Path) -> list[str]:
    seen = calls.read_text().splitlines() if calls.exists() else []
    calls.unlink(missing_ok=True)
    return [c for c in seen if not c.startswith("show ")]  # the "does it answer" probe


UNIT = installer.UNIT_NAME


def test_under_systemd_the_agent_service_is_enabled_when_asked_and_restarted_on_upgrade(
        node: Path, systemd: Path) -> None:
    prefix = node / "opt/cudahook"
    out = install(node, prefix)  # not asked (agent: off, no --agent): reload, restart if running
    assert systemctl_calls(systemd) == ["daemon-reload", f"try-restart {UNIT}"]
    assert f"ran systemctl try-restart {UNIT}" in out
    install(node, prefix, "--agent")  # asked: also enabled and started
    assert systemctl_calls(systemd) == ["daemon-reload", f"try-restart {UNIT}",
                                        f"enable --now {UNIT}"]
    # `agent: auto` in the configuration asks for it too.
    config = node / "etc/cudahook/config.yaml"
    config.write_text(config.read_text().replace("\nagent: off", "\nagent: auto"))
    install(node, prefix)
    assert systemctl_calls(systemd)[-1] == f"enable --now {UNIT}"
    rc, out, _ = run(node, "install", prefix, "--dry-run", "--agent")
    assert rc == 0 and f"would run systemctl enable --now {UNIT}" in out
    assert systemctl_calls(systemd) == []
    rc, out, _ = run(node, "uninstall", prefix)
    assert rc == 0 and systemctl_calls(systemd) == [f"disable --now {UNIT}", "daemon-reload"]
    assert not (node / installer.AGENT_UNIT.lstrip("/")).exists()


def test_under_systemd_a_failing_systemctl_is_one_line_and_exit_1(
        node: Path, systemd: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("FAIL_VERBS", "enable")
    rc, _, err = run(node, "install", node / "opt/cudahook", "--agent", "--owns",
                     str(node / "opt/cudahook/venv"))
    assert rc == 1 and err.count("\n") == 1, err
    assert f"systemctl enable --now {UNIT} failed: Failed to enable: unit broken" in err


def test_without_systemd_as_pid_1_no_systemctl_is_called(node: Path, systemd: Path) -> None:
    (node / "proc/1/comm").write_text("init\n")
    out = install(node, node / "opt/cudahook", "--agent")
    assert not systemd.exists()  # not even asked whether it answers
    assert "no systemd here: the node agent starts on demand" in out
    (node / "proc/1/comm").unlink()  # a node in a directory with no proc/ at all
    install(node, node / "opt/cudahook", "--agent")
    assert not systemd.exists()
