"""Failing closed kills the container's processes, and only them."""

from __future__ import annotations

import subprocess
import time

from cudahook.flow import containers
from cudahook.flow.context import Context
from cudahook.platform.host import Host

from .conftest import Node


def test_kill_same_never_hits_another_process_with_that_pid() -> None:
    host = Host()
    p = subprocess.Popen(["sleep", "60"])
    try:
        start = host.start_time(p.pid)
        # Listed with another start time: the PID now names some other process.
        assert containers.kill_same(host, p.pid, start - 1) is False
        time.sleep(0.1)
        assert p.poll() is None
        assert containers.kill_same(host, p.pid, start) is True
        assert p.wait(10) == -9
        assert containers.kill_same(host, p.pid, start) is False  # gone: nothing to kill
    finally:
        p.kill()
        p.wait()


def test_fail_closed_kills_the_whole_container(node: Node) -> None:
    init = node.spawn_tree(("a", {"mib": 1}), ("b", {"mib": 1, "procs": 2}))
    pids = [node.lab.wait_counter(t)["pid"] for t in ("a", "b.0", "b.1")]
    outsider = subprocess.Popen(["sleep", "60"])
    try:
        killed = containers.kill_container(Context(node.settings()), init.pid)
        # init, a and b.0 at least: b.1 is b.0's forked worker, which the
        # kernel kills when b.0 dies (PR_SET_PDEATHSIG), sometimes before
        # kill_container reaches it. That a and b.0 die at all is the proof
        # below: the death of init (a shell) kills neither.
        assert killed >= 1 + len(pids) - 1
        assert init.wait(10) == -9
        host = Host()
        deadline = time.monotonic() + 10
        while any(host.alive(p) for p in pids):
            assert time.monotonic() < deadline
            time.sleep(0.05)
        assert outsider.poll() is None
    finally:
        outsider.kill()
        outsider.wait()
