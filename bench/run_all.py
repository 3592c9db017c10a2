"""Run every benchmark (P1..P8) and print a summary table of ratios vs targets.

    python bench/run_all.py [--quick] [--reps N] [--json FILE] [--only P1,P4]
    python -m bench ...

Each benchmark runs its variants interleaved and reports medians and ratios;
a benchmark that cannot run here (no runc, no CRIU, not root) reports an
error line and the others still run. Exit status 0 unless arguments are bad.
"""

from __future__ import annotations

import argparse
import sys
import time

if __package__ in (None, ""):  # run as a file: bench/_checkout.py
    import _checkout  # noqa: F401

from bench import (
    p1_noop_action,
    p2_runc_cycle,
    p3_gpu_phases,
    p4_discovery,
    p5_container_start,
    p6_driver_api,
    p7_link_limit,
    p8_storage,
    p9_agent,
)
from bench.common import execute, meta, write_json

BENCHES = {
    "P1": p1_noop_action,
    "P2": p2_runc_cycle,
    "P3": p3_gpu_phases,
    "P4": p4_discovery,
    "P5": p5_container_start,
    "P6": p6_driver_api,
    "P7": p7_link_limit,
    "P8": p8_storage,
    "P9": p9_agent,
}


def summary_rows(results) -> list[dict]:  # type: ignore[no-untyped-def]
    rows = []
    for res in results:
        if res.error:
            rows.append({"id": res.id, "label": "ERROR", "value": None, "target": None,
                         "pass": None, "error": res.error})
        for r in res.ratios:
            if r["headline"]:
                rows.append({"id": res.id, **r})
    return rows


def print_summary(rows: list[dict], wall: float) -> None:
    print("\n== Summary (ratios of medians unless marked [means]; targets from the product spec)")
    w = max([len(r["label"]) + 8 for r in rows] + [10])
    print(f"   {'':4}{'ratio':<{w}}  {'value':>9}  {'target':>8}  verdict")
    for r in rows:
        if r["label"] == "ERROR":
            print(f"   {r['id']:4}ERROR: {r['error']}")
            continue
        val = "-" if r["value"] is None else f"{r['value']:.3f}x"
        label = r["label"] + (" [means]" if r.get("stat") == "mean" else "")
        tgt = "-" if r["target"] is None else f"<= {r['target']}x"
        verdict = "-" if r["pass"] is None else ("PASS" if r["pass"] else "MISS")
        print(f"   {r['id']:4}{label:<{w}}  {val:>9}  {tgt:>8}  {verdict}")
    print(f"   (all benchmarks: {wall:.0f} s)")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--quick", action="store_true", help="short runs")
    p.add_argument("--reps", type=int, default=None, help="repetitions for every benchmark")
    p.add_argument("--json", default=None, help="write all results as JSON here")
    p.add_argument("--only", default="", help="comma-separated ids, e.g. P1,P3")
    args = p.parse_args(argv)
    ids = [x.strip().upper() for x in args.only.split(",") if x.strip()] or list(BENCHES)
    unknown = [i for i in ids if i not in BENCHES]
    if unknown:
        p.error(f"unknown benchmark(s): {', '.join(unknown)}")
    t0 = time.monotonic()
    results = []
    for bid in ids:
        mod = BENCHES[bid]
        bargv = (["--quick"] if args.quick else []) + (
            ["--reps", str(args.reps)] if args.reps else [])
        bargs = mod.parser().parse_args(bargv)
        print(f"\n### {bid}: {mod.TITLE}", flush=True)
        res = execute(mod.run, bargs)
        res.print()
        results.append(res)
        sys.stdout.flush()
    wall = time.monotonic() - t0
    rows = summary_rows(results)
    print_summary(rows, wall)
    if args.json:
        write_json(args.json, {"meta": meta(args), "wall_s": round(wall, 1),
                               "summary": rows, "results": [r.to_dict() for r in results]})
        print(f"\n   JSON: {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
