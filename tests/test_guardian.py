"""The guardian waits for CRIU's exit, and only for that, before it restores."""

from __future__ import annotations

import errno
import json
import os
import subprocess
import threading
import time
from pathlib import Path
from typing import Any

import pytest

from cudahook.core.discovery import discover
from cudahook.flow import guardian
from cudahook.platform.host import Host

from .conftest import Node


def _no_pidfd(pid: int, flags: int = 0) -> int:
    raise OSError(errno.ENOSYS, os.strerror(errno.ENOSYS))


def _checkpointed(node: Node) -> tuple[list[int], dict[str, int], Any]:
    init = node.spawn_tree(("a", {"mib": 2}), ("b", {"mib": 1, "procs": 2}))
    tags = ["a", "b.0", "b.1"]
    for t in tags:
        node.lab.wait_counter(t, 2)
    engine = node.engine()
    procs = discover(engine.host, engine.backend, init.pid, engine.settings.device_regex).processes
    assert len(procs) == 3
    engine.checkpoint(procs)
    return [p.pid for p in procs], {t: node.lab.status(t)["counter"] for t in tags}, engine


def _args(node: Node, criu: subprocess.Popen[bytes], pids: list[int]) -> str:
    host = Host()
    return json.dumps({
        "criu_pid": criu.pid, "criu_start": host.start_time(criu.pid), "container": "c1",
        "procs": [(p, host.start_time(p)) for p in pids],
        "settings": node.settings().as_dict(),
    })


def _events(node: Node) -> list[dict[str, Any]]:
    log = Path(node.settings().log_file)
    return [json.loads(x) for x in log.read_text().splitlines()] if log.exists() else []


def _wait_intact(node: Node, since: dict[str, int]) -> None:
    for tag, before in since.items():
        st = node.lab.wait_counter(tag, before + 11)  # past one more memory check
        assert st["intact"] and st["errors"] == [], st


def _held_until_gone(node: Node, engine: Any, pids: list[int], frozen: dict[str, int],
                     args: str, blocker: subprocess.Popen[bytes]) -> None:
    """The guardian started with `args` holds the processes checkpointed
    while `blocker` lives, and brings them back, intact, once it is killed."""
    rc: list[int] = []
    t = threading.Thread(target=lambda: rc.append(guardian.main(args)))
    t.start()
    try:
        time.sleep(1.5)
        assert t.is_alive() and rc == []
        assert {engine.read_state(p) for p in pids} == {"checkpointed"}
    finally:
        blocker.kill()
        blocker.wait()
    t.join(60)
    assert rc == [0]
    assert {engine.read_state(p) for p in pids} == {"running"}
    _wait_intact(node, frozen)


def test_without_pidfd_open_it_polls_and_waits_for_criu(
        node: Node, monkeypatch: pytest.MonkeyPatch) -> None:
    """ENOSYS from pidfd_open (Linux < 5.3) is no sign that CRIU has exited."""
    monkeypatch.setattr(os, "pidfd_open", _no_pidfd)
    pids, frozen, engine = _checkpointed(node)
    criu = subprocess.Popen(["sleep", "60"])
    _held_until_gone(node, engine, pids, frozen, _args(node, criu, pids), criu)  # CRIU still dumps
    assert "resumed" in _events(node)[-1]["outcome"]


def test_never_proceeds_while_criu_lives(node: Node, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(guardian, "MAX_WAIT_S", 1)
    pids, frozen, engine = _checkpointed(node)
    criu = subprocess.Popen(["sleep", "60"])
    try:
        t0 = time.monotonic()
        assert guardian.main(_args(node, criu, pids)) == 1
        assert 1 <= time.monotonic() - t0 < 10
        assert {engine.read_state(p) for p in pids} == {"checkpointed"}
        assert "still running" in _events(node)[-1]["error"]
    finally:
        criu.kill()
        criu.wait()
    assert engine.restore(pids).ok
    _wait_intact(node, frozen)


def test_wait_exit_tells_a_reused_pid_from_criu(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(os, "pidfd_open", _no_pidfd)
    host = Host()
    p = subprocess.Popen(["sleep", "60"])
    try:
        start = host.start_time(p.pid)
        assert guardian.wait_exit(p.pid, start, host, max_wait_s=0.3) is False
        assert guardian.wait_exit(p.pid, start + 1, host, max_wait_s=5) is True  # another process
    finally:
        p.kill()
        p.wait()
    assert guardian.wait_exit(p.pid, start, host, max_wait_s=5) is True


def test_waits_for_the_action_script_as_well_as_criu(node: Node) -> None:
    """A CRIU that was killed can leave its action script still locking: the
    guardian acts only once both are gone."""
    pids, frozen, engine = _checkpointed(node)
    criu = subprocess.Popen(["true"])
    criu_start = Host().start_time(criu.pid)
    hook = subprocess.Popen(["sleep", "60"])
    args = json.loads(_args(node, criu, pids))
    args["criu_start"] = criu_start
    args["hook"] = [hook.pid, Host().start_time(hook.pid)]
    criu.wait()
    _held_until_gone(node, engine, pids, frozen, json.dumps(args), hook)


def test_restores_only_what_it_finds_locked_or_checkpointed(node: Node) -> None:
    """Armed before the first lock, the guardian may find a process never
    locked, or rolled back already: it leaves those alone."""
    init = node.spawn_tree(("a", {"mib": 1}), ("b", {"mib": 1}), ("c", {"mib": 1}))
    tags = ["a", "b", "c"]
    for t in tags:
        node.lab.wait_counter(t, 2)
    engine = node.engine()
    procs = discover(engine.host, engine.backend, init.pid, engine.settings.device_regex).processes
    by_tag = {t: node.lab.status(t)["pid"] for t in tags}
    engine.backend.lock(by_tag["b"], 1000)
    engine.checkpoint([by_tag["c"]])
    frozen = {t: node.lab.status(t)["counter"] for t in ("b", "c")}
    criu = subprocess.Popen(["true"])
    args = _args(node, criu, [p.pid for p in procs])
    criu.wait()
    assert guardian.main(args) == 0
    g = _events(node)[-1]
    assert "resumed" in g["outcome"] and sorted(g["pids"]) == sorted([by_tag["b"], by_tag["c"]])
    assert {engine.read_state(p.pid) for p in procs} == {"running"}
    _wait_intact(node, frozen)
    # Nothing left to do: said so, nothing moved.
    criu = subprocess.Popen(["true"])
    args = _args(node, criu, [p.pid for p in procs])
    criu.wait()
    assert guardian.main(args) == 0
    assert "nothing to resume" in _events(node)[-1]["outcome"]


def _three(node: Node) -> tuple[list[Any], dict[str, int], Any]:
    init = node.spawn_tree(("a", {"mib": 1}), ("b", {"mib": 1}), ("c", {"mib": 1}))
    for t in ("a", "b", "c"):
        node.lab.wait_counter(t, 2)
    engine = node.engine()
    procs = discover(engine.host, engine.backend, init.pid, engine.settings.device_regex).processes
    return procs, {t: node.lab.status(t)["pid"] for t in ("a", "b", "c")}, engine


def _guard(node: Node, pids: list[int], **settings: Any) -> int:
    criu = subprocess.Popen(["true"])
    args = json.loads(_args(node, criu, pids))
    args["settings"].update(settings)
    args["run"] = str(Path(node.settings().state_dir) / "runs" / "4242-77.json")
    criu.wait()
    return guardian.main(json.dumps(args))


def test_a_state_in_progress_is_waited_out_then_acted_on(node: Node) -> None:
    """CUDA 13.4+ says `checkpointing` while a checkpoint runs on: never
    "runs", and what it ends in (checkpointed) is brought back."""
    procs, by_tag, engine = _three(node)
    engine.checkpoint([by_tag["c"]])
    frozen = {"c": node.lab.status("c")["counter"]}
    node.lab.force_state(by_tag["c"], "checkpointing")
    timer = threading.Timer(1.0, node.lab.force_state, (by_tag["c"], "checkpointed"))
    timer.start()
    try:
        assert _guard(node, [p.pid for p in procs], call_timeout_s=20.0) == 0
    finally:
        timer.join()
    g = _events(node)[-1]
    assert "resumed" in g["outcome"] and g["pids"] == [by_tag["c"]], g
    assert {engine.read_state(p.pid) for p in procs} == {"running"}
    _wait_intact(node, frozen)


@pytest.mark.parametrize("state", ["failed", "unknown", "checkpointing", "restoring"])
def test_any_state_but_running_locked_or_checkpointed_is_unsafe(node: Node, state: str) -> None:
    """Found after the calls are dead and the wait for an operation in
    progress: exit 4, naming the process - never "every process runs"."""
    procs, by_tag, engine = _three(node)
    engine.checkpoint([by_tag["c"]])
    node.lab.force_state(by_tag["b"], state)
    assert _guard(node, [p.pid for p in procs], call_timeout_s=1.0) == 4
    g = _events(node)[-1]
    assert g.get("unsafe") is True and g["pids"] == [by_tag["b"]], g
    assert f"pid {by_tag['b']}" in g["error"] and "not running" in g["error"], g
    # What could be brought back was.
    assert engine.read_state(by_tag["c"]) == "running"


def test_the_action_scripts_calls_are_ended_before_any_state_is_read(node: Node) -> None:
    """A driver call of the pre-dump that armed the guardian, still running
    after the script died (here: about to lock b), is ended first - or it
    would lock the workload after the guardian judged it."""
    from cudahook.flow.criu_run import calls_name
    from cudahook.platform.tools import CALLS_ENV

    procs, by_tag, engine = _three(node)
    run = Path(node.settings().state_dir) / "runs" / "4242-77.json"
    env = {**os.environ, CALLS_ENV: str(calls_name(run))}
    late = subprocess.Popen(["sh", "-c", f"sleep 2; exec {node.lab.cuda_checkpoint} "
                             f"--action lock --pid {by_tag['b']}"], env=env,
                            start_new_session=True)
    try:
        assert _guard(node, [p.pid for p in procs]) == 0
        assert late.wait(5) == -9  # ended by the guardian, not by its own end
    finally:
        late.kill()
        late.wait()
    time.sleep(2.5)  # when the call would have locked b
    assert {engine.read_state(p.pid) for p in procs} == {"running"}


def test_a_successor_with_nothing_left_to_do_arms_none(node: Node) -> None:
    """A successor whose predecessor left no run record (so none can say
    that it finished), with its processes gone, ends the chain: it arms no
    successor of its own."""
    host = Host()
    gone = subprocess.Popen(["true"])  # CRIU, the process, the guardian before: all gone
    args = json.loads(_args(node, gone, [gone.pid]))
    args["after"] = [gone.pid, host.start_time(gone.pid)]
    gone.wait()
    assert guardian.main(json.dumps(args)) == 0
    state = json.dumps(str(node.settings().state_dir))
    # A successor would exist by now: Popen returns once it has exec'd.
    armed = [p for p in os.listdir("/proc") if p.isdigit() and _cmdline(int(p)).count(state)
             and "cudahook.flow.guardian import main" in _cmdline(int(p))]
    assert armed == []


def _cmdline(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().decode(errors="replace")
    except OSError:
        return ""


def test_a_guardian_killed_while_criu_dumps_is_replaced(node: Node) -> None:
    """The guardian is SIGKILLed (the OOM killer) while CRIU still dumps,
    and the dump then fails: the successor it armed at its start waits for
    CRIU and brings the workload back, intact."""
    pids, frozen, engine = _checkpointed(node)
    criu = subprocess.Popen(["sleep", "120"])  # the dump, still running
    args = json.loads(_args(node, criu, pids))
    run = Path(node.settings().state_dir) / "runs" / "4242-78.json"
    run.parent.mkdir(parents=True, exist_ok=True)
    run.write_text("{}")  # pre-dump's progress record: where a guardian says it finished
    args["run"] = str(run)
    first = guardian._detached("main", args)
    state = json.dumps(str(node.settings().state_dir))

    def successors() -> list[int]:
        return [int(p) for p in os.listdir("/proc") if p.isdigit() and int(p) != first.pid
                and _cmdline(int(p)).count(state) and '"after"' in _cmdline(int(p))]

    try:
        deadline = time.monotonic() + 30
        while not successors():
            assert time.monotonic() < deadline, "the guardian armed no successor while CRIU dumps"
            assert first.poll() is None
            time.sleep(0.05)
        first.kill()
        first.wait()
        assert {engine.read_state(p) for p in pids} == {"checkpointed"}
    finally:
        criu.kill()  # the dump fails
        criu.wait()
    deadline = time.monotonic() + 60
    while successors():
        assert time.monotonic() < deadline, "the successor never finished"
        time.sleep(0.1)
    assert {engine.read_state(p) for p in pids} == {"running"}
    assert [e for e in _events(node) if "resumed" in e.get("outcome", "")], _events(node)
    _wait_intact(node, frozen)


def test_a_chain_of_successors_is_bounded(node: Node) -> None:
    """With no record to say it finished, a successor at the last link of
    the chain arms none, and says so."""
    host = Host()
    gone = subprocess.Popen(["true"])
    args = json.loads(_args(node, gone, []))
    args["after"] = [gone.pid, host.start_time(gone.pid)]
    gone.wait()
    args["generation"] = guardian.RELAY_MAX
    ctx = type("Ctx", (), {"host": host, "log": lambda self, *a, **k: logged.append(k)})()
    logged: list[dict[str, Any]] = []
    assert guardian._relay(ctx, args, "main") is None
    assert "no successor armed: 8 in a row" in logged[0]["warning"], logged
    args["generation"] = guardian.RELAY_MAX - 1
    child = guardian._relay(ctx, args, "main")
    assert child is not None
    os.kill(child[0], 9)
    os.waitpid(child[0], 0)
