"""`cudahook state`: the checkpoint state of processes."""

from __future__ import annotations

import argparse

from cudahook.platform.errors import Exit

from .common import Command, emit, pid_arg, settings


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--pid", type=pid_arg, action="append", required=True)


def run(args: argparse.Namespace) -> int:
    from cudahook.core.backends import make_backend
    from cudahook.core.engine import Engine
    from cudahook.platform.host import Host

    config = settings(args)
    host = Host()
    engine = Engine(make_backend(config, host), config, host)
    states = {pid: engine.read_state(pid) for pid in args.pid}
    emit(args, {str(k): v for k, v in states.items()},
         "\n".join(f"{pid}  {state}" for pid, state in states.items()))
    return Exit.OK


COMMAND = Command("state", "the checkpoint state of processes", add_arguments, run)
