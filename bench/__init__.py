"""cudahook benchmarks: interleaved side-by-side comparisons that report ratios.

    python -m bench [--quick] [--reps N] [--json results.json] [--only P1,P3]
    python bench/p1_noop_action.py [--quick] [--reps N] [--json FILE]
    python -m bench.p1_noop_action [--quick] [--reps N] [--json FILE]

See docs/performance.md.
"""
