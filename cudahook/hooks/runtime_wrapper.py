"""The runtime wrapper: add cudahook's OCI hooks to a GPU container's bundle,
then exec the real runc with the arguments unchanged.

containerd 1.6 and docker have no global hook setting; wrapping runc is the
route nvidia-container-runtime takes too. Only create, run and restore reach
this module (the shell wrapper passes everything else straight to runc), and
only GPU containers are touched: the rest cost one read of config.json.
A failure to add the hooks never blocks the container: the CRIU action
script still finds CUDA processes by discovery alone.
"""

from __future__ import annotations

import json
import os
import sys
import time

from cudahook.platform.atomic import write_atomic

GLOBAL_WITH_VALUE = {"--root", "--log", "--log-format", "--criu", "--rootless"}
WITH_BUNDLE = {"create", "run", "restore"}
STAGES = ("createRuntime", "poststop")


def split(argv: list[str]) -> tuple[dict[str, str], str | None, list[str]]:
    """runc's global options, its command, and the command's arguments."""
    opts: dict[str, str] = {}
    i = 0
    while i < len(argv) and argv[i].startswith("-"):
        name, eq, value = argv[i].partition("=")
        if name in GLOBAL_WITH_VALUE and not eq and i + 1 < len(argv):
            i += 1
            value = argv[i]
        opts[name] = value
        i += 1
    if i >= len(argv):
        return opts, None, []
    return opts, argv[i], argv[i + 1:]


def bundle_of(args: list[str]) -> str:
    for i, a in enumerate(args):
        if a in ("--bundle", "-b") and i + 1 < len(args):
            return args[i + 1]
        for flag in ("--bundle=", "-b="):
            if a.startswith(flag):
                return a[len(flag):]
    return "."


def add_hooks(bundle: str, hook: str) -> bool:
    """Add the hooks to config.json if this is a GPU container; True if changed."""
    from .annotations import PREFIX
    from .gpu_request import visible_devices
    from .oci_bundle import read_config

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
    if changed:
        # The same mode as the bundle's own file, from the first byte on.
        write_atomic(path, json.dumps(cfg).encode(), os.stat(path).st_mode & 0o7777)
    return changed


def log(opts: dict[str, str], level: str, msg: str) -> None:
    path = opts.get("--log")
    if not path:
        if level != "info":
            print(f"cudahook-runtime: {msg}", file=sys.stderr)
        return
    now = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
    if opts.get("--log-format") == "json":
        line = json.dumps({"level": level, "msg": f"cudahook: {msg}", "time": now})
    else:
        line = f'time="{now}" level={level} msg="cudahook: {msg}"'
    try:
        with open(path, "a") as f:
            f.write(line + "\n")
    except OSError:
        pass


def main(argv: list[str]) -> int:
    if len(argv) < 2:
        print("cudahook-runtime: usage: wrapper RUNC HOOK [runc arguments...]", file=sys.stderr)
        return 2
    runc, hook, args = argv[0], argv[1], argv[2:]
    opts, command, rest = split(args)
    if command in WITH_BUNDLE:
        bundle = bundle_of(rest)
        try:
            if add_hooks(bundle, hook):
                log(opts, "info", f"added OCI hooks to {bundle}/config.json")
        except Exception as exc:  # never blocks the container: runc runs either way
            from cudahook.platform.errors import one_line

            log(opts, "warning", one_line(f"could not add OCI hooks to {bundle}: {exc}"))
    try:
        os.execv(runc, [runc, *args])
    except OSError as exc:
        print(f"cudahook-runtime: cannot run {runc}: {exc.strerror}", file=sys.stderr)
        return 127
    return 0  # not reached
