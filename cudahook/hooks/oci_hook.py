"""The OCI hook: keep track of GPU containers.

createRuntime/prestart (run again by runc on restore, with the restored
init's PID) record the container; poststop forgets it and removes interposer
sockets and the per-container CRIU configuration it left behind. Non-GPU
containers leave after reading config.json: no schema validation, no config
file, no tool call.
"""

from __future__ import annotations

import contextlib
import sys
import time

from cudahook.flow import annotations as ann
from cudahook.flow import oci_bundle
from cudahook.platform.errors import CudahookError, Exit, StateError, UsageError, one_line, report
from cudahook.platform.marks import mark, unmark_container

from . import oci_state
from .criu_env import PID_MAX_LIMIT

# typing costs milliseconds at every hook start: annotations only.
TYPE_CHECKING = False
if TYPE_CHECKING:
    from typing import Any

CREATE_STAGES = ("prestart", "createRuntime")
STAGES = (*CREATE_STAGES, "poststart", "poststop")
# Run inside the container's namespaces, where the host's /proc, state
# directory and tools are not what they seem.
REFUSED_STAGES = ("createContainer", "startContainer")
# cudahook.io/criu-config without its prefix (criuconf.BASE_ANNOTATION; criuconf
# itself is not imported on this path).
WRAPPER_NOTE = "criu-config"


def main(argv: list[str]) -> int:
    try:
        stage = _stage(argv)
        state = oci_state.read_state(_read_stdin())
        if stage in CREATE_STAGES:
            return on_create(stage, state)
        if stage == "poststop":
            return on_poststop(state)
        return Exit.OK
    except Exception as exc:  # every failure is one line and a documented code
        return report(exc)


def _stage(argv: list[str]) -> str:
    if len(argv) == 1 and argv[0] in REFUSED_STAGES:
        raise UsageError(f"{argv[0]} runs inside the container's namespaces: register "
                         "cudahook-oci-hook for createRuntime (or prestart) and poststop")
    if len(argv) != 1 or argv[0] not in STAGES:
        raise UsageError(f"usage: cudahook-oci-hook {{{'|'.join(STAGES)}}} < state.json")
    return argv[0]


def _read_stdin() -> str:
    """At most MAX_STATE + 1 bytes of stdin (read_state refuses more), as
    UTF-8 text (RFC 8259). The shell hook hands on the state with a newline
    added: one trailing newline is not counted."""
    data = sys.stdin.buffer.read(oci_state.MAX_STATE + 2)
    if data.endswith(b"\n"):
        data = data[:-1]
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError:
        raise UsageError("container state on stdin is not JSON: not UTF-8") from None


def _pid(state: dict) -> int | None:  # type: ignore[type-arg]
    """The state's init PID: absent (or 0) before the runtime has one."""
    pid = state.get("pid")
    if pid is None or (pid == 0 and type(pid) is int):
        return None
    if type(pid) is not int or not 1 < pid <= PID_MAX_LIMIT:
        raise UsageError(f"container state: pid {one_line(repr(pid), 40)} is not a PID")
    return pid


def on_create(stage: str, state: dict) -> int:  # type: ignore[type-arg]
    info = oci_bundle.read_bundle(state["bundle"])
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

    cid = check_id(state["id"])
    key = container_key(cid, state["bundle"])
    pid = _pid(state)
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
            bundle=state["bundle"],
            pid=pid,
            pid_start=start,
            status=state.get("status") if isinstance(state.get("status"), str) else None,
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


def on_poststop(state: dict) -> int:  # type: ignore[type-arg]
    from cudahook.platform import config
    from cudahook.platform.store import Store, check_id, container_key

    settings = config.load()
    store = Store(settings.state_dir)
    cid = check_id(state["id"])
    key = container_key(cid, state["bundle"])
    record = store.load(key)
    if record is None:
        # A record written before keys is named by the bare id: this
        # container's only if it has this bundle.
        older = store.load(cid)
        if older is not None and older.get("bundle") == state["bundle"]:
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
