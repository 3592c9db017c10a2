"""End-to-end smoke tests: real runc + CRIU (>= 4.0) checkpoint/restore of a
Python workload built with :func:`cudahook.sim.bundle.make_bundle`.

Skipped unless running as root with ``runc`` and a CRIU >= 4.0 (on PATH or
``/opt/cudahook/criu/bin/criu``; see ``scripts/provision-criu.sh``).

The workload (inside the container) increments a counter every 50 ms and writes
it atomically to ``/data/counter`` (a bind-mounted host dir), runs a thread named
``cuda0123456789a`` (``prctl(PR_SET_NAME)``) that serves a listening Unix socket
``/tmp/x.sock`` replying ``pong <counter>``, and optionally keeps a connection to
a Unix socket served by the test outside the container (``$CONNECT``).
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import socket
import subprocess
import threading
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from cudahook.sim.bundle import find_criu, make_bundle

from .outcomes import process_tree, still_alive

THREAD_NAME = "cuda0123456789a"

WORKLOAD = r"""
import ctypes, os, socket, threading, time

n = 0
libc = ctypes.CDLL(None, use_errno=True)

def serve():
    if libc.prctl(15, b"cuda0123456789a", 0, 0, 0) != 0:  # PR_SET_NAME
        os._exit(3)
    srv = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    srv.bind("/tmp/x.sock")
    srv.listen(8)
    while True:
        conn, _ = srv.accept()
        with conn:
            conn.sendall(b"pong %d\n" % n)

threading.Thread(target=serve, daemon=True).start()

peer = None
if os.environ.get("CONNECT"):
    peer = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    peer.connect(os.environ["CONNECT"])

while True:
    n += 1
    fd = os.open("/data/counter.tmp", os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    os.write(fd, b"%d\n" % n)
    os.close(fd)
    os.rename("/data/counter.tmp", "/data/counter")
    time.sleep(0.05)
"""

CRIU = find_criu()
RUNC = shutil.which("runc")

pytestmark = [
    pytest.mark.e2e,
    pytest.mark.skipif(os.geteuid() != 0, reason="needs root"),
    pytest.mark.skipif(RUNC is None, reason="runc not found"),
    pytest.mark.skipif(CRIU is None, reason="criu >= 4.0 not found (scripts/provision-criu.sh)"),
]


def wait_for(pred, timeout: float = 10.0, interval: float = 0.05, what: str = "condition"):
    deadline = time.monotonic() + timeout
    while True:
        value = pred()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout}s waiting for {what}")
        time.sleep(interval)


def tail(path: Path, n: int = 25) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-n:])
    except OSError as exc:
        return f"<{path}: {exc}>"


@dataclass
class Runc:
    """runc with a private --root, an explicit --criu and a --log file."""

    root: Path
    log: Path
    criu: str
    ids: list[str] = field(default_factory=list)

    def cmd(self, *args: str) -> list[str]:
        assert RUNC is not None
        return [RUNC, "--root", str(self.root), "--log", str(self.log), "--criu", self.criu, *args]

    def run(self, *args: str, timeout: float = 30) -> subprocess.CompletedProcess[str]:
        """A command that leaves nothing behind holding its stdio: capture output."""
        return subprocess.run(
            self.cmd(*args),
            check=False,
            stdin=subprocess.DEVNULL,
            capture_output=True,
            text=True,
            timeout=timeout,
        )

    def detached(self, *args: str, timeout: float = 30) -> None:
        """`run -d` / `restore -d`: the container inherits runc's stdio, so it
        must be /dev/null (a pipe would also keep subprocess waiting for EOF)."""
        rc = subprocess.run(
            self.cmd(*args),
            check=False,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            timeout=timeout,
        ).returncode
        assert rc == 0, f"runc {' '.join(args)} failed ({rc}); runc log:\n{tail(self.log)}"

    def start(self, bundle: Path, cid: str) -> int:
        self.ids.append(cid)
        self.detached("run", "-d", "--bundle", str(bundle), cid)
        return self.pid(cid)

    def restore(self, bundle: Path, cid: str, images: Path, work: Path) -> int:
        self.ids.append(cid)
        try:
            self.detached(
                "restore", "-d", "--bundle", str(bundle), "--image-path", str(images),
                "--work-path", str(work), cid,
            )  # fmt: skip
        except AssertionError as exc:
            raise AssertionError(f"{exc}\nrestore.log:\n{tail(work / 'restore.log')}") from None
        return self.pid(cid)

    def checkpoint(self, cid: str, images: Path, work: Path, *extra: str) -> subprocess.CompletedProcess[str]:
        return self.run(
            "checkpoint", "--image-path", str(images), "--work-path", str(work), *extra, cid, timeout=60
        )

    def state(self, cid: str) -> dict | None:
        res = self.run("state", cid)
        return json.loads(res.stdout) if res.returncode == 0 else None

    def pid(self, cid: str) -> int:
        st = self.state(cid)
        assert st is not None and st["status"] == "running", f"{cid} not running: {st}"
        return int(st["pid"])

    def cleanup(self) -> None:
        for cid in reversed(dict.fromkeys(self.ids)):
            self.run("kill", cid, "KILL")
            self.run("delete", "-f", cid)


@pytest.fixture
def runc(tmp_path: Path) -> Iterator[Runc]:
    assert CRIU is not None
    r = Runc(root=tmp_path / "runc-root", log=tmp_path / "runc.log", criu=str(CRIU))
    try:
        yield r
    finally:
        r.cleanup()


@pytest.fixture
def cid() -> str:
    return f"cudahook-smoke-{uuid.uuid4().hex[:12]}"


@pytest.fixture
def data_dir(tmp_path: Path) -> Path:
    d = tmp_path / "data"
    d.mkdir()
    return d


def build(tmp_path: Path, data_dir: Path, extra_binds=(), env_extra=()) -> Path:
    return make_bundle(
        tmp_path / "bundle",
        ["/usr/bin/python3", "-I", "-c", WORKLOAD],
        env=["PATH=/usr/sbin:/usr/bin:/sbin:/bin", *env_extra],
        binds=[(str(data_dir), "/data", False), *extra_binds],
    )


def counter(data_dir: Path) -> int:
    try:
        return int((data_dir / "counter").read_text())
    except (OSError, ValueError):
        return 0


def thread_names(pid: int) -> set[str]:
    names = set()
    for comm in Path(f"/proc/{pid}/task").glob("*/comm"):
        with contextlib.suppress(OSError):
            names.add(comm.read_text().strip())
    return names


def ping(pid: int) -> int:
    """Connect to the container's /tmp/x.sock through /proc/PID/root; return the counter it reports."""
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
        s.settimeout(5)
        s.connect(f"/proc/{pid}/root/tmp/x.sock")
        data = b""
        while chunk := s.recv(64):  # read to EOF: the server closed its side
            data += chunk
    word, num = data.split()
    assert word == b"pong"
    return int(num)


def wait_ready(data_dir: Path, pid: int, minimum: int = 5) -> None:
    wait_for(lambda: counter(data_dir) >= minimum, what=f"counter >= {minimum}")
    wait_for(lambda: THREAD_NAME in thread_names(pid), what=f"thread {THREAD_NAME}")
    wait_for(lambda: os.path.exists(f"/proc/{pid}/root/tmp/x.sock"), what="/tmp/x.sock")


def assert_counter_moves(data_dir: Path, since: int, what: str) -> int:
    return wait_for(lambda: (c := counter(data_dir)) > since and c, timeout=5, what=what)


def test_checkpoint_restore_keeps_state(tmp_path: Path, runc: Runc, cid: str, data_dir: Path) -> None:
    bundle = build(tmp_path, data_dir)
    pid = runc.start(bundle, cid)
    wait_ready(data_dir, pid, minimum=10)
    assert ping(pid) >= 10

    images, work = tmp_path / "img", tmp_path / "work-dump"
    tree = process_tree(pid)
    res = runc.checkpoint(cid, images, work)
    assert res.returncode == 0, f"checkpoint failed: {res.stderr}\ndump.log:\n{tail(work / 'dump.log')}"
    assert (images / "inventory.img").is_file()
    st = runc.state(cid)
    assert st is None or st["status"] != "running", st

    # Nothing runs on from the checkpoint: every process of it is gone.
    assert not still_alive(tree), f"still running after checkpoint: {still_alive(tree)}"
    frozen = counter(data_dir)
    assert frozen >= 10

    new_pid = runc.restore(bundle, cid, images, tmp_path / "work-restore")
    seen = [counter(data_dir)]
    deadline = time.monotonic() + 2
    while time.monotonic() < deadline:
        seen.append(counter(data_dir))
        time.sleep(0.02)
    # Continued from the checkpointed value: never reset, strictly moving on.
    assert min(seen) >= frozen, f"counter went back: frozen={frozen} seen={seen}"
    assert seen == sorted(seen), seen
    assert max(seen) > frozen, f"counter stuck at {frozen} after restore"
    assert max(seen) <= frozen + 60, f"implausible jump: frozen={frozen} seen={seen}"

    assert THREAD_NAME in thread_names(new_pid), thread_names(new_pid)
    assert ping(new_pid) >= frozen  # the listening socket survived and is served
    comm = Path(f"/proc/{new_pid}/comm").read_text().strip()
    assert comm.startswith("python3"), comm


def test_checkpoint_leave_running(tmp_path: Path, runc: Runc, cid: str, data_dir: Path) -> None:
    bundle = build(tmp_path, data_dir)
    pid = runc.start(bundle, cid)
    wait_ready(data_dir, pid)

    before = counter(data_dir)
    images, work = tmp_path / "img", tmp_path / "work-dump"
    res = runc.checkpoint(cid, images, work, "--leave-running")
    assert res.returncode == 0, f"checkpoint failed: {res.stderr}\ndump.log:\n{tail(work / 'dump.log')}"
    after = counter(data_dir)
    assert runc.pid(cid) == pid
    assert THREAD_NAME in thread_names(pid)
    assert_counter_moves(data_dir, after, "counter to move after --leave-running")
    assert ping(pid) > before

    # Let the original run on, then replace it with the image: the restored
    # counter resumes from the checkpoint, below what the original reached.
    last = wait_for(lambda: (c := counter(data_dir)) >= after + 20 and c, what="original to run on")
    runc.run("kill", cid, "KILL")
    wait_for(lambda: (runc.state(cid) or {}).get("status") != "running", what="original to stop")
    assert runc.run("delete", "-f", cid).returncode == 0
    last = max(last, counter(data_dir))

    new_pid = runc.restore(bundle, cid, images, tmp_path / "work-restore")
    first = wait_for(lambda: (c := counter(data_dir)) != last and c, timeout=5, what="restored write")
    # first visible value: the checkpointed n (if frozen between increment and
    # rename) or n + 1; the image was taken while the file showed before..after.
    assert before <= first <= after + 1, f"restored at {first}, expected {before}..{after + 1} (last={last})"
    assert THREAD_NAME in thread_names(new_pid)
    assert ping(new_pid) >= before


class PeerServer:
    """A Unix socket server outside the container (like a GPU service)."""

    def __init__(self, path: Path) -> None:
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.sock.bind(str(path))
        self.sock.listen(4)
        self.sock.settimeout(0.2)
        self.conns: list[socket.socket] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._serve, daemon=True)
        self._thread.start()

    def _serve(self) -> None:
        while not self._stop.is_set():
            try:
                conn, _ = self.sock.accept()
            except TimeoutError:
                continue
            except OSError:
                return
            self.conns.append(conn)

    def close(self) -> None:
        self._stop.set()
        self._thread.join(2)
        for c in self.conns:
            c.close()
        self.sock.close()


def test_external_unix_socket_blocks_checkpoint(tmp_path: Path, runc: Runc, cid: str, data_dir: Path) -> None:
    gpu_dir = tmp_path / "gpu"
    gpu_dir.mkdir()
    server = PeerServer(gpu_dir / "sim.sock")
    try:
        bundle = build(
            tmp_path,
            data_dir,
            extra_binds=[(str(gpu_dir), "/gpu", False)],
            env_extra=["CONNECT=/gpu/sim.sock"],
        )
        pid = runc.start(bundle, cid)
        wait_ready(data_dir, pid)
        wait_for(lambda: server.conns, what="container to connect to the peer")

        work = tmp_path / "work-dump"
        res = runc.checkpoint(cid, tmp_path / "img", work)
        assert res.returncode != 0, "checkpoint must refuse a connected external Unix socket"
        log = (work / "dump.log").read_text(errors="replace")
        assert "unix: External socket is used. Consider using --ext-unix-sk option." in log, tail(
            work / "dump.log"
        )

        # The failed dump resumed the container: same process, still counting.
        assert runc.pid(cid) == pid
        assert_counter_moves(data_dir, counter(data_dir), "counter to move after the failed dump")
        assert THREAD_NAME in thread_names(pid)
        assert ping(pid) > 0
    finally:
        server.close()
