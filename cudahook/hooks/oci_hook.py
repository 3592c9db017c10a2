"""The OCI hook: keep track of GPU containers.

createRuntime/prestart (run again by runc on restore, with the restored
init's PID) record the container; poststop forgets it and removes interposer
sockets it left behind. Non-GPU containers leave after reading config.json:
no schema validation, no config file, no tool call.
"""

from __future__ import annotations

import contextlib
import sys
import time

from cudahook.platform.errors import CudahookError, Exit, UsageError
from cudahook.platform.store import mark

from . import annotations as ann
from . import oci

# typing costs milliseconds at every hook start: annotations only.
TYPE_CHECKING = False
if TYPE_CHECKING:
    from typing import Any

CREATE_STAGES = ("prestart", "createRuntime", "createContainer", "startContainer")
STAGES = (*CREATE_STAGES, "poststart", "poststop")


def main(argv: list[str]) -> int:
    try:
        if len(argv) != 1 or argv[0] not in STAGES:
            raise UsageError(f"usage: cudahook-oci-hook {{{'|'.join(STAGES)}}} < state.json")
        stage = argv[0]
        state = oci.read_state(sys.stdin.read(oci.MAX_STATE + 1))
        if stage in CREATE_STAGES:
            return on_create(stage, state)
        if stage == "poststop":
            return on_poststop(state)
        return Exit.OK
    except CudahookError as exc:
        print(f"cudahook: {exc}", file=sys.stderr)
        return int(exc.exit_code)


def on_create(stage: str, state: dict) -> int:  # type: ignore[type-arg]
    info = oci.read_bundle(state["bundle"])
    opts = ann.parse(info.annotations) if ann.ours(info.annotations) else ann.Options()
    if opts.enabled is False or not (info.wants_gpu or opts.enabled):
        return Exit.OK
    oci.validate_state(state)
    from cudahook.platform import config
    from cudahook.platform.store import check_id

    from .context import Context

    ctx = Context(config.load())
    cid = check_id(state["id"])
    pid = state.get("pid") or None
    start = None
    if pid:
        try:
            start = ctx.host.start_time(pid)
        except Exception:
            raise UsageError(f"container {cid}: init PID {pid} does not exist") from None
    with ctx.store.locked(cid):
        record = ctx.store.load(cid) or {"id": cid, "created": time.time()}
        restored = bool(record.get("pid")) and record.get("pid") != pid
        record.update(
            bundle=state["bundle"],
            pid=pid,
            pid_start=start,
            status=state.get("status"),
            options=ann.ours(info.annotations),
            visible=info.visible,
            snapshot_control=info.snapshot_control,
            updated=time.time(),
        )
        if restored:
            record["restores"] = record.get("restores", 0) + 1
        ctx.store.save(cid, record)
    with contextlib.suppress(OSError):  # without it only poststop's cleanup is skipped
        mark("gpu", cid)
    ctx.log(f"oci-{stage}", container=cid, pid=pid, visible=info.visible)
    return Exit.OK


def on_poststop(state: dict) -> int:  # type: ignore[type-arg]
    from cudahook.platform import config
    from cudahook.platform.store import Store, check_id

    settings = config.load()
    store = Store(settings.state_dir)
    cid = check_id(state["id"])
    record = store.load(cid)
    with contextlib.suppress(OSError):
        mark("gpu", cid, on=False)
    if record is None:
        return Exit.OK
    if record.get("snapshot_control") and isinstance(record.get("vmm_sockets"), dict):
        from cudahook.vmm.sockets import remove_owned_sockets

        remove_owned_sockets(record["snapshot_control"], record["vmm_sockets"])
    store.delete(cid)
    from cudahook.platform.eventlog import log

    log(settings.log_file, "oci-poststop", container=cid)
    housekeeping(store, settings.state_retention_s)
    return Exit.OK


def housekeeping(store: Any, retention_s: float) -> None:
    """Forget containers gone without a poststop, and old results: the state
    directory is RAM. Never fails the hook."""
    with contextlib.suppress(OSError, CudahookError):
        store.prune(retention_s)
