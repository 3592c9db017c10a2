"""The hooks' checks and metrics, through the installed CRIU action script:
refusals carry their reason code and touch nothing, and every outcome lands
in a Prometheus text file that prometheus_client's own parser reads."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

from prometheus_client.parser import text_string_to_metric_families

from cudahook.core import manifest
from cudahook.platform import metrics
from cudahook.platform.config import Settings
from cudahook.platform.store import Store
from cudahook.sim.lab import wait_for

from .conftest import Node
from .test_criu_action import SCRUBBED, action, events, install

PARENT = """
import json, subprocess, sys, time
script, env = sys.argv[1], json.loads(sys.argv[2])
rc = subprocess.run([script], env=env).returncode
print(rc, flush=True)
time.sleep(float(sys.argv[3]))
"""


def samples(path: Path) -> dict[tuple[str, frozenset[tuple[str, str]]], float]:
    """Every sample of the metrics file, parsed as Prometheus parses it."""
    out = {}
    for fam in text_string_to_metric_families(path.read_text()):
        for s in fam.samples:
            out[(s.name, frozenset(s.labels.items()))] = s.value
    return out


def value(found: dict[tuple[str, frozenset[tuple[str, str]]], float], name: str,
          **labels: str) -> float | None:
    hits = [v for (n, ls), v in found.items() if n == name and set(labels.items()) <= ls]
    assert len(hits) <= 1, (name, labels, hits)
    return hits[0] if hits else None


def metrics_file(node: Node) -> Path:
    return Path(node.settings().state_dir) / metrics.DEFAULT_NAME


def dump(script: Path, init: int, image: Path, stay_s: float = 0.0) -> int:
    """pre-dump in a parent that plays CRIU; it exits after `stay_s`."""
    env = {**SCRUBBED, "CRTOOLS_SCRIPT_ACTION": "pre-dump", "CRTOOLS_INIT_PID": str(init),
           "CRTOOLS_IMAGE_DIR": str(image)}
    p = subprocess.Popen([sys.executable, "-c", PARENT, str(script), json.dumps(env),
                          str(stay_s)], stdout=subprocess.PIPE, text=True)
    assert p.stdout is not None
    rc = int(p.stdout.readline())
    if stay_s == 0:
        p.wait()
    return rc


def test_pre_dump_refuses_with_the_reason_code_and_touches_nothing(
        node: Node, tmp_path: Path) -> None:
    script = install(tmp_path, node)
    image = tmp_path / "img"
    image.mkdir()
    init = node.spawn_tree(("a", {"mib": 2}), ("b", {"mib": 1}))
    b = node.lab.wait_counter("b")["pid"]
    node.lab.force_state(b, "failed")
    r = action(script, "pre-dump", new_run=True, CRTOOLS_INIT_PID=str(init.pid),
               CRTOOLS_IMAGE_DIR=str(image))
    assert r.returncode == 1 and r.stderr.count("\n") == 1, r.stderr
    assert f"PROCESS_FAILED: pid {b} is failed" in r.stderr and "nothing was locked" in r.stderr
    assert os.listdir(image) == [] and events(node, "checkpoint") == []
    a = node.lab.status("a")["counter"]
    st = node.lab.wait_counter("a", a + 3)  # never locked
    assert st["intact"]
    refused = events(node, "pre-dump")[-1]
    assert refused["reasons"] == ["PROCESS_FAILED"]
    found = samples(metrics_file(node))
    assert value(found, "cudahook_refusals_total", side="checkpoint",
                 reason="PROCESS_FAILED") == 1
    assert value(found, "cudahook_checkpoints_total", outcome="refused") == 1
    node.lab.force_state(b, "running")


def test_a_refusal_updates_the_metrics_once(node: Node, tmp_path: Path,
                                           monkeypatch) -> None:  # type: ignore[no-untyped-def]
    """The verdict and the refused checkpoint are one event: one rewrite of
    the metrics file (under its lock), not two."""
    from cudahook.flow import actions
    from cudahook.flow.context import Context
    from cudahook.platform.tools import CALLS_ENV

    monkeypatch.setenv(CALLS_ENV, "")  # the run names its calls here: put back afterwards
    image = tmp_path / "img"
    image.mkdir()
    init = node.spawn_tree(("a", {"mib": 1}))
    a = node.lab.wait_counter("a")["pid"]
    node.lab.force_state(a, "failed")
    updates: list[metrics.Changes] = []
    real = metrics.update
    monkeypatch.setattr(metrics, "update", lambda s, c, **kw: updates.append(c) or real(s, c, **kw))
    try:
        rc = actions.run(Context(node.settings()), "pre-dump", image, init.pid, os.getpid())
    finally:
        node.lab.force_state(a, "running")
    assert rc == 1
    assert len(updates) == 1, [u.ops for u in updates]
    assert {"cudahook_last_check_ok", "cudahook_refusals_total",
            "cudahook_checkpoints_total"} <= {op[1] for op in updates[0].ops}
    found = samples(metrics_file(node))
    assert value(found, "cudahook_checkpoints_total", outcome="refused") == 1


def test_a_checkpoint_its_phases_bytes_and_the_guardian_resume_are_counted(
        node: Node, tmp_path: Path) -> None:
    script = install(tmp_path, node)
    image = tmp_path / "img"
    image.mkdir()
    init = node.spawn_tree(("a", {"mib": 4}), ("b", {"mib": 2}))
    for t in ("a", "b"):
        node.lab.wait_counter(t)
    Store(node.settings().state_dir).update("job-1", pid=init.pid, pid_start=None)
    assert dump(script, init.pid, image) == 0
    m = manifest.read(image)
    assert m is not None and m.gpu_memory_bytes == 6 << 20
    # The parent (CRIU) is gone, the tasks live on: the guardian resumes them.
    wait_for(lambda: bool(events(node, "guardian")), 30, "no guardian event")
    wait_for(lambda: value(samples(metrics_file(node)), "cudahook_guardian_resumes_total")
             is not None, 10, "no guardian resume counted")
    found = samples(metrics_file(node))
    model = "NVIDIA H100 80GB HBM3 (simulated)"
    assert value(found, "cudahook_checkpoints_total", outcome="ok", gpu_model=model,
                 container="job-1") == 1
    assert value(found, "cudahook_guardian_resumes_total", outcome="ok") == 1
    assert value(found, "cudahook_gpu_memory_moved_bytes_total", direction="to_host") == 6 << 20
    for phase in ("lock", "checkpoint", "total"):
        assert value(found, "cudahook_phase_duration_seconds_count", phase=phase) == 1
        assert value(found, "cudahook_phase_duration_seconds_sum", phase=phase) > 0
        assert value(found, "cudahook_last_phase_duration_seconds", phase=phase) > 0
    assert value(found, "cudahook_last_transfer_bytes_per_second", direction="to_host") > 0
    labels = {k for (_, ls) in found for k, _ in ls}
    assert labels <= {"container", "gpu_model", "outcome", "phase", "direction", "side", "reason"}
    text = metrics_file(node).read_text()
    assert os.stat(metrics_file(node)).st_mode & 0o777 == 0o644
    assert "# TYPE cudahook_checkpoints_total counter" in text
    for t in ("a", "b"):
        st = node.lab.wait_counter(t, node.lab.status(t)["counter"] + 3)
        assert st["intact"] and not st["errors"]


def test_post_restore_refusal_is_kept_remembered_and_counted(node: Node, tmp_path: Path) -> None:
    """A restore that can never succeed here is refused with exit 6, its
    verdict kept in the state directory (the image is left as it was), and
    the next attempt is refused from the remembered verdict."""
    script = install(tmp_path, node)
    image = tmp_path / "img"
    image.mkdir()
    manifest.write(image, {"container_id": "c1", "driver_version": "550.54.15",
                           "gpus": node.lab.uuids[:1], "processes": [{"nspid": 7, "pid": 7}],
                           "gpu_models": {node.lab.uuids[0]: {"name": "Old GPU"}}})
    before = {p.name: p.read_bytes() for p in image.iterdir()}
    init = subprocess.Popen(["sleep", "60"], start_new_session=True)
    node.procs.append(init)  # type: ignore[arg-type]
    for attempt in range(2):
        r = action(script, "post-restore", new_run=True, CRTOOLS_INIT_PID=str(init.pid),
                   CRTOOLS_IMAGE_DIR=str(image))
        assert r.returncode == 6 and r.stderr.count("\n") == 1, r.stderr
        assert "post-restore: DRIVER_BRANCH: checkpoint was taken with driver 550.54.15" in r.stderr
        ev = [e for e in events(node, "post-restore") if "reasons" in e][-1]
        assert ev["reasons"] == ["DRIVER_BRANCH"] and ev["cached"] is bool(attempt)
    assert {p.name: p.read_bytes() for p in image.iterdir()} == before
    kept = json.loads(Path(ev["verdict"]).read_text())
    assert kept["problems"][0]["code"] == "DRIVER_BRANCH" and kept["exit_code"] == 6
    assert Path(ev["verdict"]).parent == Path(node.settings().state_dir) / "verdicts"
    assert init.poll() is None  # refused, nothing killed
    found = samples(metrics_file(node))
    assert value(found, "cudahook_restores_total", outcome="refused", container="c1",
                 gpu_model="Old GPU") == 2
    assert value(found, "cudahook_refusals_total", side="restore", reason="DRIVER_BRANCH") == 2
    # `cudahook check --image` gives the same answer.
    cfg = tmp_path / "cudahook.yaml"
    r = subprocess.run([sys.executable, "-m", "cudahook", "--config", str(cfg), "check", "--image",
                        str(image)], capture_output=True, text=True, timeout=60)
    assert r.returncode == 6 and "[DRIVER_BRANCH]" in r.stdout and "NEVER" in r.stdout


def test_metrics_that_cannot_be_written_never_fail_a_checkpoint(node: Node, tmp_path: Path) -> None:
    import yaml

    script = install(tmp_path, node)
    cfg = tmp_path / "cudahook.yaml"
    data = yaml.safe_load(cfg.read_text())
    data["metrics_file"] = "/proc/version/cudahook.prom"  # can never be written
    cfg.write_text(yaml.safe_dump(data))
    image = tmp_path / "img"
    image.mkdir()
    init = node.spawn_tree(("a", {"mib": 1}),)
    node.lab.wait_counter("a")
    assert dump(script, init.pid, image, stay_s=0.5) == 0
    assert manifest.read(image) is not None
    assert not metrics_file(node).exists()
    wait_for(lambda: bool(events(node, "guardian")), 30, "no guardian event")
    node.lab.wait_counter("a", node.lab.status("a")["counter"] + 3)


def test_metrics_state_is_bounded_and_escaped(tmp_path: Path) -> None:
    settings = Settings(state_dir=str(tmp_path / "state"), state_retention_s=100,
                        metrics_file=str(tmp_path / "collector" / "cudahook.prom"))
    weird = 'gpu "A"\\x\nB'
    assert metrics.update(settings, metrics.Changes("old", weird).inc(
        "cudahook_checkpoints_total", outcome="ok"), now=1000.0)
    assert metrics.update(settings, metrics.Changes("new", "H100").inc(
        "cudahook_checkpoints_total", outcome="ok").observe(
        "cudahook_phase_duration_seconds", 0.25, phase="lock"), now=1050.0)
    found = samples(Path(settings.metrics_file))  # type: ignore[arg-type]
    assert value(found, "cudahook_checkpoints_total", container="old", gpu_model=weird) == 1
    assert value(found, "cudahook_phase_duration_seconds_sum", container="new") == 0.25
    # 200 s later, only what was seen within the retention is left.
    assert metrics.update(settings, metrics.Changes("new").inc(
        "cudahook_checkpoints_total", outcome="ok"), now=1140.0)
    found = samples(Path(settings.metrics_file))  # type: ignore[arg-type]
    assert {dict(ls)["container"] for (_, ls) in found} == {"new"}
    assert value(found, "cudahook_checkpoints_total", container="new", gpu_model="H100") == 2
    off = Settings(state_dir=str(tmp_path / "s2"), metrics_file="")
    assert metrics.update(off, metrics.Changes("x").inc("cudahook_rollbacks_total")) is False


def test_pre_dump_refuses_a_stopped_process_quickly(node: Node, tmp_path: Path) -> None:
    """A stopped process would make every cuda-checkpoint call hang until its
    deadline: refused at once, by /proc, with nothing locked."""
    script = install(tmp_path, node)
    image = tmp_path / "img"
    image.mkdir()
    init = node.spawn_tree(("a", {"mib": 1}), ("b", {"mib": 1}))
    a = node.lab.wait_counter("a")["pid"]
    node.lab.wait_counter("b")
    os.kill(a, signal.SIGSTOP)
    try:
        r = action(script, "pre-dump", new_run=True, CRTOOLS_INIT_PID=str(init.pid),
                   CRTOOLS_IMAGE_DIR=str(image))
    finally:
        os.kill(a, signal.SIGCONT)
    # PROCESS_STOPPED, not a discovery probe timing out on it: refused before any call.
    assert r.returncode == 1 and f"PROCESS_STOPPED: pid(s) {a} stopped or traced" in r.stderr, \
        r.stderr
    assert os.listdir(image) == []
    for t in ("a", "b"):
        node.lab.wait_counter(t, node.lab.status(t)["counter"] + 3)



RESTORE = """
import json, subprocess, sys
script, env = sys.argv[1], json.loads(sys.argv[2])
rcs = []
for act in ("post-restore", "post-resume"):
    rcs.append(subprocess.run([script], env={**env, "CRTOOLS_SCRIPT_ACTION": act}).returncode)
print(json.dumps(rcs))
"""


def test_rollbacks_and_fail_closed_kills_are_counted(node: Node, tmp_path: Path) -> None:
    """A checkpoint that fails midway is rolled back (counted), and a restore
    that fails at post-resume kills the container (counted), through the
    action script as CRIU runs it."""
    script = install(tmp_path, node)
    init = node.spawn_tree(("a", {"mib": 2}), ("b", {"mib": 1}))
    a = node.lab.wait_counter("a")["pid"]
    node.lab.wait_counter("b")
    Store(node.settings().state_dir).update("job-9", pid=init.pid, pid_start=None)
    first = tmp_path / "img1"
    first.mkdir()
    node.lab.fault("checkpoint", pid=a, code=2, times=1)
    assert dump(script, init.pid, first) == 1
    st = node.lab.wait_counter("a", node.lab.status("a")["counter"] + 3)  # back on its GPU
    assert st["intact"]
    found = samples(metrics_file(node))
    assert value(found, "cudahook_checkpoints_total", container="job-9",
                 outcome="rolled_back") == 1
    assert value(found, "cudahook_rollbacks_total", container="job-9") == 1

    # A checkpoint that works, CRIU (the parent) staying alive as if dumping.
    image = tmp_path / "img2"
    image.mkdir()
    env = {**SCRUBBED, "CRTOOLS_SCRIPT_ACTION": "pre-dump", "CRTOOLS_INIT_PID": str(init.pid),
           "CRTOOLS_IMAGE_DIR": str(image)}
    criu = subprocess.Popen([sys.executable, "-c", PARENT, str(script), json.dumps(env), "30"],
                            stdout=subprocess.PIPE, text=True)
    try:
        assert criu.stdout is not None and int(criu.stdout.readline()) == 0
        # "Restored" in place: the same processes, restore fails in the driver.
        node.lab.fault("restore", pid=a, code=2)
        env = {**SCRUBBED, "CRTOOLS_INIT_PID": str(init.pid), "CRTOOLS_IMAGE_DIR": str(image)}
        r = subprocess.run([sys.executable, "-c", RESTORE, str(script), json.dumps(env)],
                           capture_output=True, text=True, timeout=120)
        assert json.loads(r.stdout)[0] == 0, r.stderr  # post-restore: the checks pass
        assert init.wait(10) == -9  # post-resume failed closed: the container is gone
    finally:
        criu.kill()
        criu.wait()
    found = samples(metrics_file(node))
    assert value(found, "cudahook_fail_closed_kills_total", container="job-9") == 1
    assert value(found, "cudahook_restores_total", container="job-9", outcome="failed") == 1
    assert value(found, "cudahook_checkpoints_total", container="job-9", outcome="ok") == 1


# -- untrusted labels: a manifest's container id and GPU model --------------------------


def _settings(tmp_path: Path) -> Settings:
    return Settings(state_dir=str(tmp_path / "state"), log_file=str(tmp_path / "log"),
                    metrics_file=str(tmp_path / "collector" / "cudahook.prom"))


def _count(settings: Settings, cid: str, model: str | None = "H100", now: float = 1000.0) -> bool:
    return metrics.update(settings, metrics.Changes(cid, model).inc(
        "cudahook_checkpoints_total", outcome="ok"), now=now)


def test_untrusted_strings_bounded__a_lone_surrogate_never_freezes_the_metrics_file(
        tmp_path: Path) -> None:
    s = _settings(tmp_path)
    prom = Path(s.metrics_file)  # type: ignore[arg-type]
    assert _count(s, "bad\ud800id", "GPU \udcff model")
    assert _count(s, "good")
    found = samples(prom)
    assert value(found, "cudahook_checkpoints_total", container="good", gpu_model="H100") == 1
    assert value(found, "cudahook_checkpoints_total", container="bad\ufffdid") == 1
    prom.read_bytes().decode("utf-8")  # strictly valid UTF-8
    # A state left by an earlier version, holding a surrogate, heals at the next event.
    state = Path(s.state_dir) / metrics.STATE_NAME
    data = json.loads(state.read_text())
    data["series"][0][2]["gpu_model"] = "\udc80"
    state.write_text(json.dumps(data))
    assert _count(s, "good", now=1001.0)
    assert value(samples(prom), "cudahook_checkpoints_total", container="good",
                 gpu_model="H100") == 2


def test_untrusted_strings_bounded__a_huge_model_name_costs_no_other_container(
        tmp_path: Path) -> None:
    s = _settings(tmp_path)
    state = Path(s.state_dir) / metrics.STATE_NAME
    assert _count(s, "a")
    _count(s, "b", "X" * (2 << 20))
    _count(s, "c" * 4000, "Y" * 1000)
    assert state.stat().st_size < 64 << 10
    assert _count(s, "a", now=1001.0)
    found = samples(Path(s.metrics_file))  # type: ignore[arg-type]
    assert value(found, "cudahook_checkpoints_total", container="a") == 2
    labels = [dict(ls) for (_, ls) in found]
    assert max(len(v) for ls in labels for v in ls.values()) <= metrics.MAX_LABEL


def test_untrusted_strings_bounded__an_event_past_the_cap_is_dropped_alone(
        tmp_path: Path) -> None:
    s = _settings(tmp_path)
    state = Path(s.state_dir) / metrics.STATE_NAME
    assert _count(s, "first")
    dropped = None
    for i in range(200):  # each event as large as one may be: MAX_OPS refusal codes
        c = metrics.Changes(f"big{i}", "M" * 1000)
        for n in range(metrics.MAX_OPS + 50):
            c.inc("cudahook_refusals_total", side="restore", reason=f"{n:04d}" + "R" * 200)
        if not metrics.update(s, c, now=1000.0 + i):
            dropped = i
            break
    assert dropped is not None and dropped > 1
    assert state.stat().st_size <= 1 << 20
    # The event that did not fit left a line in the log, and everyone else's series.
    assert any(json.loads(line).get("event") == "metrics" and "big" in line
               for line in Path(s.log_file).read_text().splitlines())
    assert _count(s, "first", now=2000.0) is not None
    found = samples(Path(s.metrics_file))  # type: ignore[arg-type]
    assert value(found, "cudahook_checkpoints_total", container="first") == 2
    assert value(found, "cudahook_refusals_total", container=f"big{dropped - 1}",
                 reason="0000" + "R" * 200) == 1


def test_untrusted_strings_bounded__a_hostile_manifest_at_post_restore_costs_no_other_container(
        node: Node, tmp_path: Path) -> None:
    """Through the installed action script: a manifest whose GPU model is
    2 MiB (or holds a lone surrogate) is refused, and the counters every
    other container had are still there at the next event."""
    script = install(tmp_path, node)
    settings = node.settings()
    assert metrics.update(settings, metrics.Changes("other", "H100").inc(
        "cudahook_checkpoints_total", outcome="ok"))
    init = subprocess.Popen(["sleep", "60"], start_new_session=True)
    node.procs.append(init)  # type: ignore[arg-type]
    for n, model in enumerate(["X" * (2 << 20), "GPU \ud800"]):
        image = tmp_path / f"img{n}"
        image.mkdir()
        data = {"version": 1, "container_id": "c1", "driver_version": "550.54.15",
                "gpus": node.lab.uuids[:1], "processes": [{"nspid": 7, "pid": 7}],
                "gpu_models": {node.lab.uuids[0]: {"name": model}}}
        (image / manifest.NAME).write_text(json.dumps(data))
        r = action(script, "post-restore", new_run=True, CRTOOLS_INIT_PID=str(init.pid),
                   CRTOOLS_IMAGE_DIR=str(image))
        assert r.returncode == 6 and r.stderr.count("\n") == 1 and len(r.stderr) < 4000, r.stderr
    assert metrics.update(settings, metrics.Changes("other", "H100").inc(
        "cudahook_checkpoints_total", outcome="ok"))
    state = Path(settings.state_dir) / metrics.STATE_NAME
    assert state.stat().st_size < 64 << 10
    found = samples(metrics_file(node))
    assert value(found, "cudahook_checkpoints_total", container="other") == 2
    assert init.poll() is None


def test_untrusted_strings_bounded__an_oversized_result_costs_only_itself(tmp_path: Path) -> None:
    """The history `cudahook status` shows: a result too large for the
    store's read cap is not written, and the results kept before stay."""
    import contextlib

    from cudahook.platform.errors import CudahookError

    store = Store(tmp_path / "state")
    store.remember("c1", "checkpoint", {"ok": True, "time": 1.0})
    with contextlib.suppress(CudahookError):  # store.TooLarge: this result is not kept
        store.remember("c1", "restore", {"ok": False, "error": "X" * (2 << 20)})
    assert store.history()["c1"]["checkpoint"] == {"ok": True, "time": 1.0}


def test_own_directories_only__metrics_never_write_through_a_linked_state_dir(tmp_path) -> None:  # type: ignore[no-untyped-def]
    """A state directory replaced by a symlink (to a directory someone else
    may read) is refused before anything is made inside it: a failed
    restore's metrics once created `metrics/` and the .prom file there."""
    from cudahook.platform.config import Settings

    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir(mode=0o700)
    state = tmp_path / "state"
    state.symlink_to(elsewhere)
    settings = Settings(state_dir=str(state), log_file=str(tmp_path / "log"))
    assert metrics.update(settings, metrics.Changes("c1").inc("cudahook_restores_total",
                                                              outcome="failed")) is False
    assert list(elsewhere.iterdir()) == []


def _agent_info(pid: int, **over: object) -> dict[str, object]:
    from cudahook.platform.host import Host

    return {"pid": pid, "start": Host().start_time(pid), "version": "580.65.06", "calls": 7,
            "served": 3, "sessions": 1, "rss_bytes": 5 << 20, "workers_rss_bytes": 9 << 20,
            **over}


def test_the_agent_is_in_the_metrics_while_it_lives_and_up_0_after(tmp_path: Path) -> None:
    s = _settings(tmp_path)
    prom = Path(s.metrics_file)  # type: ignore[arg-type]
    proc = subprocess.Popen(["sleep", "60"])
    try:
        assert metrics.update_agent(s, _agent_info(proc.pid))
        found = samples(prom)
        assert value(found, "cudahook_agent_up", pid=str(proc.pid), driver="580.65.06") == 1
        assert value(found, "cudahook_agent_calls_total") == 7
        assert value(found, "cudahook_agent_sessions_total") == 3
        assert value(found, "cudahook_agent_sessions") == 1
        assert value(found, "cudahook_agent_resident_bytes", process="agent") == 5 << 20
        assert value(found, "cudahook_agent_resident_bytes", process="workers") == 9 << 20
        # A container's event keeps the agent's entry, and the container's series.
        assert _count(s, "c1", now=__import__("time").time())
        found = samples(prom)
        assert value(found, "cudahook_agent_calls_total") == 7
        assert value(found, "cudahook_checkpoints_total", container="c1") == 1
    finally:
        proc.kill()
        proc.wait()
    # Killed without a word: the next write reads that it is gone.
    assert _count(s, "c1", now=__import__("time").time())
    found = samples(prom)
    assert value(found, "cudahook_agent_up", pid=str(proc.pid)) == 0
    assert value(found, "cudahook_agent_calls_total") is None
    # An agent that ends says so itself.
    assert metrics.update_agent(s, _agent_info(os.getpid(), exited=True))
    assert value(samples(prom), "cudahook_agent_up", pid=str(os.getpid())) == 0


def test_untrusted_strings_bounded__the_agent_entry_is_fixed_and_escaped(tmp_path: Path) -> None:
    s = _settings(tmp_path)
    prom = Path(s.metrics_file)  # type: ignore[arg-type]
    state = Path(s.state_dir) / metrics.STATE_NAME
    hostile = _agent_info(os.getpid(), version='5"8\n0\\' + "x" * (2 << 20), extra="y" * 10000,
                          calls=float("nan"), sessions=float("inf"), served=True)
    assert metrics.update_agent(s, hostile)
    sizes = []
    for i in range(200):
        assert metrics.update_agent(s, {**hostile, "calls": i})
        sizes.append(state.stat().st_size)
    assert max(sizes) < 2048 and max(sizes) - sizes[10] <= 2, sizes  # replaced, never grown
    found = samples(prom)  # prometheus_client parses the escaped label back
    (driver,) = [dict(ls)["driver"] for (n, ls), _ in found.items() if n == "cudahook_agent_up"]
    assert driver.startswith('5"8\n0\\x') and len(driver) == 64
    assert value(found, "cudahook_agent_calls_total") == 199
    assert value(found, "cudahook_agent_sessions") == 0  # inf and a bool are no numbers
    assert value(found, "cudahook_agent_sessions_total") == 0
    # A damaged entry in the state is dropped, never fatal to a container's write.
    data = json.loads(state.read_text())
    data["agent"] = {"pid": "x", "version": ["a"]}
    state.write_text(json.dumps(data))
    assert _count(s, "c2", now=__import__("time").time())
    assert value(samples(prom), "cudahook_agent_up") is None
