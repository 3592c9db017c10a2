"""What the driver does at the edges of custom storage (CUDA 13.4+), as data.

cuda.h documents the happy path of a custom-storage checkpoint or restore and
says nothing of these; the simulator assumes answers for them (docs/design.md,
"Custom storage"). Each probe below drives a separate caller process
(`storage_caller.py`) step by step against a workload and records what the
driver answered: CUresult names, the target's states over time, and the
workload's own memory check. Each result has an `outcome` (the facts the
simulator must reproduce, compared by `compare`) and a `detail` (timings,
texts, handles: read, not compared).

- caller_dies_checkpoint: the caller is killed after cuCheckpointProcessCheckpoint
  returned its storage info (part copied out), before cuCheckpointOperationComplete.
- caller_dies_restore: the same for a restore from custom storage (part copied in, as zeros).
- complete_twice: cuCheckpointOperationComplete again on a completed handle,
  with a stale handle while another operation is open, and with NULL.
- second_open: while one caller holds a checkpoint open, another caller
  checkpoints the same target, then a second target.
- errors: checkpoint without a retained primary context, and a caller that
  checkpoints or restores itself.
"""

from __future__ import annotations

import contextlib
import json
import os
import queue
import re
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from cudahook.core.backends.driver_api import DriverAPI
from cudahook.platform.errors import ToolError
from cudahook.platform.host import Host

from .gpulib import REPO_ROOT, Rig, Workload, _back_to_running, wait_for

ENV_EVIDENCE = "CUDAHOOK_GPU_EVIDENCE"  # a recorder's evidence JSON from this run
CALLER = Path(__file__).resolve().with_name("storage_caller.py")
PROBES = ("caller_dies_checkpoint", "caller_dies_restore", "complete_twice", "second_open",
          "errors")
# What the whole set needs at least on a real node: a few workload starts
# (PyTorch import, CUDA init) and caller attaches, plus the settling waits.
EDGES_NEED_S = 60.0
EDGES_BUDGET_S = 150.0  # no probe starts past this (one that has started finishes)
PART = 1 << 20  # what a dying caller copies first: the driver has seen copies on the range
CU_NAME = re.compile(r"CUDA_ERROR_[A-Z_]+")


class Gone(Exception):
    """The caller process died or did not answer in time."""


class StorageCaller:
    """One storage_caller.py process, each command with a deadline."""

    def __init__(self, library: str, timeout: float):
        self.timeout = timeout
        env = {**os.environ, "PYTHONPATH": str(REPO_ROOT), "PYTHONUNBUFFERED": "1"}
        self.proc = subprocess.Popen([sys.executable, str(CALLER), library], stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, stderr=subprocess.DEVNULL,
                                     start_new_session=True, env=env)
        self.lines: queue.Queue[bytes] = queue.Queue()
        threading.Thread(target=self._read, daemon=True).start()
        self.hello = self._reply("hello")
        if not self.hello.get("ready"):
            self.kill()
            raise Gone(f"the caller did not attach: {self.hello}")
        self.pid = int(self.hello["pid"])

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            self.lines.put(line)
        self.lines.put(b"")

    def _reply(self, what: str) -> dict[str, Any]:
        try:
            line = self.lines.get(timeout=self.timeout)
        except queue.Empty:
            self.kill()
            raise Gone(f"no answer to {what} in {self.timeout:.0f}s: killed") from None
        if not line:
            self.lines.put(b"")  # every later command finds it gone too
            raise Gone(f"the caller exited ({self.proc.wait()}) during {what}")
        return dict(json.loads(line))

    def __call__(self, do: str, **args: Any) -> dict[str, Any]:
        """The answer; a caller that hung (killed then) or died answers
        "caller gone": on a real driver that is a finding, not a broken probe."""
        assert self.proc.stdin is not None
        try:
            self.proc.stdin.write((json.dumps({"do": do, **args}) + "\n").encode())
            self.proc.stdin.flush()
            return self._reply(do)
        except (OSError, Gone) as exc:
            return {"rc": None, "error": "caller gone", "why": str(exc)}

    def kill(self) -> None:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.proc.pid, signal.SIGKILL)
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.proc.wait(10)


def code_of(reply_or_exc: dict[str, Any] | BaseException | None) -> str | None:
    """The comparable part of an answer: the CUresult's name, "ok", or why none came."""
    if reply_or_exc is None:
        return None
    if isinstance(reply_or_exc, BaseException):
        found = CU_NAME.search(str(reply_or_exc))
        if found:
            return found.group(0)
        return "timed out" if getattr(reply_or_exc, "timed_out", False) else "failed"
    if reply_or_exc.get("rc") == 0:
        return "ok"
    return str(reply_or_exc.get("name") or reply_or_exc.get("error") or "failed")


class Probes:
    """The probes, run in order on `rig`; `spawn(name)` starts a small
    `memory` workload and waits until it is ready."""

    def __init__(self, rig: Rig, spawn: Callable[[str], Workload], where: Path, *,
                 call_timeout: float, settle_s: float):
        self.rig, self.spawn, self.where = rig, spawn, where
        self.call_timeout, self.settle_s = call_timeout, settle_s
        self.settings = rig.settings.with_overrides(
            call_timeout_s=max(rig.settings.call_timeout_s, call_timeout))
        self.api = DriverAPI(Host(), self.settings)
        self.spare: list[Workload] = []
        self.why: list[str] = []  # why a workload was not intact, probe by probe
        self.n = 0

    # -- pieces --------------------------------------------------------------------

    def caller(self) -> StorageCaller:
        return StorageCaller(self.settings.libcuda, self.call_timeout)

    def workload(self) -> Workload:
        """A running workload whose memory check passes: a spare one, else a new one."""
        while self.spare:
            wl = self.spare.pop()
            if wl.proc.poll() is None and self.state(wl.pids()[0]) == "running":
                return wl
            wl.kill()
        self.n += 1
        return self.spawn(f"edge{self.n}")

    def give_back(self, wl: Workload, directory: Path | None = None) -> list[str]:
        """Put a probed workload back to running; keep it for the next probe
        if its memory is still intact, else end it. What was done."""
        done = _back_to_running(self.api, wl.pids()[0], directory or self.where / "none")
        if self.state(wl.pids()[0]) == "running" and self.intact(wl):
            self.spare.append(wl)
        else:
            wl.kill()
            done.append("ended")
        return done

    def state(self, pid: int) -> str:
        try:
            return self.api.get_state(pid)
        except ToolError as exc:
            return code_of(exc) or "failed"

    def states_until_settled(self, pid: int, leaving: str) -> tuple[list[str], list[list[Any]]]:
        """The target's states every 0.2 s from now: until it has left
        `leaving` and held one state for a second, or settle_s ran out. The
        distinct states in order, and the timeline [seconds, state]."""
        t0 = time.monotonic()
        timeline: list[list[Any]] = []
        since = t0
        while True:
            now = time.monotonic()
            s = self.state(pid)
            if not timeline or timeline[-1][1] != s:
                timeline.append([round(now - t0, 3), s])
                since = now
            if s != leaving and now - since >= 1.0:
                break
            if now - t0 > self.settle_s:
                break
            time.sleep(0.2)
        return [s for _, s in timeline], timeline

    def intact(self, wl: Workload, timeout: float | None = None) -> bool:
        """The workload computes on and a memory check ran since now and passed
        (why not, when not, goes to `why`: texts are not compared)."""
        timeout = timeout or self.call_timeout
        if wl.proc.poll() is not None:
            self.why.append(f"{wl.name}: exited ({wl.proc.returncode}): {wl.log_tail(300)}")
            return False
        try:
            before = wl.counters()
            checks = [int(s.get("checks", 0)) for s in wl.statuses()]
            wl.wait_progress(before, steps=2, timeout=timeout)
            wait_for(lambda: all(int(s.get("checks", 0)) > c
                                 for s, c in zip(wl.statuses(), checks, strict=True)),
                     timeout, "no memory check")
        except (TimeoutError, RuntimeError) as exc:
            self.why.append(f"{wl.name}: not computing: {exc}"[:300])
            return False
        st = wl.statuses()[0]
        if st.get("intact") is True and not st.get("errors"):
            return True
        self.why.append(f"{wl.name}: memory check failed: {st}"[:300])
        return False

    def attempt(self, fn: Callable[[], Any]) -> str:
        try:
            fn()
        except ToolError as exc:
            return code_of(exc) or "failed"
        return "ok"

    # -- probes --------------------------------------------------------------------

    def caller_dies(self, restore: bool) -> dict[str, Any]:
        wl = self.workload()
        pid = wl.pids()[0]
        image = self.where / f"dies-{'restore' if restore else 'checkpoint'}"
        out: dict[str, Any] = {}
        detail: dict[str, Any] = {}
        try:
            self.api.lock(pid, self.settings.lock_timeout_ms)
            if restore:
                self.api.checkpoint_to_storage(pid, str(image))
            c = self.caller()
            try:
                c("retain")
                began = c("restore" if restore else "checkpoint", pid=pid)
                out["begin"] = code_of(began)
                if began.get("rc") == 0:
                    moved = c("copy-in" if restore else "copy-out", op=began["op"], limit=PART,
                              zeros=True)
                    out["partial_copy"] = code_of(moved)
                    out["state_before_death"] = self.state(pid)
            finally:
                c.kill()
            t0 = time.monotonic()
            # Where it settles is compared; how soon, and what it passed on the
            # way (a race with the first poll), is detail.
            detail["states"], detail["timeline"] = self.states_until_settled(
                pid, "restoring" if restore else "checkpointing")
            detail["settle_s"] = round(time.monotonic() - t0, 3)
            final = out["state_after_death"] = detail["states"][-1]
            if final == "locked":
                out["unlock"] = self.attempt(lambda: self.api.unlock(pid))
                out["intact_after_unlock"] = self.intact(wl)
                if not restore and out["intact_after_unlock"]:
                    # A new caller can checkpoint it: a full round trip through storage.
                    self.api.lock(pid, self.settings.lock_timeout_ms)
                    again = self.where / "dies-checkpoint-again"
                    out["new_checkpoint"] = self.attempt(
                        lambda: self.api.checkpoint_to_storage(pid, str(again)))
                    out["new_restore"] = self.attempt(
                        lambda: self.api.restore_from_storage(pid, str(again)))
                    out["new_unlock"] = self.attempt(lambda: self.api.unlock(pid))
                    out["intact_after_new_round_trip"] = self.intact(wl)
                    image = again
            elif final == "checkpointed" and restore:
                out["new_restore"] = self.attempt(
                    lambda: self.api.restore_from_storage(pid, str(image)))
                out["new_unlock"] = self.attempt(lambda: self.api.unlock(pid))
                out["intact_after_new_restore"] = self.intact(wl)
            else:
                # Still inside the operation, or somewhere unexpected: can
                # anyone take it on?
                out["new_checkpoint"] = self.attempt(
                    lambda: self.api.checkpoint_to_storage(pid, str(self.where / "dies-other")))
        finally:
            detail["put_back"] = self.give_back(wl, image)
        return {"outcome": out, "detail": detail}

    def complete_twice(self) -> dict[str, Any]:
        wl = self.workload()
        pid = wl.pids()[0]
        out: dict[str, Any] = {}
        detail: dict[str, Any] = {}
        c = self.caller()
        try:
            self.api.lock(pid, self.settings.lock_timeout_ms)
            c("retain")
            a = c("checkpoint", pid=pid)
            out["checkpoint"] = code_of(a)
            if a.get("rc") != 0:
                return {"outcome": out, "detail": detail}
            out["copy_out"] = code_of(c("copy-out", op=a["op"]))
            out["complete"] = code_of(c("complete", op=a["op"]))
            out["state_after_complete"] = self.state(pid)
            second = c("complete", op=a["op"])
            out["complete_again"] = code_of(second)
            detail["complete_again_text"] = second.get("text")
            out["state_after_complete_again"] = self.state(pid)
            null = c("complete", handle=0)
            out["complete_null"] = code_of(null)
            detail["complete_null_text"] = null.get("text")
            b = c("restore", pid=pid)
            out["restore"] = code_of(b)
            if b.get("rc") == 0:
                out["copy_in"] = code_of(c("copy-in", op=b["op"]))
                detail["handles"] = [a["handle"], b["handle"]]
                # A driver may hand the same value out again; then "stale" is
                # the open operation's own handle and says nothing.
                out["handle_reused"] = a["handle"] == b["handle"]
                if not out["handle_reused"]:
                    stale = c("complete", op=a["op"])
                    out["complete_stale"] = code_of(stale)
                    detail["complete_stale_text"] = stale.get("text")
                    out["state_after_stale"] = self.state(pid)
                    out["complete_open"] = code_of(c("complete", op=b["op"]))
                out["state_after_restore"] = self.state(pid)
            out["unlock"] = self.attempt(lambda: self.api.unlock(pid))
            out["intact"] = self.intact(wl)
        finally:
            c.kill()
            detail["put_back"] = self.give_back(wl)
        return {"outcome": out, "detail": detail}

    def second_open(self) -> dict[str, Any]:
        one, two = self.workload(), self.workload()
        p1, p2 = one.pids()[0], two.pids()[0]
        out: dict[str, Any] = {}
        detail: dict[str, Any] = {}
        c1 = c2 = None
        try:
            self.api.lock(p1, self.settings.lock_timeout_ms)
            self.api.lock(p2, self.settings.lock_timeout_ms)
            c1, c2 = self.caller(), self.caller()
            c1("retain")
            c2("retain")
            a = c1("checkpoint", pid=p1)
            out["first"] = code_of(a)
            if a.get("rc") != 0:
                return {"outcome": out, "detail": detail}
            same = c2("checkpoint", pid=p1)
            out["same_target"] = code_of(same)
            detail["same_target_text"] = same.get("text")
            out["state_after_same_target"] = self.state(p1)
            other = c2("checkpoint", pid=p2)
            out["other_target"] = code_of(other)
            if other.get("rc") == 0:
                out["other_round_trip"] = [code_of(c2("copy-out", op=other["op"])),
                                           code_of(c2("complete", op=other["op"]))]
                back = c2("restore", pid=p2)
                out["other_round_trip"].append(code_of(back))
                if back.get("rc") == 0:
                    out["other_round_trip"] += [code_of(c2("copy-in", op=back["op"])),
                                                code_of(c2("complete", op=back["op"]))]
                out["other_unlock"] = self.attempt(lambda: self.api.unlock(p2))
                out["other_intact"] = self.intact(two)
            first = [code_of(c1("copy-out", op=a["op"])), code_of(c1("complete", op=a["op"]))]
            back = c1("restore", pid=p1)
            first.append(code_of(back))
            if back.get("rc") == 0:
                first += [code_of(c1("copy-in", op=back["op"])),
                          code_of(c1("complete", op=back["op"]))]
            out["first_round_trip"] = first
            out["first_unlock"] = self.attempt(lambda: self.api.unlock(p1))
            out["first_intact"] = self.intact(one)
        finally:
            for c in (c1, c2):
                if c is not None:
                    c.kill()
            detail["put_back"] = [self.give_back(one), self.give_back(two)]
        return {"outcome": out, "detail": detail}

    def errors(self) -> dict[str, Any]:
        wl = self.workload()
        pid = wl.pids()[0]
        out: dict[str, Any] = {}
        detail: dict[str, Any] = {}
        c = self.caller()
        try:
            self.api.lock(pid, self.settings.lock_timeout_ms)
            bare = c("checkpoint", pid=pid)  # no primary context retained
            out["no_context"] = code_of(bare)
            detail["no_context_text"] = bare.get("text")
            out["state_after_no_context"] = self.state(pid)
            if bare.get("rc") == 0:  # the driver took it: a round trip puts it back
                c("retain")
                c("copy-out", op=bare["op"])
                c("complete", op=bare["op"])
                back = c("restore", pid=pid)
                if back.get("rc") == 0:
                    c("copy-in", op=back["op"])
                    c("complete", op=back["op"])
            c("retain")
            for what in ("checkpoint", "restore"):
                own = c(what, pid=c.pid)
                out[f"self_{what}"] = code_of(own)
                detail[f"self_{what}_text"] = own.get("text") or own.get("why")
        finally:
            c.kill()
            detail["put_back"] = self.give_back(wl, self.where / "none")
        out["intact"] = wl in self.spare and self.intact(wl)
        return {"outcome": out, "detail": detail}

    def run(self, budget_s: float) -> dict[str, Any]:
        """Every probe while time is left: {name: result}; a probe that raised
        is recorded with its error (that is a finding too)."""
        results: dict[str, Any] = {}
        deadline = time.monotonic() + budget_s
        steps: dict[str, Callable[[], dict[str, Any]]] = {
            "caller_dies_checkpoint": lambda: self.caller_dies(False),
            "caller_dies_restore": lambda: self.caller_dies(True),
            "complete_twice": self.complete_twice,
            "second_open": self.second_open,
            "errors": self.errors,
        }
        for name in PROBES:
            if time.monotonic() > deadline:
                results[name] = {"skipped": "out of time"}
                continue
            t0 = time.monotonic()
            self.why = []
            try:
                results[name] = steps[name]()
            except (ToolError, Gone, TimeoutError, RuntimeError, OSError) as exc:
                results[name] = {"error": f"{type(exc).__name__}: {exc}"[:500]}
            if self.why:
                results[name].setdefault("detail", {})["not_intact"] = self.why
            results[name]["seconds"] = round(time.monotonic() - t0, 2)
        return results

    def close(self) -> None:
        for wl in self.spare:
            wl.kill()
        self.api.close()


def storage_edges(rig: Rig, spawn: Callable[[str], Workload], *, budget_s: float = 180.0,
                  call_timeout: float = 60.0, settle_s: float = 20.0) -> dict[str, Any]:
    """All edge probes on this node, as one JSON-able record: the driver and
    CUDA versions, whether custom storage is there (`why` if not), and each
    probe's result. Workloads it starts are ended before it returns."""
    api = DriverAPI(Host(), rig.settings)
    try:
        features = api.probe()
        hello = getattr(api._helper, "hello", None) or {}
    finally:
        api.close()
    out: dict[str, Any] = {"driver": features.version, "cuda_version": hello.get("cuda_version"),
                           "supported": bool(features.custom_storage),
                           "why": features.custom_storage_why, "sim": rig.sim}
    if not features.custom_storage:
        return out
    t0 = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="cudahook-edges-") as d:
        probes = Probes(rig, spawn, Path(d), call_timeout=call_timeout, settle_s=settle_s)
        try:
            out["probes"] = probes.run(budget_s)
        finally:
            probes.close()
    out["seconds"] = round(time.monotonic() - t0, 2)
    return out


def simulate(recorded: dict[str, Any], workdir: Path, **kw: Any) -> dict[str, Any]:
    """The probes on a simulated node set up as the recording's driver (its
    branch and CUDA version), for `compare`."""
    from cudahook.core.backends.base import driver_major

    rig = Rig.simulated(workdir, driver=driver_major(str(recorded.get("driver") or "")) or 580)
    try:
        if recorded.get("cuda_version"):
            rig.lab.set(cuda_version=int(recorded["cuda_version"]))
        return storage_edges(rig, small_workloads(rig, 60.0), **kw)
    finally:
        rig.close()


def small_workloads(rig: Rig, start_timeout: float) -> Callable[[str], Workload]:
    """What the probes start: one 0.25 GiB `memory` process each, ready."""
    def spawn(name: str) -> Workload:
        wl = rig.spawn(name, "memory", gib=0.25)
        wl.wait_ready(start_timeout)
        return wl

    return spawn


def compare(recorded: dict[str, Any], simulated: dict[str, Any]) -> list[str]:
    """Where the simulator's answers differ from a recording, one line each
    (empty: the same). Only each probe's `outcome` counts."""
    diffs: list[str] = []
    if recorded.get("supported") != simulated.get("supported"):
        return [f"custom storage: recorded {recorded.get('supported')}, "
                f"simulator {simulated.get('supported')}"]
    mine = simulated.get("probes") or {}
    for name, rec in (recorded.get("probes") or {}).items():
        sim = mine.get(name, {})
        if "outcome" not in rec:
            continue  # not run there (out of time, or it broke): nothing to hold the simulator to
        if "outcome" not in sim:
            diffs.append(f"{name}: recorded {rec['outcome']}, simulator {sim}")
            continue
        a, b = rec["outcome"], sim["outcome"]
        for key in sorted(set(a) | set(b)):
            if a.get(key, "-") != b.get(key, "-"):
                diffs.append(f"{name}.{key}: recorded {a.get(key, '-')!r}, "
                             f"simulator {b.get(key, '-')!r}")
    return diffs
