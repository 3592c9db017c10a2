"""`cudahook check`: can a checkpoint (or a restore) succeed now? The checks
and the verdict's text are cudahook.admin.check's."""

from __future__ import annotations

import argparse

from .common import Command, emit, settings


def add_arguments(p: argparse.ArgumentParser) -> None:
    g = p.add_mutually_exclusive_group(required=True)
    g.add_argument("--container", metavar="ID", help="a container cudahook knows (see status)")
    g.add_argument("--init-pid", type=int, help="a container's init PID")
    g.add_argument("--pid", type=int, action="append", help="a CUDA process (repeatable)")
    g.add_argument("--image", metavar="DIR", help="restore side: a checkpoint image directory")
    p.add_argument("--image-dir", metavar="DIR",
                   help="checkpoint side: where the image would be written (free space)")
    t = p.add_mutually_exclusive_group()
    t.add_argument("--bundle", metavar="DIR",
                   help="restore side: the OCI bundle the container would be restored with "
                   "(its GPUs and cudahook.io/ annotations)")
    t.add_argument("--visible-gpus", metavar="UUID,...",
                   help="restore side: the GPUs to restore onto (default: the checkpoint's)")
    p.add_argument("--fresh", action="store_true",
                   help="restore side: ignore a remembered 'never on this node' verdict")
    p.add_argument("--quick", action="store_true",
                   help="restore side: of GPU memory in storage, verify each process's chunk "
                   "manifest and a sample of its chunks, not every chunk")


def run(args: argparse.Namespace) -> int:
    from cudahook.admin import check
    from cudahook.flow.context import Context
    from cudahook.platform.host import Host

    verdict = check.run(Context(settings(args), Host()), args)
    emit(args, verdict.to_dict(), check.render(verdict))
    return verdict.exit_code


COMMAND = Command(
    "check", "can a checkpoint (or a restore) succeed now? Changes nothing", add_arguments, run,
    description="Checkpoint side: --container, --init-pid or --pid. Restore side: --image. "
    "Exit 0: it can; 1: it cannot now (see the reason codes); 6: this image can never be "
    "restored on this node (start the workload cold, or restore it elsewhere).")
