"""The outcome of a checkpoint, restore, guardian resume or check, kept for
`cudahook status` and counted in the metrics: one call, so the two never
disagree. Neither may fail the operation whose outcome it records.
"""

from __future__ import annotations

import contextlib
import time

from cudahook.platform.errors import CudahookError

from .context import Context

# typing costs milliseconds at every hook start: annotations only.
TYPE_CHECKING = False
if TYPE_CHECKING:
    from typing import Any


def remember(ctx: Context, cid: str | None, kind: str, *,
             check: dict[str, Any] | None = None, **result: Any) -> None:
    """Keep the last `kind` result of the container and count it. A
    container the OCI hook never saw has no id: its outcomes are counted
    under container="" (one series, not one per init PID). `check`: the
    verdict a refusal stands on (Verdict.summary()), kept and counted with
    it in one metrics update."""
    outcomes = {"check": check} if check is not None else {}
    outcomes[kind] = {"time": time.time(), **result}
    if cid:
        with contextlib.suppress(OSError, CudahookError):
            for k, r in outcomes.items():
                ctx.store.remember(cid, k, r)
    count(ctx, cid or "", outcomes)


def count(ctx: Context, cid: str, outcomes: dict[str, dict[str, Any]]) -> None:
    """One metrics update for the outcomes ({kind: result})."""
    from cudahook.platform import metrics

    total = None
    for kind, result in outcomes.items():
        try:
            changes = _changes(cid, kind, result)
        except Exception:  # a result of an unexpected shape is not worth a failure
            continue
        if changes is None:
            continue
        if total is None:
            total = changes
        else:
            total.ops = (total.ops + changes.ops)[:metrics.MAX_OPS]
            total.gpu_model = total.gpu_model or changes.gpu_model
    if total is not None:
        metrics.update(ctx.settings, total)


def _changes(cid: str, kind: str, r: dict[str, Any]) -> Any:
    from cudahook.platform import metrics

    c = metrics.Changes(cid, r.get("gpu_model"))
    ok = bool(r.get("ok"))
    codes = [x for x in (r.get("reasons") or []) if isinstance(x, str)]
    if kind == "check":
        return c.set("cudahook_last_check_ok", 1 if ok else 0, side=str(r.get("side")))
    if kind == "criu-dump":
        seconds = float(r["criu_dump_s"])
        c.observe("cudahook_phase_duration_seconds", seconds, phase="criu_dump")
        return c.set("cudahook_last_phase_duration_seconds", seconds, phase="criu_dump")
    if kind == "resume":
        return c.inc("cudahook_guardian_resumes_total", outcome="ok" if ok else "failed")
    if kind not in ("checkpoint", "restore"):
        return None
    side = kind
    if ok:
        outcome = "ok"
    elif codes:
        outcome = "refused"
        for code in codes:
            c.inc("cudahook_refusals_total", side=side, reason=code)
    elif r.get("unsafe"):
        outcome = "unsafe"
    elif r.get("rolled_back"):
        outcome = "rolled_back"
    else:
        outcome = "failed"
    c.inc(f"cudahook_{kind}s_total", outcome=outcome)
    if r.get("rolled_back"):
        c.inc("cudahook_rollbacks_total")
    if r.get("killed") is not None:
        c.inc("cudahook_fail_closed_kills_total")
    spans = metrics.phases(r.get("timeline"))
    for name in ("criu_restore", "vmm_prepare", "vmm_restore"):
        if isinstance(r.get(f"{name}_s"), (int, float)):
            spans[name] = float(r[f"{name}_s"])
    if ok and isinstance(r.get("total_s"), (int, float)):
        spans["total"] = float(r["total_s"])
    for phase, seconds in spans.items():
        c.observe("cudahook_phase_duration_seconds", seconds, phase=phase)
        c.set("cudahook_last_phase_duration_seconds", seconds, phase=phase)
    moved = r.get("gpu_bytes")
    if ok and isinstance(moved, int) and moved > 0:
        direction = "to_host" if kind == "checkpoint" else "to_gpu"
        c.inc("cudahook_gpu_memory_moved_bytes_total", moved, direction=direction)
        busy = spans.get("checkpoint" if kind == "checkpoint" else "restore") or spans.get("toggle")
        if busy:
            c.set("cudahook_last_transfer_bytes_per_second", moved / busy,
                  direction=direction)
    return c


def criu_elapsed(ctx: Context, criu_pid: int) -> float | None:
    """Seconds since the CRIU process started: at post-restore, CRIU's own
    restore time (reading the image, recreating the tasks)."""
    import os

    try:
        ticks = ctx.host.start_time(criu_pid)
        for line in (ctx.host.proc / "stat").read_text().splitlines():
            if line.startswith("btime "):
                started = int(line.split()[1]) + ticks / os.sysconf("SC_CLK_TCK")
                return max(0.0, time.time() - started)
    except Exception:
        return None
    return None
