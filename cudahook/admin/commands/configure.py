"""`cudahook configure`: register cudahook with a container runtime. Runs
without cudahook's configuration: it is what sets a node up."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from cudahook.platform.errors import Exit, UsageError, escape_lines

from .common import Command


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--runtime", required=True,
                   choices=("runc", "containerd", "docker", "podman", "crio"))
    p.add_argument("--dry-run", action="store_true", help="show the changes, make none")
    p.add_argument("--revert", action="store_true", help="undo this runtime's registration")
    p.add_argument("--default", action="store_true", help="docker: make it the default runtime")
    p.add_argument("--criu-registration", choices=("global", "gpu-only"), default=None,
                   help="the CRIU action script for every container (global: in "
                   "/etc/criu/runc.conf) or only for GPU containers created through the "
                   "runtime wrapper (gpu-only); default: as registered now, else global")
    p.add_argument("--hooks-dir", help="where the hook executables are "
                   "(default: PREFIX/libexec of this installation)")
    p.add_argument("--root", default=None, help=argparse.SUPPRESS)


def run(args: argparse.Namespace) -> int:
    from cudahook.admin.configure import ConfigureError, configure
    from cudahook.platform import paths

    hooks_dir = Path(args.hooks_dir) if args.hooks_dir else Path(sys.prefix).parent / "libexec"
    root = args.root if args.root is not None else str(paths.root())
    try:
        lines = configure(args.runtime, hooks_dir, root=root, default=args.default,
                          dry_run=args.dry_run, revert=args.revert,
                          criu_registration=args.criu_registration)
    except ConfigureError as exc:
        raise UsageError(str(exc)) from exc
    print(escape_lines("\n".join(lines)))
    return Exit.OK


COMMAND = Command("configure", "register cudahook with a container runtime", add_arguments, run)
