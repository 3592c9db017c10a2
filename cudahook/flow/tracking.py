"""Which containers cudahook tracks, and what it keeps of each.

The OCI hook (hooks/oci_hook.py) parses the runtime's state and calls in
here: `track` at createRuntime/prestart, `forget` at poststop.
"""

from __future__ import annotations

import contextlib
import time

from cudahook.platform.errors import CudahookError, Exit, StateError, UsageError
from cudahook.platform.marks import mark, unmark_container

from . import annotations as ann
from . import oci_bundle

# typing costs milliseconds at every hook start: annotations only.
TYPE_CHECKING = False
if TYPE_CHECKING:
    from collections.abc import Callable
    from typing import Any

# cudahook.io/criu-config without its prefix (criuconf.BASE_ANNOTATION; criuconf
# itself is not imported on this path).
WRAPPER_NOTE = "criu-config"


def track(stage: str, cid: str, bundle: str, init_pid: Callable[[], int | None],
          status: object) -> int:
    """createRuntime/prestart (run again by runc on restore, with the restored
    init's PID): record a GPU container. Any other container leaves after
    config.json is read: no schema validation, no config file, no tool call."""
    info = oci_bundle.read_bundle(bundle)
    raw = ann.ours(info.annotations)
    # The runtime wrapper's own note of the container's CRIU configuration
    # (criuconf.BASE_ANNOTATION): no option of the hooks, never checked here,
    # so an odd value (which runc itself never minds) cannot stop a container.
    raw.pop(WRAPPER_NOTE, None)
    # A container cudahook leaves alone runs as it would without cudahook:
    # its cudahook.io/ annotations are only read for one cudahook tracks.
    if raw.get("enabled") == "false" or not (info.wants_gpu or raw.get("enabled") == "true"):
        return Exit.OK
    if raw:  # a bad option of a tracked container: one line at create, not at checkpoint
        ann.parse({ann.PREFIX + k: v for k, v in raw.items()})
    # Only what cudahook uses is checked: a detail of the runtime-spec
    # schema it does not use must not stop a container.
    from cudahook.flow.context import Context
    from cudahook.platform import config
    from cudahook.platform.store import check_id, container_key

    cid = check_id(cid)
    key = container_key(cid, bundle)
    pid = init_pid()
    ctx = Context(config.load())
    start = None
    if pid:
        try:
            start = ctx.host.start_time(pid)
        except Exception:
            raise UsageError(f"container {cid}: init PID {pid} does not exist") from None
    # The mark first: without it poststop's shell would never start Python
    # and the record would outlive the container.
    _mark(cid)
    with ctx.store.locked(key):
        record = ctx.store.load(key) or {"id": cid, "created": time.time()}
        restored = bool(record.get("pid")) and record.get("pid") != pid
        restores = record.get("restores")
        record.update(
            id=cid,  # the file's key names this container: a damaged record's id does not
            bundle=bundle,
            pid=pid,
            pid_start=start,
            status=status if isinstance(status, str) else None,
            options=raw,
            visible=info.visible,
            snapshot_control=info.snapshot_control,
            updated=time.time(),
        )
        if restored:
            record["restores"] = (restores if type(restores) is int else 0) + 1
        ctx.store.save(key, record)
    # Again once the record is there: a poststop of another container of
    # this id may have cleared it meanwhile, before it could see the record
    # (see marks.unmark_container).
    _mark(cid)
    ctx.log(f"oci-{stage}", container=cid, pid=pid, visible=info.visible)
    return Exit.OK


def _mark(cid: str) -> None:
    try:
        mark("gpu", cid)
    except OSError as exc:
        raise StateError(f"container {cid}: cannot leave its mark: {exc.strerror}") from exc


def forget(cid: str, bundle: str) -> int:
    """poststop: forget the container, and remove the interposer sockets and
    the per-container CRIU configuration it left behind."""
    from cudahook.platform import config
    from cudahook.platform.store import Store, check_id, container_key

    settings = config.load()
    store = Store(settings.state_dir)
    cid = check_id(cid)
    key = container_key(cid, bundle)
    record = store.load(key)
    if record is None:
        # A record written before keys is named by the bare id: this
        # container's only if it has this bundle.
        older = store.load(cid)
        if older is not None and older.get("bundle") == bundle:
            key, record = cid, older
    # The CRIU configuration the runtime wrapper gave it (gpu-only
    # registration): a restore through the wrapper writes it again.
    from cudahook.platform import criuconf

    criuconf.remove(settings.state_dir, key)
    if record is None:
        with contextlib.suppress(OSError):
            unmark_container(settings.state_dir, cid)
        return Exit.OK
    if isinstance(record.get("snapshot_control"), str) and isinstance(record.get("vmm_sockets"), dict):
        from cudahook.vmm.sockets import remove_owned_sockets

        remove_owned_sockets(record["snapshot_control"], record["vmm_sockets"])
    store.delete(key)
    with contextlib.suppress(OSError):
        unmark_container(settings.state_dir, cid)
    from cudahook.platform.eventlog import log

    log(settings.log_file, "oci-poststop", container=cid)
    housekeeping(store, settings.state_retention_s)
    return Exit.OK


def housekeeping(store: Any, retention_s: float) -> None:
    """Forget containers gone without a poststop, and old results: the state
    directory is RAM. Never fails the hook."""
    with contextlib.suppress(OSError, CudahookError):
        store.prune(retention_s)
    from cudahook.platform import criuconf

    with contextlib.suppress(OSError):
        criuconf.prune(store.root)
