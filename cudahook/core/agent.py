"""The node agent: driver calls served warm, so that no driver attach (cuInit,
seconds on real nodes) sits on a checkpoint's or a restore's critical path.

One long-lived process per node (`cudahook agent start`, or
`python -m cudahook.core.agent`) keeps driver workers attached ahead of
time and serves the hooks' driver-API calls over a Unix socket in the
state directory, with the driver helper's own line protocol
(backends/driver_helper.py). It is conservative by construction:

- Off unless it is up. The driver-API backend tries the socket with a short
  deadline (`agent_connect_ms`); no socket, no answer in time, a refusal, or
  no worker attached yet ("cold") and the phase uses its own helper, as
  without an agent. Once an agent session failed, the rest of the phase
  (its rollback) runs in a fresh per-phase helper.
- A worker is a driver helper process (one attach each), started by the
  agent before any hook needs it. Each hook session gets a worker of its
  own: the sessions of several containers run in parallel, and a call that
  hangs costs its own session's worker (killed at the call's deadline, as
  the hook kills its helper), never the agent or another container's calls.
  A worker whose session ended cleanly goes back to the pool, still
  attached. The driver has no abort call: ending the process that makes a
  call is the only way to end the call, hence processes, not threads.
- Trust: the socket is 0600 in the private state directory, and every peer
  is checked with SO_PEERCRED (uid 0 or the agent's own); the session's
  hello names the calling hook (PID and start time, which must be the peer
  itself), its container and its run (`CUDAHOOK_CALLS_OF`, platform/tools.py).
  Each call names its one target PID and only its known fields are passed on.
- No driver call outlives its phase: a session whose hook went away with a
  call in flight has its worker killed and reaped; the guardian and the
  restore watcher ask the agent to end the calls of a run (`end_calls`) and
  wait for that, as they end per-call processes by name.
- A changed driver (`driver_version_file`) makes the agent refuse new
  sessions, end the calls of the old driver's sessions, and re-execute
  itself before serving another call. `agent_idle_s` > 0: it exits after
  that long without a session.
- Workers are bound to the agent (platform/tools.py `spawn`): an agent that
  dies takes its workers with it; its clients see their channel end, as
  for a helper that died.
"""

from __future__ import annotations

import contextlib
import json
import os
import socket
import time

from cudahook.core.agent_client import (  # noqa: F401 - the agent's names, for its callers
    CLIENT_GRACE_S,
    EXIT_ANOTHER_AGENT,
    FIELDS,
    HELLO_MAX,
    LOCKFILE,
    OPS,
    PIDFILE,
    SOCKET,
    VERSION_MAX,
    _connect,
    _read_line,
    _send,
    ask,
    end_calls,
    open_session,
    peer_of,
    pid_path,
    running_pid,
    socket_path,
    start_detached,
    status,
    trusted_uid,
)
from cudahook.platform.ids import PID_MAX_LIMIT

# typing costs milliseconds at every hook start: annotations only.
TYPE_CHECKING = False
if TYPE_CHECKING:
    from typing import Any

    from cudahook.core.backends.driver_api import _Helper
    from cudahook.platform.config import Settings


# -- the agent process -----------------------------------------------------------

# The socket is an input surface (peers are root, but still parsed): every
# line is bounded, a request's fields are checked before a worker sees them,
# and any line that is not a request gets one error line back.
LINE_MAX = HELLO_MAX  # a call is some 100 bytes, a restore's GPU pairs a few KiB
MAX_CONNECTIONS = 256  # served at once (each is a thread); past it, refused
# The whole first line must come within this, however slowly it trickles in:
# a sender of a byte now and then would otherwise hold a connection (of the
# 256) for as long as it likes.
HELLO_S = 5.0
LOCK_TIMEOUT_MAX_MS = 3_600_000  # the driver's lock wait, at most an hour
PAIRS_MAX = 64  # GPU pairs of one restore
HEX_UUID = frozenset("0123456789abcdefABCDEF")


def bad_call(call: dict[str, Any]) -> str | None:
    """What is wrong with a call's fields (FIELDS), or None: a worker gets
    only a known op, one real target PID and well-typed arguments."""
    if call.get("op") not in OPS or type(call.get("pid")) is not int \
            or not 0 < call["pid"] <= PID_MAX_LIMIT:
        return "a call names one op and one target pid"
    timeout = call.get("timeout_ms", 0)
    if type(timeout) is not int or not 0 <= timeout <= LOCK_TIMEOUT_MAX_MS:
        return f"timeout_ms is a whole number of milliseconds up to {LOCK_TIMEOUT_MAX_MS}"
    pairs = call.get("pairs", [])
    if not (isinstance(pairs, list) and len(pairs) <= PAIRS_MAX and all(
            isinstance(p, list) and len(p) == 2 and all(
                isinstance(u, str) and len(u) == 32 and set(u) <= HEX_UUID for u in p)
            for p in pairs)):
        return f"pairs is a list of at most {PAIRS_MAX} [old, new] GPU UUIDs in hex"
    return None


def _refusal(stage: str, error: str) -> dict[str, Any]:
    return {"ready": False, "stage": stage, "error": error[:200]}


def _bad_request(error: str) -> dict[str, Any]:
    return {"id": None, "ok": False, "code": 1, "name": "bad request", "error": error[:200]}


def _first_line(conn: socket.socket, reader: Any) -> bytes:
    """The connection's first line, whole within HELLO_S of now: past it the
    reading side is shut, so the read ends whatever the peer still sends."""
    import threading

    conn.settimeout(HELLO_S)
    timer = threading.Timer(HELLO_S, _shut_reading, (conn,))
    timer.daemon = True
    timer.start()
    try:
        line = reader.readline(HELLO_MAX)
    finally:
        timer.cancel()
    if not line.endswith(b"\n"):
        raise ValueError(f"no hello line within {HELLO_S:g} s "
                         f"(a line of at most {HELLO_MAX} bytes)")
    return line


def _shut_reading(conn: socket.socket) -> None:
    with contextlib.suppress(OSError):
        conn.shutdown(socket.SHUT_RD)


def rss_bytes(pid: int) -> int:
    """A process's resident memory (VmRSS), 0 when it is gone."""
    from cudahook.platform.host import Host
    from cudahook.platform.procfs import ProcessGone

    try:
        return int(Host().status(pid).get("VmRSS", "0 kB").split()[0]) << 10
    except (OSError, ProcessGone, ValueError, IndexError):
        return 0


class _Session:
    """One hook's phase: its worker and its calls in flight."""

    def __init__(self, worker: _Helper, hook: list[int], container: Any, calls_of: Any,
                 conn: socket.socket):
        self.worker = worker
        self.conn = conn
        self.hook = hook
        self.container = container if isinstance(container, str) else None
        self.calls_of = calls_of if isinstance(calls_of, str) else None
        self.in_flight = 0


class Agent:
    def __init__(self, settings: Settings, spare: int = 2, max_idle: int = 8):
        import threading

        self.settings = settings
        self.spare = max(1, spare)
        self.max_idle = max(self.spare, max_idle)
        self.lock = threading.Lock()
        self.idle: list[_Helper] = []
        self.warming = 0
        self.sessions: set[_Session] = set()
        self.version = self._read_version()
        self.restarting = False
        self.stopping = False
        self.last_active = time.monotonic()
        self.served = 0
        self.calls = 0
        self.connections = 0
        self.changed = threading.Event()  # sessions ended: the metrics are due
        self.publishing = threading.Lock()
        self.listener: socket.socket | None = None

    # -- the driver and its workers ------------------------------------------------

    def _read_version(self) -> bytes | None:
        try:
            with open(self.settings.driver_version_file, "rb") as f:
                return f.read(VERSION_MAX)
        except OSError:
            return None

    def driver_changed(self) -> bool:
        """Whether the driver changed since this agent started; from then on
        it serves nothing more and restarts."""
        if not self.restarting and self._read_version() != self.version:
            self.restarting = True
        return self.restarting

    def _start_worker(self) -> _Helper | None:
        import sys

        from cudahook.core.backends.driver_api import _Helper

        try:
            worker = _Helper(sys.executable, self.settings.libcuda, self.settings.call_timeout_s)
        except (OSError, TimeoutError):
            return None
        if not worker.hello.get("ready") or worker.dead:
            worker.kill("not ready")
            return None
        return worker

    def _warm(self) -> None:
        """Start workers in the background until `spare` are idle or warming."""
        import threading

        with self.lock:
            if self.restarting or self.stopping:
                return
            need = self.spare - len(self.idle) - self.warming
            self.warming += max(0, need)
        for _ in range(max(0, need)):
            threading.Thread(target=self._warm_one, daemon=True).start()

    def _warm_one(self) -> None:
        worker = self._start_worker()
        with self.lock:
            self.warming -= 1
            if worker is not None and not (self.restarting or self.stopping):
                self.idle.append(worker)
                worker = None
        if worker is not None:
            worker.kill("not needed")

    def _take_worker(self) -> _Helper | None:
        with self.lock:
            while self.idle:
                worker = self.idle.pop()
                # One killed while idle may not be marked dead yet: its exit says.
                if not worker.dead and worker.proc.poll() is None:
                    break
            else:
                worker = None
            empty = not self.idle
        # A replacement starts (a process start and an attach: CPU beside the
        # phase) only when no worker is left for the next session; a worker
        # whose session ends cleanly comes back to the pool.
        if empty:
            self._warm()
        return worker

    def _give_back(self, worker: _Helper) -> None:
        with self.lock:
            if not worker.dead and not self.restarting and not self.stopping \
                    and len(self.idle) < self.max_idle:
                self.idle.append(worker)
                return
        worker.kill("not needed")

    # -- sessions ------------------------------------------------------------------

    def handle(self, conn: socket.socket) -> None:
        with self.lock:
            self.connections += 1
            full = self.connections > MAX_CONNECTIONS
        try:
            if full:
                _send(conn, _refusal("busy", f"more than {MAX_CONNECTIONS} connections at once"))
            else:
                self._handle(conn)
        except (ValueError, TimeoutError, RecursionError) as exc:
            # A first line that is no hello (nor control): one line says why.
            with contextlib.suppress(OSError):
                _send(conn, _refusal("refused", f"bad hello: {type(exc).__name__}: {exc}"))
        except OSError:
            pass
        except Exception as exc:  # a fault here costs this connection, said, never the agent
            self._log("agent", error=f"serving a connection: {type(exc).__name__}: {exc}"[:300])
            with contextlib.suppress(OSError):
                _send(conn, _refusal("error", f"the agent failed: {type(exc).__name__}"))
        finally:
            with self.lock:
                self.connections -= 1
            conn.close()

    def _handle(self, conn: socket.socket) -> None:
        pid, uid, _ = peer_of(conn)
        if not trusted_uid(uid):
            _send(conn, {"ready": False, "stage": "refused",
                         "error": f"peer uid {uid} is not trusted"})
            self._log("agent", error=f"refused a connection from pid {pid}, uid {uid}")
            return
        # One reader for the hello and the calls after it: nothing the client
        # sent past the hello is lost in a buffer of its own.
        reader = conn.makefile("rb")
        line = _first_line(conn, reader)
        first = json.loads(line)
        if not isinstance(first, dict):
            raise ValueError("not an object")
        if isinstance(first.get("control"), dict):
            _send(conn, self._control(first["control"]))
            return
        hello = first.get("hello")
        if not isinstance(hello, dict):
            raise ValueError("no hello")
        refusal = self._check_hello(hello, pid)
        if refusal:
            _send(conn, {"ready": False, "stage": "refused", "error": refusal})
            return
        if self.driver_changed() or self.stopping:
            _send(conn, {"ready": False, "stage": "restart",
                         "error": "the driver changed: restarting"})
            return
        worker = self._take_worker()
        if worker is None:
            # Answer at once: the hook attaches itself, never later than today.
            _send(conn, {"ready": False, "stage": "cold", "error": "no worker attached yet"})
            return
        session = _Session(worker, hello["hook"], hello.get("container"), hello.get("calls_of"),
                           conn)
        with self.lock:
            self.sessions.add(session)
            self.served += 1
        try:
            self._serve(conn, reader, session)
        finally:
            self._end_session(session)

    def _check_hello(self, hello: dict[str, Any], peer_pid: int) -> str | None:
        from cudahook.platform.host import Host

        hook = hello.get("hook")
        if not (isinstance(hook, list) and len(hook) == 2 and all(type(x) is int for x in hook)):
            return "the hello names no hook [pid, start time]"
        if hook[0] != peer_pid:
            return f"the hello names pid {hook[0]}, the caller is pid {peer_pid}"
        if not Host().alive(hook[0], hook[1]):
            return f"pid {hook[0]} with start time {hook[1]} is not the caller"
        for key in ("container", "calls_of"):
            value = hello.get(key)
            if value is not None and not (isinstance(value, str) and len(value) <= 1024):
                return f"bad {key}"
        return None

    def _serve(self, conn: socket.socket, reader: Any, session: _Session) -> None:
        import threading

        from cudahook.core.backends.driver_helper import serve_lines

        conn.settimeout(None)
        out_lock = threading.Lock()

        def say(msg: dict[str, Any]) -> None:
            with out_lock, contextlib.suppress(OSError):
                _send(conn, msg)

        def lost(ident: Any, why: str) -> dict[str, Any]:
            # Ends the session: the client takes it as a helper that died.
            say({"id": ident, "lost": why})
            with contextlib.suppress(OSError):
                conn.shutdown(socket.SHUT_RDWR)
            return None  # type: ignore[return-value]

        def handle(req: dict[str, Any]) -> dict[str, Any] | None:
            ident = req.get("id")
            call = {k: req[k] for k in FIELDS if k in req}
            wrong = bad_call(call) or (None if type(ident) is int else "a call has an integer id")
            if wrong:
                return {**_bad_request(wrong), "id": ident if type(ident) is int else None}
            if self.driver_changed():
                return lost(ident, "the driver changed under the agent")
            deadline = self.settings.call_timeout_s
            if call["op"] == "lock" and type(call.get("timeout_ms")) is int:
                deadline += call["timeout_ms"] / 1000
            asked = req.get("deadline_s")
            if isinstance(asked, (int, float)) and 0 < asked < deadline:
                deadline = float(asked)
            with self.lock:
                session.in_flight += 1
                self.calls += 1
            try:
                reply = session.worker.call(call, deadline)
            finally:
                with self.lock:
                    session.in_flight -= 1
            if reply is None:
                return lost(ident, session.worker.dead or "the driver worker exited")
            return {**reply, "id": ident}

        say({**session.worker.hello, "agent": os.getpid()})
        serve_lines(self._requests(reader, say), handle, say)

    @staticmethod
    def _requests(reader: Any, say: Any) -> Any:
        """The session's lines that are JSON objects, each at most LINE_MAX
        bytes; any other line is answered with one error. An over-long line
        ends the session: what follows it cannot be told from a request."""
        while True:
            line = reader.readline(LINE_MAX)
            if not line:
                return
            if len(line) >= LINE_MAX and not line.endswith(b"\n"):
                say(_bad_request(f"a line longer than {LINE_MAX} bytes: the session ends"))
                return
            try:
                req = json.loads(line)
            except (ValueError, RecursionError) as exc:
                say(_bad_request(f"not JSON: {type(exc).__name__}"))
                continue
            if isinstance(req, dict):
                yield line
            else:
                say(_bad_request(f"a request is a JSON object, not {type(req).__name__}"))

    def _end_session(self, session: _Session) -> None:
        """The hook closed its end (or went away). A call still in flight is
        abandoned with its worker, killed and reaped before the session is
        forgotten: nothing is left in the driver behind the guardian's back."""
        with self.lock:
            busy = session.in_flight > 0
        if busy or session.worker.dead:
            session.worker.kill("the hook left with a call in flight")
        else:
            self._give_back(session.worker)
        with self.lock:
            self.sessions.discard(session)
            self.last_active = time.monotonic()
        self.changed.set()
        self._warm()  # a worker lost with the session is replaced

    # -- control -------------------------------------------------------------------

    def stats(self) -> dict[str, Any]:
        """What the agent holds and has served: its status, its metrics."""
        from cudahook.core.backends.base import parse_nvrm
        from cudahook.platform.host import Host

        version = parse_nvrm((self.version or b"").decode(errors="replace")) or ""
        with self.lock:
            workers = [w.proc.pid for w in self.idle] + [s.worker.proc.pid for s in self.sessions]
        workers_rss = sum(rss_bytes(p) for p in workers)
        me = os.getpid()
        with self.lock:
            return {"ok": True, "pid": me, "start": Host().start_time(me), "version": version,
                    "calls": self.calls, "connections": self.connections,
                    "rss_bytes": rss_bytes(me), "workers_rss_bytes": workers_rss,
                    "sessions": len(self.sessions),
                    "in_flight": sum(s.in_flight for s in self.sessions),
                    "idle_workers": len(self.idle), "warming": self.warming,
                    "busy_worker_pids": sorted(s.worker.proc.pid for s in self.sessions),
                    "sessions_of": sorted([s.calls_of or "", s.container or "", *s.hook]
                                          for s in self.sessions),
                    "served": self.served, "restarting": self.restarting}

    def _publish(self) -> None:
        """The agent's numbers into the metrics file: about a second after
        sessions ended, and every AGENT_REFRESH_S anyway (a hook's write in
        between reads whether the agent lives)."""
        from cudahook.platform import metrics

        while True:
            with self.publishing:  # never after the last write, _shutdown's
                if self.stopping:
                    return
                metrics.update_agent(self.settings, self.stats())
            time.sleep(1.0)
            self.changed.wait(metrics.AGENT_REFRESH_S)
            self.changed.clear()

    def _control(self, control: dict[str, Any]) -> dict[str, Any]:
        op = control.get("op")
        if op == "status":
            return self.stats()
        if op == "end-calls":
            name = control.get("calls_of")
            wait_s = control.get("wait_s")
            if not isinstance(name, str) or not isinstance(wait_s, (int, float)):
                return {"ok": False, "error": "end-calls needs calls_of and wait_s"}
            return {"ok": True, "stuck": self.end_calls(name, float(wait_s))}
        return {"ok": False, "error": f"unknown control {op!r:.80}"}

    def end_calls(self, name: str, wait_s: float) -> list[int]:
        """Kill the worker of every session of run `name` (its calls with
        it) and wait until each is gone; the PIDs still alive after wait_s."""
        import signal

        with self.lock:
            mine = [s for s in self.sessions if s.calls_of == name]
        for s in mine:
            s.worker.dead = s.worker.dead or f"the calls of {name} were ended"
            with contextlib.suppress(ProcessLookupError):
                os.killpg(s.worker.proc.pid, signal.SIGKILL)
            with contextlib.suppress(OSError):  # the session ends too, idle or not
                s.conn.shutdown(socket.SHUT_RDWR)
        deadline = time.monotonic() + wait_s
        while True:
            left = [s.worker.proc.pid for s in mine if s.worker.proc.poll() is None]
            with self.lock:
                closing = any(s in self.sessions for s in mine)  # its calls answered yet
            if not (left or closing) or time.monotonic() >= deadline:
                if mine:
                    self._log("agent", ended_calls_of=name, stuck=left)
                return left
            time.sleep(0.02)

    # -- the process ---------------------------------------------------------------

    def _log(self, event: str, **fields: object) -> None:
        from cudahook.platform.eventlog import log

        with contextlib.suppress(Exception):  # the log must never take the agent down
            log(self.settings.log_file, event, **fields)  # type: ignore[arg-type]

    def run(self) -> int:
        """Serve until stopped (SIGTERM), idle past agent_idle_s, or the
        driver changed (then re-execute); the exit status."""
        import signal
        import threading
        from pathlib import Path

        from cudahook.platform.atomic import write_json_atomic
        from cudahook.platform.host import Host
        from cudahook.platform.privdir import ensure_private_dir
        from cudahook.platform.store import lock_file

        state = ensure_private_dir(Path(self.settings.state_dir))
        lock = lock_file(state / LOCKFILE, wait=False)
        if lock is None:
            print("cudahook-agent: another agent is running on this node")
            return EXIT_ANOTHER_AGENT
        path = socket_path(self.settings)
        with contextlib.suppress(FileNotFoundError):
            os.unlink(path)
        listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM | socket.SOCK_CLOEXEC)
        old = os.umask(0o177)  # 0600 from the start: no window with a wider mode
        try:
            listener.bind(path)
        finally:
            os.umask(old)
        os.chmod(path, 0o600)
        listener.listen(128)
        listener.settimeout(0.2)
        self.listener = listener
        me = os.getpid()
        write_json_atomic(pid_path(self.settings), {"pid": me, "start": Host().start_time(me)})
        signal.signal(signal.SIGTERM, lambda *_: setattr(self, "stopping", True))
        signal.signal(signal.SIGINT, lambda *_: setattr(self, "stopping", True))
        self._log("agent", started=me, socket=path)
        self._warm()
        threading.Thread(target=self._publish, daemon=True).start()
        idle_s = self.settings.agent_idle_s
        why = "stopped"
        while True:
            try:
                conn, _ = listener.accept()
                with self.lock:
                    self.last_active = time.monotonic()
                threading.Thread(target=self.handle, args=(conn,), daemon=True).start()
                continue
            except TimeoutError:
                pass
            with self.lock:
                busy = bool(self.sessions)
                quiet = time.monotonic() - self.last_active
            if self.stopping:
                break
            if self.driver_changed() and not busy:
                why = "restart"
                break
            if idle_s > 0 and not busy and quiet >= idle_s:
                why = f"idle for {idle_s:g}s"
                break
        self._shutdown(listener, path, lock)
        self._log("agent", exited=me, why=why)
        if why == "restart":
            import sys

            os.execv(sys.executable, sys.orig_argv)
        return 0

    def _shutdown(self, listener: socket.socket, path: str, lock: int) -> None:
        """Stop listening, then end: sessions left their calls' deadlines to
        finish (bounded); idle workers are killed."""
        self.stopping = True  # no worker warming now joins the pool
        with contextlib.suppress(OSError):
            os.unlink(path)
        listener.close()
        deadline = time.monotonic() + self.settings.call_timeout_s
        while time.monotonic() < deadline:
            with self.lock:
                if not self.sessions:
                    break
            time.sleep(0.05)
        with self.lock:
            workers = list(self.idle) + [s.worker for s in self.sessions]
            self.idle.clear()
        for w in workers:
            w.kill("the agent exits")
        with contextlib.suppress(OSError):
            os.unlink(pid_path(self.settings))
        from cudahook.platform import metrics

        with self.publishing:
            metrics.update_agent(self.settings, {**self.stats(), "exited": True})
        os.close(lock)


def main(argv: list[str] | None = None) -> int:
    import argparse

    from cudahook.platform.config import Settings, load
    from cudahook.platform.errors import CudahookError, report

    p = argparse.ArgumentParser(prog="cudahook-agent", description=__doc__.split("\n")[0])
    p.add_argument("--config", help="configuration file (default: the node's)")
    p.add_argument("--settings-json", help=argparse.SUPPRESS)  # the settings, as one object
    p.add_argument("--spare", type=int, default=2, help="idle attached workers kept ready")
    args = p.parse_args(argv)
    try:
        settings = Settings(**json.loads(args.settings_json)) if args.settings_json \
            else load(args.config)
        return Agent(settings, spare=args.spare).run()
    except CudahookError as exc:
        return report(exc, prog="cudahook-agent")


if __name__ == "__main__":
    import sys

    sys.exit(main())
