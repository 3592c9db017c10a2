"""Prometheus metrics in the text format, for node_exporter's textfile collector.

Every hook run is its own short process, so the series live in a small JSON
state file under the state directory; each update reads it under a lock,
applies its changes, and rewrites both the state and the metrics file
atomically (a scrape never sees half a file). Labels are the container id
and the GPU model, plus the one dimension a series is about (outcome, phase,
direction, reason: small fixed sets). A container not updated for
`state_retention_s` is dropped, so the file stays bounded on a busy node.

Writing metrics never fails an operation: `update` raises nothing; the
caller's outcome stands either way. Only the slow paths call it: a
container without a GPU never gets here.

The container id and the GPU model come from outside (a manifest, a
runtime's state): every label value is made valid UTF-8 and cut to
MAX_LABEL characters before it is kept, and rendered escaped as the text
format says. One event adds at most MAX_OPS changes, and an event whose
changes would take the state past the store's read cap is dropped, with
a log line: the other containers' series stay.
"""

from __future__ import annotations

import math
import os
import time
from pathlib import Path

from .atomic import write_atomic
from .eventlog import log
from .privdir import private_subdir
from .store import TooLarge, lock_file, process_alive, read_json, write_bounded

# typing costs milliseconds at every hook start: annotations only.
TYPE_CHECKING = False
if TYPE_CHECKING:
    from typing import Any

    from .config import Settings

# name -> (type, help). The one list of what cudahook exports.
FAMILIES: dict[str, tuple[str, str]] = {
    "cudahook_checkpoints_total": (
        "counter", "Checkpoints by outcome (ok, refused, rolled_back, unsafe, failed)."),
    "cudahook_restores_total": (
        "counter", "Restores by outcome (ok, refused, failed)."),
    "cudahook_rollbacks_total": (
        "counter", "Failed checkpoints whose processes were rolled back onto their GPU."),
    "cudahook_guardian_resumes_total": (
        "counter", "Workloads the guardian brought back onto their GPU after a dump, by outcome."),
    "cudahook_fail_closed_kills_total": (
        "counter", "Containers killed because a restore could not finish (fail closed)."),
    "cudahook_refusals_total": (
        "counter", "Checkpoints and restores refused by a check, by side and reason code."),
    "cudahook_gpu_memory_moved_bytes_total": (
        "counter", "GPU memory moved between GPU and host, by direction."),
    "cudahook_phase_duration_seconds": (
        "summary", "Duration of each phase (lock, checkpoint, restore, unlock, toggle, "
        "vmm_prepare, vmm_restore, criu_dump, criu_restore, total)."),
    "cudahook_last_phase_duration_seconds": (
        "gauge", "Duration of the phase in the container's last checkpoint or restore."),
    "cudahook_last_transfer_bytes_per_second": (
        "gauge", "GPU memory moved per second in the last checkpoint or restore, by direction."),
    "cudahook_last_check_ok": (
        "gauge", "1 when the container's last check said the operation can go ahead, else 0."),
    "cudahook_last_event_timestamp_seconds": (
        "gauge", "When cudahook last recorded anything about the container."),
    # The node agent's (core/agent.py): one set per node, no container label.
    "cudahook_agent_up": (
        "gauge", "1 while the node agent (pid, driver) serves, 0 once it exited or died."),
    "cudahook_agent_calls_total": (
        "counter", "Driver calls the node agent passed to its workers since it started."),
    "cudahook_agent_sessions_total": (
        "counter", "Hook sessions the node agent served since it started."),
    "cudahook_agent_sessions": (
        "gauge", "Hook sessions open in the node agent."),
    "cudahook_agent_resident_bytes": (
        "gauge", "Resident memory (RSS) of the node agent, by process: agent, workers."),
}

DEFAULT_NAME = "metrics/cudahook.prom"
STATE_DIR, STATE_FILE = "metrics", "state.json"
STATE_NAME = f"{STATE_DIR}/{STATE_FILE}"
# The lock waits this long at most: metrics must never hold a hook up.
LOCK_WAIT_S = 2.0


# A label value is kept to this many characters (a container id is at most
# 250, a GPU model name some 40): a 2 MiB model name must not become 2 MiB in
# every series of the container.
MAX_LABEL = 256
# One event's changes, at most (a checkpoint makes some 30).
MAX_OPS = 256
# The node agent refreshes its entry this often while it runs (and once
# when it exits); between two refreshes its liveness is read at each write.
AGENT_REFRESH_S = 15.0
# The agent's entry in the state: these numbers and its driver version, no more.
AGENT_NUMBERS = ("pid", "start", "calls", "served", "sessions", "rss_bytes",
                 "workers_rss_bytes")


def label(value: object) -> str:
    """`value` as a label value: valid UTF-8 (a lone surrogate cannot be
    encoded, and one in the state used to fail every write of the file),
    at most MAX_LABEL characters."""
    text = value if isinstance(value, str) else str(value)
    text = text[:MAX_LABEL]
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:  # surrogates: U+FFFD, as a decoder shows bad bytes
        text = "".join("\ufffd" if "\ud800" <= c <= "\udfff" else c for c in text)
    return text


def metrics_path(settings: Settings) -> Path | None:
    """Where the metrics file goes; None when metrics are off."""
    if settings.metrics_file == "":
        return None
    if settings.metrics_file:
        return Path(settings.metrics_file)
    return Path(settings.state_dir) / DEFAULT_NAME


class Changes:
    """What one event adds: counters, summary observations, gauges."""

    def __init__(self, container: str, gpu_model: str | None = None):
        self.container = label(container)
        self.gpu_model = label(gpu_model) if gpu_model else None
        self.ops: list[tuple[str, str, dict[str, str], float]] = []

    def _add(self, op: str, name: str, labels: dict[str, str], value: float) -> Changes:
        if len(self.ops) < MAX_OPS and name in FAMILIES:
            self.ops.append((op, name, {k: label(v) for k, v in labels.items()}, float(value)))
        return self

    def inc(self, name: str, value: float = 1.0, **labels: str) -> Changes:
        return self._add("inc", name, labels, value)

    def observe(self, name: str, value: float, **labels: str) -> Changes:
        return self._add("observe", name, labels, value)

    def set(self, name: str, value: float, **labels: str) -> Changes:
        return self._add("set", name, labels, value)


def update(settings: Settings, changes: Changes, *, now: float | None = None) -> bool:
    """Apply `changes` and rewrite the metrics file; False (and nothing
    raised) when that could not be done."""
    target = metrics_path(settings)
    if target is None:
        return False
    try:
        return _update(settings, target, changes, time.time() if now is None else now)
    except Exception:  # metrics never fail an operation
        return False


def update_agent(settings: Settings, info: dict[str, Any]) -> bool:
    """Record the node agent's own numbers (its status: pid, start, version,
    calls, served, sessions, rss_bytes, workers_rss_bytes; `exited`: it is
    ending) and rewrite the metrics file; False when not done. One fixed
    entry, replaced each time: it never grows."""
    target = metrics_path(settings)
    if target is None:
        return False
    try:
        return _update(settings, target, None, time.time(), agent=info)
    except Exception:  # metrics never take the agent down
        return False


def _update(settings: Settings, target: Path, changes: Changes | None, now: float,
            agent: dict[str, Any] | None = None) -> bool:

    state_path = private_subdir(settings.state_dir, STATE_DIR) / STATE_FILE
    fd = lock_file(state_path.with_suffix(".lock"), timeout_s=LOCK_WAIT_S)
    try:
        state = _valid(read_json(state_path))
        if agent is not None:
            state["agent"] = _valid_agent({**agent, "seen": now})
        if changes is not None:
            _apply(state, changes, now)
        _prune(state, now - settings.state_retention_s)
        # Derived data, rewritten at every event: compact, and not fsynced (a
        # crash loses at most the last events; a damaged state starts over,
        # which Prometheus reads as a counter reset). Past the cap, this
        # event is dropped: the file keeps everyone else's series.
        try:
            write_bounded(state_path, state, compact=True, durable=False)
        except TooLarge as exc:
            log(settings.log_file, "metrics", container=changes.container if changes else "",
                dropped=len(changes.ops) if changes else 0, reason=str(exc))
            return False
        if target.parent != state_path.parent:
            target.parent.mkdir(parents=True, exist_ok=True)
        # Readable by node_exporter, which need not run as root.
        write_atomic(target, render(state["series"] + agent_series(state.get("agent"))).encode(),
                     mode=0o644, durable=False)
        return True
    finally:
        os.close(fd)


def _apply(state: dict[str, Any], changes: Changes, now: float) -> None:
    """One container's event into the state."""
    containers: dict[str, dict[str, Any]] = state["containers"]
    info = containers.setdefault(changes.container, {})
    if changes.gpu_model:
        info["gpu_model"] = changes.gpu_model
    info["seen"] = now
    base = {"container": changes.container, "gpu_model": info.get("gpu_model") or "unknown"}
    series: list[list[Any]] = state["series"]
    index = {_key(e[0], e[1], e[2]): e for e in series}

    def add(name: str, part: str, labels: dict[str, str], value: float, op: str) -> None:
        key = _key(name, part, labels)
        entry = index.get(key)
        if entry is None:
            entry = index[key] = [name, part, labels, 0.0]
            series.append(entry)
        entry[3] = value if op == "set" else entry[3] + value

    for op, name, labels, value in changes.ops:
        full = {**base, **labels}
        if op == "observe":
            add(name, "sum", full, value, "inc")
            add(name, "count", full, 1.0, "inc")
        else:
            add(name, "", full, value, op)
    add("cudahook_last_event_timestamp_seconds", "", base, now, "set")


def _valid(data: Any) -> dict[str, Any]:
    """The state as `_update` writes it; entries of any other shape dropped."""
    if not isinstance(data, dict):
        return {"containers": {}, "series": []}
    containers = data.get("containers")
    containers = {label(k): v for k, v in containers.items() if isinstance(v, dict)} if isinstance(
        containers, dict) else {}
    # Labels written before they were bounded are made valid again here: a
    # state holding one bad value must not fail every later write.
    series = [[e[0], e[1], {k: label(v) for k, v in e[2].items()}, e[3]]
              for e in (data.get("series") if isinstance(data.get("series"), list) else [])
              if isinstance(e, list) and len(e) == 4 and e[0] in FAMILIES
              and isinstance(e[1], str) and isinstance(e[2], dict)
              and all(isinstance(k, str) and isinstance(v, str) for k, v in e[2].items())
              and isinstance(e[3], (int, float)) and not isinstance(e[3], bool)]
    for info in containers.values():
        if "gpu_model" in info:
            info["gpu_model"] = label(info["gpu_model"])
    out: dict[str, Any] = {"containers": containers, "series": series}
    agent = _valid_agent(data.get("agent"))
    if agent:
        out["agent"] = agent
    return out


def _valid_agent(data: Any) -> dict[str, Any] | None:
    """The agent's entry with its known fields only, each of its type."""
    if not isinstance(data, dict):
        return None
    out: dict[str, Any] = {k: data[k] for k in (*AGENT_NUMBERS, "seen")
                           if type(data.get(k)) in (int, float) and math.isfinite(data[k])}
    if type(out.get("pid")) is not int:
        return None
    out["version"] = label(data.get("version") or "")[:64]
    out["exited"] = data.get("exited") is True
    return out


def agent_series(agent: dict[str, Any] | None) -> list[list[Any]]:
    """The agent's series from its entry: up (alive now, as the same
    process), and while it is up its counts and memory."""
    if not agent:
        return []
    up = not agent["exited"] and process_alive(agent["pid"], agent.get("start"))
    who = {"pid": str(agent["pid"]), "driver": agent["version"] or "unknown"}
    series: list[list[Any]] = [["cudahook_agent_up", "", who, 1.0 if up else 0.0]]
    if up:
        for name, key in (("cudahook_agent_calls_total", "calls"),
                          ("cudahook_agent_sessions_total", "served"),
                          ("cudahook_agent_sessions", "sessions")):
            series.append([name, "", {}, float(agent.get(key, 0))])
        for process, key in (("agent", "rss_bytes"), ("workers", "workers_rss_bytes")):
            series.append(["cudahook_agent_resident_bytes", "", {"process": process},
                           float(agent.get(key, 0))])
    return series


def _key(name: str, part: str, labels: dict[str, str]) -> tuple[Any, ...]:
    return (name, part, tuple(sorted(labels.items())))


def _prune(state: dict[str, Any], cutoff: float) -> None:
    """Drop the series of containers not seen since `cutoff`."""
    gone = {c for c, info in state["containers"].items()
            if not isinstance(info.get("seen"), (int, float)) or info["seen"] < cutoff}
    for c in gone:
        del state["containers"][c]
    state["series"] = [e for e in state["series"]
                       if e[2].get("container") not in gone
                       and e[2].get("container") in state["containers"]]


def _escape(value: str) -> str:
    """A label value as the text format writes it: backslash, double quote
    and line feed escaped; valid UTF-8 and bounded (label)."""
    return label(value).replace("\\", "\\\\").replace("\n", "\\n").replace('"', '\\"')


def _number(v: float) -> str:
    return repr(int(v)) if float(v).is_integer() and abs(v) < 1 << 53 else repr(float(v))


def render(series: list[list[Any]]) -> str:
    """The text exposition format (version 0.0.4) of every series, grouped by family."""
    by_family: dict[str, list[tuple[str, dict[str, str], float]]] = {}
    for name, part, labels, value in series:
        sample = f"{name}_{part}" if part else name
        by_family.setdefault(name, []).append((sample, labels, value))
    lines = []
    for name in sorted(by_family):
        kind, text = FAMILIES[name]
        lines += [f"# HELP {name} {text}", f"# TYPE {name} {kind}"]
        for sample, labels, value in sorted(by_family[name],
                                            key=lambda s: (sorted(s[1].items()), s[0])):
            body = ",".join(f'{k}="{_escape(str(v))}"' for k, v in sorted(labels.items()))
            lines.append(f"{sample}{{{body}}} {_number(value)}")
    return "\n".join(lines) + "\n"


def read_state(settings: Settings) -> dict[str, Any]:
    """The series as `cudahook status --json` shows them."""
    try:
        return _valid(read_json(Path(settings.state_dir) / STATE_NAME))
    except Exception:
        return _valid(None)


def per_container(settings: Settings) -> dict[str, dict[str, Any]]:
    """container -> {"gpu_model", "series": {sample{labels}: value}} for status."""
    out: dict[str, dict[str, Any]] = {}
    for name, part, labels, value in read_state(settings)["series"]:
        labels = dict(labels)
        cid = labels.pop("container", "")
        model = labels.pop("gpu_model", "")
        entry = out.setdefault(cid, {"gpu_model": model, "series": {}})
        extra = ",".join(f"{k}={v}" for k, v in sorted(labels.items()))
        sample = (f"{name}_{part}" if part else name) + (f"{{{extra}}}" if extra else "")
        entry["series"][sample] = value
    return out


def phases(timeline: dict[str, Any] | None) -> dict[str, float]:
    """Each step kind's wall time in a timeline (first start to last end,
    across processes: they run in parallel)."""
    spans: dict[str, tuple[float, float]] = {}
    for s in (timeline or {}).get("steps") or []:
        try:
            name, start, end = str(s["step"]), float(s["start"]), float(s["end"])
        except (KeyError, TypeError, ValueError):
            continue
        if name in ("get-state", "verify"):
            continue
        lo, hi = spans.get(name, (start, end))
        spans[name] = (min(lo, start), max(hi, end))
    return {name.replace("-", "_"): hi - lo for name, (lo, hi) in spans.items()}
