"""The node agent (core/agent.py): real agent processes, real hooks' backends,
the simulated driver (fake libcuda.so.1) and workloads."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import stat
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from cudahook.core import agent
from cudahook.core.backends import make_backend
from cudahook.core.backends.driver_api import DriverAPI
from cudahook.core.engine import Engine
from cudahook.platform.errors import PhaseError
from cudahook.platform.host import Host

from .conftest import requires_root

ATTACH_S = 0.5


def workloads(node, n: int) -> list[int]:  # type: ignore[no-untyped-def]
    for i in range(n):
        node.spawn(f"w{i}", mib=2)
    return [node.lab.wait_counter(f"w{i}", 2)["pid"] for i in range(n)]


def healthy(node, n: int) -> None:  # type: ignore[no-untyped-def]
    """Each workload, read after the operation: its counter advances and its
    memory check passes."""
    for i in range(n):
        st = node.lab.wait_counter(f"w{i}", node.lab.status(f"w{i}")["counter"] + 5)
        assert st["intact"] and st["errors"] == [], st


def wait_for(what, timeout: float = 15.0):  # type: ignore[no-untyped-def]
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = what()
        if value:
            return value
        time.sleep(0.02)
    raise AssertionError(f"not within {timeout}s: {what}")


@contextlib.contextmanager
def running_agent(settings):  # type: ignore[no-untyped-def]
    """A real agent process for `settings`, warm (a worker attached); killed after."""
    proc = agent.start_detached(settings)
    try:
        wait_for(lambda: (s := agent.status(settings, 1.0)) and s["idle_workers"]
                 and not s["warming"], 30)
        yield proc
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()


def phase(settings, name: str, pids: list[int]):  # type: ignore[no-untyped-def]
    """One engine phase through a fresh backend, as one hook run makes it."""
    host = Host()
    backend = make_backend(settings, host)
    assert isinstance(backend, DriverAPI)
    t = time.monotonic()
    try:
        result = getattr(Engine(backend, settings, host), name)(pids)
    finally:
        backend.close()
    return result, backend, time.monotonic() - t


def worker_pids(node) -> set[int]:  # type: ignore[no-untyped-def]
    out = subprocess.run(["pgrep", "-f", "driver_helper.py " + str(node.lab.libcuda)],
                         capture_output=True, text=True)
    return {int(p) for p in out.stdout.split()}


def test_the_agent_serves_a_checkpoint_and_restore_with_no_attach_on_the_path(make_node) -> None:  # type: ignore[no-untyped-def]
    node = make_node(driver=580, attach_latency_s=ATTACH_S)
    pids = workloads(node, 4)
    settings = node.lab.settings(backend="driver-api")
    with running_agent(settings):
        sock = Path(agent.socket_path(settings))
        st = sock.stat(follow_symlinks=False)
        assert stat.S_ISSOCK(st.st_mode) and stat.S_IMODE(st.st_mode) == 0o600
        for name, state in (("checkpoint", "checkpointed"), ("restore", "running")):
            result, backend, took = phase(settings, name, pids)
            assert result.ok, result.errors
            assert result.final == {p: state for p in pids}
            # Served by the agent's warm worker: no attach in the phase.
            assert (backend.agent_sessions, backend.attaches) == (1, 0)
            assert took < ATTACH_S, took
        info = agent.status(settings)
        assert info and info["served"] == 2 and info["in_flight"] == 0
    healthy(node, 4)


def test_without_an_agent_or_with_one_that_hangs_the_phase_attaches_itself(  # type: ignore[no-untyped-def]
        make_node, tmp_path) -> None:
    node = make_node(driver=580, attach_latency_s=ATTACH_S)
    pids = workloads(node, 2)
    settings = node.lab.settings(backend="driver-api", agent_connect_ms=100)
    result, backend, _ = phase(settings, "checkpoint", pids)
    assert result.ok and (backend.agent_sessions, backend.attaches) == (0, 1)
    # Something listens where the agent would, and never answers.
    os.makedirs(settings.state_dir, mode=0o700, exist_ok=True)
    mute = subprocess.Popen(
        [sys.executable, "-c", "import socket, sys, time; s = socket.socket(socket.AF_UNIX); "
         "s.bind(sys.argv[1]); s.listen(); print(flush=True); c = s.accept(); time.sleep(60)",
         agent.socket_path(settings)], stdout=subprocess.PIPE)
    try:
        assert mute.stdout is not None and mute.stdout.readline()
        result, backend, took = phase(settings, "restore", pids)
        assert result.ok and (backend.agent_sessions, backend.attaches) == (0, 1)
        # The agent's deadline (100 ms) and one attach: not a call deadline.
        assert took < ATTACH_S + 0.1 + 2.0, took
    finally:
        mute.kill()
        mute.wait()
    healthy(node, 2)


@requires_root
def test_agent_peers_trusted__other_uid_refused(node) -> None:  # type: ignore[no-untyped-def]
    import tempfile

    settings = node.lab.settings(backend="driver-api")
    probe = ("import json, socket, sys; s = socket.socket(socket.AF_UNIX)\n"
             "try:\n    s.connect(sys.argv[1])\nexcept OSError as e:\n"
             "    print(json.dumps({'connect': e.errno})); sys.exit()\n"
             "try:\n    s.sendall(b'{\"control\": {\"op\": \"status\"}}\\n')\n"
             "except OSError:\n    pass  # refused before it read: its answer is still there\n"
             "print(s.makefile().readline().strip() or '{}')")

    def as_nobody() -> dict:
        out = subprocess.run([sys.executable, "-c", probe, path], capture_output=True,
                             text=True, user=65534, timeout=30)
        assert out.returncode == 0, out.stderr
        return json.loads(out.stdout)  # type: ignore[no-any-return]

    with running_agent(settings), tempfile.TemporaryDirectory(dir="/tmp") as reach:
        # The same socket (a hard link: one inode, one mode) where the probe
        # can reach it past the state directory's own 0700.
        os.chmod(reach, 0o755)
        path = os.path.join(reach, "agent.sock")
        os.link(agent.socket_path(settings), path)
        assert as_nobody() == {"connect": 13}  # the socket's own 0600: EACCES
        os.chmod(path, 0o666)  # past the file mode: the peer check still refuses
        reply = as_nobody()
        assert reply["ready"] is False and reply["stage"] == "refused"
        assert "uid 65534" in reply["error"] and "pid" not in reply
        info = agent.status(settings)
        assert info and info["served"] == 0


HOOK = """
import os, sys, time
from cudahook.core.backends import make_backend
from cudahook.platform.config import Settings
from cudahook.platform.host import Host
from cudahook.platform.tools import own_calls
import json
own_calls(sys.argv[3])  # as a hook names its calls: at run time, not in /proc/PID/environ
backend = make_backend(Settings(**json.loads(sys.argv[1])), Host())
print(flush=True)
backend.lock(int(sys.argv[2]), 0)
"""


def hook_with_a_call_in_flight(settings, pid: int, run: str):  # type: ignore[no-untyped-def]
    """A hook process (its calls named `run`) whose lock on `pid` hangs in the agent."""
    hook = subprocess.Popen([sys.executable, "-c", HOOK, json.dumps(settings.as_dict()), str(pid),
                             run], stdout=subprocess.PIPE, start_new_session=True)
    wait_for(lambda: (agent.status(settings, 1.0) or {}).get("in_flight") == 1)
    return hook


def test_a_hook_killed_mid_call_leaves_no_call_in_flight(make_node) -> None:  # type: ignore[no-untyped-def]
    node = make_node(driver=580)
    pids = workloads(node, 1)
    settings = node.lab.settings(backend="driver-api", call_timeout_s=60.0)
    node.lab.fault("lock", mode="hang", pid=pids[0], times=1)
    with running_agent(settings):
        hook = hook_with_a_call_in_flight(settings, pids[0], "criu-run-x")
        info = agent.status(settings)
        assert info and [s[0] for s in info["sessions_of"]] == ["criu-run-x"]
        assert info["sessions_of"][0][2] == hook.pid  # the hook named itself
        held = set(info["busy_worker_pids"])
        assert len(held) == 1 and held <= worker_pids(node)
        os.killpg(hook.pid, signal.SIGKILL)
        hook.wait()
        # What the guardian waits on: the run's calls, ended.
        assert agent.end_calls(settings, "criu-run-x", 10.0) == []
        info = agent.status(settings)
        assert info and info["in_flight"] == 0 and info["sessions"] == 0
        # The worker that held the call is gone, not back in the pool.
        assert not (held & worker_pids(node))
    assert node.engine(backend="cli").backend.get_state(pids[0]) == "running"
    healthy(node, 1)


def test_the_guardian_ends_a_runs_calls_in_the_agent(make_node, tmp_path) -> None:  # type: ignore[no-untyped-def]
    from cudahook.flow import guardian
    from cudahook.flow.context import Context

    node = make_node(driver=580)
    pids = workloads(node, 1)
    settings = node.lab.settings(backend="driver-api", call_timeout_s=60.0)
    node.lab.fault("lock", mode="hang", pid=pids[0], times=1)
    run = tmp_path / "1234-5678.json"
    with running_agent(settings):
        hook = hook_with_a_call_in_flight(settings, pids[0], "criu-run-1234-5678")
        try:
            ctx = Context(settings)
            t = time.monotonic()
            stuck = guardian._end_calls(ctx, {"run": str(run)}, "c1")
            assert stuck == [] and time.monotonic() - t < 10
            info = agent.status(settings)
            assert info and info["in_flight"] == 0
            # The hook sees its call fail, as a helper killed under it.
            assert hook.wait(10) != 0
        finally:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(hook.pid, signal.SIGKILL)
            hook.wait()
    healthy(node, 1)


def test_an_agent_killed_mid_call_fails_the_phase_and_a_fresh_helper_rolls_back(  # type: ignore[no-untyped-def]
        make_node) -> None:
    node = make_node(driver=580)
    pids = workloads(node, 3)
    settings = node.lab.settings(backend="driver-api")
    node.lab.fault("checkpoint", mode="delay", seconds=5, pid=pids[1], times=1)
    with running_agent(settings) as proc:
        box: list = []

        def checkpoint() -> None:
            host = Host()
            backend = make_backend(settings, host)
            try:
                Engine(backend, settings, host).checkpoint(pids)
            except PhaseError as exc:
                box.append((exc, backend))

        t = threading.Thread(target=checkpoint)
        t.start()
        # The others checkpointed, pids[1]'s checkpoint still in the agent.
        cli = node.engine(backend="cli").backend
        wait_for(lambda: cli.get_state(pids[0]) == cli.get_state(pids[2]) == "checkpointed")
        assert (agent.status(settings) or {}).get("in_flight") == 1
        os.killpg(proc.pid, signal.SIGKILL)
        t.join(60)
        assert box, "the phase did not fail"
        err, backend = box[0]
        assert err.safe and err.result.rolled_back
        assert "driver agent exited" in err.result.errors[pids[1]]
        assert err.result.final == {p: "running" for p in pids}
        # One agent session, then the rollback in a helper of its own.
        assert (backend.agent_sessions, backend.attaches) == (1, 1)
        backend.close()
    healthy(node, 3)


def test_a_hung_call_ends_at_its_deadline_and_other_containers_go_on(make_node) -> None:  # type: ignore[no-untyped-def]
    node = make_node(driver=580)
    pids = workloads(node, 3)
    settings = node.lab.settings(backend="driver-api", call_timeout_s=1.5, lock_timeout_ms=500)
    node.lab.fault("checkpoint", mode="hang", pid=pids[0], times=1)
    with running_agent(settings.replace(call_timeout_s=1.5)):
        wait_for(lambda: (agent.status(settings, 1.0) or {}).get("idle_workers"))
        out: dict = {}

        def one(key: str, which: list[int]) -> None:
            try:
                out[key] = phase(settings, "checkpoint", which)
            except PhaseError as exc:
                out[key] = exc

        hung = threading.Thread(target=one, args=("hung", [pids[0]]))
        hung.start()
        wait_for(lambda: (agent.status(settings, 1.0) or {}).get("in_flight"))
        wait_for(lambda: (agent.status(settings, 1.0) or {}).get("idle_workers"))
        one("other", pids[1:])  # another container's phase, meanwhile
        hung.join(30)
        assert isinstance(out["hung"], PhaseError) and out["hung"].safe
        assert "timed out" in out["hung"].result.errors[pids[0]]
        result, backend, _ = out["other"]
        assert result.ok and backend.agent_sessions == 1 and backend.attaches == 0
        info = agent.status(settings)  # the agent itself lives on
        assert info and info["in_flight"] == 0
        result, backend, _ = phase(settings, "restore", pids[1:])
        assert result.ok and backend.agent_sessions == 1
    healthy(node, 3)


def test_a_driver_change_restarts_the_agent_before_its_next_call(make_node) -> None:  # type: ignore[no-untyped-def]
    node = make_node(driver=580, attach_latency_s=0.2)
    pids = workloads(node, 1)
    settings = node.lab.settings(backend="driver-api")
    with running_agent(settings) as proc:
        first = agent.status(settings)
        assert first and "580." in first["version"]
        node.lab.set(driver=590)
        # The next phase is not served by the old driver's worker.
        result, backend, _ = phase(settings, "checkpoint", pids)
        assert result.ok and backend.agent_sessions == 0 and backend.attaches == 1
        # The same process, executed anew on the new driver, serves again.
        info = wait_for(lambda: (s := agent.status(settings, 1.0)) and s["idle_workers"]
                        and "590." in s["version"] and s, 30)
        assert info["pid"] == proc.pid == first["pid"]
        result, backend, _ = phase(settings, "restore", pids)
        assert result.ok and (backend.agent_sessions, backend.attaches) == (1, 0)
        assert backend._helper is None  # closed
    healthy(node, 1)


def test_agent_commands_start_status_stop(node, capsys) -> None:  # type: ignore[no-untyped-def]
    from cudahook.admin.cli import main
    from cudahook.platform.atomic import write_json_atomic

    settings = node.lab.settings(backend="driver-api", agent_idle_s=0)
    config = node.lab.root / "config.json.yaml"
    write_json_atomic(config, {k: v for k, v in settings.as_dict().items() if v is not None})
    assert main(["agent", "status", "--config", str(config)]) == 1
    assert main(["agent", "start", "--config", str(config)]) == 0
    try:
        assert main(["agent", "status", "--config", str(config), "--json"]) == 0
        out = capsys.readouterr().out
        assert "agent: started, pid" in out and '"up": true' in out
        from cudahook.admin.doctor import run_checks
        from cudahook.flow.context import Context

        seen = [c for c in run_checks(Context(settings), str(node.lab.root / "no-node"))
                if c.name == "node agent"]
        assert len(seen) == 1 and seen[0].detail.startswith("running, pid"), seen
    finally:
        assert main(["agent", "stop", "--config", str(config)]) == 0
    assert "agent: stopped" in capsys.readouterr().out
    assert not os.path.exists(agent.socket_path(settings))
    assert main(["agent", "status", "--config", str(config)]) == 1


def test_an_idle_agent_exits(node) -> None:  # type: ignore[no-untyped-def]
    settings = node.lab.settings(backend="driver-api", agent_idle_s=0.5)
    proc = agent.start_detached(settings)
    assert proc.wait(30) == 0
    assert not os.path.exists(agent.socket_path(settings))


def test_a_hello_that_names_another_process_is_refused(node) -> None:  # type: ignore[no-untyped-def]
    settings = node.lab.settings(backend="driver-api")
    with running_agent(settings):
        s = socket.socket(socket.AF_UNIX)
        s.connect(agent.socket_path(settings))
        other = os.getppid()
        s.sendall((json.dumps({"hello": {"hook": [other, Host().start_time(other)]}})
                   + "\n").encode())
        reply = json.loads(s.makefile().readline())
        s.close()
        assert reply["ready"] is False and reply["stage"] == "refused"
        assert f"names pid {other}" in reply["error"]


def test_agent_auto_starts_one_for_the_next_phases(make_node) -> None:  # type: ignore[no-untyped-def]
    node = make_node(driver=580, attach_latency_s=0.2)
    pids = workloads(node, 2)
    settings = node.lab.settings(backend="driver-api", agent="auto")
    assert agent.status(settings, 0.5) is None
    try:
        # No agent yet: this phase attaches itself and starts one, detached.
        result, backend, _ = phase(settings, "checkpoint", pids)
        assert result.ok and (backend.agent_sessions, backend.attaches) == (0, 1)
        info = wait_for(lambda: (s := agent.status(settings, 1.0)) and s["idle_workers"] and s)
        result, backend, _ = phase(settings, "restore", pids)
        assert result.ok and (backend.agent_sessions, backend.attaches) == (1, 0)
    finally:
        pid = agent.running_pid(settings)
        if pid:
            os.kill(pid, signal.SIGKILL)
    assert info["pid"] == pid
    healthy(node, 2)


def test_agent_off_starts_none(node) -> None:  # type: ignore[no-untyped-def]
    pids = workloads(node, 1)
    settings = node.lab.settings(backend="driver-api")
    assert settings.agent == "off"
    result, backend, _ = phase(settings, "checkpoint", pids)
    assert result.ok and backend.attaches == 1
    time.sleep(1.0)
    assert agent.status(settings, 0.5) is None and agent.running_pid(settings) is None
    result, backend, _ = phase(settings, "restore", pids)
    assert result.ok and backend.attaches == 1


def test_install_places_the_agent_unit_not_enabled_and_uninstall_removes_it(tmp_path) -> None:  # type: ignore[no-untyped-def]
    from cudahook.admin import installer

    from . import nodefiles
    from .test_installer import install, run

    root = nodefiles.site_node(tmp_path / "node")
    (root / "usr/local/bin").mkdir(parents=True)
    (root / "opt").mkdir()
    prefix = root / "opt/cudahook"
    install(root, prefix)
    unit = root / installer.AGENT_UNIT.lstrip("/")
    text = unit.read_text()
    assert f"ExecStart={prefix}/venv/bin/python -I -m cudahook.core.agent --config " \
           f"{root}/etc/cudahook/config.yaml\n" in text
    assert stat.S_IMODE(unit.stat().st_mode) == 0o644
    # Installed only: nothing enables it (no wants/ link).
    assert not list(root.glob("etc/systemd/system/*.wants/cudahook-agent.service"))
    rc, _, _ = run(root, "uninstall", prefix)
    assert rc == 0 and not unit.exists()


def test_status_and_metrics_show_the_agent(node, capsys) -> None:  # type: ignore[no-untyped-def]
    from cudahook.admin.cli import main
    from cudahook.platform import metrics
    from cudahook.platform.atomic import write_json_atomic

    from .test_metrics import samples, value

    pids = workloads(node, 1)
    settings = node.lab.settings(backend="driver-api")
    config = node.lab.root / "config.json.yaml"
    write_json_atomic(config, {k: v for k, v in settings.as_dict().items() if v is not None})
    prom = Path(settings.state_dir) / metrics.DEFAULT_NAME
    with running_agent(settings) as proc:
        for name in ("checkpoint", "restore"):
            assert phase(settings, name, pids)[0].ok
        info = agent.status(settings)
        assert info and info["served"] == 2 and info["calls"] >= 4 and info["rss_bytes"] > 0
        capsys.readouterr()
        assert main(["status", "--config", str(config)]) == 0
        line = capsys.readouterr().out.splitlines()[-1]
        assert line.startswith(f"node agent: running, pid {proc.pid}, driver 580."), line
        assert f"{info['calls']} calls in 2 sessions served, 0 open" in line, line
        assert main(["status", "--config", str(config), "--json"]) == 0
        shown = json.loads(capsys.readouterr().out)["agent"]
        assert shown["up"] and shown["pid"] == proc.pid and shown["calls"] == info["calls"]
        # In the metrics about a second after the sessions ended.
        wait_for(lambda: prom.exists() and value(samples(prom), "cudahook_agent_calls_total")
                 == info["calls"], 10)
        found = samples(prom)
        assert value(found, "cudahook_agent_up", pid=str(proc.pid)) == 1
        assert value(found, "cudahook_agent_sessions_total") == 2
        assert (value(found, "cudahook_agent_resident_bytes", process="agent") or 0) > 0
        assert main(["agent", "stop", "--config", str(config)]) == 0
        assert value(samples(prom), "cudahook_agent_up", pid=str(proc.pid)) == 0
    capsys.readouterr()
    assert main(["status", "--config", str(config)]) == 0
    assert capsys.readouterr().out.splitlines()[-1].startswith("node agent: not running")
    healthy(node, 1)


def test_install_without_systemd_restarts_a_running_agent_and_uninstall_stops_it(  # type: ignore[no-untyped-def]
        node, tmp_path) -> None:
    """No systemd as PID 1 (this node in a directory): an upgrade through the
    installer restarts the agent that runs, so it never serves with old
    code; --uninstall stops it."""
    import io
    from contextlib import redirect_stdout

    from cudahook.admin import installer
    from cudahook.platform.atomic import write_json_atomic

    from . import nodefiles
    from .test_installer import REPO

    root = nodefiles.site_node(tmp_path / "node")
    (root / "usr/local/bin").mkdir(parents=True)
    prefix = root / "opt/cudahook"
    (prefix / "venv/bin").mkdir(parents=True)
    python = prefix / "venv/bin/python"  # the installed code: this checkout's
    python.write_text(f"#!/bin/sh\nexec {sys.executable} \"$@\"\n")
    python.chmod(0o755)
    settings = node.lab.settings(backend="driver-api")
    config = root / "etc/cudahook/config.yaml"
    config.parent.mkdir(parents=True)
    write_json_atomic(config, {k: v for k, v in settings.as_dict().items() if v is not None})

    def installer_run(*args: str) -> str:
        out = io.StringIO()
        with redirect_stdout(out):
            rc = installer.main([*args, "--root", str(root), "--prefix", str(prefix)])
        assert rc == 0, out.getvalue()
        return out.getvalue()

    with running_agent(settings) as proc:
        out = installer_run("install", "--python", str(python), "--source", str(REPO))
        assert "restarted the running node agent on the new code" in out, out
        assert proc.wait(30) == 0  # the old one ended cleanly
        info = wait_for(lambda: agent.status(settings, 1.0))
        assert info["pid"] != proc.pid
        new = info["pid"]
        try:
            out = installer_run("uninstall")
            assert "stopped the running node agent" in out, out
            assert agent.status(settings, 1.0) is None and not Host().alive(new)
        finally:
            with contextlib.suppress(ProcessLookupError):
                os.kill(new, signal.SIGKILL)


def test_the_daemonset_runs_the_agent_after_its_install_in_the_hosts_root() -> None:
    """deploy/daemonset.yaml: the agent container runs the code install.sh
    installs, with the configuration it installs, in the host's root and PID
    namespace, and only after this pod's install finished."""
    import yaml

    from cudahook.admin.installer import agent_unit
    from cudahook.platform import paths

    from .test_installer import REPO

    doc = yaml.safe_load((REPO / "deploy/daemonset.yaml").read_text())
    spec = doc["spec"]["template"]["spec"]
    assert spec["hostPID"] is True
    containers = {c["name"]: c for c in spec["containers"]}
    install, runner = containers["install"], containers["agent"]
    assert runner["image"] == install["image"] and runner["securityContext"]["privileged"]
    mark = "/pod/installed"
    assert install["args"][0].index("install.sh") < install["args"][0].index(f"touch {mark}")
    script = runner["args"][0].replace("\\\n", " ")
    assert script.index(f"until [ -e {mark} ]") < script.index("exec chroot /host ")
    command = " ".join(script.split("exec chroot /host ", 1)[1].split())
    # What the systemd unit runs on a node install.sh set up at its defaults.
    unit = agent_unit(f"{paths.PREFIX}/venv/bin/python", Path(paths.CONFIG))
    assert f"ExecStart={command}\n" in unit, (command, unit)
    mounts = {m["name"]: m["mountPath"] for m in runner["volumeMounts"]}
    assert mounts == {"host": "/host", "pod": "/pod"}
    assert {"name": "pod", "emptyDir": {}} in spec["volumes"]


def test_the_agent_serves_the_storage_path_with_blake3_dedupe_and_zstd(make_node, tmp_path) -> None:  # type: ignore[no-untyped-def]
    """The agent's workers are the helper too: started -I -S like it, they
    load blake3 and zstandard from the agent's own install directory, and
    serve a storage checkpoint and restore (two processes, the same
    weights: their chunks stored once, compressed)."""
    node = make_node(driver=590)
    node.lab.set(cuda_version=13040)
    node.spawn("w0", mib=20, procs=2, same_weights=True)  # a full 16 MiB chunk, and the rest
    pids = [node.lab.wait_counter(f"w0.{i}", 2)["pid"] for i in range(2)]
    settings = node.lab.settings(backend="driver-api", gpu_storage_compression="zstd")
    root = tmp_path / "cudahook-gpu"
    root.mkdir()
    storage = {p: str(root / str(p)) for p in pids}
    with running_agent(settings):
        for name in ("checkpoint", "restore"):
            host = Host()
            backend = make_backend(settings, host)
            try:
                result = getattr(Engine(backend, settings, host), name)(pids, storage=storage)
            finally:
                backend.close()
            assert result.ok, result.errors
            assert (backend.agent_sessions, backend.attaches) == (1, 0)
            if name == "checkpoint":
                for p in pids:
                    m = json.loads((root / str(p) / "manifest.json").read_text())
                    assert m["digest"] == "blake3" and all(m["ranges"][0]["zstd"])
                inodes = {(root / str(p) / "gpu0-000000.chunk").stat().st_ino for p in pids}
                assert len(inodes) == 1  # one file for both processes
    for i in range(2):
        st = node.lab.wait_counter(f"w0.{i}", node.lab.status(f"w0.{i}")["counter"] + 5)
        assert st["intact"] and st["errors"] == [], st


def test_the_agent_passes_a_checked_restore_on_to_its_worker(make_node, tmp_path) -> None:  # type: ignore[no-untyped-def]
    """A restore post-restore has just verified (`checked`) reaches the
    agent's worker as it reaches a per-phase helper: the first read is
    spared, a chunk changed since is refused on its way in, and the process
    is left locked (an unchecked restore refuses it untouched, checkpointed)."""
    from cudahook.platform.errors import ToolError

    node = make_node(driver=590)
    node.lab.set(cuda_version=13040)
    node.spawn("w", mib=40)  # three 16 MiB chunks
    pid = node.lab.wait_counter("w", 2)["pid"]
    settings = node.lab.settings(backend="driver-api")
    root = tmp_path / "cudahook-gpu"
    root.mkdir()
    storage = {pid: str(root / str(pid))}
    with running_agent(settings):
        host = Host()
        backend = make_backend(settings, host)
        try:
            assert Engine(backend, settings, host).checkpoint([pid], storage=storage).ok
        finally:
            backend.close()
        last = sorted((root / str(pid)).glob("*.chunk"))[-1]
        data = bytearray(last.read_bytes())
        data[3] ^= 0x01
        last.write_bytes(bytes(data))
        backend = make_backend(settings, host)
        try:
            with pytest.raises(ToolError, match="content does not match"):
                backend.restore_from_storage(pid, storage[pid], checked=True)
            assert backend.get_state(pid) == "locked"
            assert (backend.agent_sessions, backend.attaches) == (1, 0)
        finally:
            backend.close()


def test_a_hello_trickled_in_byte_by_byte_is_cut_off_at_its_deadline(node) -> None:  # type: ignore[no-untyped-def]
    """A peer that sends a byte now and then (each within the per-read
    timeout) still gets one refusal line within HELLO_S of connecting, and
    the connection it held is free again."""
    settings = node.lab.settings(backend="driver-api")
    with running_agent(settings):
        s = socket.socket(socket.AF_UNIX)
        s.connect(agent.socket_path(settings))
        start = time.monotonic()
        s.settimeout(0.5)
        answer = b""
        while b"\n" not in answer and time.monotonic() - start < agent.HELLO_S + 10:
            with contextlib.suppress(OSError):
                s.sendall(b" ")
            try:
                got = s.recv(4096)
            except TimeoutError:
                continue
            if not got:
                break
            answer += got
        took = time.monotonic() - start
        s.close()
        reply = json.loads(answer)
        assert reply["ready"] is False and reply["stage"] == "refused", reply
        assert "no hello line within" in reply["error"]
        assert agent.HELLO_S - 0.5 < took < agent.HELLO_S + 3, took
        wait_for(lambda: agent.status(settings, 1.0)["connections"] <= 1, 10)
