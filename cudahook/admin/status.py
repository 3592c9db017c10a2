"""`cudahook status`: the GPU containers cudahook knows, one line each (like
`docker ps`: id, state, GPUs, last checkpoint and restore); `status ID`: one
of them in detail, its CUDA processes and the timeline of its last
checkpoint; `--json`: everything, for every container."""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, Any

from cudahook.flow.context import Context

from .chart import render as chart

if TYPE_CHECKING:
    from cudahook.core.manifest import Manifest


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
            "metrics_file": str(metrics.metrics_path(ctx.settings) or ""),
            "agent": agent_view(ctx.settings)}


AGENT_FIELDS = ("pid", "version", "calls", "served", "sessions", "in_flight", "idle_workers",
                "rss_bytes", "workers_rss_bytes")


def agent_view(settings: Any, *, full: bool = False) -> dict[str, Any]:
    """The node agent as status and doctor show it: up or not (and how
    phases attach then), and while up what its status answers (`full`: all
    of it, its sessions and workers too)."""
    import os

    from cudahook.core import agent_client

    info = None
    if os.path.exists(agent_client.socket_path(settings)):
        info = agent_client.status(settings, timeout=2.0)
    if info is None:
        return {"up": False, "mode": settings.agent}
    keys = info if full else AGENT_FIELDS
    return {"up": True, "mode": settings.agent,
            **{k: info.get(k) for k in keys if info.get(k) is not None and k != "ok"}}


def agent_text(view: dict[str, Any]) -> str:
    """One line (escaped, capped) for `agent_view`."""
    from cudahook.platform.errors import one_line

    if not view.get("up"):
        how = ("the first driver-API phase starts one" if view.get("mode") == "auto"
               else "each driver-API phase attaches the driver itself")
        return f"not running (agent: {one_line(str(view.get('mode')), 8)}): {how}"

    def mib(key: str) -> str:
        value = view.get(key)
        return f"{value >> 20} MiB" if type(value) is int else "?"

    return one_line(
        f"running, pid {view.get('pid')}, driver {str(view.get('version') or '?')[:40]}; "
        f"{view.get('calls', '?')} calls in {view.get('served', '?')} sessions served, "
        f"{view.get('sessions', '?')} open; {mib('rss_bytes')} resident "
        f"(+{mib('workers_rss_bytes')} in {view.get('idle_workers', '?')} idle workers)", 240)


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
            if ctx.host.stopped(pid):
                return (f"process {pid} is stopped or traced (a dump in progress?): "
                        "processes not probed")
    except Exception as exc:  # anything unreadable: do not probe blind
        return f"cannot inspect the container ({type(exc).__name__}: {exc}): processes not probed"
    return None


def _when(t: float | None) -> str:
    return time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(t)) if t else "-"


def _ago(t: Any, now: float) -> str:
    """How long ago `t` was, in the largest whole unit (docker ps style)."""
    if not isinstance(t, (int, float)) or isinstance(t, bool) or t <= 0:
        return "-"
    s = max(0, int(now - t))
    for unit, size in (("d", 86400), ("h", 3600), ("m", 60)):
        if s >= size:
            return f"{s // size}{unit} ago"
    return f"{s}s ago"


def outcome(last: dict[str, Any]) -> str:
    """One word for a checkpoint's or restore's result, as the metrics count it."""
    if last.get("ok"):
        return "ok"
    if last.get("reasons"):
        return "refused"
    if last.get("unsafe"):
        return "UNSAFE"
    if last.get("rolled_back"):
        return "rolled back"
    return "FAILED"


def _state(c: dict[str, Any]) -> str:
    return "running" if c.get("alive") else ("gone" if c.get("gone") else "not running")


def _short_gpu(uuid: str) -> str:
    """GPU-d3c6bd82-0fc1-... -> GPU-d3c6bd82: enough to tell a node's GPUs apart."""
    parts = uuid.split("-")
    return "-".join(parts[:2]) if len(parts) > 2 else uuid


def _last(c: dict[str, Any], kind: str, now: float) -> str:
    last = (c.get("last") or {}).get(kind)
    if not isinstance(last, dict) or not last:
        return "-"
    return f"{_ago(last.get('time'), now)} {outcome(last)}"


ID_WIDTH = 12
HEADER = ("CONTAINER ID", "STATE", "GPUS", "LAST CHECKPOINT", "LAST RESTORE")


def _cell(value: object) -> str:
    """Every table cell passes through here: the one place its text is made,
    escaped (ids and GPU names come from specs and manifests) and capped."""
    from cudahook.platform.errors import one_line

    return one_line(str(value), 80)


def table(rows: list[tuple[object, ...]], header: tuple[str, ...] = HEADER) -> str:
    """Left-aligned columns two spaces apart, the header first."""
    cells = [[_cell(v) for v in r] for r in [header, *rows]]
    widths = [max(len(r[i]) for r in cells) for i in range(len(header))]
    return "\n".join("  ".join(v.ljust(w) for v, w in zip(r, widths, strict=True)).rstrip()
                     for r in cells)


def render(data: dict[str, Any], *, show_all: bool = False, now: float | None = None) -> str:
    """One line per live GPU container (`show_all`: the others too)."""
    now = time.time() if now is None else now
    shown = [c for c in data["containers"] if show_all or c.get("alive")]
    hidden = len(data["containers"]) - len(shown)
    lines = [f"CRIU registration: {data.get('criu_registration', '?')}"]
    if shown:
        lines.append(table([
            (str(c["id"])[:ID_WIDTH], _state(c),
             ",".join(_short_gpu(str(g)) for g in c.get("gpus") or []) or "-",
             _last(c, "checkpoint", now), _last(c, "restore", now))
            for c in shown]))
    else:
        lines.append("no GPU containers running" if not show_all else "no GPU containers known")
    if hidden:
        lines.append(f"({hidden} not running or gone: cudahook status --all)")
    if "agent" in data:
        lines.append(f"node agent: {agent_text(data['agent'])}")
    return "\n".join(lines)


def select(data: dict[str, Any], cid: str) -> dict[str, Any]:
    """The container named by its id or a unique prefix of it."""
    from cudahook.platform.errors import UsageError, one_line

    found = [c for c in data["containers"] if c["id"] == cid]
    found = found or [c for c in data["containers"] if str(c["id"]).startswith(cid)]
    if len(found) != 1:
        what = "no container" if not found else f"{len(found)} containers"
        raise UsageError(f"{what} known by the id {one_line(cid, 80)!r}")
    return found[0]


def render_one(c: dict[str, Any]) -> str:
    """One container in detail: its processes, last results and timeline."""
    lines = [f"{c['id']}  {_state(c)}  pid {c.get('pid') or '-'}  gpus "
             f"{','.join(c.get('gpus') or []) or '-'}"]
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


def manifest_chart(image_dir: str, m: Manifest | None) -> str:
    """`cudahook status --manifest`: the checkpoint in `image_dir`, whose
    manifest is `m` (None: it has none)."""
    if m is None:
        return f"{image_dir}: no cudahook manifest (no CUDA state in this checkpoint)"
    head = (f"checkpoint of {m.container_id or '(unknown container)'} at "
            f"{_when(m.created)}, driver {m.driver_version}, "
            f"{len(m.processes)} CUDA process(es), VMM: {'yes' if m.vmm else 'no'}")
    return head + "\n" + chart(m.timeline or {})
