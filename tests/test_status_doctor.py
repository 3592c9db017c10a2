"""`cudahook doctor` and `cudahook status` against a simulated node."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

from cudahook.admin.configure import configure
from cudahook.platform.store import Store


def cli(config: Path, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "cudahook", "--config", str(config), *args],
                          capture_output=True, text=True, timeout=120)


def node_config(node, **over) -> Path:  # type: ignore[no-untyped-def]
    path = node.lab.root / "config.yaml"
    path.write_text(yaml.safe_dump(dict(node.settings(**over).__dict__)))
    return path


def checks(r: subprocess.CompletedProcess[str]) -> dict[str, dict[str, str]]:
    return {c["name"]: c for c in json.loads(r.stdout)}


def test_doctor_reports_and_explains(node, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    root = tmp_path / "root"
    root.mkdir()
    cfg = node_config(node)
    r = cli(cfg, "--json", "doctor", "--root", str(root))
    c = checks(r)
    assert c["cuda-checkpoint"]["status"] == "ok" and "580.65.06" in c["cuda-checkpoint"]["detail"]
    assert c["driver"]["status"] == "ok" and "2 GPU(s)" in c["driver"]["detail"]
    assert c["runc/criu registration"]["status"] == "fail"
    assert c["runc/criu registration"]["hint"] == "cudahook configure --runtime runc"
    assert r.returncode == 1

    hooks = tmp_path / "hooks"
    hooks.mkdir()
    (hooks / "cudahook-criu-action").write_text("#!/bin/sh\n")
    (hooks / "cudahook-criu-action").chmod(0o755)
    configure("runc", hooks, root=str(root))
    plugin = root / "usr/lib/criu/cuda_plugin.so"
    plugin.parent.mkdir(parents=True)
    plugin.write_bytes(b"\x7fELF")
    c = checks(cli(cfg, "--json", "doctor", "--root", str(root)))
    assert c["runc/criu registration"]["status"] == "ok"
    assert c["criu cuda plugin"]["status"] == "fail" and "remove" in c["criu cuda plugin"]["hint"]


def test_doctor_flags_an_open_state_dir_and_old_drivers(make_node) -> None:  # type: ignore[no-untyped-def]
    node = make_node(driver=550)
    cfg = node_config(node)
    state = Path(node.settings().state_dir)
    state.mkdir(mode=0o755)
    os.chmod(state, 0o755)
    r = cli(cfg, "doctor")
    assert "[FAIL] state dir" in r.stdout and "chmod 700" in r.stdout
    assert "[WARN] cuda-checkpoint" in r.stdout and "R555+" in r.stdout


def test_status_shows_containers_processes_and_timelines(node) -> None:  # type: ignore[no-untyped-def]
    init = node.spawn_tree(("a", {"mib": 1}), ("b", {"mib": 1}))
    pids = sorted(node.lab.wait_counter(t)["pid"] for t in ("a", "b"))
    settings = node.settings()
    store = Store(settings.state_dir)
    store.update("job-1", pid=init.pid, pid_start=None, visible=[node.lab.uuids[0]])
    engine = node.engine()
    res = engine.checkpoint(pids)
    store.remember("job-1", "checkpoint", {"time": 1.0, "ok": True, "total_s": 0.5,
                                            "timeline": res.timeline.to_dict()})
    store.remember("gone-2", "restore", {"time": 2.0, "ok": False, "error": "pid 9: boom"})
    store.remember("job-1", "restore", {"time": time.time() - 125, "ok": False,
                                         "reasons": ["DRIVER_BRANCH"], "error": "no"})
    store.update("stopped-3", pid=2**22 + 1, pid_start=None, visible=[node.lab.uuids[1]])
    cfg = node_config(node)

    # The default: one line per live container, no process probed, no chart.
    r = cli(cfg, "status")
    assert r.returncode == 0, r.stderr
    lines = r.stdout.splitlines()
    assert lines[1].split() == ["CONTAINER", "ID", "STATE", "GPUS", "LAST", "CHECKPOINT", "LAST",
                                "RESTORE"]
    row = lines[2].split()
    assert row[:3] == ["job-1", "running", node.lab.uuids[0][:12]], lines
    assert row[3].endswith("d") and row[4:] == ["ago", "ok", "2m", "ago", "refused"], lines
    assert lines[3:] == ["(2 not running or gone: cudahook status --all)",
                         "node agent: not running (agent: off): each driver-API phase attaches "
                         "the driver itself"], lines
    assert "|" not in r.stdout and "checkpointed" not in r.stdout
    assert len(lines) == 5

    # --all: the others too, one line each.
    lines = cli(cfg, "status", "--all").stdout.splitlines()
    rows = {ln.split()[0]: ln.split() for ln in lines[2:-1]}
    assert set(rows) == {"job-1", "gone-2", "stopped-3"} and len(lines) == 6, lines
    assert lines[-1].startswith("node agent: not running"), lines
    assert rows["gone-2"][1:3] == ["gone", "-"] and rows["gone-2"][3] == "-"
    assert rows["gone-2"][-1] == "FAILED" and rows["stopped-3"][1:3] == ["not", "running"]

    # One container in detail: its processes probed, its timeline.
    out = cli(cfg, "status", "job").stdout
    assert "job-1  running" in out
    for pid in pids:
        assert f"pid {pid}" in out and "checkpointed" in out
    assert "last checkpoint:" in out and "checkpoint timeline:" in out and "|" in out
    assert "gone-2" not in out
    out = cli(cfg, "status", "gone-2").stdout
    assert "gone-2  gone" in out and "FAILED: pid 9: boom" in out
    r = cli(cfg, "status", "nope")
    assert r.returncode == 2 and r.stdout == ""
    assert r.stderr == "cudahook: no container known by the id 'nope'\n"

    # --json as before: every container, the live ones probed.
    data = json.loads(cli(cfg, "--json", "status").stdout)
    assert {c["id"] for c in data["containers"]} == {"job-1", "gone-2", "stopped-3"}
    job = next(c for c in data["containers"] if c["id"] == "job-1")
    assert {p["state"] for p in job["processes"]} == {"checkpointed"}
    engine.restore(pids)


def test_status_table_says_how_long_ago_and_how_it_ended() -> None:
    from cudahook.admin.status import render

    now = 1_000_000.0
    containers = [
        {"id": "a" * 64, "alive": True, "gpus": ["GPU-d3c6bd82-0fc1-50f7-87b6-9bf5d3c4c425",
                                                  "GPU-f2401959-4145-51e1-8f85-1dcf2fa79505"],
         "last": {"checkpoint": {"time": now - 5, "ok": True},
                  "restore": {"time": now - 3 * 86400 - 7, "ok": False, "error": "x"}}},
        {"id": "b1", "alive": True, "gpus": [],
         "last": {"checkpoint": {"time": now - 7200, "ok": False, "rolled_back": True},
                  "restore": {"time": now - 61, "ok": False, "reasons": ["GPU_MISSING"]}}},
        {"id": "c2", "alive": True, "gpus": ["MIG-1"],
         "last": {"checkpoint": {"time": now - 59, "ok": False, "unsafe": True}}},
        {"id": "gone-1", "alive": False, "gone": True, "last": {}},
    ]
    data = {"criu_registration": "gpu-only", "containers": containers}
    assert render(data, now=now) == "\n".join([
        "CRIU registration: gpu-only",
        "CONTAINER ID  STATE    GPUS                       LAST CHECKPOINT     LAST RESTORE",
        "aaaaaaaaaaaa  running  GPU-d3c6bd82,GPU-f2401959  5s ago ok           3d ago FAILED",
        "b1            running  -                          2h ago rolled back  1m ago refused",
        "c2            running  MIG-1                      59s ago UNSAFE      -",
        "(1 not running or gone: cudahook status --all)",
    ])
    assert render(data, now=now, show_all=True).splitlines()[-1].split() == [
        "gone-1", "gone", "-", "-", "-"]
    assert render({"containers": [containers[3]]}, now=now).splitlines()[1:] == [
        "no GPU containers running", "(1 not running or gone: cudahook status --all)"]


def test_doctor_flags_persistence_off_na_fields_and_no_gpu(make_node) -> None:  # type: ignore[no-untyped-def]
    from cudahook.core.gpus import NoGpuVisible, query_gpus
    from cudahook.platform.errors import EnvironmentProblem
    from cudahook.platform.host import Host

    node = make_node(gpu_specs=[{"persistence_mode": "Disabled"},
                                {"fields": {"memory.total": "[N/A]", "persistence_mode": "[N/A]"}}])
    gpus = query_gpus(Host(), node.settings())
    assert [(g.persistence, g.memory_mib) for g in gpus] == [(False, 81559), (None, None)]
    cfg = node_config(node)
    c = checks(cli(cfg, "--json", "doctor"))
    assert c["persistence mode"]["status"] == "fail"
    assert c["persistence mode"]["detail"] == "Disabled on GPU 0"
    assert "restore needs it on" in c["persistence mode"]["hint"]
    r = cli(cfg, "gpus")
    assert r.returncode == 0 and "[N/A] MiB" in r.stdout

    node.lab.set(gpus=[])
    with pytest.raises(NoGpuVisible, match="no GPU visible"):
        query_gpus(Host(), node.settings())
    assert issubclass(NoGpuVisible, EnvironmentProblem)
    c = checks(cli(cfg, "--json", "doctor"))
    assert c["driver"]["status"] == "warn" and "no GPU visible" in c["driver"]["detail"]
    r = cli(cfg, "gpus")
    assert r.returncode == 5 and r.stderr == "cudahook: nvidia-smi: no GPU visible (No devices were found)\n"


def test_status_does_not_probe_during_a_checkpoint_or_a_dump(node) -> None:  # type: ignore[no-untyped-def]
    from cudahook.platform import busy

    init = node.spawn_tree(("a", {"mib": 1}),)
    pid = node.lab.wait_counter("a")["pid"]
    settings = node.settings()
    Store(settings.state_dir).update("job-1", pid=init.pid, pid_start=None)
    calls = node.lab.root / "calls.log"
    tool = node.lab.root / "logged-cuda-checkpoint"
    tool.write_text(f'#!/bin/sh\necho "$*" >> {calls}\nexec {node.lab.cuda_checkpoint} "$@"\n')
    tool.chmod(0o755)
    cfg = node_config(node, cuda_checkpoint=str(tool))
    with busy.hold(settings.state_dir, "job-1", 5):  # as a pre-dump does
        before = calls.read_text() if calls.exists() else ""
        r = cli(cfg, "status", "job-1")
        assert r.returncode == 0, r.stderr
        assert "checkpoint or restore is in progress: not probed" in r.stdout
        assert f"pid {pid}" not in r.stdout
        assert "--pid" not in (calls.read_text() if calls.exists() else "")[len(before):]
    # CRIU seizes the tasks it dumps: a stopped one is not probed either.
    os.kill(pid, signal.SIGSTOP)
    try:
        r = subprocess.run([sys.executable, "-m", "cudahook", "--config", str(cfg), "status",
                            "job-1"],
                           capture_output=True, text=True, timeout=20)
        assert f"process {pid} is stopped or traced" in r.stdout, r.stdout + r.stderr
    finally:
        os.kill(pid, signal.SIGCONT)
    r = cli(cfg, "status", "job-1")
    assert f"pid {pid}" in r.stdout and "running" in r.stdout


def test_podman_runtime_follows_containers_conf(tmp_path: Path) -> None:
    from cudahook.admin.doctor import _podman_runtime, podman_runtime

    assert podman_runtime(tmp_path, crun_installed=True) == ("crun", "podman's default")
    assert podman_runtime(tmp_path, crun_installed=False) == ("runc", "podman's default")
    share = tmp_path / "usr/share/containers/containers.conf"
    share.parent.mkdir(parents=True)
    share.write_text('[engine]\nruntime = "crun"\n')
    assert podman_runtime(tmp_path, False) == ("crun", str(share))
    assert _podman_runtime(tmp_path, False).status == "warn"
    d = tmp_path / "etc/containers/containers.conf.d"
    d.mkdir(parents=True)
    (d / "50-gpu.conf").write_text('[engine]\nruntime = "runc"\n')
    (d / "60-broken.conf").write_text("[engine\n")  # podman itself refuses it; not ours to say
    assert podman_runtime(tmp_path, True) == ("runc", str(d / "50-gpu.conf"))
    assert _podman_runtime(tmp_path, True).status == "ok"
