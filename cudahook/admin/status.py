"""`cudahook status`: the GPU containers cudahook knows, their CUDA processes,
and the last checkpoint and restore of each, with its timeline."""

from __future__ import annotations

import time
from typing import Any

from cudahook.hooks.context import Context

from .chart import render as chart


def gather(ctx: Context, *, live: bool = True) -> dict[str, Any]:
    history = ctx.store.history()
    out = []
    for rec in ctx.store.records():
        cid = rec["id"]
        pid = rec.get("pid")
        alive = bool(pid) and ctx.host.alive(pid, rec.get("pid_start"))
        entry: dict[str, Any] = {
            "id": cid, "bundle": rec.get("bundle"), "pid": pid, "alive": alive,
            "gpus": rec.get("visible", []), "options": rec.get("options", {}),
            "restores": rec.get("restores", 0), "processes": [], "last": history.get(cid, {}),
        }
        if alive and live:
            entry["processes"] = _processes(ctx, pid)
        out.append(entry)
    known = {c["id"] for c in out}
    for cid, last in history.items():
        if cid not in known:
            out.append({"id": cid, "alive": False, "gone": True, "processes": [], "last": last})
    return {"containers": out}


def _processes(ctx: Context, init_pid: int) -> list[dict[str, Any]]:
    from cudahook.core.discovery import discover
    from cudahook.platform.errors import CudahookError

    try:
        found = discover(ctx.host, ctx.backend, init_pid, ctx.settings.device_regex,
                         require_device_fd=False, max_parallel=ctx.settings.max_parallel)
    except CudahookError as exc:
        return [{"error": str(exc)}]
    return [{"pid": p.pid, "nspid": p.nspid, "state": p.state or "?"} for p in found.processes]


def _when(t: float | None) -> str:
    return time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(t)) if t else "-"


def render(data: dict[str, Any]) -> str:
    if not data["containers"]:
        return "no GPU containers known"
    lines = []
    for c in data["containers"]:
        state = "running" if c.get("alive") else ("gone" if c.get("gone") else "not running")
        lines.append(f"{c['id']}  {state}  pid {c.get('pid') or '-'}  gpus "
                     f"{','.join(c.get('gpus') or []) or '-'}")
        for p in c.get("processes", []):
            if "error" in p:
                lines.append(f"    processes: {p['error']}")
            else:
                lines.append(f"    pid {p['pid']:<8} nspid {p['nspid']:<6} {p['state']}")
        for kind in ("checkpoint", "restore", "resume"):
            last = c.get("last", {}).get(kind)
            if not last:
                continue
            result = "ok" if last.get("ok") else f"FAILED: {last.get('error', '')}"
            took = f" in {last['total_s']:.3f}s" if "total_s" in last else ""
            lines.append(f"    last {kind}: {_when(last.get('time'))}{took} {result}")
        tl = c.get("last", {}).get("checkpoint", {}).get("timeline")
        if tl:
            lines.append("    checkpoint timeline:")
            lines += ["    " + x for x in chart(tl).splitlines()]
    return "\n".join(lines)


def manifest_chart(image_dir: str) -> str:
    from pathlib import Path

    from cudahook.core.manifest import read

    data = read(Path(image_dir))
    if data is None:
        return f"{image_dir}: no cudahook manifest (no CUDA state in this checkpoint)"
    head = (f"checkpoint of {data.get('container_id') or '(unknown container)'} at "
            f"{_when(data.get('created'))}, driver {data.get('driver_version')}, "
            f"{len(data['processes'])} CUDA process(es), VMM: {'yes' if data.get('vmm') else 'no'}")
    return head + "\n" + chart(data.get("timeline") or {})
