"""`cudahook checkpoint`: lock and checkpoint CUDA processes."""

from __future__ import annotations

import argparse

from .common import Command, lock_ms_arg
from .phase import Phase, add_targets


def add_arguments(p: argparse.ArgumentParser) -> None:
    add_targets(p)
    p.add_argument("--sequential", action="store_true", default=None)
    p.add_argument("--lock-timeout-ms", type=lock_ms_arg, metavar="MS")


def run(args: argparse.Namespace) -> int:
    phase = Phase(args)
    with phase.exclusive():
        result = phase.engine.checkpoint(phase.pids(require_device_fd=True))
    return phase.done(result)


COMMAND = Command("checkpoint", "lock and checkpoint CUDA processes", add_arguments, run)
