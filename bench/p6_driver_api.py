"""P6: the driver-API backend against the CLI backend, checkpoint and restore at N = 8.

One SimLab (driver R580, attach latency 1.0 s by default - real is ~2.7 s -,
4 MiB per process at 2000 MiB/s per GPU link, 2 GPUs) runs one workload of N
CUDA processes. Each repetition runs, for each backend in a rotated order,
the checkpoint phase then the restore phase, each with a FRESH backend as
each hook invocation is a new process:

  cli         one `cuda-checkpoint` run (one driver attach) per call and process
  driver-api  the fake libcuda.so.1 through one helper process per phase
              (one cuInit: one attach), calls in parallel

Target: driver-api / cli <= 0.35 for each phase.
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
    log,
    reps_of,
    run_main,
    sim_node,
    sim_node_options,
    timed_phase,
)

TITLE = "driver-API backend vs CLI backend: checkpoint and restore phases at N=8"
TARGET = 0.35
BACKENDS = ("cli", "driver-api")


@benchmark("P6", TITLE)
def run(args) -> Result:  # type: ignore[no-untyped-def]
    reps = reps_of(args)
    n = args.n
    res = Result("P6", TITLE)
    samples: dict[str, list[float]] = {}
    attaches: dict[str, int] = {}
    with sim_node("p6", gpus=2, attach_latency=args.attach_latency, bandwidth=args.bandwidth,
                  driver_api=True) as node:
        node.spawn("w", mib=args.mib, procs=n, interval_ms=200)
        pids = node.pids("w", n)
        log(f"P6: {n} processes up; attach {args.attach_latency}s")
        for r in range(reps):
            order = list(BACKENDS[r % 2:] + BACKENDS[:r % 2])
            for kind in order:
                settings = node.lab.settings(backend=kind, call_timeout_s=120.0,
                                             lock_timeout_ms=10000)
                for phase in ("checkpoint", "restore"):
                    dt, backend = timed_phase(settings, phase, pids)
                    samples.setdefault(f"{phase}-{kind}-N{n}", []).append(dt)
                    if hasattr(backend, "attaches"):
                        attaches[f"{phase}-{kind}"] = backend.attaches
            log(f"P6 rep {r + 1}/{reps}: " + ", ".join(
                f"{k} {v[-1]:.2f}s" for k, v in samples.items()))
    res.add_samples(samples, {
        f"{p}-{k}-N{n}": f"Engine.{p} over {n} processes through the {k} backend"
        for p in ("checkpoint", "restore") for k in BACKENDS})
    for phase in ("checkpoint", "restore"):
        res.ratio(f"{phase} driver-api/cli N={n}", f"{phase}-driver-api-N{n}",
                  f"{phase}-cli-N{n}", TARGET)
    res.notes.append(f"driver attaches per driver-api phase: {attaches}")
    res.extra["settings"] = {"attach_latency_s": args.attach_latency, "n": n, "mib": args.mib,
                             "bandwidth_mib_s": args.bandwidth, "driver": SIM_DRIVER, "gpus": 2}
    return res


def parser():  # type: ignore[no-untyped-def]
    p = arg_parser(__doc__.split("\n")[0], reps=3, quick_reps=1)
    p.add_argument("--n", type=int, default=8, help="CUDA processes (default 8)")
    sim_node_options(p, mib=4, bandwidth=2000.0)
    return p


if __name__ == "__main__":
    sys.exit(run_main(run, parser()))
