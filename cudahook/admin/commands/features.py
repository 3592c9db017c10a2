"""`cudahook features`: what the installed cuda-checkpoint supports."""

from __future__ import annotations

import argparse

from cudahook.platform.errors import Exit

from .common import Command, emit, no_arguments, settings


def run(args: argparse.Namespace) -> int:
    from cudahook.core.backends import make_backend
    from cudahook.platform.host import Host

    config = settings(args)
    backend = make_backend(config, Host())
    f = backend.features
    # Which backend runs the calls, and why (`backend: auto` decides per node).
    emit(args, {**f.__dict__, "backend": backend.name, "backend_why": backend.why},
         f"{f.describe()}\nbackend: {backend.name} ({backend.why})")
    return Exit.OK


COMMAND = Command("features", "what the installed cuda-checkpoint supports", no_arguments, run)
