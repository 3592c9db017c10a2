"""Discovery scopes to the container and filters to real CUDA processes."""

from __future__ import annotations

import os
import shlex
import signal
import subprocess
import time
import uuid
from pathlib import Path

import pytest

from cudahook.core.discovery import container_pids, discover
from cudahook.platform.host import Host

from .conftest import requires_root, requires_unshare


def _cgroup_base() -> Path | None:
    for base in (Path("/sys/fs/cgroup/pids"), Path("/sys/fs/cgroup/unified"),
                 Path("/sys/fs/cgroup")):
        if (base / "cgroup.procs").exists() and os.access(base, os.W_OK):
            return base
    return None


def _children(pid: int) -> list[int]:
    host = Host()
    out = []
    for p in host.all_pids():
        try:
            if host.ppid(p) == pid:
                out.append(p)
        except Exception:
            continue
    return out


def start_container(node, use_cgroup: bool):  # type: ignore[no-untyped-def]
    """Workloads in their own PID namespace (and cgroup), like a runc container."""
    inner = " ".join(
        shlex.join(node.lab.workload_argv(t, **o)) + " &"
        for t, o in (("a", {"mib": 2}), ("b", {"mib": 2, "procs": 2}), ("m", {"nvml_only": True}))
    ) + " wait"
    cg = None
    prefix = ""
    if use_cgroup:
        base = _cgroup_base()
        if base is None:
            pytest.skip("no writable cgroup hierarchy")
        cg = base / f"cudahook-test-{uuid.uuid4().hex[:8]}"
        cg.mkdir()
        # Only the namespace's init (and so its children) joins, as under runc.
        prefix = f"echo $$ > {cg}/cgroup.procs; "
    outer = subprocess.Popen(
        ["bash", "-c", f"exec unshare --pid --fork --kill-child bash -c {shlex.quote(prefix + inner)}"],
        env=node.lab.workload_env(), start_new_session=True,
    )
    node.procs.append(outer)
    for tag in ("a", "b.0", "b.1", "m"):
        node.lab.wait_counter(tag)
    deadline = time.monotonic() + 5
    while not (kids := _children(outer.pid)):
        assert time.monotonic() < deadline
        time.sleep(0.05)
    return outer, kids[0], cg


@requires_root
@requires_unshare
@pytest.mark.parametrize("use_cgroup", [True, False])
def test_container_scope_and_namespace_pids(node, use_cgroup: bool) -> None:  # type: ignore[no-untyped-def]
    outer, init, cg = start_container(node, use_cgroup)
    bystander = node.spawn("outside", mib=1)  # same node, not in the container
    node.lab.wait_counter("outside")
    try:
        engine = node.engine()
        found = discover(engine.host, engine.backend, init, engine.settings.device_regex)
        assert found.scope == ("cgroup" if use_cgroup else "pidns-scan")
        assert Host().nspid(init) == 1
        nspids = {node.lab.status(t)["pid"] for t in ("a", "b.0", "b.1")}
        assert {p.nspid for p in found.processes} == nspids  # as the container sees them
        assert bystander.pid not in found.pids and bystander.pid not in found.candidates
        assert len(found.processes) == 3 and len(found.skipped) == 1  # the NVML monitor
        assert "initialization error" in next(iter(found.skipped.values()))
        pids, _ = container_pids(Host(), init)
        assert outer.pid not in pids and init in pids
        # Round trip inside the namespace works too.
        res = engine.checkpoint(found.processes)
        assert res.ok
        before = {t: node.lab.status(t)["counter"] for t in ("a", "b.0", "b.1")}
        engine.restore(found.processes)
        for t, c in before.items():
            st = node.lab.wait_counter(t, c + 11)
            assert st["intact"] and not st["errors"]
    finally:
        os.killpg(outer.pid, signal.SIGKILL)
        outer.wait()
        if cg is not None:
            deadline = time.monotonic() + 5
            while cg.exists():
                try:
                    cg.rmdir()
                except OSError:
                    assert time.monotonic() < deadline
                    time.sleep(0.05)


def test_tree_scan_takes_only_descendants(node) -> None:  # type: ignore[no-untyped-def]
    init = node.spawn_tree(("x", {"mib": 1}), ("y", {"mib": 1}))
    other = node.spawn("z", mib=1)
    for t in "xyz":
        node.lab.wait_counter(t)
    pids, scope = container_pids(Host(), init.pid)
    assert scope == "tree-scan"
    assert node.lab.status("x")["pid"] in pids and node.lab.status("y")["pid"] in pids
    assert other.pid not in pids


def test_r550_discovery_by_restore_thread_name(make_node) -> None:  # type: ignore[no-untyped-def]
    node = make_node(driver=550)
    init = node.spawn_tree(("c", {"mib": 1}), ("n", {"nvml_only": True}))
    c = node.lab.wait_counter("c")["pid"]
    n = node.lab.wait_counter("n")["pid"]
    engine = node.engine()
    found = discover(engine.host, engine.backend, init.pid, engine.settings.device_regex)
    assert found.pids == [c] and found.processes[0].state == "running"
    assert found.skipped[n] == "no CUDA restore thread"
    engine.checkpoint(found.processes)
    again = discover(engine.host, engine.backend, init.pid, engine.settings.device_regex,
                     require_device_fd=False)
    assert again.pids == [c] and again.processes[0].state == "checkpointed"
    engine.restore(again.processes)
    assert engine.read_state(c) == "running"


def test_device_pattern_is_configurable(node) -> None:  # type: ignore[no-untyped-def]
    """The pattern decides which open files make a candidate; a CUDA process
    is one by its restore thread as well, whatever the pattern."""
    init = node.spawn_tree(("c", {"mib": 1}), ("n", {"nvml_only": True}))
    c = node.lab.wait_counter("c")["pid"]
    n = node.lab.wait_counter("n")["pid"]
    engine = node.engine(device_pattern=r"^/dev/nvidia[0-9]+$")  # misses the lab's paths
    found = discover(engine.host, engine.backend, init.pid, engine.settings.device_regex)
    assert found.candidates == [c] and found.pids == [c]
    engine = node.engine()
    found = discover(engine.host, engine.backend, init.pid, engine.settings.device_regex)
    assert sorted(found.candidates) == sorted([c, n]) and found.pids == [c]


def test_a_process_that_does_not_answer_is_an_error_not_skipped(node) -> None:  # type: ignore[no-untyped-def]
    """A stopped CUDA process makes cuda-checkpoint hang: discovery must fail,
    not classify it as "not CUDA" and let CRIU dump it with its GPU state."""
    from cudahook.core.discovery import DiscoveryError

    init = node.spawn_tree(("a", {"mib": 1}), ("b", {"mib": 1}))
    node.lab.wait_counter("a")
    b = node.lab.wait_counter("b")["pid"]
    engine = node.engine(call_timeout_s=1.0)
    os.kill(b, signal.SIGSTOP)
    try:
        with pytest.raises(DiscoveryError, match=f"pid {b} \\(timed out\\)"):
            discover(engine.host, engine.backend, init.pid, engine.settings.device_regex)
    finally:
        os.kill(b, signal.SIGCONT)
    assert engine.read_state(b) == "running"
