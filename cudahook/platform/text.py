"""Strings from outside made safe to print: escaped, one line, capped.
The errors and the log print through it (stdlib only, and nothing of
cudahook's below it).
"""

from __future__ import annotations


def one_line(text: object, limit: int = 2000) -> str:
    """`text` safe to print as one line: THE one helper through which every
    string from outside (a container id, a GPU model, an archive member, a
    manifest field, an error message quoting one) reaches stdout or stderr.

    Every control or non-printable character is escaped (a newline must not
    become a second line, ESC must not drive the terminal: no title change,
    no screen clear; a lone surrogate becomes `\\ud800`, not an encoding
    error), and the result is cut at `limit` characters. Work is bounded by
    `limit` too: a 2 MiB string is cut before it is escaped."""
    s = text if isinstance(text, str) else str(text)
    cut = len(s) > limit
    s = s[:limit]
    out = "".join(c if c.isprintable() else repr(c)[1:-1] for c in s)
    return out[:limit] + "..." if cut or len(out) > limit else out


def escape_lines(text: str, limit: int = 20000) -> str:
    """A report of several lines, each made safe by `one_line` (the line
    breaks are cudahook's own; everything inside a line is escaped). The
    cap per line is generous: a report's lines are cudahook's, only the
    values inside them come from outside."""
    return "\n".join(one_line(line, limit) for line in text.split("\n"))
