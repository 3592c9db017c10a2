"""The CRIU action script: CUDA checkpoint before the dump, CUDA restore after it.

What runs when (CRIU's order, field notes §4):
- pre-dump: tasks still run. Discover, lock+checkpoint every CUDA process
  (rolled back on failure, and then CRIU aborts), write the manifest into the
  image directory, and leave a guardian behind (below).
- post-dump / network-unlock: tasks are stopped; CUDA restore cannot run.
- post-restore: tasks exist but do not run. Last moment to refuse: check the
  manifest, the driver, the GPUs and the device map, and fail the restore
  cleanly if any is wrong.
- post-resume: tasks run. Restore and unlock every CUDA process (onto the
  new GPUs if they changed) and verify it runs; on failure kill the container
  rather than release a half-restored workload. CRIU only logs a failure
  here, so failing closed is ours to do.

CRIU 3.19-4.1.1 run every action twice. Each action's outcome is kept per
CRIU run (its PID and start time), and the second call returns it unchanged.

The guardian: when the dump fails after pre-dump (even while freezing, where
CRIU runs no script at all) or runs with --leave-running, CRIU lets the tasks
run again - checkpointed, off their GPU. Nothing tells a script when that
happens, so a detached process waits for CRIU to exit and then restores every
CUDA process that is still alive. After a successful dump they are dead and
it does nothing.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from dataclasses import asdict
from pathlib import Path

from . import annotations as ann
from . import manifest, vmm
from .context import Context
from .criu_env import CriuCall
from .discovery import container_pids, discover
from .errors import CudahookError, EnvironmentProblem, Exit, PhaseError, UsageError, report
from .host import Host
from .store import mark, prune_restore_marks, read_json, write_json_atomic

# typing costs milliseconds at every hook start: annotations only.
TYPE_CHECKING = False
if TYPE_CHECKING:
    from typing import Any


HANDLED = ("pre-dump", "post-restore", "post-resume")


def main() -> int:
    from . import config, criu_env

    try:
        call = criu_env.from_env()
        if call.action not in HANDLED:
            return Exit.OK
        return run(Context(config.load()), call)
    except Exception as exc:  # a bug must still fail the action, in one line
        return report(exc)


def run(ctx: Context, call: CriuCall) -> int:
    handler = {"pre-dump": pre_dump, "post-restore": post_restore,
               "post-resume": post_resume}.get(call.action)
    if handler is None:
        return Exit.OK
    run_file = ctx.store.run_path(_run_key(ctx, call.criu_pid))
    progress = _progress(read_json(run_file))
    done = progress["done"]
    if call.action in done:  # the second of CRIU's two calls
        rc = int(done[call.action])
        if rc:  # its failure was told at the first call; say so again, in one line
            print(f"cudahook: {call.action}: failed earlier in this CRIU run (exit {rc}); "
                  f"see {ctx.settings.log_file}", file=sys.stderr)
        return rc
    try:
        rc = handler(ctx, call, progress)
    except CudahookError as exc:
        ctx.log(call.action, error=str(exc), init_pid=call.init_pid)
        rc = int(exc.exit_code)
    except Exception as exc:  # recorded like any failure: CRIU's second call must not retry
        ctx.log(call.action, error=f"internal error: {type(exc).__name__}: {exc}",
                init_pid=call.init_pid)
        rc = Exit.FAILED
    done[call.action] = rc
    write_json_atomic(run_file, progress)
    if call.action == "pre-dump":
        ctx.store.prune_runs()
    return rc


def _progress(data: Any) -> dict[str, Any]:
    """A run's progress file as written by run(): anything else in its place
    (another type, a damaged entry) counts as no progress at all."""
    if not isinstance(data, dict):
        return {"done": {}}
    done = data.get("done")
    if not isinstance(done, dict) or not all(
            k in HANDLED and type(v) is int and v in tuple(Exit) for k, v in done.items()):
        data["done"] = {}
    # What post-restore kept for post-resume, if it has the shape it wrote.
    if not isinstance(data.get("manifest"), dict):
        data.pop("manifest", None)
    mapping = data.get("device_map")
    if mapping is not None and not (isinstance(mapping, dict) and all(
            isinstance(k, str) and isinstance(v, str) for k, v in mapping.items())):
        data.pop("device_map")
    if not isinstance(data.get("vmm_dir"), (str, type(None))):
        data.pop("vmm_dir")
    return data


def _run_key(ctx: Context, criu_pid: int) -> str:
    try:
        return f"{criu_pid}-{ctx.host.start_time(criu_pid)}"
    except Exception:
        return str(criu_pid)


def _container(ctx: Context, init_pid: int) -> tuple[dict[str, Any] | None, Context, ann.Options]:
    """The OCI record (if the OCI hook saw this container) and its options."""
    try:
        start: int | None = ctx.host.start_time(init_pid)
    except Exception:
        start = None
    record = ctx.store.find_by_pid(init_pid, start)
    options = (record or {}).get("options")
    if not isinstance(options, dict):
        options = {}
    opts = ann.parse({ann.PREFIX + str(k): v for k, v in options.items()})
    settings = opts.apply(ctx.settings)
    if settings is not ctx.settings:
        ctx = Context(settings, ctx.host)
    return record, ctx, opts


def _need_init(call: CriuCall) -> int:
    if call.init_pid is None:
        raise UsageError(f"{call.action}: CRTOOLS_INIT_PID is not set")
    try:
        parent = Host().ppid(call.init_pid)
    except Exception:
        raise UsageError(f"{call.action}: CRTOOLS_INIT_PID {call.init_pid}: "
                         "no such process") from None
    if parent in (0, 2):  # the kernel's own threads: nothing CRIU restores or dumps
        raise UsageError(f"{call.action}: CRTOOLS_INIT_PID {call.init_pid} is a kernel thread, "
                         "not a container's init")
    return call.init_pid


def _visible(record: dict[str, Any] | None) -> list[str] | None:
    """The record's GPU list, if it is one (records are files under /run)."""
    visible = (record or {}).get("visible")
    if isinstance(visible, list) and all(isinstance(v, str) for v in visible):
        return visible
    return None


def _gpu_uuids(ctx: Context, visible: list[str] | None) -> list[str]:
    from .gpus import query_gpus
    from .oci import resolve_uuids

    gpus = query_gpus(ctx.host, ctx.settings)
    return resolve_uuids(visible or ["all"], gpus)


# -- dump ---------------------------------------------------------------------


def pre_dump(ctx: Context, call: CriuCall, progress: dict[str, Any]) -> int:
    init_pid = _need_init(call)
    # containerd and docker pause the container before `runc checkpoint`:
    # thaw it for the CUDA phase (a frozen restore thread makes
    # cuda-checkpoint hang), and freeze it again before CRIU takes over.
    thawed = False
    try:
        if ctx.host.is_frozen(init_pid):
            ctx.host.set_frozen(init_pid, False)
            thawed = True
    except (OSError, TimeoutError) as exc:
        raise EnvironmentProblem(f"pre-dump: cannot thaw the paused container: {exc}") from exc
    try:
        return _pre_dump(ctx, call, progress, init_pid)
    finally:
        if thawed:
            ctx.host.set_frozen(init_pid, True)


def _pre_dump(ctx: Context, call: CriuCall, progress: dict[str, Any], init_pid: int) -> int:
    record, ctx, opts = _container(ctx, init_pid)
    cid = (record or {}).get("id")
    if opts.enabled is False:
        ctx.log("pre-dump", container=cid, skipped="disabled by annotation")
        return Exit.OK
    found = discover(ctx.host, ctx.backend, init_pid, ctx.settings.device_regex,
                     max_parallel=ctx.settings.max_parallel)
    for w in found.warnings:
        ctx.log("pre-dump", container=cid, warning=w)
    if not found.processes:
        ctx.log("pre-dump", container=cid, init_pid=init_pid, cuda_processes=0)
        return Exit.OK
    if call.image_dir is None:
        raise UsageError("pre-dump: CRTOOLS_IMAGE_DIR is not set")

    # Everything that can refuse runs before any process is touched.
    try:
        gpus = _gpu_uuids(ctx, _visible(record))
        version = ctx.backend.features.version
        with_vmm = interposer_prepare(ctx, cid, found.processes, call)
    except CudahookError as exc:
        _remember(ctx, cid, "checkpoint", ok=False, error=str(exc))
        raise

    # Taken before the checkpoint: the guardian tells our processes from PID reuse.
    starts = {}
    for p in found.processes:
        try:
            starts[p.pid] = ctx.host.start_time(p.pid)
        except Exception:
            starts[p.pid] = None
    try:
        result = ctx.engine.checkpoint(found.processes, fresh_states=True)
    except PhaseError as exc:
        ctx.log("checkpoint", container=cid, error=str(exc), pids=found.pids,
                timeline=exc.result.timeline.to_dict() if exc.result else None)
        _remember(ctx, cid, "checkpoint", ok=False, error=str(exc))
        return int(exc.exit_code)
    data = {
        "container_id": cid,
        "created": time.time(),
        "driver_version": version,
        "gpus": gpus,
        "vmm": with_vmm,
        "processes": [{"nspid": p.nspid, "pid": p.pid, "state": p.state}
                      for p in found.processes],
        "timeline": result.timeline.to_dict(),
    }
    try:
        manifest.write(call.image_dir, data)
        spawn_guardian(ctx, call.criu_pid, cid, [(p, starts[p]) for p in found.pids])
    except Exception as exc:
        # Without a manifest the restore could never bring the GPU state back,
        # and without a guardian nothing would after CRIU aborts: undo it all.
        with contextlib.suppress(OSError):
            (call.image_dir / manifest.NAME).unlink()
        ctx.engine.restore(found.processes)
        raise EnvironmentProblem(f"pre-dump: cannot record the checkpoint: {exc}") from exc
    ctx.log("checkpoint", container=cid, pids=found.pids,
            nspids=[p.nspid for p in found.processes], total_s=result.timeline.total(),
            timeline=result.timeline.to_dict())
    _remember(ctx, cid, "checkpoint", ok=True, pids=found.pids,
              total_s=round(result.timeline.total(), 6), timeline=result.timeline.to_dict())
    progress["checkpointed"] = found.pids
    return Exit.OK


def interposer_prepare(ctx: Context, cid: str | None, procs: list[Any], call: CriuCall) -> bool:
    """Detect the CUDA VMM interposer and run its coordinator before the lock.

    A partial set of sockets refuses the checkpoint here, before anything is
    locked; a coordinator that fails or times out fails it the same way.
    """
    detection = vmm.detect(ctx.host, procs)
    if not detection.participates:
        return False
    assert call.image_dir is not None
    output = vmm.run_coordinator(
        ctx.host, ctx.settings.tool("vmm_coordinator"), "prepare", str(ctx.host.proc),
        call.image_dir, [(p.pid, p.nspid) for p in procs], ctx.settings.vmm_timeout_s)
    ctx.log("vmm-prepare", container=cid, pids=[p.pid for p in procs], output=output)
    return True


def spawn_guardian(ctx: Context, criu_pid: int, cid: str | None,
                   procs: list[tuple[int, int]]) -> None:
    args = {
        "criu_pid": criu_pid,
        "criu_start": ctx.host.start_time(criu_pid),
        "container": cid,
        "procs": procs,
        "settings": asdict(ctx.settings),
    }
    subprocess.Popen(
        [sys.executable, "-I", "-c", "import sys; from cudahook.guardian import main; "
         "sys.exit(main(sys.argv[1]))", json.dumps(args)],
        stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
        start_new_session=True, close_fds=True,
    )


# -- restore ------------------------------------------------------------------


def _plan(ctx: Context, call: CriuCall, record: dict[str, Any] | None, opts: ann.Options,
          data: dict[str, Any]) -> dict[str, str] | None:
    """The device map this restore needs, or a clear refusal."""
    from .devicemap import compute_device_map, parse_device_map

    feats = ctx.backend.features
    have, had = feats.major, str(data.get("driver_version", "")).split(".")[0]
    if had.isdigit() and have and int(had) != have:
        raise EnvironmentProblem(
            f"checkpoint was taken with driver {data['driver_version']}, this node runs "
            f"{feats.version}: restore needs the same driver branch")
    if not feats.actions and not feats.toggle:
        raise EnvironmentProblem("cuda-checkpoint on this node supports neither actions nor toggle")
    source = list(data.get("gpus") or [])
    node = _gpu_uuids(ctx, ["all"])
    if opts.device_map:
        mapping: dict[str, str] | None = parse_device_map(opts.device_map)
        missing = [u for u in (mapping or {}).values() if u not in node]
    else:
        visible = _visible(record)
        target = _gpu_uuids(ctx, visible) if visible else source
        missing = [u for u in target if u not in node]
        mapping = compute_device_map(source, target) if not missing else None
    if missing:
        raise EnvironmentProblem(
            "GPU(s) not present on this node: " + ", ".join(missing)
            + ("" if record else " (the OCI hook did not see this container; "
               "register it or set cudahook.io/device-map)"))
    if mapping and not feats.device_map:
        raise EnvironmentProblem(
            f"the restore moves GPUs ({', '.join(f'{a}={b}' for a, b in mapping.items())}) "
            f"but cuda-checkpoint {feats.version} has no --device-map (driver R580 or newer)")
    return mapping


def post_restore(ctx: Context, call: CriuCall, progress: dict[str, Any]) -> int:
    if call.image_dir is None:
        raise UsageError("post-restore: CRTOOLS_IMAGE_DIR is not set")
    data = manifest.read(call.image_dir)
    if data is None:
        return Exit.OK
    record, ctx, opts = _container(ctx, _need_init(call))
    mapping = _plan(ctx, call, record, opts, data)
    progress["device_map"] = mapping
    progress["vmm_dir"] = _vmm_dir(ctx, call, data)
    # By post-resume CRIU has closed the image directory (CRTOOLS_IMAGE_DIR
    # names a dead /proc/<criu>/fd/N, seen with CRIU 4.1.1): keep what the
    # restore needs from it now.
    progress["manifest"] = data
    prune_restore_marks()  # left by restores whose post-resume never ran
    try:  # without the mark the shell would skip post-resume: fail now instead
        mark("restore", str(call.criu_pid))
    except OSError as exc:
        raise EnvironmentProblem(f"post-restore: cannot leave a mark for post-resume: {exc}") from exc
    ctx.log("post-restore", container=(record or {}).get("id"), init_pid=call.init_pid,
            device_map=mapping, checked="manifest, driver, GPUs, device map")
    return Exit.OK


def _vmm_dir(ctx: Context, call: CriuCall, data: dict[str, Any]) -> str | None:
    """Where the coordinator finds cuda-vmm.state at post-resume, if it exists.

    CRIU's fd on the image directory is gone by then, so resolve the
    directory's real path now; if that is not reachable, keep a private copy.
    """
    assert call.image_dir is not None
    if not vmm.has_state(call.image_dir):
        if data.get("vmm"):
            ctx.log("post-restore", warning="manifest says the CUDA VMM interposer took part "
                    "but the image has no cuda-vmm.state: its coordinator will not run")
        return None
    real = os.path.realpath(call.image_dir)
    if os.path.isdir(real) and vmm.has_state(Path(real)):
        return real
    from . import safeio
    from .store import ensure_private_dir

    copy = ensure_private_dir(ctx.store.run_path(_run_key(ctx, call.criu_pid)).with_suffix(".vmm"))
    (copy / vmm.STATE_FILE).unlink(missing_ok=True)  # CRIU's second call copies again
    try:
        safeio.copy_file(call.image_dir / vmm.STATE_FILE, copy / vmm.STATE_FILE,
                         vmm.MAX_STATE_BYTES)
    except safeio.FileRefused as exc:
        raise EnvironmentProblem(f"post-restore: {vmm.STATE_FILE}: {exc}") from None
    return str(copy)


def post_resume(ctx: Context, call: CriuCall, progress: dict[str, Any]) -> int:
    with contextlib.suppress(OSError):
        mark("restore", str(call.criu_pid), on=False)
    data = progress.get("manifest")
    if data is None and "post-restore" not in progress.get("done", {}):
        data = manifest.read(call.image_dir) if call.image_dir else None
    if data is None:
        return Exit.OK
    init_pid = _need_init(call)
    record, ctx, opts = _container(ctx, init_pid)
    cid = (record or {}).get("id") or data.get("container_id")
    try:
        mapping = (progress["device_map"] if "device_map" in progress
                   else _plan(ctx, call, record, opts, data))
        procs = _restored_pids(ctx, init_pid, data)
        vmm_dir = progress.get("vmm_dir")
        before = bool(vmm_dir) and ctx.settings.vmm_restore_before_unlock
        result = ctx.engine.restore(procs, mapping, unlock=not before)
        if vmm_dir:
            # The coordinator replays CUDA calls inside the workload: it needs
            # the processes restored, and by default unlocked.
            pairs = list(zip(procs, (p["nspid"] for p in data["processes"]), strict=True))
            output = vmm.run_coordinator(ctx.host, ctx.settings.tool("vmm_coordinator"),
                                         "restore", "", Path(vmm_dir), pairs,
                                         ctx.settings.vmm_timeout_s)
            ctx.log("vmm-restore", container=cid, pids=procs, output=output)
            if before:
                ctx.engine.unlock(procs)
    except CudahookError as exc:
        killed = fail_closed(ctx, init_pid)
        error = f"restore failed, container killed ({killed} processes): {exc}"
        timeline = exc.result.timeline.to_dict() if isinstance(exc, PhaseError) and exc.result else None
        ctx.log("restore", container=cid, error=error, timeline=timeline)
        _remember(ctx, cid, "restore", ok=False, error=error, timeline=timeline)
        return int(exc.exit_code) or Exit.FAILED
    ctx.log("restore", container=cid, pids=procs, device_map=mapping,
            total_s=result.timeline.total(), timeline=result.timeline.to_dict())
    _remember(ctx, cid, "restore", ok=True, pids=procs, device_map=mapping,
              total_s=round(result.timeline.total(), 6), timeline=result.timeline.to_dict())
    return Exit.OK


def _restored_pids(ctx: Context, init_pid: int, data: dict[str, Any]) -> list[int]:
    """Host PIDs of the manifest's processes: CRIU restores namespace PIDs."""
    by_nspid: dict[int, int] = {}
    pids, _ = container_pids(ctx.host, init_pid)
    for pid in pids:
        try:
            by_nspid[ctx.host.nspid(pid)] = pid
        except Exception:
            continue
    wanted = [p["nspid"] for p in data["processes"]]
    missing = [n for n in wanted if n not in by_nspid]
    if missing:
        raise PhaseError("restore", [f"restored container has no process {n} (namespace PID)"
                                     for n in missing], safe=False)
    return [by_nspid[n] for n in wanted]


def fail_closed(ctx: Context, init_pid: int) -> int:
    try:
        pids, _ = container_pids(ctx.host, init_pid)
    except Exception:
        pids = [init_pid]
    # Never a process group (0, negatives), the host's init, nor CRIU or
    # ourselves: only the restored container's processes.
    spare = {os.getpid(), os.getppid()}
    pids = [p for p in pids if type(p) is int and p > 1 and p not in spare]
    killed = 0
    for pid in sorted(pids, key=lambda p: p != init_pid):
        try:
            os.kill(pid, signal.SIGKILL)
            killed += 1
        except ProcessLookupError:
            continue
    return killed


def _remember(ctx: Context, cid: str | None, kind: str, **result: Any) -> None:
    if not cid:
        return
    with contextlib.suppress(OSError, CudahookError):
        ctx.store.remember(cid, kind, {"time": time.time(), **result})
