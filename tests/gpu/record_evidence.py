#!/usr/bin/env python3
"""Record what NVIDIA's real `cuda-checkpoint` does, for the simulator to match.

    python3 tests/gpu/record_evidence.py [--out DIR] [--cuda-checkpoint PATH]
    python3 tests/gpu/record_evidence.py --no-gpu-workloads --out /tmp/ev   # dry run

It starts small real CUDA workloads (tests/gpu/workloads.py), a non-CUDA
process and an NVML-only one, then records, call by call, exactly what the
tool prints and returns: help texts, `--get-state` in every state, the error
for every illegal transition and non-CUDA target, a lock timeout, bad device
maps, a `--toggle` round trip, getopt forms (abbreviations, `-pPID`,
`--pid=PID`), a thread ID as `--pid`, `--timeout 0`, `--get-state` polled
during a long checkpoint and restore, persistence mode off and on, two
members of one R590 job driven at once, timings (driver attach cost, and
lock / checkpoint / restore / unlock per GiB), and CUDA 13.4's custom storage
(whether the driver has it; if so a round trip through storage, GB/s per GPU). It keeps the raw `--help`
bytes, the stub's sha256, where `libcuda.so.1` resolves and
`/proc/driver/nvidia/version`; the features cudahook uses come from that
driver version and are compared with what `--help` advertises. Each call that the simulator has a
guess for (cudahook/sim/tool.py, cudahook/sim/protocol.py) is compared with
that guess; evidence.md lists every difference. Output: evidence.json and
evidence.md in DIR (default docs/gpu-evidence/; sim-evidence.* for a dry
run, on the branch `--sim-driver` names).

Every step is guarded (one failure never stops the others), every call has a
deadline, the whole run has a budget after which remaining steps are
skipped, outputs are rewritten after each step (a killed run still leaves
what it saw), and workloads are brought back to running and killed at the end.

--no-gpu-workloads runs the same steps on the project's simulated node, so
this script's own logic is exercised without a GPU.
"""

from __future__ import annotations

import argparse
import contextlib
import difflib
import hashlib
import io
import json
import os
import platform
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import traceback
from collections.abc import Iterator
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

REPO_ROOT = Path(__file__).resolve().parents[2]
if str(REPO_ROOT) not in sys.path:
    sys.path.insert(0, str(REPO_ROOT))

from cudahook.core.backends.cli import features_for, parse_help, parse_nvrm  # noqa: E402
from cudahook.core.discovery import CUDA_THREAD  # noqa: E402
from cudahook.platform.host import Host, RunResult  # noqa: E402
from cudahook.sim import tool as simtool  # noqa: E402
from cudahook.sim.protocol import (  # noqa: E402
    CUDA_ERRORS,
    ILLEGAL_STATE,
    INVALID_VALUE,
    TIMEOUT,
)
from tests.gpu.gpulib import (  # noqa: E402
    NULL_UUID,
    Rig,
    Workload,
    compute_apps,
    custom_storage_probe,
    device_fds,
    find_cuda_checkpoint,
    gpu_rows,
    pid_alive,
    unused_pid,
)

RUNNING, LOCKED, CHECKPOINTED = "running", "locked", "checkpointed"
OTHER_UUID = "GPU-11111111-2222-3333-4444-555555555555"  # a well-formed UUID of no GPU


@dataclass
class Expect:
    """What the simulator says for a call: None means 'any'."""

    rc: int
    stdout: str | None = None
    stderr: str | None = None


def fail_status(major: int) -> int:
    """Every failure's exit status: 1 on R555+, 255 on R550 (the CUDA error is in stderr)."""
    return 255 if 0 < major < 555 else 1


def sim_error(op: str, pid: int, code: int, major: int = 580) -> Expect:
    """The simulator's failure for an operation on a CUDA process: message and exit status."""
    return Expect(fail_status(major), "", simtool.fail_text(op, pid, CUDA_ERRORS[code]))


def sim_ok(stdout: str | None = "") -> Expect:
    return Expect(0, stdout, "")


class StepSkipped(Exception):
    pass


class Recorder:
    def __init__(self, rig: Rig, tool: str, out: Path, *, budget_s: float, call_timeout_s: float,
                 sizes: list[float]):
        self.rig = rig
        self.tool = tool
        self.out = out
        self.host = Host()
        self.started = time.monotonic()
        self.deadline = self.started + budget_s
        self.call_timeout_s = call_timeout_s
        self.sizes = sizes
        self.stem = "sim-evidence" if rig.sim else "evidence"
        self.major = 0
        self.features: dict[str, Any] = {}
        self.roles: dict[str, int] = {}
        self.wl: dict[str, Workload] = {}
        self.data: dict[str, Any] = {
            "meta": {
                "mode": "simulator" if rig.sim else "real",
                "recorded_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
                "tool": tool, "budget_s": budget_s, "call_timeout_s": call_timeout_s,
                "sizes_gib": sizes,
            },
            "steps": [], "calls": [], "snapshots": [], "timing": {}, "environment": {},
            "help": {}, "targets": {}, "workloads": {}, "polls": {}, "persistence": {},
            "jobs": {},
        }

    # -- plumbing ----------------------------------------------------------------

    def left(self) -> float:
        return self.deadline - time.monotonic()

    @contextlib.contextmanager
    def step(self, name: str, need_s: float = 5.0, always: bool = False) -> Iterator[None]:
        """Run one step; whatever it raises is recorded and the run goes on."""
        entry: dict[str, Any] = {"step": name, "ok": False}
        self.data["steps"].append(entry)
        t0 = time.monotonic()
        try:
            if not always and self.left() < need_s:
                raise StepSkipped(f"budget: {self.left():.0f}s left, step needs {need_s:.0f}s")
            yield
            entry["ok"] = True
        except StepSkipped as exc:
            entry["skipped"] = str(exc)
        except Exception as exc:
            entry["error"] = f"{type(exc).__name__}: {exc}"
            entry["traceback"] = traceback.format_exc(limit=6)
        except BaseException:  # SIGTERM (SystemExit) or ^C: note it, let it unwind to cleanup
            entry["error"] = "interrupted"
            raise
        finally:
            entry["duration_s"] = round(time.monotonic() - t0, 3)
            print(f"[evidence] {name}: {'ok' if entry['ok'] else entry.get('skipped') or entry.get('error')}"
                  f" ({entry['duration_s']}s)", flush=True)
            self.save()

    def run(self, argv: list[str], timeout: float) -> RunResult:
        return self.host.run(argv, timeout)

    def call(self, group: str, label: str, args: list[str], *, target: str | None = None,
             expect: Expect | None = None, timeout: float | None = None) -> dict[str, Any]:
        """One cuda-checkpoint invocation, recorded verbatim and compared with the simulator."""
        limit = timeout or self.call_timeout_s
        limit = max(5.0, min(limit, self.left() + 30))
        res = self.run([self.tool, *args], limit)
        entry: dict[str, Any] = {
            "group": group, "label": label, "target": target,
            "argv": ["cuda-checkpoint", *args], "rc": res.returncode,
            "stdout": res.stdout, "stderr": res.stderr,
            "duration_s": round(res.duration, 4), "timed_out": res.timed_out,
        }
        if expect is not None:
            entry["sim"] = {
                **asdict(expect),
                "rc_match": expect.rc == res.returncode,
                "stdout_match": expect.stdout is None or expect.stdout == res.stdout,
                "stderr_match": expect.stderr is None or expect.stderr == res.stderr,
            }
            entry["sim"]["match"] = all(entry["sim"][k] for k in ("rc_match", "stdout_match", "stderr_match"))
        self.data["calls"].append(entry)
        return entry

    def sim_says(self, args: list[str]) -> Expect:
        """What the simulator's cuda-checkpoint prints for these arguments, run in-process.

        Only meaningful where it never reaches a CUDA process: usage errors and
        non-CUDA targets (it then answers as for a process without CUDA).
        """
        with tempfile.TemporaryDirectory() as d:
            version = simtool.VERSIONS.get(self.major or 580, f"{self.major}.00.00")
            # A node with one GPU whose driver is up (this process stands in for
            # the GPU service), so the fake's cuInit passes as the real one's does.
            Path(d, "sim.json").write_text(json.dumps({"driver_version": version,
                                                       "gpus": [{"uuid": NULL_UUID}]}))
            Path(d, "gpu.pid").write_text(f"{os.getpid()}\n")
            out, err = io.StringIO(), io.StringIO()
            with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
                rc = simtool.main(list(args), d, self.tool)
        return Expect(rc, out.getvalue(), err.getvalue())

    def state(self, group: str, role: str, expect_state: str | None) -> str:
        if 0 < self.major < 555:
            return ""  # R550 cannot be asked; its answer is the toggle's exit status
        pid = self.roles[role]
        exp = sim_ok(f"{expect_state}\n") if expect_state else None
        entry = self.call(group, f"get-state ({role}, expect {expect_state})",
                          ["--get-state", "--pid", str(pid)], target=role, expect=exp)
        return str(entry["stdout"]).strip()

    def action(self, group: str, label: str, role: str, action: str, *extra: str,
               expect: Expect | None = None, timeout: float | None = None) -> dict[str, Any]:
        pid = self.roles[role]
        return self.call(group, label, ["--action", action, *extra, "--pid", str(pid)], target=role,
                         expect=expect, timeout=timeout)

    def ensure(self, role: str, want: str, now: str) -> str:
        """Move a process from `now` to `want` with legal actions, so one surprising
        answer (a call that changed the state when the simulator says it must not)
        does not derail every later call of the walk."""
        order = [RUNNING, LOCKED, CHECKPOINTED]
        forward = {RUNNING: ("lock", "--timeout", "10000"), LOCKED: ("checkpoint",)}
        backward = {CHECKPOINTED: ("restore",), LOCKED: ("unlock",)}
        for _ in range(2):
            if now == want or now not in order:
                break
            step = forward[now] if order.index(now) < order.index(want) else backward[now]
            e = self.action("fixup", f"{step[0]} (to reach {want})", role, *step)
            if e["rc"] != 0:
                break
            now = self.state("fixup", role, None)
        return now

    def snapshot(self, label: str, role: str) -> dict[str, Any]:
        """What the process holds: device nodes, GPU memory, CUDA-named threads."""
        pid = self.roles[role]
        apps, raw = compute_apps(self.rig.smi)
        threads = []
        with contextlib.suppress(Exception):
            threads = [{"tid": t, "name": n} for t, n in self.host.thread_names(pid)
                       if n.startswith("cuda") or CUDA_THREAD.match(n)]
        snap = {
            "label": label, "role": role, "pid": pid, "alive": pid_alive(pid),
            "device_fds": device_fds(pid, self.rig.device_regex) if pid_alive(pid) else None,
            "gpu_mib": None if apps is None else apps.get(pid),
            "nvidia_smi_ok": apps is not None, "nvidia_smi_raw": None if apps is not None else raw,
            "cuda_threads": threads,
        }
        self.data["snapshots"].append(snap)
        return snap

    def save(self) -> None:
        self.data["meta"]["elapsed_s"] = round(time.monotonic() - self.started, 2)
        self.out.mkdir(parents=True, exist_ok=True)
        tmp = self.out / f".{self.stem}.json.tmp"
        tmp.write_text(json.dumps(self.data, indent=1, default=str))
        os.replace(tmp, self.out / f"{self.stem}.json")
        tmp = self.out / f".{self.stem}.md.tmp"
        tmp.write_text(render_markdown(self.data))
        os.replace(tmp, self.out / f"{self.stem}.md")

    # -- steps -------------------------------------------------------------------------

    def environment(self) -> None:
        env = self.data["environment"]
        env["uname"] = " ".join(platform.uname())
        env["python"] = sys.version.split()[0]
        env["cpus"] = os.cpu_count()
        # gVisor reports a 4.4.0 kernel; the driver's checkpoint ioctls may not pass through it.
        env["kernel"] = platform.release()
        with contextlib.suppress(OSError):
            env["proc_driver_version"] = Path(self.rig.settings.driver_version_file).read_text()
        env["driver_from_proc"] = parse_nvrm(env.get("proc_driver_version", ""))
        env["libcuda"] = libcuda_paths(self.host)
        data = Path(self.tool).read_bytes()
        env["tool_sha256"] = hashlib.sha256(data).hexdigest()
        env["tool_bytes"] = len(data)
        rows, raw = gpu_rows(self.rig.smi)
        env["nvidia_smi_query_gpu"] = raw
        env["gpus"] = rows
        env["driver_version"] = rows[0]["driver_version"] if rows else None
        # The driver decides the tool's features (the tool is a stub).
        version = env["driver_from_proc"] or env["driver_version"] or ""
        self.major = features_for(version).major
        self.data["driver_features"] = features_for(version).as_dict() if version else None
        with contextlib.suppress(OSError):
            env["usr_local_nvidia_bin"] = sorted(os.listdir("/usr/local/nvidia/bin"))

    def help(self) -> None:
        h = self.data["help"]
        raw = subprocess.run([self.tool, "--help"], capture_output=True, timeout=self.call_timeout_s)
        h["raw"] = {"rc": raw.returncode, "stdout_hex": raw.stdout.hex(),
                    "stderr_hex": raw.stderr.hex(),
                    "stdout_sha256": hashlib.sha256(raw.stdout).hexdigest()}
        res = self.call("help", "--help", ["--help"], expect=self.sim_says(["--help"]))
        self.call("help", "-h", ["-h"], expect=self.sim_says(["-h"]))
        self.call("help", "no arguments", [], expect=self.sim_says([]))
        text = str(res["stdout"]) + str(res["stderr"])
        feats = parse_help(text)
        self.major = self.major or feats.major
        driver = self.data.get("driver_features")
        # What cudahook uses is the driver's; what --help says is compared to it.
        self.features = driver or feats.as_dict()
        h["features"] = feats.as_dict()
        h["features_match_driver"] = driver is None or {
            k: v for k, v in feats.as_dict().items() if k != "version"} == {
            k: v for k, v in driver.items() if k != "version"}
        h["text"] = text
        said = self.sim_says(["--help"])
        sim_text = said.stdout + (said.stderr or "")  # R550's fake prints no help
        if feats.version:
            sim_text = re.sub(r"Version \S+\.", f"Version {feats.version}.", sim_text)
        h["sim_text_equal"] = sim_text == text
        h["diff_vs_sim"] = "".join(difflib.unified_diff(
            sim_text.splitlines(keepends=True), text.splitlines(keepends=True),
            "simulator --help", "real --help"))

    def start(self, start_timeout: float) -> None:
        rig = self.rig
        # All at once (from the main thread), so the slow CUDA start-ups overlap.
        self.wl["walk"] = rig.spawn("walk", "memory", gib=0.5, seed=7)
        for gib in self.sizes:
            self.wl[f"mem{gib:g}"] = rig.spawn(f"mem{gib:g}".replace(".", "_"), "memory", gib=gib)
        self.wl["busy"] = rig.spawn("busy", "busy", gib=0.25, kernel_ms=1000)
        self.wl["nvml"] = rig.spawn("nvml", "nvml")
        sleeper = rig.spawn_plain(["sleep", "3600"])
        self.roles["sleep"] = sleeper.pid
        self.roles["nonexistent"] = unused_pid()
        # One workload that fails to start must not cost the steps that need only the others.
        failed = []
        for name, wl in self.wl.items():
            try:
                wl.wait_ready(min(start_timeout, max(10.0, self.left())))
            except (RuntimeError, TimeoutError) as exc:
                failed.append(name)
                self.data["workloads"][name] = {"failed": str(exc)}
                continue
            self.roles[name] = wl.pids()[0]
            self.data["workloads"][name] = {"pid": self.roles[name], "status": wl.statuses()[0]}
        self.data["targets"] = dict(self.roles)
        if failed:
            raise RuntimeError(f"workloads that did not start: {failed}")

    def attach_cost(self) -> None:
        times = []
        for i in range(3):
            e = self.call("attach", f"get-state #{i + 1} (walk)",
                          ["--get-state", "--pid", str(self.roles["walk"])], target="walk",
                          expect=sim_ok("running\n"))
            times.append(e["duration_s"])
        self.data["timing"]["attach_get_state_s"] = times

    def walk_states(self) -> None:
        g, r = "states", "walk"
        pid = self.roles[r]
        before = self.wl[r].counters()
        self.state(g, r, RUNNING)
        tid = self.call(g, "get-restore-tid (running)", ["--get-restore-tid", "--pid", str(pid)], target=r,
                        expect=sim_ok(None))
        self.data["restore_tid"] = self._restore_thread(pid, str(tid["stdout"]).strip())
        self.snapshot("running", r)
        ill = "illegal"

        def illegal(op: str) -> Expect:
            return sim_error(op, pid, ILLEGAL_STATE, self.major)

        self.action(ill, "checkpoint when running", r, "checkpoint", expect=illegal("checkpoint"))
        self.action(ill, "unlock when running", r, "unlock", expect=illegal("unlock"))
        self.action(ill, "restore when running", r, "restore", expect=illegal("restore"))
        self.ensure(r, RUNNING, self.state(ill, r, RUNNING))

        self.action(g, "lock", r, "lock", "--timeout", "10000", expect=sim_ok(), timeout=40)
        self.state(g, r, LOCKED)
        self.snapshot("locked", r)
        self.action(ill, "lock when locked", r, "lock", "--timeout", "1000", expect=illegal("lock"))
        toggle = ["--toggle", "--pid", str(pid)]
        self.call(ill, "toggle when locked", toggle, target=r, expect=illegal("toggle"))
        self.action(ill, "restore when locked", r, "restore", expect=illegal("restore"))
        self.ensure(r, LOCKED, self.state(ill, r, LOCKED))

        self.action(g, "checkpoint", r, "checkpoint", expect=sim_ok())
        self.state(g, r, CHECKPOINTED)
        self.snapshot("checkpointed", r)
        self.call(g, "get-restore-tid (checkpointed)", ["--get-restore-tid", "--pid", str(pid)], target=r,
                  expect=sim_ok(None))
        self.action(ill, "checkpoint when checkpointed", r, "checkpoint", expect=illegal("checkpoint"))
        self.action(ill, "lock when checkpointed", r, "lock", expect=illegal("lock"))
        self.action(ill, "unlock when checkpointed", r, "unlock", expect=illegal("unlock"))
        now = self.ensure(r, CHECKPOINTED, self.state(ill, r, CHECKPOINTED))

        if self.features.get("device_map") and now == CHECKPOINTED:
            now = self._device_maps(r)
        if now == CHECKPOINTED:
            self.action(g, "restore", r, "restore", expect=sim_ok())
            now = self.state(g, r, LOCKED)
        if now == LOCKED:
            self.action(g, "unlock", r, "unlock", expect=sim_ok())
        self.ensure(r, RUNNING, self.state(g, r, RUNNING))
        self.snapshot("running again", r)
        # A --timeout given to another action: the simulator refuses it before attaching.
        args = ["--action", "checkpoint", "--timeout", "5", "--pid", str(pid)]
        self.call("usage", "checkpoint with --timeout (running)", args, target=r, expect=self.sim_says(args))
        self.state("usage", r, RUNNING)
        self._check_workload(r, before)

    def _restore_thread(self, pid: int, tid: str) -> dict[str, Any]:
        """Is the restore thread the one named cuda + 11 hex digits (the R550 discovery rule)?"""
        info: dict[str, Any] = {"tid": tid}
        with contextlib.suppress(OSError, ValueError):
            name = Path(f"/proc/{pid}/task/{int(tid)}/comm").read_text().strip()
            info.update(name=name, matches_cuda_thread_rule=bool(CUDA_THREAD.match(name)))
        return info

    def _device_maps(self, r: str) -> str:
        """Bad maps must fail and leave the process checkpointed; then an identity map. The state."""
        g, pid = "device-map", self.roles[r]
        source = self.rig.gpu_of(self.wl[r])
        self.data["device_map_source"] = {"used": source, "reported": self.wl[r].statuses()[0].get("gpu")}
        self.action(g, "restore onto an unknown GPU", r, "restore", "--device-map", f"{source}={NULL_UUID}",
                    expect=sim_error("restore", pid, INVALID_VALUE, self.major))
        now = self.state(g, r, CHECKPOINTED)
        if now != CHECKPOINTED:
            return now
        self.action(g, "restore with a map that omits the GPU", r, "restore", "--device-map",
                    f"{OTHER_UUID}={source}", expect=sim_error("restore", pid, INVALID_VALUE, self.major))
        now = self.state(g, r, CHECKPOINTED)
        if now != CHECKPOINTED:
            return now
        args = ["--action", "restore", "--device-map", "bogus", "--pid", str(pid)]
        self.call(g, "restore with a malformed map", args, target=r, expect=self.sim_says(args))
        now = self.state(g, r, CHECKPOINTED)
        if now != CHECKPOINTED:
            return now
        self.action(g, "restore with the identity map", r, "restore", "--device-map", f"{source}={source}",
                    expect=sim_ok())
        return self.state(g, r, LOCKED)

    def non_cuda(self) -> None:
        for role in ("sleep", "nvml", "nonexistent"):
            pid = str(self.roles[role])
            for label, args in (
                ("get-state", ["--get-state", "--pid", pid]),
                ("get-restore-tid", ["--get-restore-tid", "--pid", pid]),
                ("lock", ["--action", "lock", "--timeout", "1000", "--pid", pid]),
                ("toggle", ["--toggle", "--pid", pid]),
            ):
                self.call("non-cuda", f"{label} ({role})", args, target=role, expect=self.sim_says(args))
        self.snapshot("nvml-only", "nvml")

    def lock_timeout(self) -> None:
        g, r = "lock-timeout", "busy"
        pid = self.roles[r]
        before = self.wl[r].counters()
        e = self.action(g, "lock --timeout 1 (long kernels in flight)", r, "lock", "--timeout", "1",
                        expect=sim_error("lock", pid, TIMEOUT, self.major))
        if self.state(g, r, RUNNING) == LOCKED:  # the lock did not wait: undo it
            self.action(g, "unlock (cleanup)", r, "unlock")
        e2 = self.action(g, "lock --timeout 10000 (waits for the kernels)", r, "lock", "--timeout", "10000",
                         expect=sim_ok(), timeout=60)
        self.state(g, r, LOCKED if e2["rc"] == 0 else RUNNING)
        if e2["rc"] == 0:
            self.action(g, "unlock", r, "unlock", expect=sim_ok())
        self.data["timing"]["busy_lock_s"] = {"timeout_1ms": e["duration_s"], "timeout_10s": e2["duration_s"]}
        self._check_workload(r, before)

    def toggle(self) -> None:
        g, r = "toggle", "walk"
        pid = self.roles[r]
        before = self.wl[r].counters()
        toggle = ["--toggle", "--pid", str(pid)]
        self.call(g, "toggle (running -> checkpointed)", toggle, target=r, expect=sim_ok())
        self.state(g, r, CHECKPOINTED)
        self.snapshot("toggled off", r)
        self.call(g, "toggle (checkpointed -> running)", toggle, target=r, expect=sim_ok())
        self.state(g, r, RUNNING)
        self._check_workload(r, before)

    def timing(self) -> None:
        sizes: dict[str, Any] = {}
        self.data["timing"]["sizes"] = sizes
        for gib in self.sizes:
            r = f"mem{gib:g}"
            before = self.wl[r].counters()
            row: dict[str, Any] = {"gib": gib}
            sizes[f"{gib:g}"] = row
            # What the checkpoint really copies: the process's device memory
            # (CUDA context and allocator cache included), not just --gib.
            row["gpu_mib_running"] = self.snapshot(f"{r} running", r)["gpu_mib"]
            for action in ("lock", "checkpoint", "restore", "unlock"):
                extra = ["--timeout", "10000"] if action == "lock" else []
                e = self.action("timing", f"{action} {gib:g} GiB", r, action, *extra, expect=sim_ok(),
                                timeout=120)
                row[action] = e["duration_s"] if e["rc"] == 0 else None
                if action == "checkpoint":
                    snap = self.snapshot(f"{r} checkpointed", r)
                    row["gpu_mib_checkpointed"] = snap["gpu_mib"]
                    row["fds_checkpointed"] = snap["device_fds"]
                if e["rc"] != 0:
                    break
            row["final_state"] = self.state("timing", r, RUNNING)
            self._check_workload(r, before)
            self.save()
        self.data["timing"]["fit"] = fit_per_gib(sizes)

    def usage(self) -> None:
        pid = str(self.roles["sleep"])
        for label, args in (
            ("unknown option", ["--bogus"]),
            ("get-state without --pid", ["--get-state"]),
            ("--pid without an operation", ["--pid", pid]),
            ("unknown action", ["--action", "frobnicate", "--pid", pid]),
            ("non-numeric pid", ["--get-state", "--pid", "abc"]),
            ("two operations", ["--get-state", "--toggle", "--pid", pid]),
            ("device map on lock (non-CUDA target)", ["--action", "lock", "--device-map",
                                                       f"{OTHER_UUID}={NULL_UUID}", "--pid", pid]),
            ("short options", ["-p", pid, "--get-state"]),
            ("--option=value form", [f"--pid={pid}", "--get-state"]),
        ):
            self.call("usage", label, args, target="sleep", expect=self.sim_says(args))

    def option_forms(self) -> None:
        """Forms the driver's getopt_long takes, a thread ID as --pid, --timeout 0."""
        g, r = "options", "walk"
        pid = self.roles[r]
        before = self.wl[r].counters()
        running = sim_ok("running\n")
        for label, args in (("abbreviated --get-s", ["--get-s", "--pid", str(pid)]),
                            ("abbreviated --p", ["--get-state", "--p", str(pid)]),
                            ("ambiguous --get", ["--get", "--pid", str(pid)]),
                            ("-pPID", [f"-p{pid}", "--get-state"]),
                            ("--pid=PID", [f"--pid={pid}", "--get-state"])):
            self.call(g, label, args, target=r,
                      expect=running if "ambiguous" not in label else self.sim_says(args))
        tids = sorted(int(t) for t in os.listdir(f"/proc/{pid}/task") if int(t) != pid)
        self.data["thread_ids"] = tids[:8]
        if tids:
            self.call(g, "get-state with a thread ID as --pid",
                      ["--get-state", "--pid", str(tids[0])], target=r, expect=running)
            restore_tid = str(self.data.get("restore_tid", {}).get("tid") or "")
            if restore_tid.isdigit():
                self.call(g, "get-state with the restore thread's ID",
                          ["--get-state", "--pid", restore_tid], target=r, expect=running)
        self.action(g, "lock --timeout 0", r, "lock", "--timeout", "0", expect=sim_ok(), timeout=60)
        self.action(g, "checkpoint --timeout 0", r, "checkpoint", "--timeout", "0", expect=sim_ok())
        now = self.state(g, r, CHECKPOINTED)
        self.ensure(r, RUNNING, now if now != CHECKPOINTED else self._back(g, r))
        self._check_workload(r, before)

    def _back(self, g: str, r: str) -> str:
        self.action(g, "restore", r, "restore", expect=sim_ok())
        self.action(g, "unlock", r, "unlock", expect=sim_ok())
        return self.state(g, r, RUNNING)

    def poll_states(self) -> None:
        """--get-state while a long checkpoint and restore run (CUDA 13.4+:
        checkpointing / restoring), on the largest timing workload."""
        r = f"mem{max(self.sizes):g}"
        pid = str(self.roles[r])
        before = self.wl[r].counters()
        self.action("poll", "lock", r, "lock", "--timeout", "10000", expect=sim_ok(), timeout=60)
        for action in ("checkpoint", "restore"):
            polls: list[dict[str, Any]] = []
            t0 = time.monotonic()
            proc = subprocess.Popen([self.tool, "--action", action, "--pid", pid],
                                    stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
            while proc.poll() is None and time.monotonic() - t0 < min(120.0, self.left()):
                q = self.run([self.tool, "--get-state", "--pid", pid], 30)
                polls.append({"t_s": round(time.monotonic() - t0, 3), "rc": q.returncode,
                              "stdout": q.stdout, "stderr": q.stderr})
            try:
                out, err = proc.communicate(timeout=max(5.0, min(120.0, self.left())))
            except subprocess.TimeoutExpired:
                proc.kill()
                out, err = proc.communicate()
            self.data["polls"][action] = {
                "rc": proc.returncode, "stdout": out, "stderr": err,
                "duration_s": round(time.monotonic() - t0, 3), "polls": polls,
                "states_seen": sorted({p["stdout"].strip() for p in polls if p["rc"] == 0})}
        self.action("poll", "unlock", r, "unlock", expect=sim_ok())
        self.ensure(r, RUNNING, self.state("poll", r, RUNNING))
        self._check_workload(r, before)

    def persistence(self) -> None:
        """Persistence mode as nvidia-smi reports it, off and back on (root only)."""
        rec = self.data["persistence"]
        query = [self.rig.smi, "--query-gpu=index,persistence_mode", "--format=csv,noheader"]
        first = self.run(query, 30)
        rec["initial"] = {"rc": first.returncode, "stdout": first.stdout, "stderr": first.stderr}
        if os.geteuid() != 0:
            raise StepSkipped("changing persistence mode needs root")
        was_on = "Enabled" in first.stdout
        try:
            for label, mode in (("off", "0"), ("on", "1")):
                r = self.run([self.rig.smi, "-pm", mode], 60)
                q = self.run(query, 30)
                walk = None
                if "walk" in self.roles and not 0 < self.major < 555:
                    walk = self.call("persistence", f"get-state with persistence {label}",
                                     ["--get-state", "--pid", str(self.roles["walk"])], target="walk",
                                     expect=sim_ok("running\n"))["rc"]
                rec[label] = {"set_rc": r.returncode, "set_out": r.stdout + r.stderr,
                              "query": q.stdout, "get_state_rc": walk}
        finally:
            self.run([self.rig.smi, "-pm", "1" if was_on else "0"], 60)

    def jobs(self) -> None:
        """R590+: two members of one --launch-job job driven at once."""
        if not self.features.get("launch_job"):
            raise StepSkipped(f"driver {self.major}: no --launch-job")
        job = self.rig.workdir / "job"
        job.write_text("")
        members = [self.rig.spawn(f"job{i}", "memory", gib=0.25,
                                  launch=[self.tool, "--launch-job", str(job)]) for i in range(2)]
        for wl in members:
            wl.wait_ready(min(120.0, max(10.0, self.left())))
        pids = [wl.pids()[0] for wl in members]
        rec = self.data["jobs"]
        rec["pids"] = pids
        rec["lock"] = [self.run([self.tool, "--action", "lock", "--pid", str(p)], 60).returncode
                       for p in pids]
        calls = [subprocess.Popen([self.tool, "--action", "checkpoint", "--pid", str(p)],
                                  stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
                 for p in pids]
        results = []
        for c in calls:
            try:
                out, err = c.communicate(timeout=max(10.0, min(120.0, self.left())))
            except subprocess.TimeoutExpired:
                c.kill()
                out, err = c.communicate()
                err += "\n(killed: hung)"
            results.append({"rc": c.returncode, "stdout": out, "stderr": err})
        rec["checkpoint_at_once"] = results
        rec["sim_expect"] = "one succeeds, the other fails: the operation cannot be performed " \
                            "in the present state"
        rec["states"] = [self.run([self.tool, "--get-state", "--pid", str(p)], 60).stdout.strip()
                         for p in pids]
        for p, state in zip(pids, rec["states"], strict=True):
            for was, action in ((CHECKPOINTED, "restore"), (LOCKED, "unlock")):
                if state == was:
                    self.run([self.tool, "--action", action, "--pid", str(p)], 60)
                    state = LOCKED if action == "restore" else RUNNING

    def custom_storage(self) -> None:
        """CUDA 13.4+ custom storage: whether the driver has it, and if so one
        small process (0.25 GiB) through storage and back, GB/s per GPU each
        way, its memory checked after (tests/gpu/gpulib.custom_storage_probe)."""
        if self.rig.sim:
            self.rig.lab.set(cuda_version=13040)  # the dry run walks the supported path

        def start() -> Workload:
            wl = self.wl["storage"] = self.rig.spawn("storage", "memory", gib=0.25)
            wl.wait_ready(max(10.0, min(180.0, self.left())))
            self.roles["storage"] = wl.pids()[0]
            return wl

        with tempfile.TemporaryDirectory(prefix="cudahook-storage-") as d:
            got = self.data["custom_storage"] = custom_storage_probe(
                self.rig, start, Path(d) / "image", timeout=max(30.0, min(120.0, self.left())))
        if got["supported"] and not got.get("intact"):
            raise AssertionError(f"not intact after a custom-storage round trip: {got}")

    def end(self) -> None:
        """Every CUDA workload back to running, then its status; failures are the finding."""
        final: dict[str, Any] = {}
        for name, wl in self.wl.items():
            if name == "nvml":
                final[name] = {"status": wl.statuses()[0]}
                continue
            pid = str(self.roles[name])
            state = self.call("end", f"get-state ({name})", ["--get-state", "--pid", pid], target=name)
            s = str(state["stdout"]).strip()
            for was, action in ((CHECKPOINTED, "restore"), (LOCKED, "unlock")):
                if s == was:
                    self.call("end", f"{action} ({name}, recovery)", ["--action", action, "--pid", pid],
                              target=name)
                    s = LOCKED if action == "restore" else RUNNING
            final[name] = {"recovered_from": state["stdout"].strip(), "status": wl.statuses()[0]}
        self.data["workloads_end"] = final

    def _check_workload(self, role: str, before: list[int]) -> None:
        """The workload went on computing, and its memory check still passes."""
        wl = self.wl[role]
        after = wl.wait_progress(before, steps=2, timeout=max(10.0, min(60.0, self.left())))
        st = wl.statuses()[0]
        self.data["workloads"].setdefault(role, {})["last_status"] = st
        if st.get("intact") is not True or st.get("errors"):
            raise AssertionError(f"{role} not intact after the step: {st}")
        self.data["workloads"][role]["counters"] = {"before": before, "after": after}


def libcuda_paths(host: Host) -> dict[str, str]:
    """Where libcuda.so.1 resolves to (`readlink -f`): the driver the tool runs."""
    found: dict[str, str] = {}
    res = host.run(["ldconfig", "-p"], 30)
    cands = [line.split("=>")[-1].strip() for line in res.stdout.splitlines()
             if "libcuda.so.1 " in line]
    cands += ["/usr/lib/x86_64-linux-gnu/libcuda.so.1", "/usr/lib64/libcuda.so.1",
              "/usr/local/nvidia/lib64/libcuda.so.1"]
    for c in cands:
        if os.path.exists(c):
            found[c] = os.path.realpath(c)
    return found


def fit_line(pts: list[tuple[float, float]]) -> dict[str, Any]:
    """Least-squares seconds = a + b * GiB: b is the cost per GiB, a the fixed (attach) cost."""
    n = len(pts)
    mx, my = sum(x for x, _ in pts) / n, sum(y for _, y in pts) / n
    sxx = sum((x - mx) ** 2 for x, _ in pts)
    slope = sum((x - mx) * (y - my) for x, y in pts) / sxx if sxx else 0.0
    return {"intercept_s": round(my - slope * mx, 4), "s_per_gib": round(slope, 5),
            "gib_per_s": round(1 / slope, 2) if slope > 0 else None, "points": pts}


def fit_per_gib(sizes: dict[str, Any]) -> dict[str, Any]:
    """Per action, against the nominal size and, where nvidia-smi gave it, the measured one."""
    fit: dict[str, Any] = {}
    rows = list(sizes.values())
    measured = all((r.get("gpu_mib_running") or 0) > 0 for r in rows)
    for action in ("lock", "checkpoint", "restore", "unlock"):
        done = [r for r in rows if r.get(action) is not None]
        if len(done) < 2:
            continue
        fit[action] = {"nominal": fit_line([(r["gib"], r[action]) for r in done])}
        if measured:
            fit[action]["measured"] = fit_line([(r["gpu_mib_running"] / 1024, r[action]) for r in done])
    return fit


# -- markdown ------------------------------------------------------------------------


def _cell(value: Any, limit: int = 160) -> str:
    text = repr(value) if isinstance(value, str) else str(value)
    if len(text) > limit:
        text = text[: limit - 3] + "..."
    return text.replace("|", "\\|")


def render_markdown(data: dict[str, Any]) -> str:
    meta, env = data["meta"], data.get("environment", {})
    lines = [
        f"# cuda-checkpoint evidence ({meta['mode']})", "",
        f"- recorded: {meta['recorded_at']}, {meta.get('elapsed_s', 0)} s of a {meta['budget_s']} s budget",
        f"- tool: `{meta['tool']}` sha256 `{env.get('tool_sha256', '?')}`",
        f"- driver: {env.get('driver_version')}; kernel {env.get('kernel')}; python {env.get('python')}",
        f"- features parsed from --help: {data.get('help', {}).get('features')}", "",
        "## nvidia-smi --query-gpu", "", "```", str(env.get("nvidia_smi_query_gpu", "")).rstrip(), "```", "",
        "## Steps", "", "| step | ok | s | note |", "| --- | --- | --- | --- |",
    ]
    for s in data["steps"]:
        note = s.get("skipped") or s.get("error") or ""
        ok = "yes" if s["ok"] else "NO"
        lines.append(f"| {s['step']} | {ok} | {s.get('duration_s', '')} | {_cell(note)} |")

    calls = data["calls"]
    diffs = [c for c in calls if "sim" in c and not c["sim"]["match"]]
    h = data.get("help", {})
    other = []
    if h and not h.get("sim_text_equal"):
        other.append("--help text differs from the simulator's (diff at the end)")
    if h and h.get("features_match_driver") is False:
        other.append(f"--help advertises {h.get('features')} but the driver's branch says "
                     f"{data.get('driver_features')}")
    for action, poll in data.get("polls", {}).items():
        extra = set(poll.get("states_seen", [])) - {RUNNING, LOCKED, CHECKPOINTED}
        if extra:
            other.append(f"--get-state during {action} said {sorted(extra)}")
    for i, res in enumerate(data.get("jobs", {}).get("checkpoint_at_once", [])):
        other.append(f"job member {i} checkpointed at once with another: rc {res['rc']}, "
                     f"{res['stderr'].strip()!r} (simulator: {data['jobs'].get('sim_expect')})")
    lines += ["", "## Other differences and findings", ""]
    lines += [f"- {x}" for x in other] or ["None."]
    lines += ["", f"## Differences from the simulator ({len(diffs)} of "
              f"{sum(1 for c in calls if 'sim' in c)} compared calls)", ""]
    if diffs:
        lines += ["| group | call | real rc | sim rc | real stdout | sim stdout | real stderr | sim stderr |",
                  "| --- | --- | --- | --- | --- | --- | --- | --- |"]
        for c in diffs:
            sim = c["sim"]
            lines.append(f"| {c['group']} | {_cell(c['label'])} | {c['rc']} | {sim['rc']} | "
                         f"{_cell(c['stdout'])} | {_cell(sim['stdout'])} | {_cell(c['stderr'])} | "
                         f"{_cell(sim['stderr'])} |")
    else:
        lines.append("None: every compared call matched the simulator's exit status and output.")

    lines += ["", "## Calls", "", "| group | call | argv | rc | stdout | stderr | s | sim |",
              "| --- | --- | --- | --- | --- | --- | --- | --- |"]
    for c in calls:
        sim = c.get("sim")
        mark = "" if sim is None else ("match" if sim["match"] else "DIFFERS")
        rc = "timeout" if c["timed_out"] else c["rc"]
        lines.append(f"| {c['group']} | {_cell(c['label'])} | `{_cell(' '.join(c['argv']), 90)}` | {rc} | "
                     f"{_cell(c['stdout'], 80)} | {_cell(c['stderr'])} | {c['duration_s']} | {mark} |")

    lines += ["", "## What processes hold", "", "| when | role | pid | device fds | GPU MiB | CUDA threads |",
              "| --- | --- | --- | --- | --- | --- |"]
    for s in data["snapshots"]:
        names = ",".join(t["name"] for t in s["cuda_threads"])
        lines.append(f"| {s['label']} | {s['role']} | {s['pid']} | {_cell(s['device_fds'])} | "
                     f"{s['gpu_mib']} | {_cell(names)} |")
    if data.get("restore_tid"):
        lines += ["", f"Restore thread: {data['restore_tid']}"]

    timing = data.get("timing", {})
    lines += ["", "## Timing", "", f"- attach (`--get-state` alone): {timing.get('attach_get_state_s')} s",
              f"- busy process locks: {timing.get('busy_lock_s')}", "",
              "| GiB | GPU MiB running | lock | checkpoint | restore | unlock | GPU MiB checkpointed |",
              "| --- | --- | --- | --- | --- | --- | --- |"]
    for row in timing.get("sizes", {}).values():
        lines.append(f"| {row['gib']} | {row.get('gpu_mib_running')} | {row.get('lock')} | "
                     f"{row.get('checkpoint')} | {row.get('restore')} | {row.get('unlock')} | "
                     f"{row.get('gpu_mib_checkpointed')} |")
    if timing.get("fit"):
        lines.append("")
    for action, fits in timing.get("fit", {}).items():
        for basis, f in fits.items():
            lines.append(f"- {action} ({basis} size): {f['intercept_s']} s + {f['s_per_gib']} s/GiB "
                         f"({f['gib_per_s']} GiB/s)")
    if meta["mode"] == "simulator":
        lines.append("\n(Simulator mode: each GiB above is 16 MiB of simulated device memory.)")

    cs = data.get("custom_storage")
    if cs:
        lines += ["", "## Custom storage (CUDA 13.4+)", "",
                  f"- driver {cs.get('driver')}, CUDA {cs.get('cuda_version')}, "
                  f"`{cs.get('libcuda')}`: supported {cs.get('supported')} ({cs.get('why')})"]
        for gpu, m in (cs.get("per_gpu") or {}).items():
            lines.append(f"- {gpu}: {m['bytes']} bytes in {cs.get('chunks')} chunks; checkpoint "
                         f"{m['checkpoint_s']} s ({m['checkpoint_gb_s']} GB/s), restore "
                         f"{m['restore_s']} s ({m['restore_gb_s']} GB/s); states "
                         f"{cs.get('state_after_checkpoint')} / {cs.get('state_after_restore')}; "
                         f"intact after: {cs.get('intact')}")
    lines += ["", "## Workloads at the end", ""]
    for name, w in data.get("workloads_end", {}).items():
        st = w.get("status", {})
        lines.append(f"- {name}: was {w.get('recovered_from', '-')!r}; state {st.get('state')}, "
                     f"intact {st.get('intact')}, counter {st.get('counter')}, errors {st.get('errors')}")

    lines += ["", "## --help", "", "```", str(h.get("text", "")).rstrip(), "```", "",
              f"Same as the simulator's help for this branch: {h.get('sim_text_equal')}", ""]
    if h.get("diff_vs_sim"):
        lines += ["```diff", h["diff_vs_sim"].rstrip(), "```", ""]
    return "\n".join(lines) + "\n"


# -- main ----------------------------------------------------------------------------


def parse(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", type=Path, default=REPO_ROOT / "docs" / "gpu-evidence")
    p.add_argument("--cuda-checkpoint", help="the tool (default: search for the real one; "
                   "with --no-gpu-workloads: the simulated node's own)")
    p.add_argument("--no-gpu-workloads", action="store_true",
                   help="dry run on a simulated node (cudahook.sim) instead of a GPU")
    p.add_argument("--sim-dir", type=Path, help="with --no-gpu-workloads: the simulated node's folder")
    p.add_argument("--sim-driver", type=int, default=580, choices=(550, 555, 570, 580, 590),
                   help="with --no-gpu-workloads: the driver branch the simulated node emulates")
    p.add_argument("--sizes", default="1,2,4", help="GiB per timing workload (comma-separated)")
    p.add_argument("--budget-s", type=float, default=210.0, help="skip remaining steps after this")
    p.add_argument("--call-timeout-s", type=float, default=60.0, help="deadline per tool call")
    p.add_argument("--start-timeout-s", type=float, default=180.0, help="for workloads to start")
    return p.parse_args(argv)


def make_rig(args: argparse.Namespace, workdir: Path) -> tuple[Rig, str]:
    if args.no_gpu_workloads:
        root = args.sim_dir
        if root is None and args.cuda_checkpoint:
            # A simulated node's tool lives in ROOT/bin: use that node.
            cand = Path(args.cuda_checkpoint).resolve().parent.parent
            root = cand if (cand / "sim.json").exists() else None
        rig = Rig.simulated(workdir, root=root, call_timeout_s=args.call_timeout_s,
                            driver=args.sim_driver)
        return rig, args.cuda_checkpoint or rig.tool
    tool = args.cuda_checkpoint
    if tool is None:
        tool, looked = find_cuda_checkpoint()
        if tool is None:
            raise SystemExit(f"record_evidence: no real cuda-checkpoint found ({looked})")
    return Rig.real(tool, workdir, call_timeout_s=args.call_timeout_s), tool


def main(argv: list[str]) -> int:
    args = parse(argv)
    sizes = [float(s) for s in args.sizes.split(",") if s.strip()]

    def on_term(signum: int, _frame: object) -> None:
        raise SystemExit(128 + signum)  # unwinds through the finally below: cleanup runs

    signal.signal(signal.SIGTERM, on_term)
    workdir = Path(tempfile.mkdtemp(prefix="cudahook-evidence-"))
    rig, tool = make_rig(args, workdir)
    rec = Recorder(rig, tool, args.out, budget_s=args.budget_s, call_timeout_s=args.call_timeout_s,
                   sizes=sizes)
    try:
        with rec.step("environment", need_s=0):
            rec.environment()
        with rec.step("help", need_s=0):
            rec.help()
        with rec.step("start workloads", need_s=20):
            rec.start(args.start_timeout_s)
        ready = set(rec.roles)
        # Highest value first: the state machine and its errors, then what the
        # simulator guesses least well, then the timings.
        # R550 takes only --toggle: the steps that act or ask otherwise are
        # recorded once (usage, non-CUDA targets) and skipped after that.
        for name, fn, needs, need_s, actions in (
            ("attach cost", rec.attach_cost, {"walk"}, 10, True),
            ("states and illegal transitions", rec.walk_states, {"walk"}, 30, True),
            ("non-CUDA targets", rec.non_cuda, {"sleep", "nvml"}, 20, False),
            ("lock timeout", rec.lock_timeout, {"busy"}, 20, True),
            ("usage errors", rec.usage, {"sleep"}, 10, False),
            ("toggle round trip", rec.toggle, {"walk"}, 15, False),
            ("option forms, thread IDs, --timeout 0", rec.option_forms, {"walk"}, 20, True),
            ("timing per GiB", rec.timing, {f"mem{g:g}" for g in sizes}, 30, True),
            ("get-state during checkpoint and restore", rec.poll_states,
             {f"mem{max(sizes):g}"}, 30, True),
            ("persistence mode", rec.persistence, set(), 10, False),
            ("R590 jobs", rec.jobs, set(), 30, True),
            ("custom storage (CUDA 13.4+)", rec.custom_storage, set(), 30, True),
        ):
            with rec.step(name, need_s=need_s):
                if not needs <= ready:
                    raise StepSkipped(f"workloads not started: {sorted(needs - ready)}")
                if actions and 0 < rec.major < 555:
                    raise StepSkipped(f"driver R{rec.major}: --toggle --pid only")
                fn()
        with rec.step("end", always=True):
            rec.end()
    finally:
        with rec.step("cleanup", always=True):
            rig.close()
            shutil.rmtree(workdir, ignore_errors=True)
        rec.save()
    print(f"[evidence] wrote {args.out / (rec.stem + '.json')} and .md", flush=True)
    failed = [s["step"] for s in rec.data["steps"] if not s["ok"]]
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
