"""The runtime wrapper: runc's command line in; for create, run and restore,
the container's registration (flow/registration.py: cudahook's OCI hooks,
and its own CRIU configuration where the action script is registered
gpu-only); then the real runc, exec'd with the arguments unchanged.

containerd 1.6 and docker have no global hook setting; wrapping runc is the
route nvidia-container-runtime takes too. Only create, run and restore reach
this module (the shell wrapper passes everything else straight to runc).
Whatever the registration does, runc runs.
"""

from __future__ import annotations

import json
import os
import sys
import time

GLOBAL_WITH_VALUE = {"--root", "--log", "--log-format", "--criu", "--rootless"}
WITH_BUNDLE = {"create", "run", "restore"}


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
        if a == "--":  # what follows is the id, not an option
            break
        if a in ("--bundle", "-b") and i + 1 < len(args):
            return args[i + 1]
        for flag in ("--bundle=", "-b="):
            if a.startswith(flag):
                return a[len(flag):]
    return "."


def container_id(args: list[str]) -> str:
    """The container id of create, run and restore: their last argument, or
    the one after "--" (an id may start with "-"). "" where there is none:
    runc refuses the command, and no CRIU file is named meanwhile."""
    if "--" in args:
        rest = args[args.index("--") + 1:]
        return rest[0] if rest else ""
    return args[-1] if args and not args[-1].startswith("-") else ""


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
        from cudahook.flow import registration

        try:
            if registration.add_hooks(bundle, hook, container_id(rest),
                                      lambda msg: log(opts, "warning", msg)):
                log(opts, "info", f"added OCI hooks to {bundle}/config.json")
        except Exception as exc:  # never blocks the container: runc runs either way
            from cudahook.platform.errors import one_line

            covered = not isinstance(exc, registration.NotCovered)
            text = f"could not add OCI hooks to {bundle}: {exc}" if covered else str(exc)
            log(opts, "warning", one_line(text))
            if not covered:
                registration.not_covered(container_id(rest), text)
    try:
        os.execv(runc, [runc, *args])
    except OSError as exc:
        print(f"cudahook-runtime: cannot run {runc}: {exc.strerror}", file=sys.stderr)
        return 127
    return 0  # not reached
