"""The admin CLI: documented exit codes, one-line errors, real runs."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import yaml

from .conftest import Node


def cli(*args: str, config: str | None = None) -> subprocess.CompletedProcess[str]:
    pre = ["--config", config] if config else []
    return subprocess.run([sys.executable, "-m", "cudahook", *pre, *args],
                          capture_output=True, text=True, timeout=60)


def write_config(node: Node, **over: object) -> str:
    s = node.settings(**over)
    path = node.lab.root / "config.yaml"
    path.write_text(yaml.safe_dump(dict(s.__dict__)))
    return str(path)


def one_line_error(r: subprocess.CompletedProcess[str], code: int, text: str) -> None:
    assert r.returncode == code, r
    assert r.stderr.count("\n") == 1 and r.stderr.startswith("cudahook: "), r.stderr
    assert text in r.stderr
    assert "Traceback" not in r.stderr


@pytest.mark.parametrize("args", [[], ["checkpoint"], ["checkpoint", "--pid", "x"],
                                  ["restore", "--pid", "1", "--init-pid", "1"], ["frobnicate"]])
def test_bad_arguments_exit_2(args: list[str]) -> None:
    one_line_error(cli(*args), 2, "see 'cudahook")


def test_bad_config_exits_3(tmp_path) -> None:  # type: ignore[no-untyped-def]
    bad = tmp_path / "c.yaml"
    bad.write_text("call_timeout_s: -1\n")
    one_line_error(cli("state", "--pid", "1", config=str(bad)), 3, "call_timeout_s")


def test_missing_tool_exits_5(node: Node) -> None:
    cfg = write_config(node, cuda_checkpoint="/nonexistent/cuda-checkpoint")
    one_line_error(cli("features", config=cfg), 5, "cuda-checkpoint not usable")


def test_no_such_process_exits_2(node: Node) -> None:
    one_line_error(cli("checkpoint", "--init-pid", "4000000", config=write_config(node)), 2,
                   "no process 4000000")


def test_bad_device_map_exits_2_and_changes_nothing(node: Node) -> None:
    p = node.spawn("w", mib=1)
    node.lab.wait_counter("w")
    cfg = write_config(node)
    assert cli("checkpoint", "--pid", str(p.pid), config=cfg).returncode == 0
    one_line_error(cli("restore", "--pid", str(p.pid), "--device-map", "GPU-1=GPU-2",
                       config=cfg), 2, "not a GPU UUID")
    assert cli("state", "--pid", str(p.pid), config=cfg).stdout.split() == [str(p.pid),
                                                                             "checkpointed"]


def test_checkpoint_and_remapped_restore_by_init_pid(make_node) -> None:  # type: ignore[no-untyped-def]
    node = make_node(gpus=2)
    init = node.spawn_tree(("a", {"mib": 2}), ("b", {"mib": 2, "procs": 2}))
    tags = ["a", "b.0", "b.1"]
    pids = sorted(node.lab.wait_counter(t)["pid"] for t in tags)
    cfg = write_config(node)
    r = cli("--json", "checkpoint", "--init-pid", str(init.pid), config=cfg)
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout)
    assert out["ok"] and out["changed"] == pids
    assert {s["step"] for s in out["timeline"]["steps"]} >= {"get-state", "lock", "checkpoint"}
    frozen = {t: node.lab.status(t)["counter"] for t in tags}
    u = node.lab.uuids
    # Host processes see both GPUs, and the driver wants every one of them mapped.
    r = cli("--json", "restore", "--init-pid", str(init.pid), "--source-gpus", u[0],
            "--target-gpus", u[1], config=cfg)
    assert r.returncode == 4 and '"invalid argument"' in r.stderr
    r = cli("--json", "restore", "--init-pid", str(init.pid), "--device-map",
            f"{u[0]}={u[1]},{u[1]}={u[0]}", config=cfg)
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout)["device_map"] == {u[0]: u[1], u[1]: u[0]}
    for t in tags:
        st = node.lab.wait_counter(t, frozen[t] + 11)
        assert st["gpu"] == u[1] and st["intact"] and not st["errors"]


def test_failed_checkpoint_exits_1_and_workload_runs(node: Node) -> None:
    init = node.spawn_tree(("a", {"mib": 1}), ("b", {"mib": 1}))
    a = node.lab.wait_counter("a")["pid"]
    b = node.lab.wait_counter("b")["pid"]
    node.lab.fault("checkpoint", pid=b, code=2)
    r = cli("checkpoint", "--init-pid", str(init.pid), config=write_config(node))
    one_line_error(r, 1, f'pid {b}: checkpoint exit 1: '
                   f'Could not checkpoint on process ID {b}: "out of memory"')
    cfg = write_config(node)
    assert cli("state", "--pid", str(a), "--pid", str(b), config=cfg).stdout.split() == [
        str(a), "running", str(b), "running"]


def test_gpus_and_features(node: Node) -> None:
    cfg = write_config(node)
    r = cli("--json", "gpus", config=cfg)
    assert [g["uuid"] for g in json.loads(r.stdout)] == node.lab.uuids
    r = cli("--json", "features", config=cfg)
    f = json.loads(r.stdout)
    assert f["version"] == "580.65.06" and f["device_map"]


def test_unknown_driver_version_refuses_the_checkpoint(node: Node, tmp_path) -> None:  # type: ignore[no-untyped-def]
    init = node.spawn_tree(("a", {"mib": 1}))
    node.lab.wait_counter("a")
    cfg = write_config(node, driver_version_file=str(tmp_path / "absent"),
                       nvidia_smi=str(tmp_path / "no-smi"))
    r = cli("checkpoint", "--init-pid", str(init.pid), config=cfg)
    one_line_error(r, 5, "NVIDIA driver version unknown")
    assert cli("state", "--pid", str(node.lab.status("a")["pid"]),
               config=write_config(node)).stdout.split()[1] == "running"


def test_common_options_go_before_or_after_the_command(node: Node) -> None:
    cfg = write_config(node)
    other = node.lab.root / "bad.yaml"
    other.write_text("call_timeout_s: -1\n")
    for args in (["--json", "--config", cfg, "gpus"], ["gpus", "--json", "--config", cfg],
                 ["--config", cfg, "gpus", "--json"], ["--json", "gpus", "--config", cfg]):
        r = subprocess.run([sys.executable, "-m", "cudahook", *args],
                           capture_output=True, text=True, timeout=60)
        assert r.returncode == 0, (args, r.stderr)
        assert [g["uuid"] for g in json.loads(r.stdout)] == node.lab.uuids
    r = cli("status", "--json", "--no-live", config=cfg)
    assert r.returncode == 0
    data = json.loads(r.stdout)
    assert data.pop("criu_registration") in ("none", "global", "gpu-only")
    assert data.pop("metrics_file").endswith("cudahook.prom")
    assert data.pop("agent") == {"mode": "off", "up": False}
    assert data == {"containers": []}
    # Given after the command, --config wins over one given before it.
    r = subprocess.run([sys.executable, "-m", "cudahook", "--config", cfg, "state", "--pid", "1",
                        "--config", str(other)], capture_output=True, text=True, timeout=60)
    one_line_error(r, 3, "call_timeout_s")


@pytest.mark.parametrize("cmd", ["checkpoint", "restore"])
def test_checkpoint_and_restore_wait_for_a_live_guardian_of_the_container(
        node: Node, cmd: str) -> None:
    """A guardian still bringing the container back: the CLI waits for it
    (guardian_wait_s), then refuses with exit 5, having touched nothing."""
    from cudahook.flow import guardian
    from cudahook.platform.host import Host
    from cudahook.platform.store import Store, write_json_atomic

    init = node.spawn_tree(("a", {"mib": 1}))
    a = node.lab.wait_counter("a")["pid"]
    engine = node.engine()
    if cmd == "restore":
        engine.checkpoint([a])
    before = engine.read_state(a)
    cfg = write_config(node, guardian_wait_s=1)
    state_dir = node.settings().state_dir
    Store(state_dir).update("c1", pid=init.pid, pid_start=None)
    earlier = subprocess.Popen(["sleep", "600"])
    node.procs.append(earlier)
    write_json_atomic(guardian._marker(state_dir, "c1"),
                      {"pid": earlier.pid, "start": Host().start_time(earlier.pid), "criu_pid": 1})
    one_line_error(cli(cmd, "--init-pid", str(init.pid), config=cfg), 5,
                   f"{cmd}: the guardian of an earlier checkpoint of container c1")
    assert engine.read_state(a) == before
    earlier.kill()
    earlier.wait()
    r = cli(cmd, "--init-pid", str(init.pid), config=cfg)
    assert r.returncode == 0, r.stderr
    assert engine.read_state(a) == ("checkpointed" if cmd == "checkpoint" else "running")
    if cmd == "checkpoint":
        engine.restore([a])


# -- one_line_errors: every failure one escaped line, with a documented exit code ----------


def _archive(tmp_path, members: dict[str, bytes], name: str = "ckpt.tar.gz"):  # type: ignore[no-untyped-def]
    import io
    import tarfile

    path = tmp_path / name
    with tarfile.open(path, "w:gz") as tar:
        for member, data in members.items():
            info = tarfile.TarInfo(member)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    return path


def _plain_config(tmp_path) -> str:  # type: ignore[no-untyped-def]
    path = tmp_path / "config.yaml"
    path.write_text(f"state_dir: {tmp_path}/state\nlog_file: {tmp_path}/cudahook.log\n")
    return str(path)


def test_one_line_errors__an_unexpected_exception_is_one_line_and_logged(tmp_path) -> None:  # type: ignore[no-untyped-def]
    cfg = _plain_config(tmp_path)
    # A bug stands in as a command whose code raises what no one expects.
    code = ("import sys\nfrom cudahook.admin import cli, status\n"
            "def bug(*args, **kw):\n    raise KeyError('\\x1b[2J')\n"
            "status.gather = bug\n"
            f"sys.exit(cli.main(['--config', {cfg!r}, 'status', '--no-live']))\n")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    one_line_error(r, 1, "internal error: KeyError")
    assert "\x1b" not in r.stderr and "\\x1b[2J" in r.stderr
    logged = [json.loads(line) for line in (tmp_path / "cudahook.log").read_text().splitlines()]
    assert any(e["event"] == "internal-error" and "Traceback" in e["traceback"] for e in logged)


def test_one_line_errors__check_image_with_a_long_name_is_2(tmp_path) -> None:  # type: ignore[no-untyped-def]
    one_line_error(cli("check", "--image", "x" * 300, config=_plain_config(tmp_path)), 2,
                   "not a directory")
    for where in ("x" * 300, str(tmp_path / "none")):
        one_line_error(cli("status", "--manifest", where, config=_plain_config(tmp_path)), 2,
                       "not a directory")


def test_one_line_errors__invalid_utf8_in_config_is_3(tmp_path) -> None:  # type: ignore[no-untyped-def]
    bad = tmp_path / "c.yaml"
    bad.write_bytes(b"state_dir: /run/\xff\n")
    one_line_error(cli("status", "--no-live", config=str(bad)), 3, "not UTF-8")


def test_one_line_errors__restore_pid_0_is_bad_input(tmp_path) -> None:  # type: ignore[no-untyped-def]
    for args in (["restore", "--pid", "0"], ["checkpoint", "--init-pid", "-1"],
                 ["state", "--pid", "99999999"], ["discover", "--init-pid", "0"]):
        one_line_error(cli(*args, config=_plain_config(tmp_path)), 2, "not a PID")


def test_one_line_errors__an_empty_archive_is_one_line(tmp_path) -> None:  # type: ignore[no-untyped-def]
    empty = tmp_path / "empty.tar"
    empty.write_bytes(b"")
    one_line_error(cli("migrate", "restore", str(empty), "--no-verify", "--podman", "/bin/false",
                       config=_plain_config(tmp_path)), 2, "not a complete checkpoint archive")


@pytest.mark.parametrize("name", ["a\x00b", "\x1b]0;pwned\x07\x1b[2J", "x" * 300, "-rm"])
def test_one_line_errors__a_container_name_from_an_archive_is_refused_escaped(
        tmp_path, name: str) -> None:  # type: ignore[no-untyped-def]
    a = _archive(tmp_path, {"spec.dump": b"{}",
                            "config.dump": json.dumps({"name": name}).encode()})
    r = cli("migrate", "restore", str(a), "--no-verify", "--dry-run", "--podman", "/bin/false",
            config=_plain_config(tmp_path))
    one_line_error(r, 2, "not a container name")
    assert "\x1b" not in r.stderr + r.stdout and "\x00" not in r.stderr


@pytest.mark.parametrize("spec", [b'{"process": 5}', b'{"process": {"env": [1, 2]}}',
                                  b'{"process": {"env": "PATH=/bin"}}',
                                  b"[" * 100000 + b"]" * 100000, b"\xff\xfe"])
def test_one_line_errors__a_malformed_spec_in_an_archive_is_2(spec: bytes) -> None:
    from cudahook.admin import migrate
    from cudahook.platform.errors import CudahookError

    config = json.dumps({"name": "c", "spec": {"process": {"env": []}}}).encode()
    with pytest.raises(CudahookError) as exc:
        migrate.retarget({"spec.dump": spec, "config.dump": config},
                         ["GPU-11111111-2222-3333-4444-555555555555"])
    assert exc.value.exit_code == 2 and "\n" not in str(exc.value)


def test_one_line_errors__untrusted_strings_in_output_are_escaped(tmp_path) -> None:  # type: ignore[no-untyped-def]
    from cudahook.core import manifest

    image = tmp_path / "img\x1b]0;pwned\x07"
    image.mkdir()
    r = cli("status", "--manifest", str(image), config=_plain_config(tmp_path))
    assert r.returncode == 0 and "\x1b" not in r.stdout and "\\x1b]0;pwned\\x07" in r.stdout
    manifest.write(image, {"container_id": "c1", "processes": [{"nspid": 7}],
                           "timeline": {"steps": [{"pid": 7, "step": "lock", "start": 0,
                                                   "end": 1, "error": "\x1b[2J"}]}})
    r = cli("status", "--manifest", str(image), config=_plain_config(tmp_path))
    assert r.returncode == 0 and "\x1b" not in r.stdout, r
    # A manifest holding escapes where a name goes is refused, in one escaped line.
    raw = json.loads((image / manifest.NAME).read_text())
    raw["container_id"] = "\x1b]0;pwned\x07\x1b[2J"
    (image / manifest.NAME).write_text(json.dumps(raw))
    r = cli("status", "--manifest", str(image), config=_plain_config(tmp_path))
    one_line_error(r, 2, "container_id")
    assert "\x1b" not in r.stderr + r.stdout


def test_one_line_errors__status_escapes_what_the_state_holds(tmp_path) -> None:  # type: ignore[no-untyped-def]
    from cudahook.platform.store import Store

    cfg = _plain_config(tmp_path)
    store = Store(tmp_path / "state")
    store.save("c1", {"id": "c1", "pid": 0, "visible": ["GPU-\x1b[2J"]})
    store.remember("c1", "checkpoint", {"ok": False, "error": "boom \x1b]0;pwned\x07",
                                        "time": 1.0})
    table = cli("status", "--all", "--no-live", config=cfg)
    detail = cli("status", "c1", "--no-live", config=cfg)
    assert table.returncode == 0 and detail.returncode == 0, (table, detail)
    out = table.stdout + detail.stdout
    assert "\x1b" not in out and "\\x1b]0;pwned\\x07" in out and "\\x1b[2J" in out


@pytest.mark.parametrize("args", [
    ["status", "\x1b]0;owned\x07"], ["--config", "\u202e", "gpus"], ["gpus", "--config", "x\ny"],
    ["check", "--image", "p\x9b"], ["migrate", "restore", "\u202e\u2066"],
])
def test_one_line_errors__arguments_are_escaped_in_errors(args: list[str]) -> None:
    r = subprocess.run([sys.executable, "-m", "cudahook", *args], capture_output=True,
                       timeout=60)
    err = r.stderr.decode("utf-8", "surrogateescape")
    assert r.returncode in (2, 3) and err.count("\n") == 1 and err.startswith("cudahook: "), err
    assert err[:-1].isprintable(), err
    assert not any(c in err for c in "\x1b\x07\u202e\u2066\x9b")


def test_one_line_errors__another_users_process_is_one_line_exit_5() -> None:
    # As an unprivileged user: /proc/1/ns/pid cannot be read. A directory
    # that user can reach (pytest's own is root's, 0700).
    import shutil
    import tempfile
    from pathlib import Path

    root = Path(tempfile.mkdtemp(prefix="cudahook-nobody-", dir="/tmp"))
    try:
        root.chmod(0o777)
        cfg = _plain_config(root)
        Path(cfg).chmod(0o644)
        code = ("import os, sys\nos.setgroups([])\nos.setgid(65534)\nos.setuid(65534)\n"
                "from cudahook.admin import cli\n"
                f"sys.exit(cli.main(['--config', {cfg!r}, 'discover', '--init-pid', '1']))\n")
        r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                           timeout=60, env={"PATH": "/usr/bin:/bin", "CUDAHOOK_ROOT": str(root)})
    finally:
        shutil.rmtree(root, ignore_errors=True)
    one_line_error(r, 5, "need root")
