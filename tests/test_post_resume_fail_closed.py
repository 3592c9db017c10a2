"""post-resume fails closed: once CRIU has let the restored tasks run, any
failure of the action script - the state directory damaged, the container's
record unusable - kills the container, never leaves it running checkpointed
while CRIU (which only logs a post-resume failure) reports the restore done.

Through the installed action script, against checkpointed processes of a
simulated GPU node."""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

import pytest

from cudahook.core import manifest
from cudahook.platform.marks import mark

from .conftest import Node
from .test_criu_action import SCRUBBED, action, events, install


def _gone(pid: int) -> bool:
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return True
    return stat[stat.rindex(")") + 2] == "Z"


def _damage(node: Node, how: str, init: int) -> None:
    state = Path(node.settings().state_dir)
    if how == "record-options":
        # The container's record names options no cudahook knows.
        (state / "containers").mkdir(parents=True, exist_ok=True, mode=0o700)
        (state / "containers" / "c1.json").write_text(
            json.dumps({"id": "c1", "pid": init, "options": {"no-such-option": "1"}}))
    elif how == "runs-symlink":
        # Where the CRIU runs are kept is a symlink: the store refuses it.
        (state / "elsewhere").mkdir(parents=True, exist_ok=True, mode=0o700)
        (state / "runs").symlink_to(state / "elsewhere")


@pytest.mark.parametrize("how", ["none", "record-options", "runs-symlink"])
def test_post_resume_kills_the_container_whatever_fails(node: Node, tmp_path: Path,
                                                        how: str) -> None:
    script = install(tmp_path, node)
    image = tmp_path / "img"
    image.mkdir()
    init = node.spawn_tree(("a", {"mib": 2}), ("b", {"mib": 1}))
    pids = [node.lab.wait_counter(t)["pid"] for t in ("a", "b")]
    # As CRIU leaves them at post-resume: running, checkpointed.
    node.engine().checkpoint(pids)
    manifest.write(image, {"container_id": None, "driver_version": "580.65.06",
                           "processes": [{"nspid": p, "pid": p, "state": "running"}
                                         for p in pids]})
    Path(node.settings().state_dir).mkdir(parents=True, exist_ok=True, mode=0o700)
    _damage(node, how, init.pid)
    mark("restore", str(os.getpid()))  # post-restore's mark for this run
    try:
        r = action(script, "post-resume", CRTOOLS_INIT_PID=str(init.pid),
                   CRTOOLS_IMAGE_DIR=str(image), **SCRUBBED)
    finally:
        mark("restore", str(os.getpid()), on=False)
    if how == "none":  # the control: the same restore, undamaged, brings them back
        assert r.returncode == 0, (r.stderr, events(node))
        for t in ("a", "b"):
            st = node.lab.wait_counter(t, node.lab.status(t)["counter"] + 5)
            assert st["intact"] and not st["errors"], st
        return
    assert r.returncode != 0, r.stderr
    deadline = time.monotonic() + 10
    while not all(_gone(p) for p in [init.pid, *pids]):
        assert time.monotonic() < deadline, "the restored container was left alive"
        time.sleep(0.05)
    if how == "record-options":  # where the log can still be written, it says why
        failed = [e for e in events(node, "restore") if "error" in e]
        assert failed and "container killed" in failed[-1]["error"], events(node)
