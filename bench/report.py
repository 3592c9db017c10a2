"""Markdown tables from a results JSON (for docs/performance.md).

    python bench/report.py bench/results/default.json
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

if __package__ in (None, ""):  # run as a file: bench/_checkout.py
    import _checkout  # noqa: F401

from bench.common import fmt_s as fmt


def main(argv: list[str]) -> int:
    data = json.loads(Path(argv[0]).read_text())
    print("| id | ratio | numerator / denominator (median or mean) | value | target | verdict |")
    print("| --- | --- | --- | --- | --- | --- |")
    for res in data["results"]:
        v = res["variants"]
        for r in res["ratios"]:
            if not r["headline"]:
                continue
            stat = "mean_s" if r.get("stat") == "mean" else "median_s"
            a, b = v.get(r["num"], {}).get(stat), v.get(r["den"], {}).get(stat)
            tag = " (means)" if stat == "mean_s" else ""
            verdict = "-" if r["pass"] is None else ("PASS" if r["pass"] else "**MISS**")
            val = "-" if r["value"] is None else f"{r['value']:.2f}x"
            print(f"| {res['id']} | {r['label']}{tag} | {fmt(a)} / {fmt(b)} | {val} | "
                  f"<= {r['target']}x | {verdict} |")
    print()
    for res in data["results"]:
        print(f"{res['id']} secondary ratios:")
        for r in res["ratios"]:
            if r["headline"]:
                continue
            tag = " (means)" if r.get("stat") == "mean" else ""
            val = "-" if r["value"] is None else f"{r['value']:.2f}x"
            tgt = f" (target <= {r['target']}x)" if r["target"] else ""
            print(f"  - {r['label']}{tag}: {val}{tgt}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
