"""`cudahook status`: GPU containers and their last results; one in detail;
a checkpoint's timeline from its manifest."""

from __future__ import annotations

import argparse
from pathlib import Path

from cudahook.platform.errors import Exit, UsageError

from .common import Command, emit, settings


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("container", nargs="?", metavar="ID",
                   help="one container (its id or a unique prefix): its CUDA processes, "
                   "last results and checkpoint timeline")
    p.add_argument("--all", "-a", action="store_true",
                   help="also the containers that are not running or gone")
    p.add_argument("--manifest", metavar="IMAGE_DIR",
                   help="show a checkpoint's per-process timeline from its manifest")
    p.add_argument("--no-live", action="store_true",
                   help="do not query process states (no cuda-checkpoint calls)")


def run(args: argparse.Namespace) -> int:
    from cudahook.admin import status as view
    from cudahook.flow.context import Context
    from cudahook.platform.host import Host

    ctx = Context(settings(args), Host())
    if args.manifest:
        from cudahook.admin.check import _is_dir

        if not _is_dir(Path(args.manifest)):
            raise UsageError(f"--manifest {args.manifest}: not a directory")
        from cudahook.core.manifest import read

        # Read once: the JSON and the chart show the same manifest.
        m = read(Path(args.manifest))
        emit(args, m.to_dict() if m is not None else None, view.manifest_chart(args.manifest, m))
        return Exit.OK
    # The table shows no process states: probe only for the detail and --json.
    data = view.gather(ctx, live=not args.no_live and bool(args.container or args.json))
    if args.container:
        one = view.select(data, args.container)
        emit(args, {**data, "containers": [one]}, view.render_one(one))
    else:
        emit(args, data, view.render(data, show_all=args.all))
    return Exit.OK


COMMAND = Command("status", "GPU containers and their last results, one line each; "
                  "with an ID, that container in detail", add_arguments, run)
