"""Render a phase timeline as a per-process chart in the terminal."""

from __future__ import annotations

from typing import Any

GLYPHS = {"get-state": ".", "verify": ".", "lock": "L", "checkpoint": "C", "restore": "R",
          "unlock": "U", "toggle": "T"}


def render(timeline: dict[str, Any], width: int = 60) -> str:
    steps = timeline.get("steps", [])
    if not steps:
        return "(no steps)"
    total = max(s["end"] for s in steps) or 1e-9
    pids = sorted({s["pid"] for s in steps})
    lines = []
    for pid in pids:
        row = [" "] * width
        for s in (s for s in steps if s["pid"] == pid):
            a = min(width - 1, int(s["start"] / total * width))
            b = max(a + 1, min(width, round(s["end"] / total * width)))
            glyph = GLYPHS.get(s["step"], s["step"][:1].upper())
            if not s.get("ok", True):
                glyph = "!"
            for i in range(a, b):
                row[i] = glyph
        lines.append(f"{pid:>8} |{''.join(row)}|")
    scale = f"{'0':>10}{f'{total:.3f}s':>{width}}"
    legend = "  . state/verify  L lock  C checkpoint  R restore  U unlock  T toggle  ! failed"
    return "\n".join([*lines, scale, legend])
