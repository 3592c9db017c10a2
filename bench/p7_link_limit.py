"""P7: a checkpoint+restore close to the physical limit: 8 processes on 8 GPUs.

One SimLab (driver R580, 8 GPUs, attach latency 1.0 s, each GPU's link at
--bandwidth MiB/s) runs one process per GPU holding --mib MiB. The
driver-API backend checkpoints and restores them all; the CUDA phase time
(checkpoint phase + restore phase) is compared with the physical limit of
the same cycle: per phase, one driver attach plus the largest per-GPU byte
count over the link's bandwidth.

  limit = 2 x (attach + max per-GPU MiB / bandwidth)      target: cycle / limit <= 1.15

Beside it, informative: the same cycle against the floor the simulator
itself puts on this machine. A real GPU copies device memory to the host by
DMA within its link's time; the simulator copies it on the CPUs
(cudahook.sim.gpu.copy_memfd), which a small machine may not fit in the
modelled link time. The same copies, measured in this run once the node is
down (bench.common.sim_copy_floor), give

  limit' = per phase, attach + max(link time, the simulator's copies in the
  phase) (the checkpoint's; the restore's copy back comes after its phase)
                                        informative: cycle / limit' <= 1.15

The CLI backend's cycle is measured beside it, for reference.
"""

from __future__ import annotations

import sys

if __package__ in (None, ""):  # run as a file: bench/_checkout.py
    import _checkout  # noqa: F401

from bench.common import (
    SIM_DRIVER,
    Result,
    arg_parser,
    benchmark,
    floor_limits,
    log,
    reps_of,
    run_main,
    sim_copy_floor,
    sim_node,
    sim_node_options,
    timed_phase,
    verify_restored,
)

TITLE = "checkpoint+restore of 8 processes on 8 GPUs vs the physical limit"
TARGET = 1.15
SIM_FLOOR_LABEL = "cycle driver-api / max(limit, sim copy floor), informative"


@benchmark("P7", TITLE)
def run(args) -> Result:  # type: ignore[no-untyped-def]
    reps = reps_of(args)
    gpus = args.gpus
    res = Result("P7", TITLE)
    samples: dict[str, list[float]] = {}
    kinds = ["driver-api"] + ([] if args.no_cli else ["cli"])
    with sim_node("p7", gpus=gpus, attach_latency=args.attach_latency, bandwidth=args.bandwidth,
                  driver_api=True, memory_mib=max(1024, 2 * args.mib)) as node:
        lab = node.lab
        for i in range(gpus):
            # Quiet workloads: a memory check of hundreds of MiB would load
            # the CPUs, so they check only after each restore, and the
            # benchmark waits for those checks outside the timed phases.
            node.spawn(f"g{i}", mib=args.mib, gpu=i, interval_ms=500,
                       check_every=100000, check_after_restore=True)
        pids = [pid for i in range(gpus) for pid in node.pids(f"g{i}", timeout=120)]
        log(f"P7: {gpus} processes, {args.mib} MiB each, one per GPU")
        restores = 0
        for r in range(reps):
            order = kinds[r % len(kinds):] + kinds[:r % len(kinds)]
            for kind in order:
                settings = lab.settings(backend=kind, call_timeout_s=300.0,
                                        lock_timeout_ms=10000)
                cycle = 0.0
                for phase in ("checkpoint", "restore"):
                    dt, _ = timed_phase(settings, phase, pids)
                    samples.setdefault(f"{phase}-{kind}", []).append(dt)
                    cycle += dt
                samples.setdefault(f"cycle-{kind}", []).append(cycle)
                restores += 1
                verify(lab, gpus, restores)
            log(f"P7 rep {r + 1}/{reps}: " + ", ".join(
                f"{k} {v[-1]:.2f}s" for k, v in samples.items() if k.startswith("cycle")))
        for i in range(gpus):
            st = lab.status(f"g{i}")
            if st.get("errors"):
                raise RuntimeError(f"workload g{i} reports errors: {st['errors']}")
    per_phase = args.attach_latency + args.mib / args.bandwidth
    samples["limit-phase"] = [per_phase]
    samples["limit-cycle"] = [2 * per_phase]
    # The simulator's own floor on this machine, measured in this run once the
    # node is gone (its memory free again): the host copies it makes on the
    # CPUs where a real GPU makes them by DMA.
    log(f"P7: the simulator's host copies, {gpus} x {args.mib} MiB")
    floor = sim_copy_floor(gpus, args.mib, reps)
    samples.update(floor)
    samples["limit-sim-floor"] = floor_limits(args.mib / args.bandwidth, args.attach_latency,
                                              floor)
    res.add_samples(samples, {
        "limit-phase": "one attach + largest per-GPU MiB / link MiB/s",
        "limit-cycle": "the limit of checkpoint + restore",
        "sim-copy-checkpoint": f"{gpus} processes at once each copy {args.mib} MiB memfd to "
                               "memfd (the simulator's checkpoint copy, copy_memfd)",
        "sim-copy-restore": f"one process copies {gpus} x {args.mib} MiB back, a thread each "
                            "(the GPU service's recharge, made after the restore phase)",
        "limit-sim-floor": "per phase, one attach + the longer of the link time and the "
                           "simulator's copies within the phase (the checkpoint's), summed",
    })
    res.ratio("cycle driver-api/limit", "cycle-driver-api", "limit-cycle", TARGET)
    res.ratio(SIM_FLOOR_LABEL, "cycle-driver-api", "limit-sim-floor", TARGET)
    for phase in ("checkpoint", "restore"):
        res.ratio(f"{phase} driver-api/limit", f"{phase}-driver-api", "limit-phase", TARGET,
                  headline=False)
    if not args.no_cli:
        res.ratio("cycle cli/limit", "cycle-cli", "limit-cycle", None, headline=False)
    res.extra["settings"] = {"attach_latency_s": args.attach_latency, "gpus": gpus,
                             "mib": args.mib, "bandwidth_mib_s": args.bandwidth, "driver": SIM_DRIVER}
    return res


def verify(lab, gpus: int, restores: int) -> None:  # type: ignore[no-untyped-def]
    """The memory check of the workloads g0..g{gpus-1} after a restore."""
    verify_restored(lab, [f"g{i}" for i in range(gpus)], restores)


def parser():  # type: ignore[no-untyped-def]
    p = arg_parser(__doc__.split("\n")[0], reps=3, quick_reps=1)
    p.add_argument("--gpus", type=int, default=8, help="GPUs, one process each (default 8)")
    sim_node_options(p, mib=512, bandwidth=1024.0)
    p.add_argument("--no-cli", action="store_true", help="skip the CLI reference cycle")
    return p


if __name__ == "__main__":
    sys.exit(run_main(run, parser()))
