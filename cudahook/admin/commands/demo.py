"""`cudahook demo`: checkpoint and restore a simulated GPU container. The one
way from the product into the simulator (tests/test_layout.py SIM_DOORS)."""

from __future__ import annotations

import argparse

from .common import Command


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--processes", action="store_true",
                   help="the process-level demo (no runc/CRIU needed)")


def run(args: argparse.Namespace) -> int:
    from cudahook.sim.demo import main as demo

    return demo(processes_only=args.processes)


COMMAND = Command("demo", "checkpoint and restore a simulated GPU container", add_arguments, run)
