"""Bring a workload back onto its GPU once CRIU lets it run again.

Started detached at pre-dump. CRIU resumes the tasks when a dump fails (at
any point, including while freezing, where no action script runs) or when it
dumps with --leave-running; either way the CUDA processes are alive but
checkpointed. A successful dump kills them. So: wait for this CRIU process
to exit, and restore whichever of the checkpointed processes is still alive.
"""

from __future__ import annotations

import contextlib
import json
import os
import select
import time

# typing costs milliseconds at every hook start: annotations only.
TYPE_CHECKING = False
if TYPE_CHECKING:
    from typing import Any


MAX_WAIT_S = 6 * 3600


def spawn(ctx: Any, criu_pid: int, cid: str | None, procs: list[tuple[int, int | None]]) -> None:
    """Leave a guardian behind for this CRIU run, detached (its own session:
    a runtime that kills the hook's process group does not kill it).

    `procs` are (pid, start time) pairs: the start time tells our processes
    from a later process that reused the PID.
    """
    import subprocess
    import sys
    from dataclasses import asdict

    args = {
        "criu_pid": criu_pid,
        "criu_start": ctx.host.start_time(criu_pid),
        "container": cid,
        "procs": procs,
        "settings": asdict(ctx.settings),
    }
    subprocess.Popen(
        [sys.executable, "-I", "-c", "import sys; from cudahook.hooks.guardian import main; "
         "sys.exit(main(sys.argv[1]))", json.dumps(args)],
        stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
        start_new_session=True, close_fds=True,
    )


def wait_exit(pid: int, start: int, host: Any) -> None:
    try:
        fd = os.pidfd_open(pid)
    except (ProcessLookupError, OSError):
        return
    try:
        if not host.alive(pid, start):
            return
        poller = select.poll()
        poller.register(fd, select.POLLIN)
        poller.poll(MAX_WAIT_S * 1000)
    finally:
        os.close(fd)


def _frozen(ctx: Any, pid: int) -> bool:
    try:
        return bool(ctx.host.is_frozen(pid))
    except Exception:
        return False


def main(arg: str) -> int:
    from cudahook.platform.config import Settings
    from cudahook.platform.errors import CudahookError

    from .context import Context

    args = json.loads(arg)
    ctx = Context(Settings(**args["settings"]))
    wait_exit(int(args["criu_pid"]), int(args["criu_start"]), ctx.host)
    # The tasks of a completed dump are being killed; let that land.
    time.sleep(0.05)
    alive = [pid for pid, start in args["procs"] if ctx.host.alive(pid, start)]
    cid = args.get("container")
    if not alive:
        ctx.log("guardian", container=cid, outcome="dump completed; nothing to resume")
        return 0
    # A runtime that paused the container for the dump resumes it after
    # CRIU exits; the CUDA restore can only run once it has.
    deadline = time.monotonic() + MAX_WAIT_S
    while any(_frozen(ctx, pid) for pid in alive) and time.monotonic() < deadline:
        time.sleep(0.05)
        alive = [pid for pid, start in args["procs"] if ctx.host.alive(pid, start)]
    try:
        result = ctx.engine.restore(alive)
    except CudahookError as exc:
        alive = [pid for pid, start in args["procs"] if ctx.host.alive(pid, start)]
        if not alive:
            ctx.log("guardian", container=cid, outcome="tasks exited while resuming")
            return 0
        ctx.log("guardian", container=cid, pids=alive,
                error=f"could not bring the workload back onto its GPU: {exc}")
        return 1
    ctx.log("guardian", container=cid, pids=alive, outcome="resumed on GPU after the dump",
            total_s=result.timeline.total(), timeline=result.timeline.to_dict())
    if cid:
        with contextlib.suppress(OSError, CudahookError):
            ctx.store.remember(cid, "resume", {"time": time.time(), "ok": True, "pids": alive})
    return 0
