"""The CUDA VMM interposer's part of a checkpoint and a restore.

A CUDA checkpoint drops a process's VMM mappings; only the coordinator's
replay of the state its prepare saved brings them back. The replay is one
step, used wherever processes run again after a checkpoint: the
checkpoint's undo, the restore, and the guardian's late resume.
"""

from __future__ import annotations

import contextlib
from collections.abc import Sequence
from pathlib import Path

from cudahook.vmm import coordinator as vmm

from .context import Context

# typing costs milliseconds at every hook start: annotations only.
TYPE_CHECKING = False
if TYPE_CHECKING:
    from cudahook.core.discovery import CudaProcess

# What a failed replay is reported as: the processes' mappings are then lost.
NOT_REPLAYED = "VMM mappings not restored"


def prepare(ctx: Context, cid: str | None, procs: Sequence[CudaProcess], image_dir: Path,
            key: str | None) -> bool:
    """Detect the interposer and run its coordinator's prepare; whether the
    processes take part. A partial set of sockets is refused (detect)."""
    detection = vmm.detect(ctx.host, procs)
    if not detection.participates:
        return False
    if key:  # poststop removes these sockets, and only these
        ctx.store.update(key, vmm_sockets=detection.sockets)
    output = vmm.run_coordinator(
        ctx.host, ctx.settings.tool("vmm_coordinator"), "prepare", str(ctx.host.proc),
        image_dir, [(p.pid, p.nspid) for p in procs], ctx.settings.vmm_timeout_s)
    ctx.log("vmm-prepare", container=cid, pids=[p.pid for p in procs], output=output)
    return True


def replay(ctx: Context, cid: str | None, directory: Path | str | None,
           pairs: Sequence[tuple[int, int]], reason: str | None = None) -> None:
    """Replay the saved state into `pairs` ((host PID, namespace PID) of
    processes that run again). Raises when it could not: their mappings
    are then lost, and the outcome unsafe."""
    from cudahook.platform.errors import EnvironmentProblem

    if not pairs:
        return
    if directory is None:
        raise EnvironmentProblem("no image directory")
    output = vmm.run_coordinator(ctx.host, ctx.settings.tool("vmm_coordinator"), "restore",
                                 "", Path(directory), list(pairs), ctx.settings.vmm_timeout_s)
    fields = {"reason": reason} if reason else {}
    ctx.log("vmm-restore", container=cid, pids=[p for p, _ in pairs], output=output, **fields)


def keep_for_guardian(image_dir: Path, copy: Path) -> None:
    """A private copy of the VMM state for the guardian, where it looks for
    one: by the time it runs, CRIU's image directory path is gone, or the
    image was dropped. Written whole or not at all: the guardian takes the
    directory's presence for "prepare ran". The image directory is the
    container's to fill: the state is copied as post-restore copies it
    (no link followed, regular file only, capped, under a deadline)."""
    import shutil  # here: it loads bz2 and lzma, which no other hook step needs

    partial = copy.with_name(copy.name + ".new")
    shutil.rmtree(partial, ignore_errors=True)
    partial.mkdir(mode=0o700)
    try:
        vmm.copy_state(image_dir, partial, "pre-dump")
    except BaseException:
        shutil.rmtree(partial, ignore_errors=True)  # refused: no half copy left in /run
        raise
    partial.rename(copy)


def record_sockets(ctx: Context, key: str, pids: list[int], nspids: list[int]) -> None:
    """The restored shims' sockets are new files: record them as this
    container's, for poststop. Best effort: without it they are only left."""
    from cudahook.core.discovery import CudaProcess

    with contextlib.suppress(Exception):
        found = vmm.detect(ctx.host, [CudaProcess(p, n) for p, n in zip(pids, nspids, strict=True)])
        if found.participates:
            ctx.store.update(key, vmm_sockets=found.sockets)
