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
    from cudahook.core.backends import gpu_memory_path, probe

    # Which backend runs the calls, and why (`backend: auto` decides per node);
    # where a container's GPU memory would go, and why.
    f = probe(backend)
    path, path_why = gpu_memory_path(config.gpu_memory, f)
    emit(args, {**f.__dict__, "backend": backend.name, "backend_why": backend.why,
                "gpu_memory": path, "gpu_memory_why": path_why},
         f"{f.describe()}\nbackend: {backend.name} ({backend.why})\n"
         f"custom storage: {'yes' if f.custom_storage else 'no'} ({f.custom_storage_why})\n"
         f"gpu memory: {path or 'refused'} ({path_why})")
    return Exit.OK


COMMAND = Command("features", "what the installed cuda-checkpoint supports", no_arguments, run)
