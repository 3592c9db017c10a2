"""`cudahook discover`: a container's CUDA processes."""

from __future__ import annotations

import argparse

from cudahook.platform.errors import Exit, UsageError

from .common import Command, emit, pid_arg, settings


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--init-pid", type=pid_arg, required=True)
    p.add_argument("--checkpointed", action="store_true",
                   help="also find processes that hold no device node (already checkpointed)")


def run(args: argparse.Namespace) -> int:
    from cudahook.core.backends import make_backend
    from cudahook.core.discovery import discover
    from cudahook.platform.host import Host

    config = settings(args)
    host = Host()
    backend = make_backend(config, host)
    if not host.exists(args.init_pid):
        raise UsageError(f"no process {args.init_pid}")
    found = discover(host, backend, args.init_pid, config.device_regex,
                     require_device_fd=not args.checkpointed,
                     max_parallel=config.max_parallel)
    data = {
        "init_pid": found.init_pid, "scope": found.scope, "scanned": found.scanned,
        "processes": [p.__dict__ for p in found.processes],
        "skipped": {str(k): v for k, v in found.skipped.items()},
        "warnings": found.warnings,
    }
    lines = [f"{p.pid}  nspid {p.nspid}  {p.state or ''}" for p in found.processes]
    lines += [f"{pid}  skipped: {why}" for pid, why in found.skipped.items()]
    emit(args, data, "\n".join(lines) or "no CUDA processes")
    return Exit.OK


COMMAND = Command("discover", "list a container's CUDA processes", add_arguments, run)
