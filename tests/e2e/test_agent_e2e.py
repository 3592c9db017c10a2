"""runc checkpoint/restore of a GPU container, real runc and CRIU, with the
node agent up: the hooks' driver calls go to its warm workers."""

from __future__ import annotations

import contextlib
import os
import signal
import time

from cudahook.core import agent

from .conftest import needs_runc

pytestmark = needs_runc

WORKLOADS = [("solo", {"mib": 8}), ("mp", {"mib": 2, "procs": 2})]
TAGS = ["solo", "mp.0", "mp.1"]


@contextlib.contextmanager
def running_agent(settings):  # type: ignore[no-untyped-def]
    proc = agent.start_detached(settings)
    try:
        deadline = time.monotonic() + 30
        while not (agent.status(settings, 1.0) or {}).get("idle_workers"):
            assert time.monotonic() < deadline, "the agent did not come up"
            time.sleep(0.05)
        yield proc
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()


def test_round_trip_through_the_agent(make_env, tmp_path) -> None:  # type: ignore[no-untyped-def]
    env = make_env(driver=580, attach_latency_s=0.5)
    settings = env.lab.settings(backend="driver-api")
    with running_agent(settings) as proc:
        bundle = env.box.bundle("b1", WORKLOADS)
        cid = env.cid()
        r = env.box.run(cid, bundle)
        assert r.returncode == 0, r.stderr
        env.wait_running(TAGS, steps=3)
        image = tmp_path / "img"
        r = env.box.checkpoint(cid, image)
        assert r.returncode == 0, r.stderr
        frozen = env.frozen(cid, TAGS)
        after_dump = agent.status(settings)
        # pre-dump's phase (and CRIU's second, idempotent run) went to the agent.
        assert after_dump and after_dump["served"] >= 1 and after_dump["in_flight"] == 0
        r = env.box.restore(cid, bundle, image)
        assert r.returncode == 0, r.stderr
        env.wait_running(TAGS, frozen)
        assert env.box.state(cid)["status"] == "running"
        restores = env.events("restore")
        assert len(restores) == 1 and not restores[0].get("error")
        info = agent.status(settings)
        assert info and info["served"] > after_dump["served"] and info["in_flight"] == 0
        assert info["pid"] == proc.pid  # the one agent served both


def test_a_dump_failing_after_pre_dump_resumes_through_the_guardian(make_env, tmp_path) -> None:  # type: ignore[no-untyped-def]
    env = make_env(driver=580)
    settings = env.lab.settings(backend="driver-api")
    # A process holding a connection to a host socket: CRIU cannot dump it,
    # and fails after pre-dump has checkpointed the CUDA processes (through
    # the agent); the guardian asks the agent to end the run's calls, then
    # brings the workload back.
    holder = ("/usr/bin/python3 -c 'import socket,time; s=socket.socket(socket.AF_UNIX); "
              "s.connect(\"/run/cuda-sim/gpu.sock\"); time.sleep(1e6)'")
    with running_agent(settings):
        bundle = env.box.bundle("b1", WORKLOADS, others=[holder])
        cid = env.cid()
        r = env.box.run(cid, bundle)
        assert r.returncode == 0, r.stderr
        env.wait_running(TAGS, steps=3)
        before = env.counters(TAGS)
        r = env.box.checkpoint(cid, tmp_path / "img")
        assert r.returncode != 0
        assert "External socket" in (tmp_path / "img.work" / "dump.log").read_text()
        env.wait_event("guardian", lambda e: "resumed" in e.get("outcome", ""), timeout=30)
        env.wait_running(TAGS, before)
        info = agent.status(settings)
        assert info and info["served"] >= 1 and info["in_flight"] == 0
