"""Bring a workload back onto its GPU once CRIU lets it run again.

Started detached at pre-dump. CRIU resumes the tasks when a dump fails (at
any point, including while freezing, where no action script runs) or when it
dumps with --leave-running; either way the CUDA processes are alive but
checkpointed. A successful dump kills them. So: wait for this CRIU process
to exit, and restore whichever of the checkpointed processes is still alive;
if the CUDA VMM interposer took part, replay its saved state into them too
(the checkpoint dropped their VMM mappings). Failing that, it says so: the
result is recorded unsafe, never "resumed".
"""

from __future__ import annotations

import json
import os
import select
import time

# typing costs milliseconds at every hook start: annotations only.
TYPE_CHECKING = False
if TYPE_CHECKING:
    from typing import Any


MAX_WAIT_S = 6 * 3600
POLL_S = 0.1


def spawn(ctx: Any, criu_pid: int, cid: str | None, procs: list[tuple[int, int | None]],
          vmm_keep: dict[str, Any] | None = None) -> None:
    """Leave a guardian behind for this CRIU run, detached (its own session:
    a runtime that kills the hook's process group does not kill it).

    `procs` are (pid, start time) pairs: the start time tells our processes
    from a later process that reused the PID. `vmm_keep`: where a copy of the
    VMM state --prepare saved is, and each process's namespace PID.
    """
    import subprocess
    import sys
    args = {
        "criu_pid": criu_pid,
        "criu_start": ctx.host.start_time(criu_pid),
        "container": cid,
        "procs": procs,
        "settings": ctx.settings.as_dict(),
        "vmm": vmm_keep,
        "handed_over": time.time(),  # pre-dump's end: CRIU dumps from here to its exit
    }
    subprocess.Popen(
        [sys.executable, "-I", "-c", "import sys; from cudahook.hooks.guardian import main; "
         "sys.exit(main(sys.argv[1]))", json.dumps(args)],
        stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
        start_new_session=True, close_fds=True,
    )


def wait_exit(pid: int, start: int, host: Any, max_wait_s: float | None = None) -> bool:
    """Wait for that CRIU process (PID and start time) to exit; False if it
    still runs after max_wait_s.

    Only the process's end counts. pidfd_open is the cheap way to wait; where
    it is missing (ENOSYS before Linux 5.3, RHEL 8's 4.18) or fails for any
    other reason, /proc is polled instead: an error is never taken for an exit.
    """
    deadline = time.monotonic() + (MAX_WAIT_S if max_wait_s is None else max_wait_s)
    try:
        fd: int | None = os.pidfd_open(pid)
    except OSError:  # ESRCH included: /proc below says whether it is gone
        fd = None
    try:
        while _alive(host, pid, start):
            left = deadline - time.monotonic()
            if left <= 0:
                return False
            if fd is None:
                time.sleep(min(POLL_S, left))
            else:
                # Woken by the exit; the PID and start time are read again
                # either way, so a spurious wake-up changes nothing.
                poller = select.poll()
                poller.register(fd, select.POLLIN)
                poller.poll(int(min(left, 60) * 1000) + 1)
        return True
    finally:
        if fd is not None:
            os.close(fd)


def _alive(host: Any, pid: int, start: int) -> bool:
    """Alive unless /proc says otherwise: an unreadable entry is not an exit."""
    try:
        return bool(host.alive(pid, start))
    except Exception:
        return True


def _drop(keep: dict[str, Any] | None) -> None:
    if keep:
        import shutil

        shutil.rmtree(keep["dir"], ignore_errors=True)


def _vmm_restore(ctx: Any, cid: str | None, keep: dict[str, Any], result: Any) -> None:
    """Replay the VMM state --prepare saved into the processes the checkpoint
    dropped it from (those this restore brought back), then unlock if the
    settings want the replay first."""
    from pathlib import Path

    from cudahook.vmm import coordinator as vmm

    back = {s.pid for s in result.timeline.steps if s.ok and s.step in ("restore", "toggle")}
    pairs = [(pid, int(keep["nspids"][str(pid)])) for pid in result.pids if pid in back]
    if pairs:
        output = vmm.run_coordinator(ctx.host, ctx.settings.tool("vmm_coordinator"), "restore",
                                     "", Path(keep["dir"]), pairs, ctx.settings.vmm_timeout_s)
        ctx.log("vmm-restore", container=cid, pids=[p for p, _ in pairs], output=output,
                reason="guardian")
    if ctx.settings.vmm_restore_before_unlock:
        ctx.engine.unlock(result.pids)


def _busy(ctx: Any, cid: str | None) -> Any:
    """The container's busy lock while restoring; a status probe holds it for
    seconds at most, and bringing the workload back matters more than the
    lock, so after the wait it restores anyway."""
    from cudahook.platform import busy

    return busy.hold(ctx.settings.state_dir, cid, 60.0, required=False)


def _frozen(ctx: Any, pid: int) -> bool:
    try:
        return bool(ctx.host.is_frozen(pid))
    except Exception:
        return False


def main(arg: str) -> int:
    from cudahook.platform.config import Settings
    from cudahook.platform.errors import CudahookError

    from . import results
    from .context import Context

    args = json.loads(arg)
    ctx = Context(Settings(**args["settings"]))
    cid = args.get("container")
    if not wait_exit(int(args["criu_pid"]), int(args["criu_start"]), ctx.host):
        # Restoring under a dump that is still running would put GPU state
        # into processes CRIU is saving: never proceed while CRIU lives.
        ctx.log("guardian", container=cid, error=f"CRIU (pid {args['criu_pid']}) still "
                f"running after {MAX_WAIT_S}s: the workload is left checkpointed")
        return 1
    # CRIU's own dump time, as seen from here: pre-dump's end to CRIU's exit.
    if isinstance(args.get("handed_over"), (int, float)):
        results.count(ctx, cid or "", "criu-dump",
                      {"criu_dump_s": max(0.0, time.time() - args["handed_over"])})
    # The tasks of a completed dump are being killed; let that land.
    time.sleep(0.05)
    alive = [pid for pid, start in args["procs"] if ctx.host.alive(pid, start)]
    keep = args.get("vmm")
    if not alive:
        _drop(keep)
        ctx.log("guardian", container=cid, outcome="dump completed; nothing to resume")
        return 0
    # A runtime that paused the container for the dump resumes it after
    # CRIU exits; the CUDA restore can only run once it has.
    deadline = time.monotonic() + MAX_WAIT_S
    while any(_frozen(ctx, pid) for pid in alive):
        if time.monotonic() >= deadline:
            # A frozen target makes cuda-checkpoint hang: nothing to do but say so.
            ctx.log("guardian", container=cid, pids=alive, error="container still paused "
                    f"after {MAX_WAIT_S}s: the workload is left checkpointed")
            return 1
        time.sleep(0.05)
        alive = [pid for pid, start in args["procs"] if ctx.host.alive(pid, start)]
    try:
        with _busy(ctx, cid):
            result = ctx.engine.restore(alive, unlock=not (
                keep and ctx.settings.vmm_restore_before_unlock))
            if keep:
                _vmm_restore(ctx, cid, keep, result)
    except CudahookError as exc:
        alive = [pid for pid, start in args["procs"] if ctx.host.alive(pid, start)]
        if not alive:
            ctx.log("guardian", container=cid, outcome="tasks exited while resuming")
            return 0
        error = f"could not bring the workload back onto its GPU: {exc}"
        ctx.log("guardian", container=cid, pids=alive, error=error,
                vmm_state=keep["dir"] if keep else None)
        results.remember(ctx, cid, "resume", ok=False, unsafe=True, error=error)
        return 1
    _drop(keep)
    ctx.log("guardian", container=cid, pids=alive, outcome="resumed on GPU after the dump",
            total_s=result.timeline.total(), timeline=result.timeline.to_dict())
    results.remember(ctx, cid, "resume", ok=True, pids=alive)
    return 0
