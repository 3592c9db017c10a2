"""The CRIU action script: the whole story of a GPU container's checkpoint and
restore, in the order CRIU tells it.

CRIU runs this script at every action of every dump and restore, GPU or not
(the shell in hooks/cudahook-criu-action lets only the three actions below,
and only containers that may hold a GPU, reach Python):

    dump:     pre-dump -> (tasks frozen) -> dump -> post-dump -> tasks killed
              or, with --leave-running or on failure, resumed
    restore:  pre-restore -> ... -> post-restore (tasks exist, not running)
              -> pre-resume -> tasks run -> post-resume

A non-zero exit aborts a dump at pre-dump and a restore up to post-restore;
at post-resume CRIU only logs it. When CRIU fails while freezing, it runs no
script at all. At post-dump and network-unlock the tasks are stopped, and a
stopped process's CUDA restore thread cannot run: CUDA work happens at
pre-dump, post-restore (checks only) and post-resume, nowhere else.

Who undoes what, at each failure point, is named where the step is taken.
"""

from __future__ import annotations

import contextlib
import sys
import time
from pathlib import Path

from cudahook.core import manifest
from cudahook.core.discovery import describe_holders, device_files
from cudahook.flow import criu_run as criu_run_steps
from cudahook.flow import guardian, results
from cudahook.flow.containers import (
    container_for,
    gpus_and_models,
    kill_container,
    lock_key,
    restored_pids,
    visible_gpus,
)
from cudahook.flow.context import Context
from cudahook.flow.criu_run import HANDLED, CriuRun
from cudahook.flow.restore_gate import plan_restore
from cudahook.platform.errors import (
    CudahookError,
    EnvironmentProblem,
    Exit,
    PhaseError,
    UsageError,
    report,
)
from cudahook.platform.marks import mark, prune_restore_marks
from cudahook.vmm import coordinator as vmm

from .criu_env import CriuCall

# typing costs milliseconds at every hook start: annotations only.
TYPE_CHECKING = False
if TYPE_CHECKING:
    from typing import Any




def main() -> int:
    from cudahook.platform import config

    from . import criu_env

    try:
        call = criu_env.from_env()
        if call.action not in HANDLED:
            return Exit.OK
        return run(Context(config.load()), call)
    except Exception as exc:  # a bug must still fail the action, in one line
        return report(exc)


def run(ctx: Context, call: CriuCall) -> int:
    """One action, once per CRIU run: CRIU's duplicate call gets the first
    call's outcome (see criu_run.py)."""
    step = {"pre-dump": pre_dump, "post-restore": post_restore,
            "post-resume": post_resume}.get(call.action)
    if step is None:
        return Exit.OK
    try:
        criu_run = CriuRun(ctx.store, ctx.host, call.criu_pid)
        earlier = criu_run.outcome(call.action)
        killed = earlier is None and criu_run.started(call.action)
        if earlier is None and not killed:
            criu_run.own_calls(call.action, ctx.host)  # before any call: platform/tools.py
    except Exception as exc:
        if call.action != "post-resume":
            raise
        # The tasks run already, and the shell let this call through only
        # because post-restore marked a CUDA restore: without the run's
        # record it cannot be finished, so it fails closed.
        with contextlib.suppress(OSError):
            mark("restore", str(call.criu_pid), on=False)
        try:
            init_pid: int | None = _need_init(ctx, call)
        except CudahookError:
            init_pid = None
        return _fail_closed(ctx, init_pid, None, None, exc)
    if killed:
        # Hazard: CRIU 3.19-4.1.1 run the second call even when the first was
        # killed mid-way, with no outcome recorded. Acting again would race
        # whatever the first call left in progress. Undo: none - this call
        # touches nothing; the operation fails, and the guardian (dump) or
        # the restore watcher (restore) deals with what the first call left.
        what = "dump" if call.action == "pre-dump" else "restore"
        error = (f"{call.action}: an earlier call in this CRIU run stopped without finishing "
                 f"(killed?): this {what} fails, and its "
                 f"{'guardian' if what == 'dump' else 'restore watcher'} deals with what "
                 "that call left; nothing was touched by this call")
        ctx.log(call.action, error=error, init_pid=call.init_pid)
        criu_run.finish(call.action, Exit.FAILED)
        print(f"cudahook: {error}", file=sys.stderr)
        return Exit.FAILED
    if earlier is not None:
        if earlier:  # its failure was told at the first call; say so again, in one line
            print(f"cudahook: {call.action}: failed earlier in this CRIU run (exit {earlier}); "
                  f"see {ctx.settings.log_file}", file=sys.stderr)
        return earlier
    try:
        rc = step(ctx, call, criu_run)
    except CudahookError as exc:
        ctx.log(call.action, error=str(exc), init_pid=call.init_pid)
        rc = int(exc.exit_code)
    except Exception as exc:  # recorded like any failure: CRIU's second call must not retry
        ctx.log(call.action, error=f"internal error: {type(exc).__name__}: {exc}",
                init_pid=call.init_pid)
        rc = Exit.FAILED
    criu_run.finish(call.action, rc)
    if call.action in ("pre-dump", "post-resume"):
        housekeeping(ctx)
    return rc


def housekeeping(ctx: Context) -> None:
    """Keep the state directory (RAM) bounded: finished CRIU runs, and
    containers gone without a poststop. Never fails the action."""
    with contextlib.suppress(OSError, CudahookError):
        ctx.store.prune_runs()
        ctx.store.prune(ctx.settings.state_retention_s)


# == checkpoint: pre-dump ======================================================
# The tasks still run. Everything that can refuse runs before any process is
# touched; after the first lock, every way out either rolls back or leaves
# someone (the guardian) to bring the processes back.


def pre_dump(ctx: Context, call: CriuCall, criu_run: CriuRun) -> int:
    # Hazard: CRIU 3.19-4.1.1 run this script twice per dump, and run the
    # second call even when the first failed - or was killed mid-way, with
    # no outcome recorded. The dump fails on the first call's exit status
    # whatever this one does; its guardian, if it was armed, brings the
    # workload back once CRIU is gone. Undo: none - this call touches nothing.
    if criu_run.get("step"):
        raise CudahookError(
            f"pre-dump: an earlier call in this CRIU run stopped without finishing "
            f"(last step: {criu_run['step']}; killed?): this dump fails, and its guardian "
            "brings back what it had touched; nothing was touched by this call")
    criu_run.step(criu_run_steps.STARTED)
    init_pid = _need_init(ctx, call)
    # Hazard: containerd and docker pause the container before `runc
    # checkpoint`. A frozen process's CUDA restore thread cannot run, and
    # cuda-checkpoint then hangs. Thaw for the CUDA phase; undo: freeze it
    # again before CRIU takes over, whatever happened.
    thawed = False
    try:
        if ctx.host.is_frozen(init_pid):
            ctx.host.set_frozen(init_pid, False)
            thawed = True
    except (OSError, TimeoutError) as exc:
        raise EnvironmentProblem(f"pre-dump: cannot thaw the paused container: {exc}") from exc
    try:
        # 1. Which container, with which options. Hazard: `cudahook status`
        #    calling cuda-checkpoint on processes being locked or checkpointed;
        #    undo: none needed - the container's busy lock keeps it out.
        record, ctx, opts = container_for(ctx, init_pid)
        with _busy(ctx, lock_key(ctx, record, init_pid)):
            return _checkpoint(ctx, call, criu_run, init_pid, record, opts)
    finally:
        if thawed:
            ctx.host.set_frozen(init_pid, True)


# How long a checkpoint waits for a `cudahook status` probe of the same container.
BUSY_WAIT_S = 30.0


def _busy(ctx: Context, cid: str | None) -> Any:
    return guardian.exclusive(ctx, cid, BUSY_WAIT_S, "pre-dump")


def _checkpoint(ctx: Context, call: CriuCall, criu_run: CriuRun, init_pid: int,
                record: dict[str, Any] | None, opts: Any) -> int:
    # An annotation can opt the container out.
    cid = (record or {}).get("id")
    if opts.enabled is False:
        ctx.log("pre-dump", container=cid, skipped="disabled by annotation")
        return Exit.OK

    # 2. Discover its CUDA processes, and check everything `cudahook check`
    #    knows would make this checkpoint fail: NVIDIA device files CRIU
    #    cannot dump (an NVML monitor), CRIU's own CUDA plugin acting on the
    #    same processes, a process stopped (cuda-checkpoint would hang on
    #    it), not running (one already locked or checkpointed, found by its
    #    restore thread, was not put there by this checkpoint: dumped, it
    #    would be restored without its GPU state), failed; too little host
    #    memory; persistence off. A task traced while it runs and the image
    #    size are left to CRIU, which fails cleanly on them (the guardian
    #    then resumes the workload). The same checks (flow/checks.py),
    #    refused with their reason code before anything is locked. Hazard: a
    #    probe that times out is not "not CUDA" - it refuses too, or a
    #    process would be dumped with live GPU state. Nothing touched: no undo.
    from cudahook.flow import checks  # the reason table: only pre-dump and post-restore need it

    verdict = checks.checkpoint_checks(ctx, init_pid=init_pid, full=False,
                                       image_dir=call.image_dir, container=cid)
    for w in verdict.warnings:
        ctx.log("pre-dump", container=cid, warning=w)
    found = verdict.found
    if not verdict.ok or found is None:
        checks.remember(ctx, cid, verdict)
        return _refuse(ctx, cid, init_pid, len(found.processes) if found else 0,
                       verdict.hook_exit, verdict.message() + "; nothing was locked",
                       reasons=[p.code for p in verdict.problems])
    if not found.processes:
        ctx.log("pre-dump", container=cid, init_pid=init_pid, cuda_processes=0)
        return Exit.OK
    if call.image_dir is None:
        raise UsageError("pre-dump: CRTOOLS_IMAGE_DIR is not set")

    # 3. Arm the guardian, before anything is touched. Hazard: this script
    #    can die at any point from here on (a runtime's or kubelet's timeout
    #    SIGKILLs it, the OOM killer), leaving processes locked or
    #    checkpointed with nobody to bring them back: CRIU then aborts the
    #    dump, and the guardian, once CRIU and this script are both gone,
    #    restores whichever it finds locked or checkpointed. Start times are
    #    taken first: it tells our processes from a later one that reused a
    #    PID. If it cannot be armed, nothing is touched.
    starts = {p.pid: _start_time(ctx, p.pid) for p in found.processes}
    try:
        guardian.spawn(ctx, call.criu_pid, cid, [(p, starts[p]) for p in found.pids],
                       criu_run.path, {p.pid: p.nspid for p in found.processes},
                       key=lock_key(ctx, record, init_pid))
    except Exception as exc:
        raise EnvironmentProblem(f"pre-dump: cannot arm the guardian: {exc}; "
                                 "nothing was locked") from exc
    criu_run.step(criu_run_steps.ARMED)

    # 4. What the manifest and a later restore need, and the VMM interposer's
    #    prepare step, which must run before the CUDA lock. A partial set of
    #    interposer sockets is refused here. Nothing is locked yet: a refusal
    #    aborts the dump and the workload never noticed. The state --prepare
    #    saved is copied for the guardian now, before any lock: CRIU's image
    #    directory is gone by the time the guardian acts.
    try:
        gpus, models = gpus_and_models(ctx, visible_gpus(record))
        version = ctx.backend.features.version
        began = time.monotonic()
        with_vmm = _interposer_prepare(ctx, cid, found.processes, call, (record or {}).get("key"))
        vmm_prepare_s = time.monotonic() - began if with_vmm else None
        if with_vmm:
            keep_vmm_state(call, criu_run)
    except CudahookError as exc:
        results.remember(ctx, cid, "checkpoint", ok=False, error=str(exc),
                  reasons=[exc.reason] if exc.reason else [])
        raise
    except OSError as exc:
        message = f"pre-dump: cannot keep the VMM state for the guardian: {exc}; nothing was locked"
        results.remember(ctx, cid, "checkpoint", ok=False, error=message)
        raise EnvironmentProblem(message) from exc

    # 5. Lock all (in parallel: a partly locked NCCL job can hang its peers),
    #    then checkpoint all. Undo on any failure: the engine rolls every
    #    touched process back and verifies each one `running`; CRIU then
    #    aborts on our exit status (the guardian finds them running and
    #    leaves them; a rollback that failed it tries again).
    criu_run.step(criu_run_steps.LOCKING)
    try:
        result = ctx.engine.checkpoint(found.processes, fresh_states=True)
    except PhaseError as exc:
        error, rc = str(exc), int(exc.exit_code)
        unsafe = not exc.safe
        # Hazard: the checkpoint dropped the VMM mappings of the processes it
        # reached, and the rollback does not bring them back. Undo: replay
        # the state --prepare saved into them; failing that, say unsafe.
        if with_vmm:
            undo = undo_prepare(ctx, cid, call.image_dir, _dropped_vmm(found.processes, exc))
            if undo:
                error, rc, unsafe = f"{error}; {undo}", Exit.UNSAFE, True
        if not unsafe:  # every process verified running: nothing left for the guardian
            criu_run.step(criu_run_steps.ROLLED_BACK)
        ctx.log("checkpoint", container=cid, error=error, pids=found.pids, unsafe=unsafe,
                timeline=exc.result.timeline.to_dict() if exc.result else None)
        results.remember(ctx, cid, "checkpoint", ok=False, error=error, unsafe=unsafe,
                  rolled_back=bool(exc.result and exc.result.rolled_back))
        return rc

    # Hazard: NVML handles (and a fork()ed child's CUDA references) survive
    # the CUDA checkpoint, and CRIU fails on them. Only now can they be told
    # from CUDA's own device files. Undo: put every process back on its GPU.
    leftover = {p.pid: files for p in found.processes
                if (files := device_files(ctx.host, p.pid, ctx.settings.device_regex))}
    if leftover:
        message = ("NVML_FDS: CRIU cannot dump open NVIDIA device files left after the CUDA checkpoint "
                   "(NVML handles are not released by it): "
                   + describe_holders(leftover, "CUDA process"))
        code = Exit.FAILED
        try:
            ctx.engine.restore(found.processes)
            message += "; every process was restored and runs"
        except PhaseError as exc:
            message += f"; rolling back failed: {exc}"
            code = Exit.UNSAFE
        # Their VMM mappings went with the checkpoint: replay them too.
        undo = undo_prepare(ctx, cid, call.image_dir,
                            [(p.pid, p.nspid) for p in found.processes]) if with_vmm else None
        if undo:
            message, code = f"{message}; {undo}", Exit.UNSAFE
        if code == Exit.FAILED:
            criu_run.step(criu_run_steps.ROLLED_BACK)
        ctx.log("checkpoint", container=cid, error=message, pids=found.pids)
        results.remember(ctx, cid, "checkpoint", ok=False, error=message, unsafe=code == Exit.UNSAFE,
                  rolled_back=True, reasons=["NVML_FDS"])
        return code

    # 6. Record the checkpoint in the image. Hazard: the dump can still fail
    #    after us (even while freezing, where CRIU runs no script), or run
    #    with --leave-running; either way CRIU lets the tasks run again,
    #    checkpointed, off their GPU: the guardian armed above brings them
    #    back. Undo if the manifest cannot be written: without it the
    #    restore could never bring the GPU state back - so remove it and
    #    restore everything now.
    criu_run.step(criu_run_steps.CHECKPOINTED)
    data = {
        "container_id": cid,
        "created": time.time(),
        "driver_version": version,
        "gpus": gpus,
        # Model and size of each: a restore elsewhere needs the same chip.
        "gpu_models": {u: {"name": models[u][0], "memory_mib": models[u][1]}
                       for u in gpus if u in models},
        "vmm": with_vmm,
        "gpu_memory_bytes": verdict.facts.get("gpu_memory_bytes"),
        "processes": [{"nspid": p.nspid, "pid": p.pid, "state": p.state}
                      for p in found.processes],
        "timeline": result.timeline.to_dict(),
    }
    try:
        manifest.write(call.image_dir, data, files=[vmm.STATE_FILE] if with_vmm else [])
    except Exception as exc:
        with contextlib.suppress(OSError):
            (call.image_dir / manifest.NAME).unlink()
        ctx.engine.restore(found.processes)
        undo = undo_prepare(ctx, cid, call.image_dir,
                            [(p.pid, p.nspid) for p in found.processes]) if with_vmm else None
        if not undo:
            criu_run.step(criu_run_steps.ROLLED_BACK)
        raise (PhaseError("checkpoint", [f"cannot record the checkpoint: {exc}", undo],
                          safe=False) if undo else
               EnvironmentProblem(f"pre-dump: cannot record the checkpoint: {exc}")) from exc

    # 7. Handed over to CRIU: it dumps the processes, now without GPU state.
    criu_run.step(criu_run_steps.RECORDED)
    criu_run["handed_over"] = time.time()  # CRIU dumps from here (the guardian's metric)
    ctx.log("checkpoint", container=cid, pids=found.pids,
            nspids=[p.nspid for p in found.processes], total_s=result.timeline.total(),
            timeline=result.timeline.to_dict())
    results.remember(ctx, cid, "checkpoint", ok=True, pids=found.pids,
              total_s=round(result.timeline.total(), 6), timeline=result.timeline.to_dict(),
              gpu_bytes=verdict.facts.get("gpu_memory_bytes"), vmm_prepare_s=vmm_prepare_s,
              gpu_model=_model({u: m[0] for u, m in models.items()}, gpus))
    criu_run["checkpointed"] = found.pids
    return Exit.OK


def _interposer_prepare(ctx: Context, cid: str | None, procs: list[Any], call: CriuCall,
                        key: str | None) -> bool:
    """Detect the CUDA VMM interposer and run its coordinator's prepare."""
    detection = vmm.detect(ctx.host, procs)
    if not detection.participates:
        return False
    if key:  # poststop removes these sockets, and only these
        ctx.store.update(key, vmm_sockets=detection.sockets)
    assert call.image_dir is not None
    output = vmm.run_coordinator(
        ctx.host, ctx.settings.tool("vmm_coordinator"), "prepare", str(ctx.host.proc),
        call.image_dir, [(p.pid, p.nspid) for p in procs], ctx.settings.vmm_timeout_s)
    ctx.log("vmm-prepare", container=cid, pids=[p.pid for p in procs], output=output)
    return True


def _dropped_vmm(procs: list[Any], exc: PhaseError) -> list[tuple[int, int]]:
    """(pid, nspid) of the processes a failed checkpoint had checkpointed and
    its rollback brought back: their VMM mappings went with the checkpoint."""
    steps = exc.result.timeline.steps if exc.result else []
    back = {s.pid for s in steps if s.ok and s.step in ("rollback-restore", "rollback-toggle")}
    return [(p.pid, p.nspid) for p in procs if p.pid in back]


def undo_prepare(ctx: Context, cid: str | None, directory: Path | None,
                 pairs: list[tuple[int, int]]) -> str | None:
    """Replay the VMM state that --prepare saved into processes that run
    again after a checkpoint dropped it. The error, if that failed: their
    mappings are then lost, and the outcome is unsafe."""
    if not pairs:
        return None
    if directory is None:
        return "VMM mappings not restored: no image directory"
    try:
        output = vmm.run_coordinator(ctx.host, ctx.settings.tool("vmm_coordinator"), "restore",
                                     "", directory, pairs, ctx.settings.vmm_timeout_s)
    except CudahookError as exc:
        return f"VMM mappings not restored: {exc}"
    ctx.log("vmm-restore", container=cid, pids=[p for p, _ in pairs], output=output,
            reason="rollback")
    return None


def keep_vmm_state(call: CriuCall, criu_run: CriuRun) -> None:
    """A private copy of the VMM state for the guardian, where it looks for
    one: by the time it runs, CRIU's image directory path is gone, or the
    image was dropped. Written whole or not at all: the guardian takes the
    directory's presence for "prepare ran". The image directory is the
    container's to fill: the state is copied as post-restore copies it
    (no link followed, regular file only, capped, under a deadline)."""
    import shutil

    assert call.image_dir is not None
    copy = guardian.vmm_dir(criu_run.path)
    partial = copy.with_name(copy.name + ".new")
    shutil.rmtree(partial, ignore_errors=True)
    partial.mkdir(mode=0o700)
    try:
        vmm.copy_state(call.image_dir, partial, "pre-dump")
    except BaseException:
        shutil.rmtree(partial, ignore_errors=True)  # refused: no half copy left in /run
        raise
    partial.rename(copy)


# == restore: post-restore =====================================================
# The tasks exist but have not run: the last moment to refuse cleanly. A
# non-zero exit makes CRIU kill them and fail the restore; the image is
# untouched and the restore can be retried once the cause is fixed.


def post_restore(ctx: Context, call: CriuCall, criu_run: CriuRun) -> int:
    if call.image_dir is None:
        raise UsageError("post-restore: CRTOOLS_IMAGE_DIR is not set")
    # 1. Only a checkpoint that holds CUDA state carries a manifest. One
    #    that is there but unreadable is the checks' MANIFEST_UNREADABLE
    #    (exit 6, as for `cudahook check --image`), not bad input.
    try:
        data = manifest.read(call.image_dir)
    except manifest.ManifestError:
        data = {}
    if data is None:
        return Exit.OK
    # 2. Hazard: this script or post-resume's killed (a runtime's timeout, the
    #    OOM killer) - with CRIU itself, when a runtime kills the whole
    #    process group - leaves the restored tasks running checkpointed, or
    #    never resumed by CRIU: CRIU only logs a post-resume failure, and
    #    reports the restore done. Undo: the restore watcher, armed before
    #    anything else, kills the container once CRIU and these scripts are
    #    gone, unless post-resume recorded a restore that succeeded. Left
    #    open: a kill of the whole group (CRIU with it) before this point -
    #    while the interpreter starts - leaves the never-resumed tasks to the
    #    runtime, which deletes a container whose runc failed.
    init_pid = _need_init(ctx, call)
    try:
        watcher = guardian.watch(ctx, call.criu_pid, data.get("container_id"), init_pid,
                                 criu_run.path)
        criu_run.note("watcher", [watcher, _start_time(ctx, watcher)])
    except Exception as exc:
        raise EnvironmentProblem(f"post-restore: cannot arm the restore watcher: {exc}") from exc
    # 3. The restore checks of `cudahook check --image` (flow/checks.py): the
    #    image intact, CRIU's own CUDA plugin absent (it would restore these
    #    processes without a device map), the same driver branch, the GPUs
    #    present, a device map this driver can apply, the VMM coordinator.
    #    A refusal here is clean; one that no retry here can change is
    #    remembered, and the next attempt refused at once.
    from cudahook.flow import checks

    record, ctx, opts = container_for(ctx, init_pid)
    verdict = checks.restore_checks(ctx, call.image_dir, record, opts)
    cid = (record or {}).get("id") or data.get("container_id")
    kept = checks.write_verdict(ctx, call.image_dir, verdict)
    criu_run["criu_restore_s"] = results.criu_elapsed(ctx, call.criu_pid)
    if not verdict.ok:
        checks.remember(ctx, cid, verdict)
        ctx.log("post-restore", container=cid, verdict=str(kept), reasons=[
            p.code for p in verdict.problems], cached=verdict.cached)
        results.remember(ctx, cid, "restore", ok=False, error=verdict.message(),
                  reasons=[p.code for p in verdict.problems], gpu_model=_model(data))
        raise checks.Refused(verdict, "post-restore")
    mapping = verdict.facts.get("device_map")
    criu_run["device_map"] = mapping
    # 4. Hazard: by post-resume CRIU has closed the image directory
    #    (CRTOOLS_IMAGE_DIR names a dead /proc/<criu>/fd/N): keep what the
    #    restore needs from it now - the manifest, and where the VMM state is.
    #    Hazard: an image directory reused from an older checkpoint can hold
    #    a stale cuda-vmm.state; only the manifest says whether the VMM step
    #    took part in this one.
    vmm_dir = None
    if not data.get("vmm"):
        if vmm.has_state(call.image_dir):
            ctx.log("post-restore", warning="cuda-vmm.state in the image is not from this "
                    "checkpoint (its manifest has no VMM step): ignored")
    else:  # the checks made sure it is there
        vmm_dir = vmm.locate_state(call.image_dir, criu_run.path.with_suffix(".vmm"))
    criu_run["vmm_dir"] = vmm_dir
    criu_run["manifest"] = data
    # 5. The mark that lets the shell start Python at post-resume. Without it
    #    post-resume would be skipped and the workload left checkpointed: fail
    #    the restore now instead, while that is still clean.
    prune_restore_marks()  # left by restores whose post-resume never ran
    try:
        mark("restore", str(call.criu_pid))
    except OSError as exc:
        raise EnvironmentProblem(f"post-restore: cannot leave a mark for post-resume: {exc}") from exc
    ctx.log("post-restore", container=(record or {}).get("id"), init_pid=call.init_pid,
            device_map=mapping, checked="manifest, driver, GPUs, device map")
    return Exit.OK


# == restore: post-resume ======================================================
# The tasks run, still checkpointed. CRIU only logs a failure here, so
# failing closed is ours to do: a workload is never released half-restored.


def post_resume(ctx: Context, call: CriuCall, criu_run: CriuRun) -> int:
    """Every step here runs inside one fail-closed guard: the tasks run
    already, so a failure of any of them - reading the manifest, finding
    the container in the state directory, the driver calls - kills the
    container instead of leaving it running checkpointed while CRIU
    reports the restore successful."""
    with contextlib.suppress(OSError):
        mark("restore", str(call.criu_pid), on=False)
    data: dict[str, Any] | None = None
    cid: str | None = None
    init_pid: int | None = None  # set once it is known to be a container's init
    try:
        data = criu_run.get("manifest")
        if data is None and "post-restore" not in criu_run["done"]:
            data = manifest.read(call.image_dir) if call.image_dir else None
        if data is None:
            return Exit.OK
        cid = data.get("container_id")
        init_pid = _need_init(ctx, call)
        record, ctx, opts = container_for(ctx, init_pid)
        cid = (record or {}).get("id") or cid
        from cudahook.platform import busy

        # Hazard: `cudahook status` calling cuda-checkpoint on processes being
        # restored. The container's busy lock keeps it out - but never at the
        # cost of the restore: after the wait it goes on without the lock.
        with busy.hold(ctx.settings.state_dir, lock_key(ctx, record, init_pid), BUSY_WAIT_S,
                       required=False):
            result, procs, mapping, vmm_s = _restore(ctx, criu_run, data, init_pid, record,
                                                     opts, cid)
    except Exception as exc:  # whatever failed, after CRIU restored the tasks
        return _fail_closed(ctx, init_pid, cid, data, exc)
    _restored(ctx, criu_run, data, record, cid, result, procs, mapping, vmm_s)
    return Exit.OK


def _restore(ctx: Context, criu_run: CriuRun, data: dict[str, Any], init_pid: int,
             record: dict[str, Any] | None, opts: Any,
             cid: str | None) -> tuple[Any, list[int], Any, float | None]:
    # 1. The device map post-restore settled on, and the restored
    #    processes by their namespace PIDs (host PIDs changed).
    mapping = (criu_run["device_map"] if "device_map" in criu_run
               else plan_restore(ctx, record, opts, data))
    procs = restored_pids(ctx, init_pid, data)
    # 2. Restore all (onto the new GPUs if they changed), then unlock all
    #    and verify each one `running`. Hazard: a remap that skips the
    #    unlock leaves the workload running but blocked forever - the
    #    engine verifies. A restore that fails on memory leaves a process
    #    checkpointed: the engine releases nothing on failure.
    vmm_dir = criu_run.get("vmm_dir")
    before = bool(vmm_dir) and ctx.settings.vmm_restore_before_unlock
    result = ctx.engine.restore(procs, mapping, unlock=not before)
    # 3. The VMM coordinator replays CUDA calls inside the workload: it
    #    needs the processes restored and, by default, unlocked.
    began, vmm_s = time.monotonic(), None
    if vmm_dir:
        pairs = list(zip(procs, (p["nspid"] for p in data["processes"]), strict=True))
        output = vmm.run_coordinator(ctx.host, ctx.settings.tool("vmm_coordinator"),
                                     "restore", "", Path(vmm_dir), pairs,
                                     ctx.settings.vmm_timeout_s)
        ctx.log("vmm-restore", container=cid, pids=procs, output=output)
        vmm_s = time.monotonic() - began
        if before:
            ctx.engine.unlock(procs)
    return result, procs, mapping, vmm_s


def _fail_closed(ctx: Context, init_pid: int | None, cid: str | None,
                 data: dict[str, Any] | None, exc: Exception) -> int:
    """Undo: none is possible for a half-restored workload. Kill the
    container; the image is unchanged, and a retry restores from it. An
    init PID that is not a container's (unset, gone, a kernel thread) names
    nothing to kill: the error says so."""
    killed = kill_container(ctx, init_pid) if init_pid is not None else 0
    if isinstance(exc, CudahookError):
        what, rc = str(exc), int(exc.exit_code) or Exit.FAILED
    else:  # a bug must still fail closed, and say what it was
        what, rc = f"internal error: {type(exc).__name__}: {exc}", Exit.FAILED
    error = f"restore failed, container killed ({killed} processes): {what}"
    timeline = (exc.result.timeline.to_dict()
                if isinstance(exc, PhaseError) and exc.result else None)
    with contextlib.suppress(Exception):  # the kill is done; telling it must not undo it
        ctx.log("restore", container=cid, error=error, timeline=timeline)
        results.remember(ctx, cid, "restore", ok=False, error=error, timeline=timeline,
                         killed=killed, gpu_model=_model(data))
    return rc


def _restored(ctx: Context, criu_run: CriuRun, data: dict[str, Any],
              record: dict[str, Any] | None, cid: str | None,
              result: Any, procs: list[int], mapping: Any, vmm_s: float | None) -> None:
    """Record a restore that succeeded. Only bookkeeping: the workload runs
    on its GPU, verified, and a full or damaged state directory must not
    kill it now."""
    try:
        if criu_run.get("vmm_dir") and record:
            record_vmm_sockets(ctx, record["key"], procs, [p["nspid"] for p in data["processes"]])
        ctx.log("restore", container=cid, pids=procs, device_map=mapping,
                total_s=result.timeline.total(), timeline=result.timeline.to_dict())
        results.remember(ctx, cid, "restore", ok=True, pids=procs, device_map=mapping,
                         total_s=round(result.timeline.total(), 6),
                         timeline=result.timeline.to_dict(),
                         gpu_bytes=data.get("gpu_memory_bytes"), gpu_model=_model(data),
                         criu_restore_s=criu_run.get("criu_restore_s"), vmm_restore_s=vmm_s)
    except Exception as exc:
        with contextlib.suppress(Exception):
            ctx.log("restore", container=cid, pids=procs,
                    warning=f"restored, but the result was not recorded: {exc}")


def record_vmm_sockets(ctx: Context, key: str, pids: list[int], nspids: list[int]) -> None:
    """The restored shims' sockets are new files: record them as this
    container's, for poststop. Best effort: without it they are only left."""
    from cudahook.core.discovery import CudaProcess

    with contextlib.suppress(Exception):
        found = vmm.detect(ctx.host, [CudaProcess(p, n) for p, n in zip(pids, nspids, strict=True)])
        if found.participates:
            ctx.store.update(key, vmm_sockets=found.sockets)


# -- small helpers --------------------------------------------------------------


def _refuse(ctx: Context, cid: str | None, init_pid: int, cuda_processes: int, code: int,
            message: str, reasons: list[str]) -> int:
    """A refusal before anything was touched: logged, remembered, returned."""
    ctx.log("pre-dump", container=cid, init_pid=init_pid, error=message,
            cuda_processes=cuda_processes, reasons=reasons)
    results.remember(ctx, cid, "checkpoint", ok=False, error=message, reasons=reasons)
    return code


def _need_init(ctx: Context, call: CriuCall) -> int:
    if call.init_pid is None:
        raise UsageError(f"{call.action}: CRTOOLS_INIT_PID is not set")
    try:
        parent = ctx.host.ppid(call.init_pid)
    except Exception:
        raise UsageError(f"{call.action}: CRTOOLS_INIT_PID {call.init_pid}: "
                         "no such process") from None
    if parent in (0, 2):  # the kernel's own threads: nothing CRIU restores or dumps
        raise UsageError(f"{call.action}: CRTOOLS_INIT_PID {call.init_pid} is a kernel thread, "
                         "not a container's init")
    return call.init_pid


def _start_time(ctx: Context, pid: int) -> int | None:
    try:
        return ctx.host.start_time(pid)
    except Exception:
        return None


def _model(data: dict[str, Any] | None, gpus: list[str] | None = None) -> str | None:
    """The GPU model label of the metrics: the first GPU's, from
    {uuid: name} or a manifest's gpu_models."""
    if data is None:
        return None
    models = data.get("gpu_models") if "gpu_models" in data else data
    uuids = gpus if gpus is not None else list(data.get("gpus") or [])
    for u in uuids:
        m = (models or {}).get(u) if isinstance(models, dict) else None
        name = m.get("name") if isinstance(m, dict) else m
        if isinstance(name, str) and name:
            return name
    return None
