"""The per-container busy lock between checkpoints, restores and status."""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

import pytest

from cudahook.platform import busy

HOLDER = """
import sys, time
from cudahook.platform import busy
with busy.hold(sys.argv[1], "c1", 5):
    print("held", flush=True)
    time.sleep(30)
"""


def test_hold_peek_and_wait(tmp_path: Path) -> None:
    state = str(tmp_path / "state")
    other = subprocess.Popen([sys.executable, "-c", HOLDER, state], stdout=subprocess.PIPE,
                             text=True)
    try:
        assert other.stdout is not None and other.stdout.readline() == "held\n"
        with busy.peek(state, "c1") as free:
            assert free is False
        with busy.peek(state, "c2") as free:
            assert free is True
        t = time.monotonic()
        with pytest.raises(busy.Busy, match=r"still runs after 0\.3s"), busy.hold(state, "c1", 0.3):
            pass
        assert time.monotonic() - t < 2
        ran = []
        with busy.hold(state, "c1", 0.3, required=False):
            ran.append(1)  # a restore goes on without the lock
        assert ran == [1]
    finally:
        other.kill()
        other.wait()
    # The holder died: its lock died with it.
    with busy.peek(state, "c1") as free:
        assert free is True
    with busy.hold(state, "c1", 0.3):
        pass


def test_a_gone_containers_lock_file_goes_but_never_from_under_a_holder(tmp_path: Path) -> None:
    state = str(tmp_path / "state")
    lock = tmp_path / "state" / "busy" / "c1.lock"
    other = subprocess.Popen([sys.executable, "-c", HOLDER, state], stdout=subprocess.PIPE,
                             text=True)
    try:
        assert other.stdout is not None and other.stdout.readline() == "held\n"
        assert busy.remove(state, "c1") is False and lock.exists()  # held: stays
    finally:
        other.kill()
        other.wait()
    assert busy.remove(state, "c1") is True and not lock.exists()
    assert busy.remove(state, "c1") is True  # already gone


def test_a_waiter_whose_file_was_removed_locks_the_new_one(tmp_path: Path) -> None:
    state = str(tmp_path / "state")
    with busy.hold(state, "c1", 1):
        old = busy._open(state, "c1")  # a waiter that opened the file before its removal
    try:
        assert busy.remove(state, "c1")
        import fcntl

        fcntl.flock(old, fcntl.LOCK_EX)  # what the waiter then gets: a lock nobody else sees
        assert not busy._still_named(old, state, "c1")
        with busy.hold(state, "c1", 1), busy.peek(state, "c1") as free:
            assert free is False  # the real lock file is the one held
    finally:
        import os

        os.close(old)
