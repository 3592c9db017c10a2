"""P3: GPU phases at N = 1, 8, 32 simulated CUDA processes.

One SimLab (driver R580, attach latency 1.0 s per cuda-checkpoint call by
default - real is ~2.7 s - and a copy cost: 4 MiB per process at 2000 MiB/s)
runs ALL workloads at once (N=1, N=8 and N=32 groups: the background load is
the same for every variant). Each repetition runs, for every N in a rotated
order, the checkpoint phase then the restore phase:

  checkpoint  Engine.checkpoint(pids): get-state all, lock all, checkpoint all
  restore     Engine.restore(pids): get-state all, restore all, unlock all, verify all

Each phase gets a FRESH Engine/backend, as each hook invocation is a new
process: its `cuda-checkpoint --help` feature probe is part of the phase.

Variants:
  par       default settings (parallel everything)            target: N=32/N=1 <= 1.3
  seq       sequential=True (locks parallel, the rest one at a time)
  serial    per process lock, checkpoint; then per process restore, unlock
            (CRIU's CUDA plugin order; no state reads, no --help probe)
  helper    PROTOTYPE: the unchanged Engine over a backend that attaches to
            the driver ONCE per phase (bench/helper_backend.py), as a
            driver-API backend or persistent helper would
  par1help  par, with the backend's `--help` feature probe done once before
            the engine fans out (today each of the N get-state threads may
            probe it: a race on the lazy property); at N=1 and N=max only

seq/serial are linear in N (about N x attach latency per step), so by default
they are measured at small N only and their N=32 figure is PROJECTED from the
fitted per-process slope (marked as such); --full measures them at every N.

Separately, the fake tool's own start-up (attach latency set to 0): one
`cuda-checkpoint --get-state`, and a burst of 32 at once (2 cores), and the
engine phases at attach latency 0 (what is left is pure overhead).
"""

from __future__ import annotations

import os
import statistics
import sys
import threading
import time

if __package__ in (None, ""):  # run as a file: bench/_checkout.py
    import _checkout  # noqa: F401

from bench.common import (
    Result,
    arg_parser,
    benchmark,
    fmt_s,
    log,
    med,
    reps_of,
    run_main,
    sim_node,
    sim_node_options,
    spawn_wait,
)
from bench.helper_backend import OneAttachBackend

TITLE = "GPU phases (checkpoint, restore) at N = 1, 8, 32 CUDA processes"


def _host_cls():  # type: ignore[no-untyped-def]
    from cudahook.platform.host import Host

    class CountingHost(Host):
        """Counts tool calls by kind (--help, --get-state, --action X)."""

        def __init__(self) -> None:
            super().__init__()
            self.calls: dict[str, int] = {}
            self._lk = threading.Lock()

        def run(self, argv, timeout):  # type: ignore[no-untyped-def]
            a = list(argv)
            kind = ("help" if "--help" in a else
                    a[a.index("--action") + 1] if "--action" in a else
                    next((x.lstrip("-") for x in a[1:] if x.startswith("--")), "?"))
            with self._lk:
                self.calls[kind] = self.calls.get(kind, 0) + 1
            return super().run(argv, timeout)

    return CountingHost


def step_spans(timeline) -> dict[str, dict[str, float]]:  # type: ignore[no-untyped-def]
    """Per step name: wall span (first start to last end) and median call duration."""
    by: dict[str, list] = {}
    for s in timeline.steps:
        by.setdefault(s.step, []).append(s)
    return {
        name: {"span_s": round(max(s.end for s in ss) - min(s.start for s in ss), 4),
               "median_call_s": round(statistics.median(s.duration for s in ss), 4),
               "calls": len(ss)}
        for name, ss in by.items()
    }


@benchmark("P3", TITLE)
def run(args) -> Result:  # type: ignore[no-untyped-def]
    from cudahook.core.backends.cli import CudaCheckpointCLI, parse_help
    from cudahook.core.engine import Engine

    reps = reps_of(args)
    ns = [int(x) for x in args.n.split(",")]
    small = [int(x) for x in args.seq_n.split(",")] if not args.full else ns
    latency = args.attach_latency
    lo, hi = min(ns), max(ns)
    res = Result("P3", TITLE)
    CountingHost = _host_cls()
    with sim_node("p3", gpus=2, attach_latency=latency, bandwidth=args.bandwidth) as node:
        lab = node.lab
        for n in ns:
            node.spawn(f"n{n}", mib=args.mib, procs=n, interval_ms=200)
        pids = {n: node.pids(f"n{n}", n) for n in ns}
        log(f"P3: {sum(len(v) for v in pids.values())} workloads up; attach {latency}s")
        def group(n: int) -> list[int]:
            # seq/serial at an N without its own group: the first n of the largest
            return pids[n] if n in pids else pids[max(ns)][:n]

        settings = lab.settings(call_timeout_s=120.0, lock_timeout_ms=10000)
        seq_settings = settings.with_overrides(sequential=True)
        help_text = None

        samples: dict[str, list[float]] = {}
        spans: dict[str, dict] = {}
        calls: dict[str, dict[str, int]] = {}

        def add(name: str, dt: float) -> None:
            samples.setdefault(name, []).append(dt)

        def engine_phase(n: int, mode: str) -> None:
            st = seq_settings if mode == "seq" else settings
            for phase in ("checkpoint", "restore"):
                host = CountingHost()
                be = (OneAttachBackend(lab.root) if mode == "helper"
                      else CudaCheckpointCLI(host, st))
                eng = Engine(be, st, host)
                fn = eng.checkpoint if phase == "checkpoint" else eng.restore
                t0 = time.perf_counter()
                if mode == "par1help":
                    be.features  # probe once, before the engine fans out  # noqa: B018
                r = fn(group(n))
                dt = time.perf_counter() - t0
                if not r.ok:
                    raise RuntimeError(f"{phase} N={n}: {r.errors}")
                add(f"{phase}-{mode}-N{n}", dt)
                spans[f"{phase}-{mode}-N{n}"] = step_spans(r.timeline)
                calls[f"{phase}-{mode}-N{n}"] = dict(host.calls)

        def serial_phase(n: int) -> None:
            nonlocal help_text
            host = CountingHost()
            if help_text is None:
                help_text = host.run([str(lab.cuda_checkpoint), "--help"], 30).stdout
            be = CudaCheckpointCLI(host, settings, features=parse_help(help_text))
            t0 = time.perf_counter()
            for p in group(n):
                be.lock(p, settings.lock_timeout_ms)
                be.checkpoint(p)
            add(f"checkpoint-serial-N{n}", time.perf_counter() - t0)
            t0 = time.perf_counter()
            for p in group(n):
                be.restore(p)
                be.unlock(p)
            add(f"restore-serial-N{n}", time.perf_counter() - t0)

        # 1. the headline: parallel engine at every N, interleaved
        for r in range(reps):
            order = ns[r % len(ns):] + ns[:r % len(ns)]
            if r % 2:
                order.reverse()
            for n in order:
                modes = ["par", "helper", "par1help"]
                if args.no_helper:
                    modes.remove("helper")
                if n not in (lo, hi):
                    modes.remove("par1help")  # only for the headline ratio
                k = (r + n) % len(modes)
                for mode in modes[k:] + modes[:k]:
                    engine_phase(n, mode)
            log(f"P3 parallel rep {r + 1}/{reps}: " + ", ".join(
                f"N{n} {fmt_s(samples[f'checkpoint-par-N{n}'][-1])}/"
                f"{fmt_s(samples[f'restore-par-N{n}'][-1])}" for n in ns))

        # 2. comparison strategies (linear in N: small N, one rep, interleaved)
        if not args.no_serial:
            for n in small:
                for mode in (("seq", "serial") if n % 2 else ("serial", "seq")):
                    if mode == "seq" and n == 1:
                        continue  # one process: seq is par (measured above)
                    if mode == "seq":
                        engine_phase(n, "seq")
                    else:
                        serial_phase(n)
                log(f"P3 seq/serial N={n} done")

        # 3. the fake tool's own cost, and engine overhead, at attach latency 0
        lab.set(attach_latency_s=0.0)
        try:
            one = pids[ns[0]][0]
            argv = [str(lab.cuda_checkpoint), "--get-state", "--pid", str(one)]
            single = [spawn_wait(argv)[0] for _ in range(15)]
            burst_n = max(ns)
            burst = []
            for _ in range(5):
                t0 = time.perf_counter()
                ths = [threading.Thread(target=spawn_wait, args=(argv,)) for _ in range(burst_n)]
                for t in ths:
                    t.start()
                for t in ths:
                    t.join()
                burst.append(time.perf_counter() - t0)
            samples["tool-get-state-lat0"] = single
            samples[f"tool-burst{burst_n}-lat0"] = burst
            for _ in range(2):
                for n in (min(ns), max(ns)):
                    for phase in ("checkpoint", "restore"):
                        host = CountingHost()
                        eng = Engine(CudaCheckpointCLI(host, settings), settings, host)
                        fn = eng.checkpoint if phase == "checkpoint" else eng.restore
                        t0 = time.perf_counter()
                        fn(pids[n])
                        add(f"{phase}-par-N{n}-lat0", time.perf_counter() - t0)
        finally:
            lab.set(attach_latency_s=latency)

    descr = {}
    for k in samples:
        if k.startswith("tool-get-state"):
            descr[k] = "one fake cuda-checkpoint --get-state, attach latency 0"
        elif k.startswith("tool-burst"):
            descr[k] = "that many --get-state at once (wall), attach latency 0"
        elif k.endswith("-lat0"):
            descr[k] = "engine phase at attach latency 0: pure overhead"
    res.add_samples(samples, descr)
    for phase in ("checkpoint", "restore"):
        res.ratio(f"{phase} par N={hi}/N={lo}", f"{phase}-par-N{hi}", f"{phase}-par-N{lo}", 1.3)
    for phase in ("checkpoint", "restore"):
        res.ratio(f"{phase} helper N={hi}/N={lo}", f"{phase}-helper-N{hi}",
                  f"{phase}-helper-N{lo}", 1.3, headline=False)
        res.ratio(f"{phase} helper/par N={hi}", f"{phase}-helper-N{hi}", f"{phase}-par-N{hi}",
                  None, headline=False)
        res.ratio(f"{phase} par1help N={hi}/N={lo}", f"{phase}-par1help-N{hi}",
                  f"{phase}-par1help-N{lo}", 1.3, headline=False)
    for n in ns:
        if n != lo and n != hi:
            for phase in ("checkpoint", "restore"):
                res.ratio(f"{phase} par N={n}/N={lo}", f"{phase}-par-N{n}", f"{phase}-par-N{lo}",
                          1.3, headline=False)

    # seq / serial: measured or projected N=hi figures (linear fit over measured N)
    proj: dict[str, dict] = {}
    for mode in ("seq", "serial"):
        for phase in ("checkpoint", "restore"):
            pts = [(n, med(samples[f"{phase}-{mode}-N{n}"])) for n in small
                   if samples.get(f"{phase}-{mode}-N{n}")]
            if not pts:
                continue
            if mode == "seq" and 1 not in [n for n, _ in pts] and samples.get(
                    f"{phase}-par-N1"):
                pts.insert(0, (1, med(samples[f"{phase}-par-N1"])))  # N=1: seq == par
            if len(pts) >= 2:
                (n0, t0_), (n1, t1_) = pts[0], pts[-1]
                slope = (t1_ - t0_) / (n1 - n0)
                icpt = t0_ - slope * n0
            else:
                n1, t1_ = pts[0]
                slope = t1_ / n1  # pessimistically all per-process
                icpt = 0.0
            base = med(samples[f"{phase}-par-N{lo}"])
            at_hi = med(samples[f"{phase}-{mode}-N{hi}"]) if samples.get(
                f"{phase}-{mode}-N{hi}") else icpt + slope * hi
            proj[f"{phase}-{mode}"] = {
                "points": pts, "slope_s_per_proc": round(slope, 4),
                "intercept_s": round(icpt, 4), f"N{hi}_s": round(at_hi, 3),
                "measured": bool(samples.get(f"{phase}-{mode}-N{hi}")),
                f"ratio_vs_par_N{lo}": round(at_hi / base, 3) if base else None,
            }
    res.extra["seq_serial"] = proj
    res.extra["step_spans"] = spans
    res.extra["tool_calls"] = calls
    res.extra["settings"] = {"attach_latency_s": latency, "bandwidth_mib_s": args.bandwidth,
                             "mib": args.mib, "ns": ns, "seq_serial_ns": small}
    for k, v in proj.items():
        res.notes.append(
            f"{k}: N={hi} {'measured' if v['measured'] else 'PROJECTED'} {v[f'N{hi}_s']:.2f} s "
            f"({v['slope_s_per_proc']:.3f} s/process), {v[f'ratio_vs_par_N{lo}']}x par N={lo}")
    for phase in ("checkpoint", "restore"):
        for mode in ("par", "par1help"):
            c = calls.get(f"{phase}-{mode}-N{hi}")
            if c:
                res.notes.append(f"{phase} {mode} N={hi} tool calls: {c}")
    t1 = res.median("tool-get-state-lat0")
    tb = res.median(f"tool-burst{max(ns)}-lat0")
    if t1 and tb:
        res.notes.append(f"fake tool start-up: one call {fmt_s(t1)}; {max(ns)} at once "
                         f"{fmt_s(tb)} wall on {os.cpu_count()} cores")
    return res


def parser():  # type: ignore[no-untyped-def]
    p = arg_parser(__doc__.split("\n")[0], reps=2, quick_reps=1)
    p.add_argument("--n", default="1,8,32", help="process counts (default 1,8,32)")
    p.add_argument("--seq-n", default="2",
                   help="process counts for the seq/serial comparison (default 2; seq at N=1 "
                   "is par at N=1, serial is linear from 0)")
    p.add_argument("--full", action="store_true", help="measure seq/serial at every --n (slow)")
    p.add_argument("--no-serial", action="store_true", help="skip the seq/serial comparison")
    p.add_argument("--no-helper", action="store_true",
                   help="skip the one-attach-per-phase prototype backend")
    sim_node_options(p, mib=4, bandwidth=2000.0)
    return p


if __name__ == "__main__":
    sys.exit(run_main(run, parser()))
