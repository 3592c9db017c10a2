"""One CRIU action, once per CRIU run.

CRIU runs the action script at every action of every dump and restore:

    dump:     pre-dump -> (tasks frozen) -> dump -> post-dump -> tasks killed
              or, with --leave-running or on failure, resumed
    restore:  pre-restore -> ... -> post-restore (tasks exist, not running)
              -> pre-resume -> tasks run -> post-resume

A non-zero exit aborts a dump at pre-dump and a restore up to post-restore;
at post-resume CRIU only logs it. When CRIU fails while freezing, it runs no
script at all. At post-dump and network-unlock the tasks are stopped, and a
stopped process's CUDA restore thread cannot run: CUDA work happens at
pre-dump (checkpoint.py), post-restore (checks only) and post-resume
(restore.py), nowhere else. CRIU's duplicate call of an action gets the
first call's outcome (criu_run.py).
"""

from __future__ import annotations

import contextlib
import sys
from pathlib import Path

from cudahook.platform.errors import CudahookError, Exit
from cudahook.platform.marks import mark

from . import checkpoint, guardian, restore
from .containers import need_init
from .context import Context
from .criu_run import CriuRun

STEPS = {"pre-dump": checkpoint.pre_dump, "post-restore": restore.post_restore,
         "post-resume": restore.post_resume}


def run(ctx: Context, action: str, image_dir: Path | None, init_pid: int | None,
        criu_pid: int) -> int:
    step = STEPS.get(action)
    if step is None:
        return Exit.OK
    try:
        criu_run = CriuRun(ctx.store, ctx.host, criu_pid)
        earlier = criu_run.outcome(action)
        killed = earlier is None and criu_run.started(action)
        if earlier is None and not killed:
            criu_run.own_calls(action, ctx.host)  # before any call: platform/tools.py
    except Exception as exc:
        if action != "post-resume":
            raise
        return _no_record(ctx, init_pid, criu_pid, exc)
    if killed:
        return _after_a_kill(ctx, action, init_pid, criu_run)
    if earlier is not None:
        if earlier:  # its failure was told at the first call; say so again, in one line
            print(f"cudahook: {action}: failed earlier in this CRIU run (exit {earlier}); "
                  f"see {ctx.settings.log_file}", file=sys.stderr)
        return earlier
    try:
        rc = step(ctx, image_dir, init_pid, criu_pid, criu_run)
    except CudahookError as exc:
        ctx.log(action, error=str(exc), init_pid=init_pid)
        rc = int(exc.exit_code)
    except Exception as exc:  # recorded like any failure: CRIU's second call must not retry
        ctx.log(action, error=f"internal error: {type(exc).__name__}: {exc}", init_pid=init_pid)
        rc = Exit.FAILED
    criu_run.finish(action, rc)
    if action in ("pre-dump", "post-resume"):
        housekeeping(ctx)
    return rc


def _no_record(ctx: Context, init_pid: int | None, criu_pid: int, exc: Exception) -> int:
    """post-resume without its run's record: the tasks run already, and the
    shell let this call through only because post-restore marked a CUDA
    restore. It cannot be finished, so it fails closed."""
    with contextlib.suppress(OSError):
        mark("restore", str(criu_pid), on=False)
    try:
        pid: int | None = need_init(ctx, "post-resume", init_pid)
    except CudahookError:
        pid = None
    return restore.fail_closed(ctx, pid, None, None, exc)


def _after_a_kill(ctx: Context, action: str, init_pid: int | None, criu_run: CriuRun) -> int:
    """Hazard: CRIU 3.19-4.1.1 run the second call even when the first was
    killed mid-way, with no outcome recorded. Acting again would race
    whatever the first call left in progress. Undo: none - this call
    touches nothing; the operation fails, and the guardian (dump) or the
    restore watcher (restore) deals with what the first call left."""
    what = "dump" if action == "pre-dump" else "restore"
    error = (f"{action}: an earlier call in this CRIU run stopped without finishing "
             f"(killed?): this {what} fails, and its "
             f"{'guardian' if what == 'dump' else 'restore watcher'} deals with what "
             "that call left; nothing was touched by this call")
    ctx.log(action, error=error, init_pid=init_pid)
    criu_run.finish(action, Exit.FAILED)
    print(f"cudahook: {error}", file=sys.stderr)
    return Exit.FAILED


def housekeeping(ctx: Context) -> None:
    """Keep the state directory (RAM) bounded: finished CRIU runs, and
    containers gone without a poststop. Never fails the action."""
    with contextlib.suppress(OSError, CudahookError):
        # A gone run's chunk links kept beside its image (checkpoint._keep)
        # go with its record, if no guardian lived to remove them.
        ctx.store.prune_runs(gone=guardian.drop_kept)
        ctx.store.prune(ctx.settings.state_retention_s)
