"""The node agent as its clients reach it (core/agent.py is the agent):
its socket and pid file, the peer check, one control request, a session
with a warm worker, and starting it detached.

Apart from the agent so that the driver-API backend, which the agent's
workers run, can be its client without the two importing each other.
"""

from __future__ import annotations

import json
import os
import socket
import struct
import time

# typing costs milliseconds at every hook start: annotations only.
TYPE_CHECKING = False
if TYPE_CHECKING:
    from typing import Any

    from cudahook.platform.config import Settings

SOCKET = "agent.sock"
PIDFILE = "agent.pid"
LOCKFILE = "agent.lock"
# The agent's exit status when another agent holds LOCKFILE: the unit must not
# restart on it, or systemd retries forever beside an agent a hook started.
EXIT_ANOTHER_AGENT = 3
# The calls a worker serves, and the fields of a call passed on to it.
OPS = ("get-state", "get-restore-tid", "lock", "checkpoint", "restore", "unlock",
       "storage-checkpoint", "storage-restore")
# A storage call's directory, chunk size, zstd level, dedupe switch and a
# restore's `checked` (its chunks just verified by the caller) go through as
# the helper checks them (driver_helper.Driver.call).
FIELDS = ("op", "pid", "timeout_ms", "pairs", "dir", "chunk", "zstd", "dedupe", "checked")
# Past a call's deadline the agent answers "lost" first; the client's own
# deadline comes this much later (it only fires for an agent that hangs).
CLIENT_GRACE_S = 1.0
HELLO_MAX = 64 << 10
VERSION_MAX = 4096


def socket_path(settings: Settings) -> str:
    return os.path.join(settings.state_dir, SOCKET)


def pid_path(settings: Settings) -> str:
    return os.path.join(settings.state_dir, PIDFILE)


def peer_of(sock: socket.socket) -> tuple[int, int, int]:
    """(pid, uid, gid) of the process at the other end, from the kernel."""
    raw = sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i"))
    pid, uid, gid = struct.unpack("3i", raw)
    return pid, uid, gid


def trusted_uid(uid: int) -> bool:
    """Root, or the agent's own user (an agent a test runs unprivileged)."""
    return uid in (0, os.geteuid())


def _send(sock: socket.socket, msg: dict[str, Any]) -> None:
    sock.sendall((json.dumps(msg) + "\n").encode())


def _read_line(sock: socket.socket, deadline: float) -> bytes:
    """One line, at most HELLO_MAX bytes, before `deadline` (monotonic)."""
    buf = b""
    while b"\n" not in buf:
        left = deadline - time.monotonic()
        if left <= 0:
            raise TimeoutError("no line in time")
        sock.settimeout(left)
        chunk = sock.recv(4096)
        if not chunk:
            raise ConnectionError("closed before a line")
        buf += chunk
        if len(buf) > HELLO_MAX:
            raise ValueError("line too long")
    return buf


def _connect(settings: Settings, timeout: float) -> socket.socket | None:
    """A connection to this node's agent, its peer checked; None when none answers."""
    path = socket_path(settings)
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM | socket.SOCK_CLOEXEC)
    try:
        sock.settimeout(timeout)
        sock.connect(path)
        if not trusted_uid(peer_of(sock)[1]):
            raise PermissionError(f"{path}: served by an untrusted uid")
        return sock
    except OSError:
        sock.close()
        return None


def ask(settings: Settings, control: dict[str, Any], timeout: float) -> dict[str, Any] | None:
    """One control request (status, end-calls) and its answer; None when no
    agent answers within `timeout`."""
    sock = _connect(settings, min(timeout, 1.0))
    if sock is None:
        return None
    try:
        _send(sock, {"control": control})
        reply = json.loads(_read_line(sock, time.monotonic() + timeout))
        return reply if isinstance(reply, dict) else None
    except (OSError, ValueError):
        return None
    finally:
        sock.close()


def end_calls(settings: Settings, name: str, wait_s: float) -> list[int]:
    """Have this node's agent end every driver call of the run `name` and
    wait until none is left (platform/tools.py end_calls' counterpart): the
    worker PIDs still alive after wait_s - [] when all ended or no agent is
    up. An agent that is up but does not answer may hold calls of the run:
    its own PID is returned then, so that the workload is reported unsafe
    rather than read while a call may still change it."""
    if not os.path.exists(socket_path(settings)):
        return []
    reply = ask(settings, {"op": "end-calls", "calls_of": name, "wait_s": wait_s},
                wait_s + 5.0)
    if reply is not None:
        stuck = reply.get("stuck")
        return [p for p in stuck if type(p) is int] if isinstance(stuck, list) else []
    pid = running_pid(settings)
    return [pid] if pid else []


def running_pid(settings: Settings) -> int | None:
    """The PID of the agent the pid file names, when that process lives."""
    from pathlib import Path

    from cudahook.platform.store import process_alive, read_json

    data = read_json(Path(pid_path(settings)))
    if isinstance(data, dict) and process_alive(data.get("pid"), data.get("start")):
        return int(data["pid"])
    return None


def status(settings: Settings, timeout: float = 5.0) -> dict[str, Any] | None:
    return ask(settings, {"op": "status"}, timeout)


def open_session(settings: Settings, timeout: float, container: str | None,
                 link_type: Any) -> Any:
    """A `link_type` (the driver-API backend's AgentLink, which reads the
    worker's hello) to a warm worker of this node's agent, or None (no
    agent, no answer in `timeout`, refused, cold): then the caller attaches
    itself, as without an agent. `container`: the container the calls are
    for, when the caller knows it (the run's name says which CRIU run)."""
    deadline = time.monotonic() + timeout  # for the connect and the hello together
    sock = _connect(settings, timeout)
    if sock is None:
        return None
    from cudahook.platform.host import Host
    from cudahook.platform.tools import CALLS_ENV

    me = os.getpid()
    hello = {"hook": [me, Host().start_time(me)], "container": container,
             "calls_of": os.environ.get(CALLS_ENV)}
    try:
        _send(sock, {"hello": hello})
        link = link_type(sock, max(deadline - time.monotonic(), 0.001))
    except (OSError, TimeoutError):
        sock.close()
        return None
    if not link.hello.get("ready"):
        link.close()
        return None
    return link


def start_detached(settings: Settings) -> Any:
    """Start this node's agent in a session of its own, outliving the caller:
    not bound to it and not carrying its calls' name (the agent's calls
    belong to no one run). A second agent exits at once (its lock file)."""
    import subprocess
    import sys

    from cudahook.platform.tools import calls_env

    return subprocess.Popen(
        [sys.executable, "-I", "-m", "cudahook.core.agent", "--settings-json",
         json.dumps(settings.as_dict())],
        stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
        start_new_session=True, close_fds=True, env=calls_env(),
    )
