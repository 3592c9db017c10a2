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
    from cudahook.hooks import guardian
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
