"""A GPU container's registration: cudahook's OCI hooks in its bundle and,
where the CRIU action script is registered gpu-only (see
cudahook.platform.criuconf), a CRIU configuration of its own that names the
script: runc reads `org.criu.config` from the container's config at every
checkpoint and restore, so only GPU containers pay for the script.

The runtime wrapper (hooks/runtime_wrapper.py) parses runc's command line
and calls in here for create, run and restore. Only GPU containers are
touched: the rest cost one read of config.json. A failure to add the hooks
never blocks the container: the CRIU action script still finds CUDA
processes by discovery alone.
"""

from __future__ import annotations

import json
import os

from cudahook.platform.atomic import write_atomic

# typing costs milliseconds at every wrapper start: annotations only.
TYPE_CHECKING = False
if TYPE_CHECKING:
    from collections.abc import Callable

STAGES = ("createRuntime", "poststop")


def add_hooks(bundle: str, hook: str, cid: str | None = None,
              warn: Callable[[str], None] | None = None) -> bool:
    """Add the hooks to config.json if this is a GPU container, and with
    `cid`, its own CRIU configuration where the site's does not name the
    action script; True if config.json changed. `warn` hears each thing
    the wrapper set aside (an annotation it would not trust, a line dropped)."""
    from cudahook.flow.annotations import PREFIX
    from cudahook.flow.gpu_request import visible_devices
    from cudahook.flow.oci_bundle import read_config

    path = os.path.join(bundle, "config.json")
    cfg = read_config(bundle)
    if not isinstance(cfg, dict):
        raise ValueError("config.json is not a JSON object")
    notes = cfg.get("annotations") or {}
    enabled = notes.get(PREFIX + "enabled")
    env = (cfg.get("process") or {}).get("env") or []
    gpu = bool(visible_devices(env, notes, (cfg.get("linux") or {}).get("devices")))
    if enabled == "false" or not (gpu or enabled == "true"):
        return False
    hooks = cfg.setdefault("hooks", {})
    changed = False
    for stage in STAGES:
        entries = hooks.setdefault(stage, [])
        if not any(isinstance(e, dict) and e.get("path") == hook for e in entries):
            entries.append({"path": hook, "args": ["cudahook-oci-hook", stage]})
            changed = True
    problem = None
    if cid is not None:
        from cudahook.platform.criuconf import installed_script

        try:
            changed |= point_criu_config(cfg, installed_script(hook), cid, warn or _ignore,
                                         bundle)
        except Exception as exc:  # the hooks still go in; the caller reports it
            problem = NotCovered(f"GPU container {cid} is NOT covered by cudahook's CRIU "
                                 f"action script: {exc}")
            problem.__cause__ = exc
            changed = True  # point_criu_config may have neutralised the annotation
    if changed:
        # The same mode as the bundle's own file, from the first byte on.
        write_atomic(path, json.dumps(cfg).encode(), os.stat(path).st_mode & 0o7777)
    if problem is not None:
        raise problem
    return changed


class NotCovered(Exception):
    """The hooks went in, but the container's CRIU configuration could not
    be made to name the action script: its checkpoints run without it."""


def not_covered(cid: str | None, text: str) -> None:
    """A GPU container left uncovered goes in cudahook's own log as well as
    runc's: the operator looks there first. Never fails the wrapper."""
    import contextlib

    from cudahook.platform import config
    from cudahook.platform.eventlog import log as event

    with contextlib.suppress(Exception):
        event(config.load().log_file, "wrapper-not-covered", container=cid, reason=text)


def _ignore(_: str) -> None:
    pass


def point_criu_config(cfg: dict, script: str, cid: str,  # type: ignore[type-arg]
                      warn: Callable[[str], None], bundle: str) -> bool:
    """Give the container a CRIU configuration naming `script` unless the one
    runc would hand CRIU already does (a global registration): the site's
    file, or a file in the operator's CRIU directory the container's own
    org.criu.config names with every line that runs code dropped, copied
    and the action-script line added. True if the annotations changed.

    Whatever the container's annotations name outside the operator's
    directory is never read: CRIU runs as root, and such a file (an overlay
    upperdir, say) is the container author's to write. Where no copy can be
    made, the container names no file at all: runc then hands CRIU none.
    The copy is named by the container's key (store.container_key: its id
    and `bundle`)."""
    from cudahook.platform import criuconf, paths

    notes = cfg.get("annotations")
    if not isinstance(notes, dict):
        notes = cfg["annotations"] = {}
    before = dict(notes)
    current = notes.get(criuconf.ANNOTATION)
    try:
        _point(notes, script, cid, warn, bundle)
    except Exception:
        notes.pop(criuconf.BASE_ANNOTATION, None)
        if current is not None and current != str(paths.at(paths.CRIU_CONF)):
            notes[criuconf.ANNOTATION] = ""
        raise
    return notes != before


def _point(notes: dict, script: str, cid: str,  # type: ignore[type-arg]
           warn: Callable[[str], None], bundle: str) -> None:
    from cudahook.platform import config, criuconf, paths
    from cudahook.platform.errors import one_line
    from cudahook.platform.store import container_key

    state_dir = config.load().state_dir
    key = container_key(cid, bundle)
    current = notes.get(criuconf.ANNOTATION)
    default = str(paths.at(paths.CRIU_CONF))  # runc's default file
    who = one_line(cid, 100)  # runc checks the id only after the wrapper
    if criuconf.BASE_ANNOTATION in notes:  # set here at create: what it was before
        named = notes[criuconf.BASE_ANNOTATION]
    elif current is None or (isinstance(current, str) and criuconf.is_copy(current, state_dir)):
        named = None
    else:  # the container's own
        named = current
    if named is not None and not (isinstance(named, str) and criuconf.operator_file(named)):
        warn(f"container {who}: CRIU configuration {one_line(str(named), 200)!r} is not a file "
             f"in {paths.at(criuconf.OPERATOR_DIR)}: not used, its copy starts from {default}")
        named = None
    text, dropped = None, []
    if named is not None:
        try:
            text, dropped = criuconf.without_code(criuconf.read_base(named), script)
        except Exception as exc:  # a FIFO, a link, a device: never followed or waited on
            warn(f"container {who}: CRIU configuration {named}: {one_line(str(exc), 200)}: "
                 f"not used, its copy starts from {default}")
            named = None
        else:
            for line in dropped:
                warn(f"container {who}: {named}: dropped a line that could run or load code: "
                     f"{one_line(line, 200)!r}")
    if text is None:
        text = criuconf.read_base(default)
    if criuconf.registers(text, script) and not dropped:
        # Registered globally (or in the operator's file the container
        # named): runc's own choice of file already covers it.
        criuconf.remove(state_dir, key)
        notes.pop(criuconf.BASE_ANNOTATION, None)
        if named is None:
            notes.pop(criuconf.ANNOTATION, None)
        else:
            notes[criuconf.ANNOTATION] = named
        return
    notes[criuconf.ANNOTATION] = str(criuconf.write(state_dir, key,
                                                    criuconf.for_container(text, script)))
    if named is None:
        notes.pop(criuconf.BASE_ANNOTATION, None)
    else:
        notes[criuconf.BASE_ANNOTATION] = named
