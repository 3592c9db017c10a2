"""The checkpoint, told in order: what pre-dump does while the tasks still run.

    pre_dump         refuse a second start; thaw a paused container
    _checkpoint      which container; opted out?
      _where         host memory or storage for the GPU memory (`gpu_memory`)
      _check         discovery and every check: refuse before anything is touched
      _reserve       storage: the image's space for GPU memory, preallocated
                     and held until the copy-out writes into it;
                     undo: remove what was written there
      _arm           the guardian, for a script killed from here on
      _prepare       the VMM interposer's prepare; undo: replay its state
      _lock_all      lock all, checkpoint all (storage: into the image);
                     undo: restore all
      _unreserve     storage: what is left of the reservation goes
      _no_nvml_left  NVML handles CRIU cannot dump
      _record        the manifest; undo: remove it
      _keep          storage: the chunks hard-linked for the guardian
      _hand_over     CRIU dumps the processes, now without GPU state

Every step that changes something pushes its undo on one stack (undo.py);
any failure unwinds it, last step first. The engine's own rollback of a
partly locked set is the lock step's; what the stack adds is every undo
after it. Once the manifest is written the stack commits: from then on a
failed dump is the guardian's to mend.
"""

from __future__ import annotations

import contextlib
import time
from pathlib import Path

from cudahook.core import manifest
from cudahook.core.discovery import describe_holders, device_files
from cudahook.platform.errors import (
    CudahookError,
    EnvironmentProblem,
    Exit,
    PhaseError,
    UsageError,
)

from . import criu_run as steps
from . import guardian, results, vmm_steps
from .containers import container_for, gpus_and_models, lock_key, need_init, start_time, visible_gpus
from .context import Context
from .criu_run import CriuRun
from .undo import Undo

# typing costs milliseconds at every hook start: annotations only.
TYPE_CHECKING = False
if TYPE_CHECKING:
    from typing import Any

    from cudahook.core.discovery import CudaProcess



# What a failed "restore every process" undo is reported as.
ROLLBACK_FAILED = "rolling back failed"


class Checkpoint:
    """What the steps of one pre-dump learn and hand on. (A plain class: the
    dataclasses module costs every hook start milliseconds of imports.)"""

    def __init__(self, ctx: Context, image_dir: Path | None, criu_pid: int, run: CriuRun,
                 init_pid: int, undo: Undo):
        self.ctx, self.image_dir, self.criu_pid, self.run = ctx, image_dir, criu_pid, run
        self.init_pid, self.undo = init_pid, undo
        self.record: dict[str, Any] | None = None
        self.opts: Any = None
        self.verdict: Any = None
        self.procs: list[CudaProcess] = []
        self.with_vmm = False
        # The processes that run again after the checkpoint dropped their VMM
        # mappings: whoever brings them back says which (see _prepare).
        self.back: list[tuple[int, int]] = []
        # Storage (gpu_memory): pid -> the directory in the image its GPU
        # memory goes to; empty on the host path.
        self.path: tuple[str | None, str] | None = None  # (where, why): _path
        self.to_storage = False
        self.storage: dict[int, str] = {}

    @property
    def cid(self) -> str | None:
        return (self.record or {}).get("id")

    @property
    def pids(self) -> list[int]:
        return [p.pid for p in self.procs]


def pre_dump(ctx: Context, image_dir: Path | None, init_pid: int | None, criu_pid: int,
             run: CriuRun) -> int:
    # Hazard: CRIU 3.19-4.1.1 run this script twice per dump, and run the
    # second call even when the first failed - or was killed mid-way, with
    # no outcome recorded. The dump fails on the first call's exit status
    # whatever this one does; its guardian, if it was armed, brings the
    # workload back once CRIU is gone. Undo: none - this call touches nothing.
    if run.get("step"):
        raise CudahookError(
            f"pre-dump: an earlier call in this CRIU run stopped without finishing "
            f"(last step: {run['step']}; killed?): this dump fails, and its guardian "
            "brings back what it had touched; nothing was touched by this call")
    run.step(steps.STARTED)
    pid = need_init(ctx, "pre-dump", init_pid)
    with Undo() as undo:
        cp = Checkpoint(ctx, image_dir, criu_pid, run, pid, undo)
        _thaw(cp)
        # Which container, with which options. Hazard: `cudahook status`
        # calling cuda-checkpoint on processes being locked or checkpointed;
        # undo: none needed - the container's busy lock keeps it out.
        cp.record, cp.ctx, cp.opts = container_for(ctx, pid)
        with guardian.exclusive(cp.ctx, lock_key(cp.ctx, cp.record, pid), guardian.BUSY_WAIT_S,
                                "pre-dump"):
            return _checkpoint(cp)


def _thaw(cp: Checkpoint) -> None:
    """Hazard: containerd and docker pause the container before `runc
    checkpoint`. A frozen process's CUDA restore thread cannot run, and
    cuda-checkpoint then hangs. Thaw for the CUDA phase; undo: freeze it
    again before CRIU takes over, whatever happened."""
    host = cp.ctx.host
    try:
        if not host.is_frozen(cp.init_pid):
            return
        host.set_frozen(cp.init_pid, False)
    except (OSError, TimeoutError) as exc:
        raise EnvironmentProblem(f"pre-dump: cannot thaw the paused container: {exc}") from exc
    cp.undo.always("cannot freeze the container again", lambda: host.set_frozen(cp.init_pid, True))


def _checkpoint(cp: Checkpoint) -> int:
    if cp.opts.enabled is False:  # an annotation opted the container out
        cp.ctx.log("pre-dump", container=cp.cid, skipped="disabled by annotation")
        return Exit.OK
    refused = _check(cp)
    if refused is not None:
        return refused
    if not cp.procs:
        cp.ctx.log("pre-dump", container=cp.cid, init_pid=cp.init_pid, cuda_processes=0)
        return Exit.OK
    if cp.image_dir is None:
        raise UsageError("pre-dump: CRTOOLS_IMAGE_DIR is not set")
    refused = _where(cp)
    if refused is None:
        refused = _reserve(cp)
    if refused is not None:
        return refused
    _arm(cp)
    gpus, models, vmm_prepare_s = _prepare(cp)
    result = _lock_all(cp)
    if isinstance(result, int):
        return result
    _unreserve(cp)
    failed = _no_nvml_left(cp)
    if failed is not None:
        return failed
    _record(cp, gpus, models, result)
    _keep(cp)
    _hand_over(cp, gpus, models, result, vmm_prepare_s)
    return Exit.OK


def _check(cp: Checkpoint) -> int | None:
    """Discover the container's CUDA processes and check everything `cudahook
    check` knows would make this checkpoint fail: NVIDIA device files CRIU
    cannot dump (an NVML monitor), CRIU's own CUDA plugin acting on the
    same processes, a process stopped (cuda-checkpoint would hang on it),
    not running (one already locked or checkpointed was not put there by
    this checkpoint: dumped, it would be restored without its GPU state),
    failed; too little host memory (the host path only); persistence off. A task traced while it
    runs and the image size are left to CRIU, which fails cleanly on them
    (the guardian then resumes the workload). Hazard: a probe that times
    out is not "not CUDA" - it refuses too, or a process would be dumped
    with live GPU state. Nothing touched: no undo. The exit code of a
    refusal, or None."""
    from . import checks  # the reason table: only pre-dump and post-restore need it

    ctx, cid = cp.ctx, cp.cid
    # The path decides which room is checked: host memory on the host path,
    # the image directory's space on the storage path (_reserve proves it).
    cp.verdict = verdict = checks.checkpoint_checks(
        ctx, init_pid=cp.init_pid, full=False, image_dir=cp.image_dir, container=cid,
        path=lambda: _path(cp))
    for w in verdict.warnings:
        ctx.log("pre-dump", container=cid, warning=w)
    found = verdict.found
    if verdict.ok and found is not None:
        cp.procs = found.processes
        return None
    message = verdict.message() + "; nothing was locked"
    reasons = [p.code for p in verdict.problems]
    ctx.log("pre-dump", container=cid, init_pid=cp.init_pid, error=message,
            cuda_processes=len(found.processes) if found else 0, reasons=reasons)
    results.remember(ctx, cid, "checkpoint", check=verdict.summary(), ok=False, error=message,
                     reasons=reasons)
    return verdict.hook_exit


def _refuse(cp: Checkpoint, code: str, message: str) -> int:
    """A refusal before anything was locked: logged, remembered, its exit code."""
    from cudahook.platform.reasons import REASONS

    message = f"{code}: {message}; nothing was locked"
    cp.ctx.log("pre-dump", container=cp.cid, init_pid=cp.init_pid, error=message,
               cuda_processes=len(cp.procs), reasons=[code])
    results.remember(cp.ctx, cp.cid, "checkpoint", ok=False, error=message, reasons=[code])
    return int(REASONS[code].exit)


def _path(cp: Checkpoint) -> tuple[str | None, str]:
    """Where the GPU memory goes under `gpu_memory` (core/backends
    gpu_memory_path), asked of the driver once: `host` asks nothing."""
    if cp.path is None:
        from .checks import memory_path

        cp.path = memory_path(cp.ctx)
    return cp.path


def _where(cp: Checkpoint) -> int | None:
    """Where the GPU memory goes: into the processes' host memory (CRIU dumps
    it), or with CUDA 13.4+ custom storage straight into chunk files of the
    image, `<image>/cudahook-gpu/<nspid>/`, so that every runtime's export of
    the image carries it. `gpu_memory: host` (the default) asks the driver
    nothing. Storage asked for and not there is refused: nothing touched.
    The exit code of a refusal, or None."""
    path, why = _path(cp)
    if path is None:
        return _refuse(cp, "GPU_STORAGE_UNAVAILABLE", why)
    if path == "storage":
        assert cp.image_dir is not None
        root = cp.image_dir / manifest.STORAGE_DIR
        cp.to_storage = True
        cp.storage = {p.pid: str(root / str(p.nspid)) for p in cp.procs}
        cp.ctx.log("pre-dump", container=cp.cid, gpu_memory=path, why=why)
    return None


def _reserve(cp: Checkpoint) -> int | None:
    """Storage only. Hazard: a disk that fills while chunks are copied fails
    the checkpoint with the processes locked and their memory half written
    (the helper then puts it back: slow, and a second way to fail). The
    GPU memory's size is preallocated in the image first, so a full disk
    refuses before anything is locked. The reservation is held through the
    lock: the driver helper shrinks it just before writing each chunk, so
    the space stays ours until the copy-out writes into it, whoever else
    fills the disk meanwhile; what is left of it goes after the checkpoint
    (_unreserve). Undo: remove every file the checkpoint writes there,
    the reservation too. The exit code of a refusal, or None."""
    if not cp.to_storage:
        return None
    assert cp.image_dir is not None
    root = cp.image_dir / manifest.STORAGE_DIR
    try:
        _clear_storage(root)  # an older checkpoint's, in a reused image directory
        root.mkdir(mode=0o700)
    except OSError as exc:
        raise EnvironmentProblem(f"pre-dump: cannot make {manifest.STORAGE_DIR} in the image: "
                                 f"{exc}; nothing was locked") from exc
    cp.undo.push("cannot remove the GPU memory written to the image",
                 lambda: _clear_storage(root))
    from .checks import STORAGE_SLACK

    need = int(cp.verdict.facts.get("gpu_memory_bytes") or 0) + STORAGE_SLACK
    import os

    try:
        fd = os.open(root / manifest.STORAGE_RESERVE, os.O_WRONLY | os.O_CREAT | os.O_EXCL
                     | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
        try:
            os.posix_fallocate(fd, 0, need)
        finally:
            os.close(fd)
    except OSError as exc:
        undone = cp.undo.unwind()
        return _refuse(cp, "IMAGE_SPACE", "; ".join(
            [f"cannot preallocate {need} bytes for the GPU memory in the image directory "
             f"({exc.strerror or exc})", *undone]))
    return None


def _unreserve(cp: Checkpoint) -> None:
    """What is left of the reservation once every process is copied out: the
    image carries only the chunks and their manifests. Nothing to undo."""
    if not cp.to_storage:
        return
    assert cp.image_dir is not None
    try:
        (cp.image_dir / manifest.STORAGE_DIR / manifest.STORAGE_RESERVE).unlink(missing_ok=True)
    except OSError as exc:  # space left held, not a failed checkpoint
        cp.ctx.log("pre-dump", container=cp.cid, warning=f"cannot remove the space "
                   f"reservation in {manifest.STORAGE_DIR}: {exc}")


def _clear_storage(root: Path) -> None:
    """Remove a storage directory of this image: the chunk files and
    manifests in its per-process directories, the index of links by digest,
    then the directories. Anything else there is not ours: it stays, and so
    does the directory (an error)."""
    import os
    import stat

    from cudahook.core.backends.driver_helper import INDEX

    try:
        st = root.lstat()
    except FileNotFoundError:
        return
    if not stat.S_ISDIR(st.st_mode):
        raise OSError(f"{root}: not a directory")
    for sub in os.listdir(root):
        path = root / sub
        if sub == manifest.STORAGE_RESERVE:
            path.unlink()
            continue
        if sub == INDEX:
            _drop_index(path)
            continue
        if not sub.isdigit() or not stat.S_ISDIR(path.lstat().st_mode):
            raise OSError(f"{path}: not a file of a GPU-memory checkpoint")
        for name in os.listdir(path):
            if name == manifest.STORAGE_MANIFEST or name.endswith(".chunk"):
                (path / name).unlink()
        path.rmdir()
    root.rmdir()


def _drop_index(index: Path) -> None:
    """The checkpoint's index of chunks by digest: only links to files each
    process's directory also holds, used while the chunks are written. It
    goes once they are, so the image holds the process directories alone,
    as without dedupe (their shared chunks stay hard links)."""
    import os
    import stat

    try:
        st = index.lstat()
    except FileNotFoundError:
        return
    if not stat.S_ISDIR(st.st_mode):
        raise OSError(f"{index}: not a directory")
    for name in os.listdir(index):
        (index / name).unlink()
    index.rmdir()


def _arm(cp: Checkpoint) -> None:
    """The guardian, armed before anything is touched. Hazard: this script
    can die at any point from here on (a runtime's or kubelet's timeout
    SIGKILLs it, the OOM killer), leaving processes locked or checkpointed
    with nobody to bring them back: CRIU then aborts the dump, and the
    guardian, once CRIU and this script are both gone, restores whichever
    it finds locked or checkpointed. Start times are taken first: it tells
    our processes from a later one that reused a PID. If it cannot be
    armed, nothing is touched."""
    ctx = cp.ctx
    starts = {p.pid: start_time(ctx, p.pid) for p in cp.procs}
    try:
        guardian.spawn(ctx, cp.criu_pid, cp.cid, [(p, starts[p]) for p in cp.pids],
                       cp.run.path, {p.pid: p.nspid for p in cp.procs},
                       key=lock_key(ctx, cp.record, cp.init_pid))
    except Exception as exc:
        raise EnvironmentProblem(f"pre-dump: cannot arm the guardian: {exc}; "
                                 "nothing was locked") from exc
    cp.run.step(steps.ARMED)


def _prepare(cp: Checkpoint) -> tuple[list[str], dict[str, Any], float | None]:
    """What the manifest and a later restore need, and the VMM interposer's
    prepare step, which must run before the CUDA lock. A partial set of
    interposer sockets is refused here. Nothing is locked yet: a refusal
    aborts the dump and the workload never noticed. The state --prepare
    saved is copied for the guardian now, before any lock: CRIU's image
    directory is gone by the time the guardian acts. Undo, from the
    checkpoint on: it drops the processes' VMM mappings, and nothing else
    brings them back - replay the saved state into those that run again."""
    ctx, cid = cp.ctx, cp.cid
    assert cp.image_dir is not None
    try:
        gpus, models = gpus_and_models(ctx, visible_gpus(cp.record))
        began = time.monotonic()
        cp.with_vmm = vmm_steps.prepare(ctx, cid, cp.procs, cp.image_dir,
                                        (cp.record or {}).get("key"))
        vmm_prepare_s = time.monotonic() - began if cp.with_vmm else None
        if cp.with_vmm:
            vmm_steps.keep_for_guardian(cp.image_dir, guardian.vmm_dir(cp.run.path))
    except CudahookError as exc:
        results.remember(ctx, cid, "checkpoint", ok=False, error=str(exc),
                         reasons=[exc.reason] if exc.reason else [])
        raise
    except OSError as exc:
        message = f"pre-dump: cannot keep the VMM state for the guardian: {exc}; nothing was locked"
        results.remember(ctx, cid, "checkpoint", ok=False, error=message)
        raise EnvironmentProblem(message) from exc
    if cp.with_vmm:
        image_dir = cp.image_dir
        cp.undo.push(vmm_steps.NOT_REPLAYED,
                     lambda: vmm_steps.replay(ctx, cid, image_dir, cp.back, "rollback"))
    return gpus, models, vmm_prepare_s


def _lock_all(cp: Checkpoint) -> Any:
    """Lock all (in parallel: a partly locked NCCL job can hang its peers),
    then checkpoint all. On a failure the engine rolls every touched process
    back and verifies each one `running`, and the stack replays the VMM
    state into those it brought back; CRIU then aborts on our exit status
    (the guardian finds them running and leaves them; a rollback that
    failed it tries again). The engine's result, or the exit code.
    Undo from here on: restore every process."""
    ctx, cid = cp.ctx, cp.cid
    if cp.storage:
        # Where the GPU memory is, by its real path: a guardian bringing the
        # processes back after a failed dump restores from there. Written
        # before the first lock: this script may be killed at any point
        # after it, and a guardian without it restores from host memory,
        # which a storage checkpoint left empty (the driver refuses).
        cp.run.note("gpu_storage", {str(pid): _real(d) for pid, d in cp.storage.items()})
    cp.run.step(steps.LOCKING)
    try:
        result = ctx.engine.checkpoint(cp.procs, fresh_states=True, storage=cp.storage or None)
    except PhaseError as exc:
        back = exc.result.brought_back() if exc.result else set()
        cp.back = [(p.pid, p.nspid) for p in cp.procs if p.pid in back]
        undone = cp.undo.unwind()
        error = "; ".join([str(exc), *undone])
        unsafe = not exc.safe or bool(undone)
        if not unsafe:  # every process verified running: nothing left for the guardian
            cp.run.step(steps.ROLLED_BACK)
        ctx.log("checkpoint", container=cid, error=error, pids=cp.pids, unsafe=unsafe,
                timeline=exc.result.timeline.to_dict() if exc.result else None)
        results.remember(ctx, cid, "checkpoint", ok=False, error=error, unsafe=unsafe,
                         rolled_back=bool(exc.result and exc.result.rolled_back))
        return Exit.UNSAFE if undone else int(exc.exit_code)
    cp.undo.push(ROLLBACK_FAILED, lambda: _restore_all(cp))
    return result


def _real(path: str) -> str:
    import os

    return os.path.realpath(path)  # CRTOOLS_IMAGE_DIR is a /proc/<criu>/fd/N link


def _restore_all(cp: Checkpoint) -> None:
    cp.ctx.engine.restore(cp.procs, storage=cp.storage or None)
    cp.back = [(p.pid, p.nspid) for p in cp.procs]  # the VMM replay's, next on the stack


def _no_nvml_left(cp: Checkpoint) -> int | None:
    """Hazard: NVML handles (and a fork()ed child's CUDA references) survive
    the CUDA checkpoint, and CRIU fails on them. Only now can they be told
    from CUDA's own device files. Undo: the stack puts every process back
    on its GPU. The exit code, or None when none is left."""
    ctx = cp.ctx
    leftover = {p.pid: files for p in cp.procs
                if (files := device_files(ctx.host, p.pid, ctx.settings.device_regex))}
    if not leftover:
        return None
    # Every process is put back on its GPU, with its VMM mappings too.
    cp.back = [(p.pid, p.nspid) for p in cp.procs]
    undone = cp.undo.unwind()
    message = ("NVML_FDS: CRIU cannot dump open NVIDIA device files left after the CUDA "
               "checkpoint (NVML handles are not released by it): "
               + describe_holders(leftover, "CUDA process"))
    rolled = not any(u.startswith(f"{ROLLBACK_FAILED}: ") for u in undone)
    message = "; ".join([message, *(["every process was restored and runs"] if rolled else []),
                         *undone])
    code = Exit.UNSAFE if undone else Exit.FAILED
    if code == Exit.FAILED:
        cp.run.step(steps.ROLLED_BACK)
    ctx.log("checkpoint", container=cp.cid, error=message, pids=cp.pids)
    results.remember(ctx, cp.cid, "checkpoint", ok=False, error=message,
                     unsafe=code == Exit.UNSAFE, rolled_back=True, reasons=["NVML_FDS"])
    return code


def _record(cp: Checkpoint, gpus: list[str], models: dict[str, Any], result: Any) -> None:
    """The checkpoint, recorded in the image. Hazard: the dump can still fail
    after us (even while freezing, where CRIU runs no script), or run with
    --leave-running; either way CRIU lets the tasks run again, checkpointed,
    off their GPU: the guardian armed above brings them back. Undo if the
    manifest cannot be written: without it the restore could never bring
    the GPU state back - so remove it and restore everything now."""
    from cudahook.vmm import coordinator as vmm

    assert cp.image_dir is not None
    image_dir = cp.image_dir
    cp.run.step(steps.CHECKPOINTED)
    data = {
        "container_id": cp.cid,
        "created": time.time(),
        "driver_version": cp.ctx.backend.features.version,
        "gpus": gpus,
        # Model and size of each: a restore elsewhere needs the same chip.
        "gpu_models": {u: {"name": models[u][0], "memory_mib": models[u][1]}
                       for u in gpus if u in models},
        "vmm": cp.with_vmm,
        "gpu_memory_bytes": cp.verdict.facts.get("gpu_memory_bytes"),
        "processes": [{"nspid": p.nspid, "pid": p.pid, "state": p.state} for p in cp.procs],
        "timeline": result.timeline.to_dict(),
    }
    cp.undo.push("cannot remove the partial manifest", lambda: _unlink(image_dir / manifest.NAME))
    try:
        if cp.to_storage:
            data["gpu_storage"] = _stored(cp)
        manifest.write(image_dir, data, files=[vmm.STATE_FILE] if cp.with_vmm else [])
    except Exception as exc:
        undone = cp.undo.unwind()
        if not undone:
            cp.run.step(steps.ROLLED_BACK)
            raise EnvironmentProblem(f"pre-dump: cannot record the checkpoint: {exc}") from exc
        raise PhaseError("checkpoint", [f"cannot record the checkpoint: {exc}", *undone],
                         safe=False) from exc


def _keep(cp: Checkpoint) -> None:
    """Storage only. Hazard: containerd's task service (and docker, through
    it) has CRIU dump into a temporary directory, copies that into its
    content store and removes it before it resumes the paused task: after
    a --leave-running dump, or a failed one, the guardian would find no
    chunks to bring the GPU memory back from, and the workload would stay
    off its GPU. Hard links made now outlive that removal and copy nothing:
    beside the image directory (its file system), else beside the run's
    record. The guardian restores from them and removes them. Where neither
    can be made the checkpoint goes on and says so: only a runtime that
    removes the image early needs them, and the image itself is whole."""
    if not cp.storage:
        return
    import os
    import shutil
    import tempfile

    assert cp.image_dir is not None
    image = Path(_real(str(cp.image_dir)))
    errors = []
    # Beside the run's record it is named after the run, so that the
    # state directory's pruning of gone runs' files takes it too.
    for parent, name in ((image.parent, f".{image.name}"), (cp.run.path.parent,
                                                             cp.run.path.stem)):
        try:
            keep = Path(tempfile.mkdtemp(prefix=name + guardian.KEPT_INFIX, dir=parent))
        except OSError as exc:
            errors.append(f"{parent}: {exc.strerror or exc}")
            continue
        try:
            # Named before it fills: the guardian removes whatever was made.
            cp.run.note(guardian.KEPT, str(keep))
            dirs = {}
            for pid, d in cp.storage.items():
                src = Path(_real(d))
                (keep / src.name).mkdir(mode=0o700)
                for name in os.listdir(src):
                    os.link(src / name, keep / src.name / name, follow_symlinks=False)
                dirs[str(pid)] = str(keep / src.name)
        except OSError as exc:
            shutil.rmtree(keep, ignore_errors=True)
            cp.run.note(guardian.KEPT, None)
            errors.append(f"{parent}: {exc.strerror or exc}")
            continue
        cp.run.note("gpu_storage", dirs)
        return
    cp.ctx.log("pre-dump", container=cp.cid, warning="the GPU memory's chunks could not be "
               "kept for the guardian (" + "; ".join(errors) + "): a runtime that removes the "
               "image directory before the tasks run again leaves them off their GPU after a "
               "--leave-running or failed dump")


def _stored(cp: Checkpoint) -> manifest.GpuStorage:
    """What the storage checkpoint wrote, for the manifest: each process's
    chunk manifest by its sha256 and size, and every chunk's digest, which
    post-restore and `cudahook check --image` verify. Read back from the
    files the helper fsynced, before CRIU dumps anything."""
    import hashlib
    import json

    from cudahook.core.backends.driver_helper import INDEX
    from cudahook.platform import safeio

    assert cp.image_dir is not None
    _drop_index(cp.image_dir / manifest.STORAGE_DIR / INDEX)
    procs, digests = [], set()
    for p in cp.procs:
        raw = safeio.read_bytes(Path(cp.storage[p.pid]) / manifest.STORAGE_MANIFEST,
                                16 << 20)
        m = json.loads(raw)
        digests.add(m["digest"])
        procs.append(manifest.StoredProcess(
            nspid=p.nspid, chunk=int(m["chunk"]), manifest_sha256=hashlib.sha256(raw).hexdigest(),
            manifest_size=len(raw), ranges=tuple(
                manifest.StorageRange(size=int(r["size"]), chunks=tuple(r["chunks"]),
                                      zstd=tuple(r.get("zstd") or ()))
                for r in m["ranges"])))
    if len(digests) > 1:  # one helper writes them all: never seen, but never recorded wrong
        raise ValueError(f"the processes' chunks have different digests: {sorted(digests)}")
    return manifest.GpuStorage(dir=manifest.STORAGE_DIR, processes=tuple(procs),
                               digest=digests.pop() if digests else "sha256")


def _unlink(path: Path) -> None:
    with contextlib.suppress(OSError):  # never written, or already gone
        path.unlink()


def _hand_over(cp: Checkpoint, gpus: list[str], models: dict[str, Any], result: Any,
               vmm_prepare_s: float | None) -> None:
    """Handed over to CRIU: it dumps the processes, now without GPU state.
    The stack commits: a dump that fails from here is the guardian's."""
    ctx, cid = cp.ctx, cp.cid
    cp.undo.commit()
    cp.run.step(steps.RECORDED)
    cp.run["handed_over"] = time.time()  # CRIU dumps from here (the guardian's metric)
    timeline = result.timeline.to_dict()
    ctx.log("checkpoint", container=cid, pids=cp.pids, nspids=[p.nspid for p in cp.procs],
            total_s=result.timeline.total(), timeline=timeline)
    results.remember(ctx, cid, "checkpoint", ok=True, pids=cp.pids,
                     gpu_memory="storage" if cp.to_storage else "host",
                     total_s=round(result.timeline.total(), 6), timeline=timeline,
                     gpu_bytes=cp.verdict.facts.get("gpu_memory_bytes"),
                     vmm_prepare_s=vmm_prepare_s,
                     gpu_model=next((models[u][0] for u in gpus if models.get(u, ("",))[0]),
                                    None))
    cp.run["checkpointed"] = cp.pids

