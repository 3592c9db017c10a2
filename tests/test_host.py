from __future__ import annotations

import os
import signal
import time
from pathlib import Path

import pytest

from cudahook.platform.host import Host, ProcessGone


def test_run_captures_output_and_status() -> None:
    r = Host().run(["sh", "-c", "echo out; echo err >&2; exit 3"], timeout=5)
    assert (r.returncode, r.stdout, r.stderr, r.ok) == (3, "out\n", "err\n", False)


def test_deadline_kills_the_whole_process_group(tmp_path) -> None:  # type: ignore[no-untyped-def]
    pidfile = tmp_path / "grandchild"
    t = time.monotonic()
    r = Host().run(["sh", "-c", f"sleep 60 & echo $! > {pidfile}; wait"], timeout=0.5)
    assert r.timed_out and r.returncode is None and not r.ok
    assert time.monotonic() - t < 5
    grandchild = int(pidfile.read_text())
    deadline = time.monotonic() + 2
    while os.path.exists(f"/proc/{grandchild}"):  # reaped by init once killed
        state = Path(f"/proc/{grandchild}/stat").read_text().rsplit(")", 1)[1].split()[0]
        if state == "Z":
            break
        assert time.monotonic() < deadline, "grandchild survived the deadline"
        time.sleep(0.02)


def test_missing_tool_is_reported_not_raised() -> None:
    r = Host().run(["/nonexistent/cuda-checkpoint", "--help"], timeout=5)
    assert r.returncode == 127 and "No such file" in r.stderr


def test_proc_reads() -> None:
    h = Host()
    me = os.getpid()
    assert h.nspid(me) == me
    assert h.ppid(me) == os.getppid()
    assert h.state(me) == "R"
    assert any(tid == me for tid, _ in h.thread_names(me))
    with pytest.raises(ProcessGone):
        h.status(2**22 + 12345)


def test_a_deadline_ends_the_wait_even_when_the_pipes_stay_open(monkeypatch, tmp_path) -> None:  # type: ignore[no-untyped-def]
    """A tool whose helper escaped its process group keeps stdout open after
    the group is killed: the call must still return, soon after the deadline."""
    from cudahook.platform import tools

    monkeypatch.setattr(tools, "KILL_GRACE_S", 0.5)
    started = time.monotonic()
    # setsid: the helper leaves the tool's process group, holding its stdout.
    pidfile = tmp_path / "helper"
    res = Host().run(["sh", "-c", f"setsid sleep 30 & echo $! > {pidfile}; sleep 30"],
                     timeout=0.5)
    took = time.monotonic() - started
    try:
        assert res.timed_out and res.returncode is None
        assert "abandoned" in res.stderr
        assert took < 5, took
    finally:
        os.kill(int(pidfile.read_text()), signal.SIGKILL)
