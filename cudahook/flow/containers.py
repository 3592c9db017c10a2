"""The container behind a CRIU run: its OCI record and options, its GPUs,
its processes after a restore, and killing it when a restore cannot finish.
"""

from __future__ import annotations

import contextlib
import os

from cudahook.core.discovery import container_pids
from cudahook.platform.errors import PhaseError

from . import annotations as ann
from .context import Context

# typing costs milliseconds at every hook start: annotations only.
TYPE_CHECKING = False
if TYPE_CHECKING:
    from typing import Any

    from cudahook.core.manifest import Manifest


def container_for(ctx: Context, init_pid: int) -> tuple[dict[str, Any] | None, Context, ann.Options]:
    """The OCI record (if the OCI hook saw this container; with its `key`),
    a context with its per-container options applied, and the options."""
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
    key = (record or {}).get("key")
    if settings is not ctx.settings or (key and "backend" not in ctx.__dict__):
        ctx = Context(settings, ctx.host, key if isinstance(key, str) else None)
    return record, ctx, opts


def lock_key(ctx: Context, record: dict[str, Any] | None, init_pid: int) -> str | None:
    """What serialises the operations on this container (its busy lock and
    its guardian's marker): its key when the OCI hook recorded it, else its
    init process, which every CRIU run of it names (None if that is gone)."""
    key = (record or {}).get("key")
    if isinstance(key, str) and key:
        return key
    from cudahook.platform.store import init_key

    try:
        return init_key(init_pid, ctx.host.start_time(init_pid))
    except Exception:
        return None


def visible_gpus(record: dict[str, Any] | None) -> list[str] | None:
    """The record's GPU list, if it is one (records are files under /run)."""
    visible = (record or {}).get("visible")
    if isinstance(visible, list) and all(isinstance(v, str) for v in visible):
        return visible
    return None


def gpu_uuids(ctx: Context, visible: list[str] | None) -> list[str]:
    """The UUIDs of the GPUs a container sees (all, by default)."""
    return gpus_and_models(ctx, visible)[0]


def gpus_and_models(ctx: Context, visible: list[str] | None
                    ) -> tuple[list[str], dict[str, tuple[str, int | None]]]:
    """The UUIDs of the GPUs `visible` names, and every node GPU's (model, MiB)."""
    from .gpu_request import resolve_uuids

    gpus = ctx.gpus
    return resolve_uuids(visible or ["all"], gpus), {g.uuid: (g.name, g.memory_mib) for g in gpus}


def restored_pids(ctx: Context, init_pid: int, m: Manifest) -> list[int]:
    """Host PIDs of the manifest's processes: CRIU restores namespace PIDs."""
    by_nspid: dict[int, int] = {}
    pids, _ = container_pids(ctx.host, init_pid)
    for pid in pids:
        try:
            by_nspid[ctx.host.nspid(pid)] = pid
        except Exception:
            continue
    wanted = m.nspids
    missing = [n for n in wanted if n not in by_nspid]
    if missing:
        raise PhaseError("restore", [f"restored container has no process {n} (namespace PID)"
                                     for n in missing], safe=False)
    return [by_nspid[n] for n in wanted]


def kill_container(ctx: Context, init_pid: int) -> int:
    """SIGKILL every process of the container, init first; how many were killed.

    Each kill goes through a pidfd opened on the process seen when the
    container was listed (same PID, same start time), so a PID reused in
    between is never hit.
    """
    try:
        pids, _ = container_pids(ctx.host, init_pid)
    except Exception:
        pids = [init_pid]
    # Never a process group (0, negatives), the host's init, nor CRIU or
    # ourselves: only the restored container's processes.
    spare = {os.getpid(), os.getppid()}
    pids = [p for p in pids if type(p) is int and p > 1 and p not in spare]
    members = []
    for pid in sorted(pids, key=lambda p: p != init_pid):
        with contextlib.suppress(Exception):
            members.append((pid, ctx.host.start_time(pid)))
    killed = 0
    for pid, start in members:
        with contextlib.suppress(Exception):  # one unreadable process must not spare the rest
            killed += kill_same(ctx.host, pid, start)
    return killed


def kill_same(host: Any, pid: int, start: int) -> bool:
    """SIGKILL the process `pid` only if it is still the one that started at `start`."""
    import signal  # its enums cost every hook start; a kill is rare

    try:
        fd = os.pidfd_open(pid)
    except ProcessLookupError:
        return False
    except OSError:
        # No pidfd (Linux < 5.3): the start time just read is the best check left.
        if not host.alive(pid, start):
            return False
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
            return True
        return False
    try:
        # The pidfd pins the process: what /proc says now is about it.
        if not host.alive(pid, start):
            return False
        signal.pidfd_send_signal(fd, signal.SIGKILL)
        return True
    except ProcessLookupError:
        return False
    finally:
        os.close(fd)


def need_init(ctx: Context, action: str, init_pid: int | None) -> int:
    """CRTOOLS_INIT_PID as a container's init, or UsageError: unset, gone,
    or a kernel thread names nothing CRIU dumps or restores."""
    from cudahook.platform.errors import UsageError

    if init_pid is None:
        raise UsageError(f"{action}: CRTOOLS_INIT_PID is not set")
    try:
        parent = ctx.host.ppid(init_pid)
    except Exception:
        raise UsageError(f"{action}: CRTOOLS_INIT_PID {init_pid}: no such process") from None
    if parent in (0, 2):  # the kernel's own threads: nothing CRIU restores or dumps
        raise UsageError(f"{action}: CRTOOLS_INIT_PID {init_pid} is a kernel thread, "
                         "not a container's init")
    return init_pid


def start_time(ctx: Context, pid: int) -> int | None:
    try:
        return ctx.host.start_time(pid)
    except Exception:
        return None

