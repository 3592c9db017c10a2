"""Bring a workload back onto its GPU once CRIU lets it run again.

Armed at pre-dump before the first CUDA lock, detached (its own session), so
that whatever ends the action script - its own failure, a SIGKILL from a
runtime's or kubelet's timeout, the OOM killer - someone is left to undo
what it did. CRIU lets the tasks run again when a dump fails (at any point,
including while freezing, where no action script runs, and when the action
script itself failed or was killed: CRIU then aborts) or when it dumps with
--leave-running; a successful dump kills them.

So the guardian never acts while a dump may still legitimately run: it waits
for this CRIU process to exit, then for the action script that armed it (a
CRIU that was killed itself leaves a hook that may still be locking). Then
it ends every driver call that script started and waits until none is left
(platform/tools.py: each call carries the run's name; a call left running
would finish a checkpoint after the guardian judged the workload). Only then
it reads each of its processes' CUDA state - once no operation is in
progress on it (`checkpointing`, `restoring`: CUDA 13.4+) - and restores
those it finds locked or checkpointed; one found `running` (never locked,
or rolled back by the action script) is left alone. Any other state -
failed, unknown, still in progress, or a call that could not be ended - is
reported unsafe (exit 4), with its PID: never taken for running. If the CUDA VMM interposer's
prepare ran (its state was copied next to the run's progress record before
the first lock), the state is replayed into the processes it brought back
from checkpointed: the checkpoint dropped their VMM mappings. Failing that,
it says so: the result is recorded unsafe, never "resumed".

While it lives, its marker in the state directory names it, so that a new
checkpoint of the same container waits for it (see `pending`). At its
start it arms a successor, which takes over if it is killed before it
finished (`_relay`), also while CRIU still dumps; a successor arms its own
only while something is left to bring back.

The restore side has its watcher (`watch_restore`), armed at post-restore
before the tasks run: once CRIU and the post-resume action script are gone,
unless post-resume recorded a restore that succeeded, it ends the restore's
driver calls and kills the container - a half-restored workload is never
left running. It arms its successor through the same relay, at its start.
"""

from __future__ import annotations

import contextlib
import json
import os
import select
import time

from .criu_run import SETTLED

# typing costs milliseconds at every hook start: annotations only.
TYPE_CHECKING = False
if TYPE_CHECKING:
    from collections.abc import Iterator
    from pathlib import Path
    from typing import Any


MAX_WAIT_S = 6 * 3600
POLL_S = 0.1
# Where the VMM prepare state is kept for the guardian, next to the run's record.
VMM_SUFFIX = ".vmm-undo"
# The run's record names (under KEPT) the directory of hard links to the GPU
# memory's chunks pre-dump made for us (flow/checkpoint.py _keep); its name
# holds KEPT_INFIX.
KEPT = "gpu_storage_kept"
KEPT_INFIX = ".cudahook-gpu-kept."


def spawn(ctx: Any, criu_pid: int, cid: str | None, procs: list[tuple[int, int | None]],
          run_path: Path, vmm_nspids: dict[int, int], *, key: str | None = None) -> None:
    """Arm the guardian for this CRIU run, detached (its own session: a
    runtime that kills the hook's process group does not kill it), and leave
    its marker for the container.

    `procs` are (pid, start time) pairs, every process this pre-dump may
    touch: the start time tells ours from a later process that reused the
    PID. `run_path`: the run's progress record (criu_run.py). `vmm_nspids`:
    each process's namespace PID, for a VMM replay. `key`: what names the
    container's busy lock and the marker (containers.lock_key).
    """
    hook = os.getpid()
    args = {
        "criu_pid": criu_pid,
        "criu_start": ctx.host.start_time(criu_pid),
        "hook": [hook, ctx.host.start_time(hook)],
        "container": cid,
        "key": key,
        "procs": procs,
        "settings": ctx.settings.as_dict(),
        "run": str(run_path),
        "vmm": {"dir": str(vmm_dir(run_path)), "nspids": {str(p): n for p, n in vmm_nspids.items()}},
    }
    child = _detached("main", args)
    if key:
        from cudahook.platform.store import write_json_atomic

        write_json_atomic(_marker(ctx.settings.state_dir, key),
                          {"pid": child.pid, "start": ctx.host.start_time(child.pid),
                           "criu_pid": criu_pid})


def _detached(entry: str, args: dict[str, Any]) -> Any:
    """Start `entry`(args) of this module in a session of its own, outliving
    the hook: not bound to it, and not carrying its calls' name (it ends
    those calls; its own carry a name of their own)."""
    import subprocess
    import sys

    from cudahook.platform.tools import calls_env

    return subprocess.Popen(
        [sys.executable, "-I", "-c", f"import sys; from cudahook.flow.guardian import {entry}; "
         f"sys.exit({entry}(sys.argv[1]))", json.dumps(args)],
        stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
        start_new_session=True, close_fds=True, env=calls_env(),
    )


def _end_calls(ctx: Any, args: dict[str, Any], cid: str | None) -> list[int]:
    """End the driver calls of the run that armed us, and name our own
    calls; the PIDs of calls that would not end (stuck in the driver)."""
    from cudahook.platform.tools import end_calls, own_calls

    from .criu_run import calls_name

    name = calls_name(args.get("run"))
    if not name:
        return []
    from cudahook.core.agent_client import end_calls as end_agent_calls  # calls the node agent serves

    # A successor ends its killed predecessor's calls too (they carry the
    # same name as its own will: ended before it makes any).
    names = [name, f"{name}.guardian"] if args.get("after") else [name]
    stuck = []
    for each in names:
        stuck += end_calls(each, ctx.settings.call_timeout_s)
        stuck += end_agent_calls(ctx.settings, each, ctx.settings.call_timeout_s)
    own_calls(f"{name}.guardian")
    if stuck:
        ctx.log("guardian", container=cid, stuck_calls=stuck,
                error=f"driver calls of the action script still alive after SIGKILL and "
                f"{ctx.settings.call_timeout_s:g}s (stuck in the driver): pids {stuck}")
    return stuck


def vmm_dir(run_path: Path) -> Path:
    return run_path.with_suffix(VMM_SUFFIX)


def _marker(state_dir: str, key: str, *, create: bool = True) -> Path:
    from pathlib import Path

    from cudahook.platform.privdir import private_subdir
    from cudahook.platform.store import check_key

    d = private_subdir(state_dir, "guardians") if create else Path(state_dir) / "guardians"
    return d / f"{check_key(key)}.json"


def pending(ctx: Any, key: str | None) -> tuple[int, int] | None:
    """The (pid, start time) of a guardian of this container (by its
    containers.lock_key) that is still alive, if any: it may be about to
    bring processes back, or be doing it."""
    if not key:
        return None
    from cudahook.platform.store import read_json

    path = _marker(ctx.settings.state_dir, key, create=False)  # reading makes nothing
    data = read_json(path)
    if not isinstance(data, dict):
        return None
    pid, start = data.get("pid"), data.get("start")
    if type(pid) is not int or type(start) is not int or pid <= 0:
        return None
    if _alive(ctx.host, pid, start):
        return pid, start
    # A guardian killed before it could remove its marker: the state
    # directory is RAM, so the marker goes now.
    with contextlib.suppress(OSError):
        path.unlink()
    return None


# How long a checkpoint or restore waits for a `cudahook status` probe (or
# another operation) holding the same container.
BUSY_WAIT_S = 30.0


@contextlib.contextmanager
def exclusive(ctx: Any, key: str | None, busy_wait_s: float, what: str) -> Iterator[None]:
    """The container's busy lock (Busy after busy_wait_s: EnvironmentProblem),
    with no guardian of the container still alive: that one may be about
    to bring processes back onto their GPU, and a checkpoint or restore
    meanwhile would take them half-way. A live guardian is waited for
    (settings.guardian_wait_s at most, without holding the lock: it needs
    it to restore), then refused. Pre-dump and the admin CLI's checkpoint
    and restore go through here."""
    from cudahook.platform import busy
    from cudahook.platform.errors import EnvironmentProblem

    deadline = time.monotonic() + ctx.settings.guardian_wait_s
    while True:
        held = contextlib.ExitStack()
        try:
            held.enter_context(busy.hold(ctx.settings.state_dir, key, busy_wait_s))
        except busy.Busy as exc:
            raise EnvironmentProblem(f"{what}: {exc}") from exc
        other = pending(ctx, key)
        if other is None:
            break
        held.close()
        left = deadline - time.monotonic()
        if left <= 0 or not wait_exit(*other, ctx.host, max_wait_s=left):
            raise EnvironmentProblem(
                f"{what}: the guardian of an earlier checkpoint of container {key} "
                f"(pid {other[0]}) still runs after {ctx.settings.guardian_wait_s:g}s: "
                "retry once it has brought the workload back; nothing was locked")
    with held:
        yield


def wait_exit(pid: int, start: int | None, host: Any, max_wait_s: float | None = None) -> bool:
    """Wait for that process (PID and start time) to exit; False if it
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


def _alive(host: Any, pid: int, start: int | None) -> bool:
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
    from . import vmm_steps

    back = result.brought_back()
    pairs = [(pid, int(keep["nspids"][str(pid)])) for pid in result.pids if pid in back]
    vmm_steps.replay(ctx, cid, keep["dir"], pairs, "guardian")
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


def _record_of(args: dict[str, Any]) -> dict[str, Any]:
    """The run's progress record ({} when there is none)."""
    from pathlib import Path

    from cudahook.platform.store import read_json

    data = read_json(Path(args["run"])) if args.get("run") else None
    return data if isinstance(data, dict) else {}


def _how(args: dict[str, Any]) -> tuple[str, str | None, Any]:
    """What the run's progress record says of the pre-dump that armed us:
    its outcome, or that it did not finish; the last step it took; and
    when it handed the processes over to CRIU, if it did."""
    data = _record_of(args)
    if not data:
        return "pre-dump left no record", None, None
    done = data.get("done")
    rc = done.get("pre-dump") if isinstance(done, dict) else None
    # The step is the first call's: CRIU's duplicate call refuses to act
    # after a first call that never finished, and records only its exit.
    step = data.get("step") if isinstance(data.get("step"), str) else None
    last = f"last step: {step or 'none'}"
    return (f"pre-dump exited {rc} ({last})" if type(rc) is int
            else f"pre-dump did not finish ({last})"), step, data.get("handed_over")


def main(arg: str) -> int:
    args = json.loads(arg)
    cid = args.get("container")
    # One armed before keys named its marker by the container id.
    key = args.get("key", cid)
    try:
        return _guard(args, cid)
    finally:
        if args.get("run"):  # first: a successor finds the work done, not the links
            from pathlib import Path

            drop_kept(Path(args["run"]))
        _finished(args, FINISHED)
        if key:
            _unmark(args, key)


def drop_kept(run: Path) -> None:
    """Remove the chunks' hard links pre-dump kept for the guardian of the
    run recorded at `run`: the image holds the same files, and the run is
    over - its guardian finished, or (the run's record pruned, long after
    its CRIU exited) it and every successor were killed."""
    import shutil
    from pathlib import Path

    from cudahook.platform.store import read_json

    data = read_json(run)
    kept = data.get(KEPT) if isinstance(data, dict) else None
    if isinstance(kept, str) and KEPT_INFIX in Path(kept).name:
        shutil.rmtree(kept, ignore_errors=True)


# In the run's record: the guardian of this run finished (whatever it found);
# the restore watcher of this run finished.
FINISHED = "guardian_finished"
WATCHED = "watcher_finished"


def _finished(args: dict[str, Any], what: str) -> None:
    """Record that this guardian or watcher finished (`what`), for a
    successor waiting on it."""
    from pathlib import Path

    from cudahook.platform.store import read_json, write_json_atomic

    with contextlib.suppress(Exception):  # no record: a successor does the work again
        path = Path(args["run"])
        data = read_json(path)
        if isinstance(data, dict):
            write_json_atomic(path, {**data, what: os.getpid()})


def _took_over(ctx: Any, args: dict[str, Any], what: str) -> bool:
    """For a successor (`after` names the one before it): wait for that one
    to exit; False if it recorded that it finished (`what`: nothing is left
    to do), else True: the work is ours now. The first of a chain: True at
    once. Each arms its own successor only while work is left, so that a
    chain ends (with no run record, nobody can record that it finished)."""
    before = args.get("after")
    if not before:
        return True
    wait_exit(int(before[0]), before[1], ctx.host)
    return not _record_of(args).get(what)


# A chain of successors is bounded: with no run record to say "finished"
# (unwritable), each would otherwise arm the next for as long as the
# processes live. Each link exists only because the one before was killed.
RELAY_MAX = 8


def _relay(ctx: Any, args: dict[str, Any], entry: str) -> tuple[int, int | None] | None:
    """Hazard: a guardian or a restore watcher can itself be SIGKILLed (the
    OOM killer) with work left: its calls die with it, and a restore from
    storage left half-way is ended by the driver with its caller - the
    process checkpointed again, or a half-restored container left alive -
    with nobody left to finish. So it arms a successor running the same
    `entry`, detached like itself, which waits for it to exit and, unless
    it recorded that it finished (`_finished`, `_took_over`), arms its own
    while work is left and does the work again from the start from what it reads (ends the
    calls, reads every state afresh, restores what is locked or
    checkpointed, or kills the container: each step applies once). The
    successor's (pid, start time); None, said in the log, when it could not
    be started: the work goes on without one (it matters more)."""
    me = os.getpid()
    generation = int(args.get("generation", 0)) + 1
    try:
        if generation > RELAY_MAX:
            raise RuntimeError(f"{RELAY_MAX} in a row, none of which could record its end")
        child = _detached(entry, {**args, "after": [me, ctx.host.start_time(me)],
                                  "generation": generation})
        return child.pid, ctx.host.start_time(child.pid)
    except Exception as exc:
        with contextlib.suppress(Exception):
            ctx.log("guardian" if entry == "main" else "restore-watcher",
                    container=args.get("container"), warning=f"no successor armed: {exc}")
        return None


def _relay_guardian(ctx: Any, args: dict[str, Any]) -> None:
    """`_relay`, and the container's marker names the successor from now on,
    so a new checkpoint waits for it too."""
    successor = _relay(ctx, args, "main")
    key = args.get("key", args.get("container"))
    if key and successor:
        pid, start = successor
        from cudahook.platform.store import write_json_atomic

        with contextlib.suppress(Exception):  # the successor works without it
            write_json_atomic(_marker(ctx.settings.state_dir, key),
                              {"pid": pid, "start": start, "criu_pid": args["criu_pid"]})


def _unmark(args: dict[str, Any], key: str) -> None:
    """Remove this guardian's marker (only its own: a later one may have
    replaced it)."""
    from cudahook.platform.store import read_json

    with contextlib.suppress(Exception):
        path = _marker(args["settings"]["state_dir"], key, create=False)
        data = read_json(path)
        if isinstance(data, dict) and data.get("pid") == os.getpid():
            path.unlink()


def _guard(args: dict[str, Any], cid: str | None) -> int:
    from cudahook.platform.config import Settings

    from . import results
    from .context import Context

    ctx = Context(Settings(**args["settings"]))
    if not _took_over(ctx, args, FINISHED):
        return 0  # the guardian before this one finished its work
    first = not args.get("after")
    if first:
        # Killed while CRIU still dumps (the OOM killer), with no successor,
        # a dump that then fails would leave the workload checkpointed with
        # nobody to bring it back: so the first guardian arms one at once,
        # for one waiting interpreter per GPU dump.
        _relay_guardian(ctx, args)
    if not _dump_over(ctx, args, cid):
        return 1
    how, step, handed_over = _how(args)
    if not first and step not in SETTLED and _alive_procs(ctx, args):
        _relay_guardian(ctx, args)  # something may be left to bring back
    # Its calls die with it (parent-death signal); whatever they started,
    # or a call the signal missed, is ended here before any state is read.
    stuck = _end_calls(ctx, args, cid)
    # CRIU's own dump time, as seen from here: pre-dump's end to CRIU's exit.
    if isinstance(handed_over, (int, float)) and not args.get("after"):  # counted once
        results.count(ctx, cid or "",
                      {"criu-dump": {"criu_dump_s": max(0.0, time.time() - handed_over)}})
    keep = args.get("vmm")
    if keep and not os.path.isdir(keep["dir"]):
        keep = None  # prepare never ran (or no VMM step): nothing to replay
    if step in SETTLED and not stuck:
        # The pre-dump stopped before any lock, or its own rollback verified
        # every process running: nothing to do, and nothing to wait for (a
        # container left paused must not hold up its next checkpoint).
        _drop(keep)
        ctx.log("guardian", container=cid, outcome="nothing to resume: no process was left "
                "locked or checkpointed", run=how)
        return 0
    # The tasks of a completed dump are being killed; let that land.
    time.sleep(0.05)
    alive = _alive_procs(ctx, args)
    if not alive:
        _drop(keep)
        ctx.log("guardian", container=cid, outcome="dump completed; nothing to resume", run=how)
        return 0
    alive = _thawed(ctx, args, cid, alive)
    if alive is None:
        return 1
    if stuck:  # a call still in the driver may change any state read now
        return _unsafe(ctx, cid, alive, how, keep,
                       f"driver calls {stuck} of the action script could not be ended; "
                       "the workload's CUDA state is not known")
    return _resume(ctx, args, cid, alive, how, keep)


def _alive_procs(ctx: Any, args: dict[str, Any]) -> list[int]:
    return [pid for pid, start in args["procs"] if ctx.host.alive(pid, start)]


def _dump_over(ctx: Any, args: dict[str, Any], cid: str | None) -> bool:
    """Restoring under a dump that is still running would put GPU state into
    processes CRIU is saving: never proceed while CRIU lives. The action
    script is waited for too: it may outlive a CRIU that was killed, and
    must not be racing us. Its own calls all have deadlines."""
    hook = args.get("hook") or [None, None]
    before = args.get("after") or [None, None]  # a successor's: the guardian before it
    for what, pid, start in (("CRIU", args["criu_pid"], args["criu_start"]),
                             ("the action script", hook[0], hook[1]),
                             ("the guardian before", before[0], before[1])):
        if pid is not None and not wait_exit(int(pid), start, ctx.host):
            ctx.log("guardian", container=cid, error=f"{what} (pid {pid}) still running after "
                    f"{MAX_WAIT_S}s: the workload is left as it is")
            return False
    return True


def _thawed(ctx: Any, args: dict[str, Any], cid: str | None,
            alive: list[int]) -> list[int] | None:
    """A runtime that paused the container for the dump resumes it after
    CRIU exits; the CUDA restore can only run once it has. The processes
    still alive then, or None when it never was resumed."""
    deadline = time.monotonic() + MAX_WAIT_S
    while any(_frozen(ctx, pid) for pid in alive):
        if time.monotonic() >= deadline:
            # A frozen target makes cuda-checkpoint hang: nothing to do but say so.
            ctx.log("guardian", container=cid, pids=alive, error="container still paused "
                    f"after {MAX_WAIT_S}s: the workload is left checkpointed")
            return None
        time.sleep(0.05)
        alive = _alive_procs(ctx, args)
    return alive


def _stored(args: dict[str, Any]) -> dict[int, str] | None:
    """GPU memory the pre-dump checkpointed into the image (custom storage):
    pid -> its directory, as the run's record holds it. A plain restore
    would find nothing to restore in those processes."""
    dirs = _record_of(args).get("gpu_storage")
    if not isinstance(dirs, dict):
        return None
    return {int(p): d for p, d in dirs.items() if str(p).isdigit() and isinstance(d, str)}


def _resume(ctx: Any, args: dict[str, Any], cid: str | None, alive: list[int], how: str,
            keep: dict[str, Any] | None) -> int:
    """Only `running` is safe. Locked or checkpointed: what a checkpoint
    left behind, brought back. Anything else (failed, unknown, an operation
    still in progress after the wait) is nothing we may act on, and never
    taken for running."""
    from cudahook.core.backends import CHECKPOINTED, LOCKED, RUNNING, explain_state
    from cudahook.core.timeline import Timeline
    from cudahook.platform.errors import CudahookError

    from . import results

    troubled: dict[int, str] = {}
    try:
        with _busy(ctx, args.get("key", cid)):
            states, unread = ctx.engine.read_states(alive, Timeline(), settle=True)
            if unread:
                raise CudahookError("; ".join(unread[p] for p in sorted(unread)))
            todo = [p for p in alive if states[p] in (LOCKED, CHECKPOINTED)]
            troubled = {p: states[p] for p in alive if states[p] not in (RUNNING, LOCKED,
                                                                        CHECKPOINTED)}
            if not todo and not troubled:
                _drop(keep)
                ctx.log("guardian", container=cid, outcome="every process runs; nothing to "
                        "resume", run=how)
                return 0
            result = ctx.engine.restore(todo, unlock=not (
                keep and ctx.settings.vmm_restore_before_unlock),
                storage=_stored(args)) if todo else None
            if keep and result is not None:
                _vmm_restore(ctx, cid, keep, result)
    except CudahookError as exc:
        alive = _alive_procs(ctx, args)
        if not alive:
            ctx.log("guardian", container=cid, outcome="tasks exited while resuming")
            return 0
        return _unsafe(ctx, cid, alive, how, keep,
                       f"could not bring the workload back onto its GPU: {exc}")
    if troubled:
        return _unsafe(ctx, cid, sorted(troubled), how, keep, "; ".join(
            f"pid {p}: CUDA process is {explain_state(st)}, not running"
            for p, st in sorted(troubled.items())) + (f"; pids {todo} were brought back"
                                                      if todo else ""))
    assert result is not None
    _drop(keep)
    ctx.log("guardian", container=cid, pids=todo, outcome="resumed on GPU after the dump",
            run=how, total_s=result.timeline.total(), timeline=result.timeline.to_dict())
    results.remember(ctx, cid, "resume", ok=True, pids=todo)
    return 0


def _unsafe(ctx: Any, cid: str | None, pids: list[int], how: str, keep: dict[str, Any] | None,
            error: str) -> int:
    """Say that the workload was not brought back to a safe state, with the
    PIDs: logged, remembered for `cudahook status`, exit 4."""
    from cudahook.platform.errors import Exit

    from . import results

    ctx.log("guardian", container=cid, pids=pids, error=error, unsafe=True, run=how,
            vmm_state=keep["dir"] if keep else None)
    results.remember(ctx, cid, "resume", ok=False, unsafe=True, error=error, pids=pids)
    return int(Exit.UNSAFE)


# -- the restore side ---------------------------------------------------------------


def watch(ctx: Any, criu_pid: int, cid: str | None, init_pid: int,
          run_path: Path) -> int:
    """Arm the restore watcher for this CRIU restore (at post-restore: the
    tasks exist, and have not run); its PID."""
    child = _detached("watch_restore", {
        "criu_pid": criu_pid, "criu_start": ctx.host.start_time(criu_pid),
        "init": [init_pid, ctx.host.start_time(init_pid)], "container": cid,
        "settings": ctx.settings.as_dict(), "run": str(run_path)})
    return int(child.pid)


def watch_restore(arg: str) -> int:
    """Once CRIU and post-resume's action script are gone: unless post-resume
    recorded a restore that succeeded, end the restore's driver calls, then
    kill the container. Its image is unchanged, and a retry restores it.

    Hazard: the watcher killed (the OOM killer) while it waits, and then
    post-resume's script too, or while it acts: a half-restored container
    left alive. So the first watcher arms its successor at once (`_relay`):
    it is killed with its work still ahead of it, when a post-resume that
    then dies leaves nobody; unlike the guardian's, its wait is all of the
    restore's CUDA work, and a successor armed once the scripts are gone
    would be too late. It costs one more waiting process per CUDA restore."""
    from cudahook.platform.config import Settings

    from .context import Context

    args = json.loads(arg)
    cid = args.get("container")
    ctx = Context(Settings(**args["settings"]))
    try:
        if not _took_over(ctx, args, WATCHED):
            return 0  # the watcher before this one finished
        init_pid, init_start = args["init"]
        done = _record_of(args).get("done")
        done = done.get("post-resume") if isinstance(done, dict) else None
        if done != 0 and ctx.host.alive(init_pid, init_start):  # work left
            _relay(ctx, args, "watch_restore")
        return _watch_restore(ctx, args, cid)
    finally:
        _finished(args, WATCHED)


def _watch_restore(ctx: Any, args: dict[str, Any], cid: str | None) -> int:
    from pathlib import Path

    from cudahook.platform.errors import Exit
    from cudahook.platform.store import read_json

    from . import results
    from .containers import kill_container

    if not wait_exit(int(args["criu_pid"]), args["criu_start"], ctx.host):
        return int(Exit.FAILED)

    def progress() -> dict[str, Any]:
        data = read_json(Path(args["run"]))
        return data if isinstance(data, dict) else {}

    # A CRIU killed itself leaves a post-resume script that may still restore.
    hooks = progress().get("hooks") or {}
    for action in ("post-restore", "post-resume"):
        hook = hooks.get(action) if isinstance(hooks, dict) else None
        if isinstance(hook, list) and len(hook) == 2 and all(type(x) is int for x in hook):
            wait_exit(hook[0], hook[1], ctx.host)
    finished = progress().get("done") or {}
    done = finished.get("post-resume")
    if done == 0:
        return int(Exit.OK)  # restored, every process verified running
    stuck = _end_calls(ctx, args, cid)
    refused = finished.get("post-restore")
    if done is None and refused:
        # post-restore refused, cleanly: CRIU kills the tasks it restored.
        return int(Exit.UNSAFE if stuck else Exit.OK)
    init_pid, init_start = args["init"]
    killed = kill_container(ctx, init_pid) if ctx.host.alive(init_pid, init_start) else 0
    if done is not None and not killed and not stuck:
        return int(Exit.OK)  # post-resume failed closed itself, and said so
    why = ("post-resume did not finish (its action script was killed?)" if done is None
           else f"post-resume exited {done}")
    error = f"restore not finished: {why}; container killed ({killed} processes)"
    if stuck:
        error += f"; driver calls {stuck} could not be ended"
    ctx.log("restore-watcher", container=cid, error=error, unsafe=bool(stuck))
    if killed or stuck:
        results.remember(ctx, cid, "restore", ok=False, error=error, killed=killed,
                         unsafe=bool(stuck))
    return int(Exit.UNSAFE if stuck else Exit.FAILED)
