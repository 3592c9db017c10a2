"""The restore, told in order.

post-restore: the tasks exist but have not run - the last moment to refuse
cleanly. A non-zero exit makes CRIU kill them and fail the restore; the
image is untouched and the restore can be retried once the cause is fixed.

    post_restore     read the manifest; no CUDA state: nothing to do
      _watch         arm the restore watcher, before anything else
      _check         the checks of `cudahook check --image`: refuse cleanly
                     (GPU memory in storage: every chunk against its digest)
      _keep          what post-resume needs from the image, kept now
      _leave_mark    the mark that lets post-resume reach Python

post-resume: the tasks run, still checkpointed. CRIU only logs a failure
here, so failing closed is ours: a workload is never released half-restored.

    post_resume      one fail-closed guard around every step
      _restore       restore all (with the device map; storage: from the
                     image's chunks, each checked again), unlock, verify
                     running; the VMM replay
      _fail_closed   undo for a half-restored workload: none is possible -
                     kill the container; the image is unchanged
      _restored      the bookkeeping of a restore that succeeded
"""

from __future__ import annotations

import contextlib
import time
from pathlib import Path

from cudahook.core import manifest
from cudahook.core.manifest import Manifest
from cudahook.platform.errors import CudahookError, EnvironmentProblem, Exit, PhaseError, UsageError
from cudahook.platform.marks import mark, prune_restore_marks
from cudahook.vmm import coordinator as vmm

from . import guardian, results, vmm_steps
from .containers import (
    container_for,
    kill_container,
    lock_key,
    need_init,
    restored_pids,
    start_time,
)
from .context import Context
from .criu_run import CriuRun
from .restore_gate import plan_restore

# typing costs milliseconds at every hook start: annotations only.
TYPE_CHECKING = False
if TYPE_CHECKING:
    from typing import Any



# == post-restore ===============================================================


def post_restore(ctx: Context, image_dir: Path | None, init_pid: int | None, criu_pid: int,
                 run: CriuRun) -> int:
    if image_dir is None:
        raise UsageError("post-restore: CRTOOLS_IMAGE_DIR is not set")
    # Only a checkpoint that holds CUDA state carries a manifest. One that
    # is there but unreadable is the checks' MANIFEST_UNREADABLE (exit 6, as
    # for `cudahook check --image`), not bad input.
    # The file is read once, here: the checks judge the very manifest the
    # restore goes on to use.
    from .checks import read_manifest

    found = read_manifest(image_dir)
    if found is None:
        return Exit.OK
    pid = need_init(ctx, "post-restore", init_pid)
    _watch(ctx, criu_pid, found, pid, run)
    record, ctx, m, mapping = _check(ctx, image_dir, found, pid, criu_pid, run)
    _keep(ctx, image_dir, m, mapping, run)
    _leave_mark(criu_pid)
    ctx.log("post-restore", container=(record or {}).get("id"), init_pid=pid,
            device_map=mapping, checked="manifest, driver, GPUs, device map")
    return Exit.OK


def _watch(ctx: Context, criu_pid: int, found: Manifest | CudahookError, init_pid: int,
           run: CriuRun) -> None:
    """Hazard: this script or post-resume's killed (a runtime's timeout, the
    OOM killer) - with CRIU itself, when a runtime kills the whole process
    group - leaves the restored tasks running checkpointed, or never
    resumed by CRIU: CRIU only logs a post-resume failure, and reports the
    restore done. Undo: the restore watcher, armed before anything else,
    kills the container once CRIU and these scripts are gone, unless
    post-resume recorded a restore that succeeded. Left open: a kill of the
    whole group (CRIU with it) before this point - while the interpreter
    starts - leaves the never-resumed tasks to the runtime, which deletes a
    container whose runc failed."""
    try:
        cid = found.container_id if isinstance(found, Manifest) else None
        watcher = guardian.watch(ctx, criu_pid, cid, init_pid, run.path)
        run.note("watcher", [watcher, start_time(ctx, watcher)])
    except Exception as exc:
        raise EnvironmentProblem(f"post-restore: cannot arm the restore watcher: {exc}") from exc


def _check(ctx: Context, image_dir: Path, found: Manifest | CudahookError, init_pid: int,
           criu_pid: int, run: CriuRun) -> tuple[dict[str, Any] | None, Context, Manifest, Any]:
    """The restore checks of `cudahook check --image` (flow/checks.py): the
    image intact (GPU memory in storage: every chunk, and a driver with
    custom storage to restore it), CRIU's own CUDA plugin absent (it would restore these
    processes without a device map), the same driver branch, the GPUs
    present, a device map this driver can apply, the VMM coordinator. A
    refusal here is clean; one that no retry here can change is
    remembered, and the next attempt refused at once. The container's
    record, its context, the manifest and the device map."""
    from . import checks

    record, ctx, opts = container_for(ctx, init_pid)
    verdict = checks.restore_checks(ctx, image_dir, record, opts, found=found)
    m = found if isinstance(found, Manifest) else None
    cid = (record or {}).get("id") or (m.container_id if m else None)
    kept = checks.write_verdict(ctx, image_dir, verdict)
    run["criu_restore_s"] = results.criu_elapsed(ctx, criu_pid)
    if not verdict.ok:
        ctx.log("post-restore", container=cid, verdict=str(kept), reasons=[
            p.code for p in verdict.problems], cached=verdict.cached)
        results.remember(ctx, cid, "restore", check=verdict.summary(), ok=False,
                         error=verdict.message(), reasons=[p.code for p in verdict.problems],
                         gpu_model=m.gpu_model() if m else None)
        raise checks.Refused(verdict, "post-restore")
    assert m is not None  # an unreadable manifest is refused above
    mapping = verdict.facts.get("device_map")
    run["device_map"] = mapping
    return record, ctx, m, mapping


def _keep(ctx: Context, image_dir: Path, m: Manifest, mapping: Any, run: CriuRun) -> None:
    """Hazard: by post-resume CRIU has closed the image directory
    (CRTOOLS_IMAGE_DIR names a dead /proc/<criu>/fd/N): keep what the
    restore needs from it now - the manifest, and where the VMM state is.
    Hazard: an image directory reused from an older checkpoint can hold a
    stale cuda-vmm.state; only the manifest says whether the VMM step took
    part in this one."""
    vmm_dir = None
    if not m.vmm:
        if vmm.has_state(image_dir):
            ctx.log("post-restore", warning="cuda-vmm.state in the image is not from this "
                    "checkpoint (its manifest has no VMM step): ignored")
    else:  # the checks made sure it is there
        vmm_dir = vmm.locate_state(image_dir, run.path.with_suffix(".vmm"))
    run["vmm_dir"] = vmm_dir
    run["gpu_storage"] = _storage_root(image_dir, m)
    run["manifest"] = m


def _storage_root(image_dir: Path, m: Manifest) -> dict[str, Any] | None:
    """Hazard: CRIU closes the image directory before post-resume, and the
    GPU memory is too large to copy aside as the VMM state is. Kept: its
    real path (CRTOOLS_IMAGE_DIR is a /proc/<criu>/fd/N link) and identity,
    which post-resume checks before it reads a byte from there."""
    import os

    if m.gpu_storage is None:
        return None
    root = os.path.realpath(image_dir / m.gpu_storage.dir)
    st = os.lstat(root)
    return {"dir": root, "dev": st.st_dev, "ino": st.st_ino}


def _leave_mark(criu_pid: int) -> None:
    """The mark that lets the shell start Python at post-resume. Without it
    post-resume would be skipped and the workload left checkpointed: fail
    the restore now instead, while that is still clean."""
    prune_restore_marks()  # left by restores whose post-resume never ran
    try:
        mark("restore", str(criu_pid))
    except OSError as exc:
        raise EnvironmentProblem(f"post-restore: cannot leave a mark for post-resume: {exc}") from exc


# == post-resume ================================================================


def post_resume(ctx: Context, image_dir: Path | None, init_pid: int | None, criu_pid: int,
                run: CriuRun) -> int:
    """Every step here runs inside one fail-closed guard: the tasks run
    already, so a failure of any of them - reading the manifest, finding
    the container in the state directory, the driver calls - kills the
    container instead of leaving it running checkpointed while CRIU
    reports the restore successful."""
    from cudahook.platform import busy

    with contextlib.suppress(OSError):
        mark("restore", str(criu_pid), on=False)
    data: Manifest | None = None
    cid: str | None = None
    pid: int | None = None  # set once it is known to be a container's init
    try:
        data = run.get("manifest")
        if data is None and "post-restore" not in run["done"]:
            data = manifest.read(image_dir) if image_dir else None
        if data is None:
            return Exit.OK
        cid = data.container_id
        pid = need_init(ctx, "post-resume", init_pid)
        record, ctx, opts = container_for(ctx, pid)
        cid = (record or {}).get("id") or cid
        # Hazard: `cudahook status` calling cuda-checkpoint on processes being
        # restored. The container's busy lock keeps it out - but never at the
        # cost of the restore: after the wait it goes on without the lock.
        with busy.hold(ctx.settings.state_dir, lock_key(ctx, record, pid), guardian.BUSY_WAIT_S,
                       required=False):
            result, procs, mapping, vmm_s = _restore(ctx, run, data, pid, record, opts, cid)
    except Exception as exc:  # whatever failed, after CRIU restored the tasks
        return fail_closed(ctx, pid, cid, data, exc)
    _restored(ctx, run, data, record, cid, result, procs, mapping, vmm_s)
    return Exit.OK


def _restore(ctx: Context, run: CriuRun, data: Manifest, init_pid: int,
             record: dict[str, Any] | None, opts: Any,
             cid: str | None) -> tuple[Any, list[int], Any, float | None]:
    # 1. The device map post-restore settled on, and the restored
    #    processes by their namespace PIDs (host PIDs changed).
    mapping = run["device_map"] if "device_map" in run else plan_restore(ctx, record, opts, data)
    procs = restored_pids(ctx, init_pid, data)
    # 2. Restore all (onto the new GPUs if they changed), then unlock all
    #    and verify each one `running`. Hazard: a remap that skips the
    #    unlock leaves the workload running but blocked forever - the
    #    engine verifies. A restore that fails on memory leaves a process
    #    checkpointed: the engine releases nothing on failure.
    vmm_dir = run.get("vmm_dir")
    before = bool(vmm_dir) and ctx.settings.vmm_restore_before_unlock
    storage = _storage_dirs(run, data, procs)
    # Post-restore verified every chunk (its checks): the helper checks each
    # again only on its way in.
    result = ctx.engine.restore(procs, mapping, unlock=not before, storage=storage,
                                storage_checked=True)
    # 3. The VMM coordinator replays CUDA calls inside the workload: it
    #    needs the processes restored and, by default, unlocked.
    began, vmm_s = time.monotonic(), None
    if vmm_dir:
        pairs = list(zip(procs, data.nspids, strict=True))
        vmm_steps.replay(ctx, cid, vmm_dir, pairs)
        vmm_s = time.monotonic() - began
        if before:
            ctx.engine.unlock(procs)
    return result, procs, mapping, vmm_s


def _storage_dirs(run: CriuRun, data: Manifest, procs: list[int]) -> dict[int, str] | None:
    """Host PID -> the directory its GPU memory is restored from (storage),
    or None (host memory). The directory must be the one post-restore
    verified, and each process's chunk manifest the one this image's
    manifest records: the helper checks every chunk against that file
    before it touches the process, and again as it copies each one in."""
    import hashlib
    import os

    from cudahook.platform import safeio

    if data.gpu_storage is None:
        return None
    kept = run.get("gpu_storage")
    if not kept:
        raise EnvironmentProblem("post-resume: post-restore kept no GPU-memory directory")
    st = os.lstat(kept["dir"])
    if (st.st_dev, st.st_ino) != (kept["dev"], kept["ino"]):
        raise EnvironmentProblem(f"post-resume: {kept['dir']} is no longer the directory "
                                 "post-restore verified")
    by_nspid = {p.nspid: p for p in data.gpu_storage.processes}
    out = {}
    for pid, nspid in zip(procs, data.nspids, strict=True):
        where = os.path.join(kept["dir"], str(nspid))
        raw = safeio.read_bytes(os.path.join(where, manifest.STORAGE_MANIFEST), 16 << 20)
        want = by_nspid[nspid]
        if hashlib.sha256(raw).hexdigest() != want.manifest_sha256:
            raise EnvironmentProblem(f"post-resume: {manifest.STORAGE_DIR}/{nspid}/"
                                     f"{manifest.STORAGE_MANIFEST} changed since post-restore",
                                     reason="IMAGE_CHECKSUM")
        out[pid] = where
    return out


def fail_closed(ctx: Context, init_pid: int | None, cid: str | None,
                data: Manifest | None, exc: Exception) -> int:
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
                         killed=killed, gpu_model=data.gpu_model() if data else None)
    return rc


def _restored(ctx: Context, run: CriuRun, data: Manifest,
              record: dict[str, Any] | None, cid: str | None,
              result: Any, procs: list[int], mapping: Any, vmm_s: float | None) -> None:
    """Record a restore that succeeded. Only bookkeeping: the workload runs
    on its GPU, verified, and a full or damaged state directory must not
    kill it now."""
    try:
        if run.get("vmm_dir") and record:
            vmm_steps.record_sockets(ctx, record["key"], procs, data.nspids)
        ctx.log("restore", container=cid, pids=procs, device_map=mapping,
                total_s=result.timeline.total(), timeline=result.timeline.to_dict())
        results.remember(ctx, cid, "restore", ok=True, pids=procs, device_map=mapping,
                         total_s=round(result.timeline.total(), 6),
                         timeline=result.timeline.to_dict(),
                         gpu_bytes=data.gpu_memory_bytes, gpu_model=data.gpu_model(),
                         criu_restore_s=run.get("criu_restore_s"), vmm_restore_s=vmm_s)
    except Exception as exc:
        with contextlib.suppress(Exception):
            ctx.log("restore", container=cid, pids=procs,
                    warning=f"restored, but the result was not recorded: {exc}")
