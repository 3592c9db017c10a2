"""`cudahook check`: would a checkpoint, or a restore, succeed now?

The checks themselves are the hooks' (flow/checks.py): pre-dump and
post-restore refuse on exactly what this command reports. This module only
finds the target, calls them, and shows the verdict. It never changes a
workload: process states are read, nothing is locked or thawed.
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

from cudahook.flow import annotations as ann
from cudahook.flow import checks
from cudahook.flow.context import Context
from cudahook.platform.errors import UsageError


def run(ctx: Context, args: argparse.Namespace) -> checks.Verdict:
    if args.image:
        if args.image_dir:
            raise UsageError("--image-dir goes with a checkpoint check (--container, --init-pid "
                             "or --pid), not with --image")
        return _restore(ctx, args)
    if args.bundle or args.visible_gpus or args.fresh:
        raise UsageError("--bundle, --visible-gpus and --fresh go with --image")
    if args.image_dir and not _is_dir(Path(args.image_dir)):
        raise UsageError(f"--image-dir {args.image_dir}: not a directory")
    image_dir = Path(args.image_dir) if args.image_dir else None
    if args.pid:
        for pid in args.pid:
            if not ctx.host.exists(pid):
                raise UsageError(f"no process {pid}")
        return checks.checkpoint_checks(ctx, pids=list(args.pid), image_dir=image_dir)
    from cudahook.flow.containers import container_for

    cid = args.container
    if cid is not None:
        record = ctx.store.find(cid)
        pid = (record or {}).get("pid")
        if not record or not pid or not ctx.host.alive(pid, record.get("pid_start")):
            raise UsageError(f"container {cid}: not a running GPU container cudahook knows "
                             "(see 'cudahook status')")
        init_pid = int(pid)
    else:
        init_pid = args.init_pid
        if not ctx.host.exists(init_pid):
            raise UsageError(f"no process {init_pid}")
    record, ctx, _opts = container_for(ctx, init_pid)
    cid = cid or (record or {}).get("id")
    v = checks.checkpoint_checks(ctx, init_pid=init_pid, image_dir=image_dir, container=cid)
    checks.remember(ctx, cid, v)
    return v


def _is_dir(path: Path) -> bool:
    """A directory; a name the kernel refuses (too long, a NUL) is none."""
    try:
        return path.is_dir()
    except (OSError, ValueError):
        return False


def _restore(ctx: Context, args: argparse.Namespace) -> checks.Verdict:
    image = Path(args.image)
    if not _is_dir(image):
        raise UsageError(f"--image {image}: not a directory")
    record: dict[str, Any] | None = None
    opts = ann.Options()
    if args.bundle:
        from cudahook.flow import oci_bundle

        info = oci_bundle.read_bundle(args.bundle)
        record = {"visible": info.visible}
        if ann.ours(info.annotations):
            opts = ann.parse(info.annotations)
            ctx = Context(opts.apply(ctx.settings), ctx.host)
    elif args.visible_gpus:
        record = {"visible": [u.strip() for u in args.visible_gpus.split(",") if u.strip()]}
    return checks.restore_checks(ctx, image, record, opts, use_cache=not args.fresh,
                                 quick=bool(getattr(args, "quick", False)))


def render(v: checks.Verdict) -> str:
    what = "checkpoint" if v.side == "checkpoint" else "restore"
    t = v.target
    if v.side == "checkpoint":
        subject = (f"container {t['container']}" if t.get("container") else
                   f"init pid {t['init_pid']}" if t.get("init_pid") else
                   "pid(s) " + ", ".join(map(str, t.get("pids") or [])))
    else:
        subject = f"image {t.get('image')}"
    if v.ok:
        head = f"{subject}: the {what} can go ahead"
        if v.side == "restore" and not v.facts.get("manifest"):
            head += " (no cudahook manifest: the image holds no CUDA state)"
        elif v.side == "checkpoint" and not v.facts.get("cuda_processes"):
            head += " (no CUDA processes)"
    elif v.never_here:
        head = f"{subject}: can NEVER be restored on this node: start the workload cold here, " \
               "or restore it elsewhere"
    else:
        head = f"{subject}: the {what} would FAIL now"
    if v.cached:
        head += " (remembered verdict; --fresh checks again)"
    lines = [head]
    for p in v.problems:
        lines.append(f"  [{p.code}] {p.detail}")
        lines.append(f"      -> {p.reason.hint}")
    lines += [f"  warning: {w}" for w in v.warnings]
    facts = _facts(v.facts)
    if facts:
        lines.append("  " + "; ".join(facts))
    if v.checked:
        lines.append("  checked: " + ", ".join(v.checked))
    return "\n".join(lines)


def _mib(n: Any) -> str:
    return f"{n / (1 << 20):.0f} MiB" if isinstance(n, int) else "?"


def _facts(f: dict[str, Any]) -> list[str]:
    out = []
    if f.get("driver_version"):
        out.append(f"driver {f['driver_version']}")
    if f.get("criu_version"):
        out.append(f"CRIU {f['criu_version']}")
    if f.get("cuda_processes"):
        out.append(f"{len(f['cuda_processes'])} CUDA process(es)")
    if isinstance(f.get("gpu_memory_bytes"), int):
        out.append(f"GPU memory {_mib(f['gpu_memory_bytes'])}")
    if "gpu_memory_path" in f:
        out.append(f"GPU memory to {f['gpu_memory_path'] or 'nowhere'} "
                   f"({f.get('gpu_memory_path_why', '')})")
    if isinstance(f.get("host_memory_available_bytes"), int):
        out.append(f"host MemAvailable {_mib(f['host_memory_available_bytes'])}")
    if "image_gpu_bytes" in f and "image_expected_bytes" not in f:
        out.append(f"GPU memory to write {_mib(f['image_gpu_bytes'])}, "
                   f"{_mib(f['image_free_bytes'])} free")
    if "image_expected_bytes" in f:
        out.append(f"image about {_mib(f['image_expected_bytes'])}, "
                   f"{_mib(f['image_free_bytes'])} free")
    if f.get("device_map"):
        out.append("device map " + ",".join(f"{a}={b}" for a, b in f["device_map"].items()))
    return out
