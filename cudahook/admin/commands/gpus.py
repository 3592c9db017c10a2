"""`cudahook gpus`: the GPUs nvidia-smi reports."""

from __future__ import annotations

import argparse

from cudahook.platform.errors import Exit

from .common import Command, emit, no_arguments, settings


def run(args: argparse.Namespace) -> int:
    from cudahook.core.gpus import query_gpus
    from cudahook.platform.host import Host

    config = settings(args)
    gpus = query_gpus(Host(), config)
    emit(args, [g.__dict__ for g in gpus],
         "\n".join(f"{g.index}  {g.uuid}  {g.name}  "
                   f"{'[N/A]' if g.memory_mib is None else g.memory_mib} MiB  driver "
                   f"{g.driver_version}" for g in gpus))
    return Exit.OK


COMMAND = Command("gpus", "the GPUs nvidia-smi reports", no_arguments, run)
