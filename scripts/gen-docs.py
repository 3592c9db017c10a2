#!/usr/bin/env python3
"""Regenerate the documentation's generated parts from their sources.

    .venv/bin/python scripts/gen-docs.py          # rewrite them
    .venv/bin/python scripts/gen-docs.py --check  # exit 1 if any is stale

- docs/configuration.md: the configuration keys and the annotations, from
  config/config.schema.json and config/annotations.schema.json (each key's
  `description`) and the defaults in `cudahook.platform.config.Settings`;
- docs/performance.md: the results table, from bench/results/*.json.

A generated part sits between `<!-- generated: NAME -->` and
`<!-- end generated: NAME -->`; everything around it is written by hand.
tests/test_docs.py fails when a part differs from what this script makes.
"""

from __future__ import annotations

import json
import os
import re
import sys
from collections.abc import Callable
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))  # the package and the benchmarks, from this checkout
GIB = 1 << 30


def _cell(text: str) -> str:
    return text.replace("|", "\\|")


def _code(value: object) -> str:
    return f"`{_cell(str(value))}`"


def _default(value: object) -> str:
    if value is None:
        return "unset"
    if isinstance(value, bool):
        return _code(str(value).lower())
    if isinstance(value, float) and value.is_integer():
        value = int(value)
    if isinstance(value, int) and value >= GIB and value % GIB == 0:
        return f"{_code(value)} ({value // GIB} GiB)"
    return _code(value)


def _accepts(prop: dict) -> str:
    if "enum" in prop:
        return ", ".join(_code(v) for v in prop["enum"])
    kinds = prop.get("type", "any")
    kind = " or ".join(kinds) if isinstance(kinds, list) else kinds
    bounds = []
    if "minimum" in prop:
        bounds.append(f">= {prop['minimum']}")
    if "exclusiveMinimum" in prop:
        bounds.append(f"> {prop['exclusiveMinimum']}")
    if "maximum" in prop:
        bounds.append(f"<= {prop['maximum']}")
    if prop.get("format") == "regex":
        bounds.append("a regular expression")
    if prop.get("pattern") == "^[^\\x00-\\x1f]*\\Z":
        bounds.append("no control characters")
    elif "pattern" in prop:
        bounds.append(f"matching {_code(prop['pattern'])}")
    return kind + (" " + ", ".join(bounds) if bounds else "")


def _schema(name: str) -> dict:
    return json.loads((REPO / "config" / name).read_text())


def configuration() -> str:
    """The tables of docs/configuration.md."""
    from cudahook.platform.config import Settings

    # The defaults as on a real node: node paths follow CUDAHOOK_ROOT.
    saved = os.environ.pop("CUDAHOOK_ROOT", None)
    try:
        defaults = Settings()
    finally:
        if saved is not None:
            os.environ["CUDAHOOK_ROOT"] = saved
    lines = ["| key | default | accepts | meaning |", "| --- | --- | --- | --- |"]
    for key, prop in _schema("config.schema.json")["properties"].items():
        lines.append(f"| `{key}` | {_default(getattr(defaults, key))} | {_accepts(prop)} | "
                     f"{_cell(prop['description'])} |")
    lines += ["", "| annotation | accepts | meaning |", "| --- | --- | --- |"]
    for key, prop in _schema("annotations.schema.json")["properties"].items():
        lines.append(f"| `cudahook.io/{key}` | {_accepts(prop)} | {_cell(prop['description'])} |")
    return "\n".join(lines)


def _seconds(value: float | None, variant: str = "") -> str:
    if value is None:
        return "-"
    from bench.common import is_size

    if is_size(variant):
        return f"{value:.0f} MiB"
    if value >= 1:
        return f"{value:.2f} s"
    return f"{value * 1000:.3g} ms"


def performance() -> str:
    """The results table of docs/performance.md: each headline ratio from the
    newest full (not --quick) run in bench/results/ that measured it."""
    newest: dict[tuple[str, str], tuple[str, str, str, dict, dict]] = {}
    order: dict[tuple[str, str], int] = {}
    for path in sorted((REPO / "bench" / "results").glob("*.json")):
        data = json.loads(path.read_text())
        meta = data.get("meta", {})
        if meta.get("args", {}).get("quick"):
            continue
        when, head = meta.get("time", ""), meta.get("git", {}).get("head", "-")
        for res in data.get("results", []):
            for ratio in res.get("ratios", []):
                if not ratio.get("headline"):
                    continue
                key = (res["id"], ratio["label"])
                order.setdefault(key, len(order))
                if key not in newest or when > newest[key][0]:
                    newest[key] = (when, head, path.name, res, ratio)
    lines = ["| id | ratio | numerator / denominator | value | target | verdict | run |",
             "| --- | --- | --- | --- | --- | --- | --- |"]
    for key in sorted(newest, key=lambda k: (k[0], order[k])):
        when, head, name, res, r = newest[key]
        stat = r.get("stat", "median")
        num = res["variants"].get(r["num"], {}).get(f"{stat}_s")
        den = res["variants"].get(r["den"], {}).get(f"{stat}_s")
        value = "-" if r["value"] is None else f"{r['value']:.3f}x"
        target = f"<= {r['target']}x" if r["target"] is not None else "-"
        verdict = "-" if r["pass"] is None else ("PASS" if r["pass"] else "**MISS**")
        lines.append(f"| {key[0]} | {_cell(r['label'])} ({stat}s) | {_seconds(num, r['num'])} / "
                     f"{_seconds(den, r['den'])} | {value} | {target} | {verdict} | "
                     f"`{name}`, {when[:10]}, `{head}` |")
    return "\n".join(lines)


PARTS: dict[str, tuple[str, Callable[[], str]]] = {
    "configuration": ("docs/configuration.md", configuration),
    "performance": ("docs/performance.md", performance),
}


def render(text: str, name: str, body: str) -> str:
    """`text` with its generated part `name` replaced by `body`."""
    pattern = re.compile(rf"(<!-- generated: {name} -->\n).*?(<!-- end generated: {name} -->)",
                         re.S)
    if not pattern.search(text):
        raise SystemExit(f"gen-docs: no generated part {name!r}")
    return pattern.sub(lambda m: m.group(1) + body + "\n" + m.group(2), text)


def expected(name: str) -> tuple[Path, str, str]:
    """The page, its text now, and its text as this script makes it."""
    page, make = PARTS[name]
    path = REPO / page
    text = path.read_text()
    return path, text, render(text, name, make())


def main(argv: list[str]) -> int:
    stale = 0
    for name in PARTS:
        path, now, want = expected(name)
        if now != want:
            if "--check" in argv:
                print(f"gen-docs: {path.relative_to(REPO)} is stale", file=sys.stderr)
                stale = 1
            else:
                path.write_text(want)
    return stale


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
