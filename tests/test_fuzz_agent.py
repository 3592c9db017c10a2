"""Fuzzing the node agent's socket (core/agent.py): its request protocol,
the first line (hello or control) and the calls after it, against a real
agent process on a socket of its own, with the simulator's libcuda.

Peers are root only (SO_PEERCRED), but every line is still parsed: each
example is one connection carrying malformed JSON, lines past the cap,
wrong types, hellos naming a process that is not the caller, calls naming
a PID in a form the protocol does not have, unknown ops and fields,
written whole or in pieces. For each one: exactly one reply line per line
sent (a clear error for every bad one), each a bounded JSON object; the
connection ends when it should. After every example, and at the end: the
agent is the same process and answers; no call reached a worker but the
well-formed calls of a session whose hello named the caller (the agent's
own count of calls says so, exactly); the workload no well-formed call
named is untouched (still `running`, its counter advancing, its memory
intact); the agent's memory and threads stay bounded.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import subprocess
import time
from collections.abc import Iterator
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from cudahook.core import agent
from cudahook.platform.host import Host

from .conftest import Node, requires_root
from .test_agent import wait_for
from .test_fuzz_hooks import (
    STATS,
    fuzz,
    fuzz_summary,  # noqa: F401  (the session's summary)
    verdict,
)

SURFACE = "agent socket"
REPLY_MAX = 4096  # no answer of the agent is longer (a hello, a status, an error)
GONE_PID = (1 << 22) - 7  # above any pid_max a test node has: never a process
RSS_GROWTH_MAX = 48 << 20


class Bench:
    """The node, its agent and the processes the examples name."""

    def __init__(self, node: Node, proc: subprocess.Popen[bytes], settings: Any,
                 victim: int, bystander: int):
        self.node, self.proc, self.settings = node, proc, settings
        self.victim, self.bystander = victim, bystander
        self.me = [os.getpid(), Host().start_time(os.getpid())]
        self.calls = 0  # well-formed calls of ready sessions: the only ones a worker may see
        self.examples = 0

    def status(self) -> dict[str, Any]:
        info = agent.status(self.settings, 5.0)
        assert info is not None, "the agent does not answer"
        return info


@pytest.fixture(scope="module")
def bench(tmp_path_factory: pytest.TempPathFactory, fake_libcuda: Any) -> Iterator[Bench]:
    node = Node(tmp_path_factory.mktemp("agent-fuzz"), "driver-api", driver=580)
    bystander = subprocess.Popen(["sleep", "3600"])
    try:
        node.spawn("victim", mib=2)
        victim = node.lab.wait_counter("victim", 2)["pid"]
        settings = node.lab.settings(backend="driver-api", call_timeout_s=10.0)
        proc = agent.start_detached(settings)
        try:
            wait_for(lambda: (s := agent.status(settings, 1.0)) and s["idle_workers"]
                     and not s["warming"], 30.0)
            yield Bench(node, proc, settings, victim, bystander.pid)
        finally:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    finally:
        bystander.kill()
        bystander.wait()
        node.close()


# -- what one connection carries ------------------------------------------------------------------

JUNK = st.one_of(
    st.sampled_from([b"", b"{", b"}", b"[]", b"null", b"1", b'"hello"', b"{'a': 1}", b"\xff\xfe",
                     b'{"hello": 1}', b'{"control": []}', b"\x00" * 8, b"[" * 5000 + b"]" * 5000,
                     b'{"a":' * 3000 + b"1" + b"}" * 3000, b"NaN", b'{"id": NaN}', b" " * 100]),
    st.binary(max_size=200).filter(lambda b: b"\n" not in b),
)
ANY_JSON = st.recursive(
    st.one_of(st.none(), st.booleans(), st.integers(min_value=-2**70, max_value=2**70),
              st.floats(), st.text(max_size=20)),
    lambda kids: st.one_of(st.lists(kids, max_size=4),
                           st.dictionaries(st.text(max_size=8), kids, max_size=4)),
    max_leaves=12)


@st.composite
def first_line(draw: st.DrawFn, bench: Bench) -> tuple[str, bytes]:
    """(what it is, the line without its newline)."""
    kind = draw(st.sampled_from(["hello"] * 4 + [
        "other-pid", "bad-hook", "bad-fields", "control", "junk", "json", "huge"]))
    me = bench.me
    if kind == "hello":
        hello = {"hook": me, "container": draw(st.one_of(st.none(), st.text(max_size=40))),
                 "calls_of": draw(st.one_of(st.none(), st.just("fuzz-run")))}
        return kind, json.dumps({"hello": hello}).encode()
    if kind == "other-pid":  # a hello naming a process that is not the caller
        pid = draw(st.sampled_from([bench.victim, bench.bystander, 1, GONE_PID, me[0] + 1]))
        start = Host().start_time(pid) if pid in (bench.victim, bench.bystander, 1) else 1
        return kind, json.dumps({"hello": {"hook": [pid, start]}}).encode()
    if kind == "bad-hook":
        hook = draw(st.sampled_from([
            [str(me[0]), me[1]], [me[0], str(me[1])], [float(me[0]), me[1]], [me[0]],
            [me[0], me[1], 0], me[0], None, [True, me[1]], [me[0], me[1] + 1], [me[0], -1],
            [me[0], 2**80], {"pid": me[0]}]))
        return kind, json.dumps({"hello": {"hook": hook}}).encode()
    if kind == "bad-fields":
        key = draw(st.sampled_from(["container", "calls_of"]))
        value = draw(st.one_of(ANY_JSON.filter(lambda v: not isinstance(v, str) and v is not None),
                               st.just("x" * 2000)))
        return kind, json.dumps({"hello": {"hook": me, key: value}}).encode()
    if kind == "control":
        control = draw(st.one_of(
            st.just({"op": "status"}), st.just({"op": "nope"}),
            st.fixed_dictionaries({"op": st.just("end-calls"),
                                   "calls_of": st.one_of(st.just("no-such-run"), ANY_JSON),
                                   "wait_s": st.one_of(st.sampled_from([0, 0.01, -1]),
                                                       ANY_JSON)}),
            st.dictionaries(st.text(max_size=6), ANY_JSON, max_size=3)))
        return kind, json.dumps({"control": control}).encode()
    if kind == "json":
        return kind, json.dumps(draw(ANY_JSON)).encode()
    if kind == "huge":
        return kind, draw(st.sampled_from([b"x", b" ", b'{"hello": "'])) * (agent.LINE_MAX + 10)
    return kind, draw(JUNK)


@st.composite
def call_line(draw: st.DrawFn, bench: Bench) -> tuple[str, bytes]:
    """(good or bad, the line): a well-formed call names the bystander (not a
    CUDA process), a PID that does not exist, or reads the victim's state;
    the victim appears only in calls the protocol does not have."""
    ident = draw(st.integers(min_value=0, max_value=2**31))
    kind = draw(st.sampled_from(["good"] * 3 + ["bad-pid", "bad-op", "bad-arg", "bad-id",
                                                 "junk", "json", "huge"]))
    if kind == "good":
        op, pid = draw(st.one_of(
            st.tuples(st.sampled_from(agent.OPS), st.sampled_from([bench.bystander, GONE_PID])),
            st.just(("get-state", bench.victim))))
        call: dict[str, Any] = {"id": ident, "op": op, "pid": pid}
        if op == "lock":
            call["timeout_ms"] = draw(st.integers(min_value=0, max_value=50))
        if op == "restore" and draw(st.booleans()):
            call["pairs"] = [["ab" * 16, "cd" * 16]]
        if draw(st.booleans()):  # a deadline past call_timeout_s, or none, is not taken
            call["deadline_s"] = draw(st.sampled_from(
                [8.0, 1e9, 2**70, -1, 0, float("nan"), float("inf"), "1", [1], None]))
        if draw(st.booleans()):  # unknown fields are dropped, never passed on
            call[draw(st.sampled_from(["pids", "dir", "chunk", "x"]))] = [bench.victim]
        return "good", json.dumps(call).encode()
    v = bench.victim
    if kind == "bad-pid":
        pid = draw(st.sampled_from([str(v), float(v), [v], {"pid": v}, True, None, 0, -v,
                                    2**31 + v, 2**64, (1 << 22) + 1, f" {v}", f"{v}\n"]))
        return kind, json.dumps({"id": ident, "op": draw(st.sampled_from(agent.OPS)),
                                 "pid": pid}).encode()
    if kind == "bad-op":
        op = draw(st.one_of(st.sampled_from(["LOCK", "lock ", "kill", "storage-checkpoint",
                                             "storage-restore", "", None, 1, ["lock"]]),
                            st.text(max_size=12)).filter(lambda o: o not in agent.OPS))
        return kind, json.dumps({"id": ident, "op": op, "pid": v, "dir": "/", "chunk": 1}).encode()
    if kind == "bad-arg":
        field, value = draw(st.one_of(
            st.tuples(st.just("timeout_ms"), st.sampled_from(
                [-1, 2**33, 2**80, 1.5, "10", None, [1], agent.LOCK_TIMEOUT_MAX_MS + 1])),
            st.tuples(st.just("pairs"), st.sampled_from(
                [{"a": "b"}, [["ab" * 16]], [["zz" * 16, "cd" * 16]], [[1, 2]], "ab",
                 [["ab" * 16, "cd" * 16]] * (agent.PAIRS_MAX + 1), [["ab" * 17, "cd" * 16]]]))))
        op = "lock" if field == "timeout_ms" else "restore"
        return kind, json.dumps({"id": ident, "op": op, "pid": v, field: value}).encode()
    if kind == "bad-id":
        ident_bad = draw(st.sampled_from([None, "1", 1.0, [1], True]))
        return kind, json.dumps({"id": ident_bad, "op": "lock", "pid": v}).encode()
    if kind == "json":
        return kind, json.dumps(draw(ANY_JSON.filter(lambda x: not isinstance(x, dict)))).encode()
    if kind == "huge":
        return kind, b"9" * (agent.LINE_MAX + draw(st.integers(0, 3 * agent.LINE_MAX)))
    return kind, draw(JUNK)


@st.composite
def connection(draw: st.DrawFn, bench: Bench) -> dict[str, Any]:
    first = draw(first_line(bench))
    calls = draw(st.lists(call_line(bench), max_size=6)) if first[0] == "hello" else []
    # A huge line ends the session: nothing after it is read.
    for i, (kind, _) in enumerate(calls):
        if kind == "huge":
            calls = calls[:i + 1]
            break
    return {"first": first, "calls": calls, "chunks": draw(st.integers(1, 4)),
            "pause_s": draw(st.sampled_from([0.0, 0.0, 0.005])),
            "unterminated": draw(st.booleans()) and not calls and first[0] != "huge"}


# -- one connection ------------------------------------------------------------------------------


def send(sock: socket.socket, data: bytes, chunks: int, pause_s: float) -> None:
    """`data` in `chunks` writes (a client's partial writes)."""
    step = max(1, -(-len(data) // chunks))
    for i in range(0, len(data), step):
        sock.sendall(data[i:i + step])
        if pause_s:
            time.sleep(pause_s)


def read_replies(sock: socket.socket, want: int | None, deadline_s: float = 8.0) -> tuple[
        list[dict[str, Any]], bool]:
    """Reply lines until `want` came (None: until the end), and whether the
    agent closed the connection by then."""
    buf, replies, closed = b"", [], False
    end = time.monotonic() + deadline_s
    while want is None or len(replies) < want:
        left = end - time.monotonic()
        assert left > 0, f"no answer in {deadline_s}s (got {replies})"
        sock.settimeout(left)
        try:
            chunk = sock.recv(65536)
        except ConnectionResetError:
            chunk = b""
        except TimeoutError:
            raise AssertionError(f"no answer in {deadline_s}s (got {replies})") from None
        if not chunk:
            closed = True
            break
        buf += chunk
        assert len(buf) <= 64 * REPLY_MAX, "the agent answers more than it was asked"
        while b"\n" in buf:
            line, buf = buf.split(b"\n", 1)
            assert len(line) <= REPLY_MAX, line[:200]
            msg = json.loads(line)
            assert isinstance(msg, dict), msg
            replies.append(msg)
    assert not buf.strip() or closed, buf[:200]
    return replies, closed


def clear_error(msg: dict[str, Any]) -> None:
    assert isinstance(msg.get("error"), str) and 0 < len(msg["error"]) <= 200, msg
    assert msg["error"].isprintable(), msg


def run_connection(bench: Bench, case: dict[str, Any]) -> str:
    kind, line = case["first"]
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.settimeout(5)
    sock.connect(agent.socket_path(bench.settings))
    try:
        tail = b"" if case["unterminated"] else b"\n"
        try:
            send(sock, line + tail, case["chunks"], case["pause_s"])
        except (BrokenPipeError, ConnectionResetError):
            assert kind == "huge", "the agent closed on a line it should have read"
        if case["unterminated"]:
            sock.shutdown(socket.SHUT_WR)
        if kind != "hello":
            replies, closed = read_replies(sock, None)
            assert len(replies) == 1, (kind, replies)
            msg = replies[0]
            if kind == "control" and msg.get("ok"):
                return "control ok"
            clear_error(msg)
            assert msg.get("ready") in (False, None) and "agent" not in msg, msg
            return f"refused ({msg.get('stage', 'control')})"
        hello, _ = read_replies(sock, 1)
        if case["unterminated"]:  # a hello with no newline is no hello
            assert hello[0]["stage"] == "refused", hello
            clear_error(hello[0])
            assert read_replies(sock, None) == ([], True)
            return "refused (unterminated)"
        if not hello[0].get("ready"):
            assert hello[0]["stage"] in ("cold", "busy"), hello
            clear_error(hello[0])
            return f"refused ({hello[0]['stage']})"
        assert hello[0]["agent"] == bench.proc.pid, hello
        sent_good = 0
        for call_kind, body in case["calls"]:
            try:
                send(sock, body + b"\n", case["chunks"], case["pause_s"])
            except (BrokenPipeError, ConnectionResetError):
                assert call_kind == "huge"
            sent_good += call_kind == "good"
        bench.calls += sent_good
        huge = any(k == "huge" for k, _ in case["calls"])
        replies, closed = read_replies(sock, len(case["calls"]))
        good_ids = {json.loads(b)["id"] for k, b in case["calls"] if k == "good"}
        for msg in replies:
            if "lost" in msg:
                # Only an over-long line ends a session with calls in flight:
                # they are abandoned with their worker, and said so.
                assert huge and msg["id"] in good_ids, (msg, case["calls"])
            elif msg.get("ok"):
                assert msg["id"] in good_ids, msg
            else:
                clear_error(msg)
        if huge:
            assert closed or read_replies(sock, None)[1], "an over-long line ends the session"
            assert any("longer than" in m.get("error", "") for m in replies), replies
        else:
            assert len(replies) == len(case["calls"]), (case["calls"], replies)
            sock.shutdown(socket.SHUT_WR)
            assert read_replies(sock, None) == ([], True)
        victim_reads = [m for m in replies if m.get("ok") and m.get("value") == "running"]
        return "session" + (" (victim read)" if victim_reads else "")
    finally:
        sock.close()


def settled(bench: Bench) -> dict[str, Any]:
    """The agent's status once no connection of the example is left."""
    return wait_for(lambda: (s := bench.status()) and s["connections"] <= 1 and not s["sessions"]
                    and s, 10)


@requires_root
@fuzz("CUDAHOOK_FUZZ_AGENT", 1000)
@given(data=st.data())
def test_fuzz_agent_socket(bench: Bench, data: st.DataObject) -> None:
    case = data.draw(connection(bench))
    with verdict(SURFACE):
        outcome = run_connection(bench, case)
        STATS[SURFACE][outcome] += 1
        STATS[SURFACE]["examples"] += 1
        info = settled(bench)
        assert info["pid"] == bench.proc.pid and bench.proc.poll() is None
        # Only the well-formed calls of a session that named its caller
        # reached a worker: the agent's count of calls is exactly theirs.
        assert info["calls"] == bench.calls, (info["calls"], bench.calls, case)


def threads(pid: int) -> int:
    return int(Host().status(pid)["Threads"])


@requires_root
def test_agent_socket__many_connections_bounded_and_served_after(bench: Bench) -> None:
    """More connections than the agent serves at once, some silent, some
    with half a hello: the extra ones get one line (busy) and are closed,
    and once the others are gone the agent answers as before, no call
    made, its threads back where they were."""
    before = settled(bench)
    base_threads = threads(bench.proc.pid)
    socks = []
    try:
        for i in range(agent.MAX_CONNECTIONS + 40):
            s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            s.connect(agent.socket_path(bench.settings))
            if i % 3 == 0:
                s.sendall(b'{"hello": {"hook": [')
            socks.append(s)
        busy = 0
        for s in socks[agent.MAX_CONNECTIONS:]:
            replies, closed = read_replies(s, None, 10.0)
            assert len(replies) == 1 and replies[0]["stage"] == "busy" and closed, replies
            busy += 1
        assert busy == 40
    finally:
        for s in socks:
            s.close()
    after = settled(bench)
    assert after["pid"] == before["pid"] and after["calls"] == before["calls"]
    wait_for(lambda: threads(bench.proc.pid) <= base_threads, 10)


@requires_root
def test_agent_socket__bounded_memory_and_the_victim_untouched(bench: Bench) -> None:
    """Runs after the fuzz (module order): the agent still serves a real
    call, its memory grew by less than RSS_GROWTH_MAX over the whole run,
    and the workload only bad calls named is running, counting, intact."""
    info = settled(bench)
    assert STATS[SURFACE]["examples"] > 0, "run with test_fuzz_agent_socket"
    assert info["rss_bytes"] > 0
    growth = info["rss_bytes"] - bench_rss_start[0]
    STATS[SURFACE]["agent RSS growth, KiB"] = growth >> 10  # in the run's summary
    assert growth < RSS_GROWTH_MAX, (info, bench_rss_start)
    node = bench.node
    assert node.engine(backend="cli").backend.get_state(bench.victim) == "running"
    st_ = node.lab.wait_counter("victim", node.lab.status("victim")["counter"] + 5)
    assert st_["intact"] and st_["errors"] == [], st_


bench_rss_start: list[int] = []


@pytest.fixture(scope="module", autouse=True)
def rss_at_start(bench: Bench) -> None:
    bench_rss_start.append(bench.status()["rss_bytes"])

