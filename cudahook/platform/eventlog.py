"""Structured log lines: one JSON object per line, appended.

The log is the record an operator reads after a failed checkpoint, so every
line carries the container, the action, the PIDs and the timings.

Its size is capped: past MAX_BYTES the file is renamed to `<log>.1` (the one
older generation kept; an earlier `.1` goes) and the next line starts a new
file. install.sh's logrotate rule normally rotates it long before that.
"""

from __future__ import annotations

import fcntl
import json
import os
import sys
import time

from .text import one_line

MAX_BYTES = 32 << 20  # 32 MiB

# typing costs milliseconds at every hook start: annotations only.
TYPE_CHECKING = False
if TYPE_CHECKING:
    from typing import Any



def log(path: str, event: str, *, error: str | None = None, **fields: Any) -> None:
    line = {"ts": round(time.time(), 3), "event": event, **fields}
    if error:
        line["error"] = error
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
        if os.fstat(fd).st_size > MAX_BYTES:
            rotate(path, fd)
    except OSError:
        pass  # nor must a full disk
    finally:
        os.close(fd)


def rotate(path: str, fd: int) -> None:
    """Rename the log (open as `fd`) to `<path>.1`, once, however many hooks
    append to it at the same time. Writers that still have the old file open
    finish their line in `.1`; the next line opens a new file. The lock is
    on the file itself and never waited for: whoever holds it is rotating."""
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        return
    try:
        st = os.stat(path, follow_symlinks=False)
        mine = os.fstat(fd)
        # Someone rotated it already: the path names another (new) file.
        if (st.st_ino, st.st_dev) == (mine.st_ino, mine.st_dev) and mine.st_size > MAX_BYTES:
            os.replace(path, path + ".1")
    finally:
        fcntl.flock(fd, fcntl.LOCK_UN)
