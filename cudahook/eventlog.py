"""Structured log lines: one JSON object per line, appended.

The log is the record an operator reads after a failed checkpoint, so every
line carries the container, the action, the PIDs and the timings.
"""

from __future__ import annotations

import json
import os
import sys
import time

# typing costs milliseconds at every hook start: annotations only.
TYPE_CHECKING = False
if TYPE_CHECKING:
    from typing import Any



def log(path: str, event: str, *, error: str | None = None, **fields: Any) -> None:
    line = {"ts": round(time.time(), 3), "event": event, **fields}
    if error:
        line["error"] = error
        from .errors import one_line

        print(f"cudahook: {one_line(f'{event}: {error}')}", file=sys.stderr)
    if not path:
        return
    data = (json.dumps(line, sort_keys=True, default=str) + "\n").encode()
    try:
        fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o600)
    except OSError:
        return  # a missing log directory must never fail a checkpoint
    try:
        os.write(fd, data)  # one write of one line: O_APPEND keeps lines whole
    finally:
        os.close(fd)
