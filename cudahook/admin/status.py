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
            entry["processes"] = _processes(ctx, rec["key"], pid)
        out.append(entry)
    known = {c["id"] for c in out}
    for cid, last in history.items():
        if cid not in known:
            out.append({"id": cid, "alive": False, "gone": True, "processes": [], "last": last})
    # The metrics each container has (the same series as the metrics file).
    from cudahook.platform import metrics

    series = metrics.per_container(ctx.settings)
    for c in out:
        c["metrics"] = series.get(c["id"], {})
    return {"criu_registration": criu_registration(), "containers": out,
            "metrics_file": str(metrics.metrics_path(ctx.settings) or "")}


def criu_registration() -> str:
    """Which containers' checkpoints run the action script: global (all of
    them), gpu-only (GPU containers created through the runtime wrapper), or
    none registered."""
    from cudahook.platform import criuconf, paths

    try:
        text = paths.at(paths.CRIU_CONF).read_text(errors="replace")
    except OSError:
        text = ""
    return criuconf.registration(text)[0] or "none"


# Each cuda-checkpoint probe of `status` gets at most this long: it is a look,
# and a process that does not answer is reported, not waited for.
PROBE_TIMEOUT_S = 10.0


def _processes(ctx: Context, key: str, init_pid: int) -> list[dict[str, Any]]:
    from cudahook.core.discovery import discover
    from cudahook.platform import busy
    from cudahook.platform.errors import CudahookError

    try:
        with busy.peek(ctx.settings.state_dir, key) as free:
            if not free:
                return [{"error": "a checkpoint or restore is in progress: not probed"}]
            why = _unprobeable(ctx, init_pid)
            if why:
                return [{"error": why}]
            settings = ctx.settings.with_overrides(
                call_timeout_s=min(ctx.settings.call_timeout_s, PROBE_TIMEOUT_S))
            look = Context(settings, ctx.host)
            found = discover(look.host, look.backend, init_pid, settings.device_regex,
                             require_device_fd=False, max_parallel=settings.max_parallel)
    except (CudahookError, OSError) as exc:
        return [{"error": str(exc)}]
    return [{"pid": p.pid, "nspid": p.nspid, "state": p.state or "?"} for p in found.processes]


def _unprobeable(ctx: Context, init_pid: int) -> str | None:
    """Why cuda-checkpoint must not be called on the container now, if so:
    it hangs on a frozen, stopped or traced target (CRIU seizes the tasks
    it dumps)."""
    from cudahook.core.discovery import container_pids

    try:
        if ctx.host.is_frozen(init_pid):
            return "container paused: processes not probed"
        pids, _ = container_pids(ctx.host, init_pid)
        for pid in pids:
            status = ctx.host.status(pid)
            if status.get("State", "")[:1] in ("t", "T") or status.get("TracerPid", "0") != "0":
                return (f"process {pid} is stopped or traced (a dump in progress?): "
                        "processes not probed")
    except Exception as exc:  # anything unreadable: do not probe blind
        return f"cannot inspect the container ({type(exc).__name__}: {exc}): processes not probed"
    return None


def _when(t: float | None) -> str:
    return time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(t)) if t else "-"


def render(data: dict[str, Any]) -> str:
    lines = [f"CRIU registration: {data.get('criu_registration', '?')}"]
    if not data["containers"]:
        return "\n".join([*lines, "no GPU containers known"])
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
        check = c.get("last", {}).get("check")
        if check:
            verdict = ("ok" if check.get("ok") else
                       f"REFUSED {','.join(check.get('codes') or [])}: {check.get('message', '')}")
            lines.append(f"    last check ({check.get('side', '?')}): {_when(check.get('time'))} "
                         f"{verdict}")
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
