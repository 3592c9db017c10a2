"""`cudahook restore`: restore and unlock CUDA processes, onto other GPUs
with a device map."""

from __future__ import annotations

import argparse

from cudahook.platform.errors import UsageError

from .common import Command
from .phase import Phase, add_targets


def add_arguments(p: argparse.ArgumentParser) -> None:
    add_targets(p)
    p.add_argument("--device-map", help="old=new GPU UUID pairs, comma separated")
    p.add_argument("--source-gpus", help="GPU UUIDs at checkpoint time (comma separated); "
                   "with --target-gpus, the device map is computed")
    p.add_argument("--target-gpus", help="GPU UUIDs to restore onto (comma separated)")
    p.add_argument("--sequential", action="store_true", default=None)


def run(args: argparse.Namespace) -> int:
    phase = Phase(args)
    device_map = _device_map(args)
    with phase.exclusive():
        result = phase.engine.restore(phase.pids(require_device_fd=False), device_map)
    return phase.done(result)


def _device_map(args: argparse.Namespace) -> dict[str, str] | None:
    from cudahook.core.devicemap import compute_device_map, parse_device_map

    if args.device_map and (args.source_gpus or args.target_gpus):
        raise UsageError("give either --device-map or --source-gpus/--target-gpus")
    if args.device_map:
        return parse_device_map(args.device_map)
    if args.source_gpus or args.target_gpus:
        if not (args.source_gpus and args.target_gpus):
            raise UsageError("--source-gpus and --target-gpus go together")
        split = lambda s: [u.strip() for u in s.split(",") if u.strip()]  # noqa: E731
        return compute_device_map(split(args.source_gpus), split(args.target_gpus))
    return None


COMMAND = Command("restore", "restore and unlock CUDA processes", add_arguments, run)
