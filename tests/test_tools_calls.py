"""Calls that cannot outlive their hook (platform/tools.py): every process
carrying a phase's name is found and ended, whatever group or session it
moved to, and nothing else is touched."""

from __future__ import annotations

import os
import subprocess
import time

from cudahook.platform.tools import CALLS_ENV, calls_of, end_calls


def test_every_process_carrying_the_name_is_ended_wherever_it_moved() -> None:
    name = f"test-{os.getpid()}-{time.monotonic_ns()}"
    env = {**os.environ, CALLS_ENV: name}
    # A call that left a grandchild in a session of its own, as a helper may.
    call = subprocess.Popen(["sh", "-c", "setsid sleep 300 & exec sleep 300"], env=env,
                            start_new_session=True)
    bystander = subprocess.Popen(["sleep", "300"], env={**os.environ, CALLS_ENV: name + "x"})
    try:
        deadline = time.monotonic() + 5
        while len(calls_of(name)) < 2:
            assert time.monotonic() < deadline, calls_of(name)
            time.sleep(0.02)
        found = {pid for pid, _ in calls_of(name)}
        assert call.pid in found and bystander.pid not in found
        assert end_calls(name, 5.0) == []
        assert calls_of(name) == []
        assert call.wait(5) == -9
        assert bystander.poll() is None  # another name: untouched
    finally:
        for p in (call, bystander):
            p.kill()
            p.wait()
