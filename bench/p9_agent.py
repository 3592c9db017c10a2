"""P9: the node agent (driver workers attached ahead of time) against the per-phase helper.

Part 1, one SimLab (driver R580, attach latency 1.0 s by default - real is
~2.7 s -, 2 GPUs, N = 8 CUDA processes of 4 MiB at 2000 MiB/s per link).
Each repetition runs, in a rotated order, the checkpoint phase then the
restore phase through a FRESH driver-API backend (one hook run each):

  helper  no agent up: the phase starts its own helper (one attach)
  agent   a warm agent is up: the phase's calls go to an attached worker
  cold    an agent started just before the phase, its first worker still
          attaching: the phase must cost no more than with the helper

Targets: agent / helper <= 0.2 for each phase; cold / helper <= 1.05 (the
helper's cost, within the noise of a shared machine).

Part 2, P7's cycle with the agent: 8 processes on 8 GPUs, --p7-mib each at
--p7-bandwidth MiB/s per link, checkpoint + restore through a warm agent,
against the limit with no attach at all:

  limit = 2 x (largest per-GPU MiB / bandwidth)      target: cycle / limit <= 1.15

Beside it, informative: the same cycle against the floor the simulator
itself puts on this machine. A real GPU copies device memory to and from the
host by DMA within its link's time; the simulator copies it on the CPUs
(cudahook.sim.gpu.copy_memfd), 8 x --p7-mib MiB at once, which a small
machine may not fit in the modelled link time. The same copies, measured in
this run once the lab is down (bench.common.sim_copy_floor), give

  limit' = per phase, max(link time, the simulator's copies in the phase)
  (the checkpoint's; the restore's copy back comes after its phase)
                                        informative: cycle / limit' <= 1.15

The helper's cycle is measured beside it, for reference, and the agent's
with an untimed pause before each phase (`agent-settled`: where a real
cycle has CRIU's dump and restore, and the helper's cycle its attach).
The simulated GPU service unmaps a phase's released memory off its lock,
so the back-to-back cycle need not wait for it: the two should agree.
"""

from __future__ import annotations

import sys

if __package__ in (None, ""):
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.common import (
    Result,
    arg_parser,
    floor_limits,
    kill_group,
    log,
    reps_of,
    run_main,
    sim_copy_floor,
    timed_phase,
    tmpdir,
)

TITLE = "node agent vs per-phase helper: phases at N=8, P7's cycle vs the no-attach limit"
TARGET = 0.2
COLD_TARGET = 1.05
P7_TARGET = 1.15
SIM_FLOOR_LABEL = "P7 cycle agent / max(limit, sim copy floor), informative"
KINDS = ("helper", "agent", "cold")


class AgentProc:
    """The lab's agent process: started, awaited, stopped by the benchmark."""

    def __init__(self, settings) -> None:  # type: ignore[no-untyped-def]
        self.settings = settings
        self.proc = None

    def start(self, *, warm: bool) -> None:
        import time

        from cudahook.core import agent

        self.stop()
        self.proc = agent.start_detached(self.settings)
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            info = agent.status(self.settings, 1.0)
            if info is not None and ((info.get("idle_workers") and not info.get("warming"))
                                     or not warm):
                if not warm and info.get("idle_workers"):
                    raise RuntimeError("the agent attached before the cold phase began")
                return
            time.sleep(0.005)
        raise RuntimeError("the agent did not come up")

    def stop(self) -> None:
        import signal

        if self.proc is not None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(30)
            finally:
                kill_group(self.proc)
            self.proc = None


def phases(args, res: Result, tmp) -> None:  # type: ignore[no-untyped-def]
    from cudahook.sim.lab import SimLab

    n = args.n
    samples: dict[str, list[float]] = {}
    served: dict[str, list[tuple[int, int]]] = {}
    lab = SimLab(tmp / "node", driver=580, gpus=2, attach_latency_s=args.attach_latency,
                 bandwidth_mib_s=args.bandwidth)
    proc = None
    settings = lab.settings(backend="driver-api", call_timeout_s=120.0, lock_timeout_ms=10000)
    agent = AgentProc(settings)
    try:
        lab.start()
        if not lab.libcuda.exists():
            raise RuntimeError("the fake libcuda.so.1 was not built (is gcc installed?)")
        proc = lab.spawn("w", mib=args.mib, procs=n, interval_ms=200)
        tags = [f"w.{i}" for i in range(n)] if n > 1 else ["w"]
        pids = [lab.wait_counter(t, timeout=60)["pid"] for t in tags]
        log(f"P9: {n} processes up; attach {args.attach_latency}s")
        for r in range(reps_of(args)):
            k = r % len(KINDS)
            for kind in KINDS[k:] + KINDS[:k]:
                if kind == "helper":
                    agent.stop()
                elif kind == "agent":
                    agent.start(warm=True)
                for phase in ("checkpoint", "restore"):
                    if kind == "cold":
                        agent.start(warm=False)
                    dt, backend = timed_phase(settings, phase, pids)
                    samples.setdefault(f"{phase}-{kind}-N{n}", []).append(dt)
                    served.setdefault(f"{phase}-{kind}", []).append(
                        (backend.agent_sessions, backend.attaches))
            log(f"P9 rep {r + 1}: " + ", ".join(f"{k} {v[-1]:.3f}s" for k, v in samples.items()))
        for i in range(n):
            st = lab.status(tags[i])
            if st.get("errors") or st.get("intact") is False:
                raise RuntimeError(f"workload {tags[i]} after the phases: {st}")
    finally:
        agent.stop()
        kill_group(proc)
        lab.stop()
    res.add_samples(samples, {f"{p}-{k}-N{n}": f"Engine.{p} over {n} processes, {k}"
                              for p in ("checkpoint", "restore") for k in KINDS})
    for phase in ("checkpoint", "restore"):
        res.ratio(f"{phase} agent/helper N={n}", f"{phase}-agent-N{n}", f"{phase}-helper-N{n}",
                  TARGET)
        res.ratio(f"{phase} cold agent/helper N={n}", f"{phase}-cold-N{n}",
                  f"{phase}-helper-N{n}", COLD_TARGET, headline=False)
    res.notes.append("(agent sessions, driver attaches) per phase: "
                     + ", ".join(f"{k} {sorted(set(v))}" for k, v in served.items()))
    res.extra["phases"] = {"attach_latency_s": args.attach_latency, "n": n, "mib": args.mib,
                           "bandwidth_mib_s": args.bandwidth, "driver": 580, "gpus": 2}


def link_limit(args, res: Result, tmp) -> None:  # type: ignore[no-untyped-def]
    import time

    from bench.p7_link_limit import verify
    from cudahook.sim.lab import SimLab

    gpus, mib, bw = args.p7_gpus, args.p7_mib, args.p7_bandwidth
    samples: dict[str, list[float]] = {}
    lab = SimLab(tmp / "p7", driver=580, gpus=gpus, memory_mib=max(1024, 2 * mib),
                 attach_latency_s=args.attach_latency, bandwidth_mib_s=bw)
    settings = lab.settings(backend="driver-api", call_timeout_s=300.0, lock_timeout_ms=10000)
    agent = AgentProc(settings)
    procs = []
    try:
        lab.start()
        for i in range(gpus):
            # Quiet workloads, as in P7: they check their memory after each restore.
            procs.append(lab.spawn(f"g{i}", mib=mib, gpu=i, interval_ms=500,
                                   check_every=100000, check_after_restore=True))
        pids = [lab.wait_counter(f"g{i}", timeout=120)["pid"] for i in range(gpus)]
        restores = 0
        kinds = ["agent", "agent-settled"] + ([] if args.no_helper else ["helper"])
        for r in range(reps_of(args)):
            for kind in kinds[r % len(kinds):] + kinds[:r % len(kinds)]:
                if kind.startswith("agent"):
                    agent.start(warm=True)
                else:
                    agent.stop()
                cycle = 0.0
                for phase in ("checkpoint", "restore"):
                    if kind == "agent-settled":
                        # Untimed: where CRIU's dump, or its restore, runs in a real cycle.
                        time.sleep(args.p7_settle)
                    dt, backend = timed_phase(settings, phase, pids)
                    if kind.startswith("agent") and backend.attaches:
                        raise RuntimeError(f"{phase} attached with a warm agent up")
                    samples.setdefault(f"p7-{phase}-{kind}", []).append(dt)
                    cycle += dt
                samples.setdefault(f"p7-cycle-{kind}", []).append(cycle)
                restores += 1
                verify(lab, gpus, restores)
            log(f"P9/P7 rep {r + 1}: " + ", ".join(
                f"{k} {v[-1]:.3f}s" for k, v in samples.items() if "cycle" in k))
    finally:
        agent.stop()
        for p in procs:
            kill_group(p)
        lab.stop()
    samples["p7-limit-no-attach"] = [2 * mib / bw]
    # The simulator's own floor on this machine, measured in this run once the
    # lab is gone (its memory free again): the host copies it makes on the CPUs
    # where a real GPU makes them by DMA.
    log(f"P9/P7: the simulator's host copies, {gpus} x {mib} MiB")
    floor = sim_copy_floor(gpus, mib, reps_of(args))
    samples.update({f"p7-{k}": v for k, v in floor.items()})
    samples["p7-limit-sim-floor"] = floor_limits(mib / bw, 0.0, floor)
    res.add_samples(samples, {
        "p7-limit-no-attach": "2 x largest per-GPU MiB / link MiB/s",
        "p7-sim-copy-checkpoint": f"{gpus} processes at once each copy {mib} MiB memfd to memfd "
                                  "(the simulator's checkpoint copy, copy_memfd)",
        "p7-sim-copy-restore": f"one process copies {gpus} x {mib} MiB back, a thread each (the "
                               "GPU service's recharge, made after the restore phase)",
        "p7-limit-sim-floor": "per phase, the longer of the link time and the simulator's "
                              "copies within the phase (the checkpoint's), summed",
    })
    res.ratio("P7 cycle agent/no-attach limit", "p7-cycle-agent", "p7-limit-no-attach",
              P7_TARGET)
    res.ratio(SIM_FLOOR_LABEL, "p7-cycle-agent", "p7-limit-sim-floor", P7_TARGET)
    res.ratio("P7 cycle agent/no-attach limit, phases apart", "p7-cycle-agent-settled",
              "p7-limit-no-attach", P7_TARGET, headline=False)
    res.ratio(f"{SIM_FLOOR_LABEL}, phases apart", "p7-cycle-agent-settled",
              "p7-limit-sim-floor", P7_TARGET, headline=False)
    res.notes.append(
        f"agent-settled: an untimed pause of {args.p7_settle:g}s before each phase, where a real "
        "cycle has CRIU's dump and restore (and the helper variant its attach); the simulated "
        "GPU service unmaps the previous phase's memory off its lock, so the two should agree")
    if not args.no_helper:
        res.ratio("P7 cycle helper/no-attach limit", "p7-cycle-helper", "p7-limit-no-attach",
                  None, headline=False)
    res.extra["p7"] = {"attach_latency_s": args.attach_latency, "gpus": gpus, "mib": mib,
                       "bandwidth_mib_s": bw, "driver": 580}


def run(args) -> Result:  # type: ignore[no-untyped-def]
    res = Result("P9", TITLE)
    with tmpdir("p9") as tmp:
        phases(args, res, tmp)
        if not args.no_p7:
            link_limit(args, res, tmp)
            remains(args, res)
    return res


def remains(args, res: Result) -> None:  # type: ignore[no-untyped-def]
    """What the cycle takes beyond the simulator's floor, beside the agent's
    own cost per phase in part 1 (an agent phase less its link time)."""
    cycle, floor = res.median("p7-cycle-agent"), res.median("p7-limit-sim-floor")
    link = args.n * args.mib / args.bandwidth  # part 1's processes share the first GPU
    own = [res.median(f"{p}-agent-N{args.n}") for p in ("checkpoint", "restore")]
    if cycle is None or floor is None or None in own:
        return
    res.extra["p7_beyond_floor_s"] = round(cycle - floor, 4)
    res.notes.append(
        f"{SIM_FLOOR_LABEL}: the cycle takes {(cycle - floor) * 1000:.0f} ms beyond the floor; "
        "the agent's own cost in part 1 (an agent phase less its link time): checkpoint "
        f"{(own[0] - link) * 1000:.0f} ms, restore {(own[1] - link) * 1000:.0f} ms")


run.bench_id = "P9"  # type: ignore[attr-defined]
run.title = TITLE  # type: ignore[attr-defined]


def parser():  # type: ignore[no-untyped-def]
    p = arg_parser(__doc__.split("\n")[0], reps=5, quick_reps=2)
    p.add_argument("--n", type=int, default=8, help="CUDA processes (default 8)")
    p.add_argument("--attach-latency", type=float, default=1.0)
    p.add_argument("--bandwidth", type=float, default=2000.0, help="MiB/s per GPU link")
    p.add_argument("--mib", type=int, default=4, help="device memory per process")
    p.add_argument("--p7-gpus", type=int, default=8)
    p.add_argument("--p7-mib", type=int, default=512)
    p.add_argument("--p7-bandwidth", type=float, default=1024.0)
    p.add_argument("--p7-settle", type=float, default=1.0,
                   help="part 2, agent-settled: untimed pause before each phase (s)")
    p.add_argument("--no-p7", action="store_true", help="skip part 2 (P7's cycle)")
    p.add_argument("--no-helper", action="store_true", help="part 2: skip the helper's cycle")
    return p


if __name__ == "__main__":
    sys.exit(run_main(run, parser()))
