"""`cudahook doctor`: check this node and explain problems."""

from __future__ import annotations

import argparse

from cudahook.platform.errors import Exit

from .common import Command, emit, settings


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--root", default=None, help=argparse.SUPPRESS)


def run(args: argparse.Namespace) -> int:
    from cudahook.admin import doctor
    from cudahook.flow.context import Context
    from cudahook.platform.host import Host

    checks = doctor.run_checks(Context(settings(args), Host()), root=args.root)
    emit(args, doctor.as_json(checks), doctor.render(checks))
    return Exit.FAILED if any(c.status == "fail" for c in checks) else Exit.OK


COMMAND = Command("doctor", "check this node and explain problems", add_arguments, run)
