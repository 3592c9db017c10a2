"""The metrics file, as Prometheus's own tools see it, after real checkpoints
and restores (runc, CRIU, cudahook's hooks, the simulated GPU): `promtool
check metrics` finds no problem in it (names, types, help, units, labels),
and node_exporter's textfile collector, set up as the README's Metrics
section says, serves cudahook's series.

promtool (Debian 13) and prometheus-node-exporter (Debian 12) are unpacked,
never installed, by scripts/provision-runtimes.sh: no node_exporter service
exists or is touched; the one here is a private process on a loopback port
with every collector but the textfile one off.
"""

from __future__ import annotations

import shutil
import socket
import subprocess
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest
import yaml
from prometheus_client.parser import text_string_to_metric_families

from .conftest import Env, needs_runc

PRIVATE = Path(__file__).resolve().parents[2] / ".cache" / "runtimes"


def _tool(pattern: str, name: str) -> str | None:
    hits = sorted(PRIVATE.glob(pattern))
    return str(hits[-1]) if hits else shutil.which(name)


PROMTOOL = _tool("promtool-*/usr/bin/promtool", "promtool")
NODE_EXPORTER = _tool("node-exporter-*/usr/bin/prometheus-node-exporter",
                      "prometheus-node-exporter")

pytestmark = [
    *needs_runc,
    pytest.mark.skipif(PROMTOOL is None, reason="promtool not found (scripts/provision-runtimes.sh)"),
]

WORKLOADS = [("solo", {"mib": 4}), ("mp", {"mib": 2, "procs": 2})]
TAGS = ["solo", "mp.0", "mp.1"]


def promtool(text: str) -> subprocess.CompletedProcess[str]:
    assert PROMTOOL is not None
    return subprocess.run([PROMTOOL, "check", "metrics"], input=text, capture_output=True,
                          text=True, timeout=60)


def samples(text: str) -> dict[tuple[str, frozenset[tuple[str, str]]], float]:
    return {(s.name, frozenset(s.labels.items())): s.value
            for fam in text_string_to_metric_families(text) for s in fam.samples}


def cudahook_samples(text: str) -> dict[tuple[str, frozenset[tuple[str, str]]], float]:
    return {k: v for k, v in samples(text).items() if k[0].startswith("cudahook_")}


@pytest.fixture(scope="module")
def written(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    """The metrics file after a --leave-running checkpoint (guardian resume),
    a checkpoint, a restore refused by the gate and the restore after it,
    written where node_exporter's textfile collector reads."""
    tmp = tmp_path_factory.mktemp("prom")
    env = Env(tmp)
    try:
        textfile = tmp / "textfile"
        settings = env.lab.settings(metrics_file=str(textfile / "cudahook.prom"))
        env.config.write_text(yaml.safe_dump(dict(settings.__dict__)))
        bundle = env.box.bundle("b1", WORKLOADS, others=["sleep 100000"])
        cid = env.cid()
        r = env.box.run(cid, bundle)
        assert r.returncode == 0, r.stderr
        env.wait_running(TAGS, steps=3)
        before = env.counters(TAGS)
        r = env.box.checkpoint(cid, tmp / "live", leave_running=True)
        assert r.returncode == 0, r.stderr
        env.wait_event("guardian", lambda e: "resumed" in e.get("outcome", ""))
        env.wait_running(TAGS, before)
        image = tmp / "img"
        r = env.box.checkpoint(cid, image)
        assert r.returncode == 0, r.stderr
        frozen = env.frozen(cid, TAGS)
        env.lab.set(driver=570)  # the gate refuses: another driver branch
        try:
            r = env.box.restore(cid, bundle, image)
        finally:
            env.lab.set(driver=580)
        assert r.returncode != 0
        env.box.delete(cid)
        r = env.box.restore(cid, bundle, image)
        assert r.returncode == 0, r.stderr
        env.wait_running(TAGS, frozen)
        yield textfile / "cudahook.prom"
    finally:
        env.close()


def test_promtool_finds_no_problem_in_the_metrics_file(written: Path) -> None:
    text = written.read_text()
    found = cudahook_samples(text)
    names = {n for n, _ in found}
    # Every kind of series a checkpoint, a resume, a refusal and a restore write.
    assert {"cudahook_checkpoints_total", "cudahook_restores_total", "cudahook_refusals_total",
            "cudahook_guardian_resumes_total", "cudahook_gpu_memory_moved_bytes_total",
            "cudahook_phase_duration_seconds_sum", "cudahook_phase_duration_seconds_count",
            "cudahook_last_phase_duration_seconds", "cudahook_last_transfer_bytes_per_second",
            "cudahook_last_event_timestamp_seconds"} <= names, names
    outcomes = {dict(ls).get("outcome") for n, ls in found if n == "cudahook_restores_total"}
    assert outcomes == {"ok", "refused"}
    r = promtool(text)
    assert (r.returncode, r.stdout, r.stderr) == (0, "", ""), r
    # promtool does lint: a name in a non-base unit, a counter without _total.
    bad = text.replace("cudahook_last_transfer_bytes_per_second",
                       "cudahook_last_transfer_gigabytes_per_second")
    bad = bad.replace("cudahook_rollbacks_total", "cudahook_rollbacks")
    bad += ("# HELP cudahook_rollbacks Rollbacks.\n# TYPE cudahook_rollbacks counter\n"
            'cudahook_rollbacks{container="c",gpu_model="m"} 1\n')
    r = promtool(bad)
    assert r.returncode != 0
    assert 'use base unit "bytes" instead of "gigabytes"' in r.stdout + r.stderr
    assert "counter metrics should have \"_total\" suffix" in r.stdout + r.stderr


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _scrape(url: str, timeout: float = 20) -> str:
    opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))  # loopback only
    deadline = time.monotonic() + timeout
    while True:
        try:
            with opener.open(url, timeout=5) as resp:
                return resp.read().decode()
        except OSError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.1)


@pytest.mark.skipif(NODE_EXPORTER is None,
                    reason="prometheus-node-exporter not found (scripts/provision-runtimes.sh)")
def test_node_exporter_textfile_collector_serves_cudahook_series(written: Path,
                                                                 tmp_path: Path) -> None:
    assert NODE_EXPORTER is not None
    port = _free_port()
    log = (tmp_path / "node-exporter.log").open("wb")
    proc = subprocess.Popen(
        [NODE_EXPORTER, f"--web.listen-address=127.0.0.1:{port}",
         "--collector.disable-defaults", "--collector.textfile",
         f"--collector.textfile.directory={written.parent}", "--web.disable-exporter-metrics",
         "--runtime.gomaxprocs=1"],
        stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT)
    try:
        scraped = _scrape(f"http://127.0.0.1:{port}/metrics")
    finally:
        proc.terminate()
        proc.wait(10)
        log.close()
    got = samples(scraped)
    # The collector read the file without error, and serves every series of it.
    assert [v for (n, _), v in got.items() if n == "node_textfile_scrape_error"] == [0.0], scraped
    assert cudahook_samples(scraped) == cudahook_samples(written.read_text())
    assert not [n for n, _ in got if n.startswith("node_cpu")]  # the other collectors are off


def test_promtool_finds_no_problem_in_the_node_agents_series(tmp_path: Path) -> None:
    """The agent's series beside a container's, as the agent writes them."""
    import os

    from cudahook.platform import metrics
    from cudahook.platform.config import Settings
    from cudahook.platform.host import Host

    s = Settings(state_dir=str(tmp_path / "state"), log_file=str(tmp_path / "log"),
                 metrics_file=str(tmp_path / "textfile" / "cudahook.prom"))
    me = os.getpid()
    assert metrics.update_agent(s, {"pid": me, "start": Host().start_time(me),
                                    "version": "580.65.06", "calls": 12, "served": 3,
                                    "sessions": 1, "rss_bytes": 1 << 24,
                                    "workers_rss_bytes": 1 << 25})
    assert metrics.update(s, metrics.Changes("c1", "H100").inc("cudahook_checkpoints_total",
                                                               outcome="ok"))
    text = Path(s.metrics_file).read_text()  # type: ignore[arg-type]
    names = {n for n, _ in cudahook_samples(text)}
    assert {"cudahook_agent_up", "cudahook_agent_calls_total", "cudahook_agent_sessions_total",
            "cudahook_agent_sessions", "cudahook_agent_resident_bytes",
            "cudahook_checkpoints_total"} <= names, names
    r = promtool(text)
    assert (r.returncode, r.stdout, r.stderr) == (0, "", ""), r
