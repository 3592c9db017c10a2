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
