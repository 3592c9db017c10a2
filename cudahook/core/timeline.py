"""Per-process, per-step timings of a phase (the idea of gVisor's timing.Timeline).

A checkpoint is only as fast as its slowest process, and a stall in one
process's lock looks like a slow checkpoint of all; recording every call's
start and end is what lets `cudahook status` show which.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from contextlib import contextmanager

from cudahook.platform.record import Record

# typing costs milliseconds at every hook start: annotations only.
TYPE_CHECKING = False
if TYPE_CHECKING:
    from typing import Any



class Step(Record):
    pid: int
    step: str
    start: float  # seconds since the timeline's origin
    end: float
    ok: bool = True
    error: str = ""

    @property
    def duration(self) -> float:
        return self.end - self.start


class Timeline:
    def __init__(self) -> None:
        self.origin_wall = time.time()
        self._origin = time.monotonic()
        import threading  # here: hooks that time no phase do not load it

        self._lock = threading.Lock()
        self.steps: list[Step] = []

    def now(self) -> float:
        return time.monotonic() - self._origin

    @contextmanager
    def step(self, pid: int, name: str) -> Iterator[None]:
        start = self.now()
        try:
            yield
        except BaseException as exc:
            self._add(Step(pid, name, start, self.now(), ok=False, error=str(exc)))
            raise
        self._add(Step(pid, name, start, self.now()))

    def _add(self, step: Step) -> None:
        with self._lock:
            self.steps.append(step)

    def total(self) -> float:
        return max((s.end for s in self.steps), default=0.0)

    def to_dict(self) -> dict[str, Any]:
        return {
            "origin": self.origin_wall,
            "total_s": round(self.total(), 6),
            "steps": [
                {k: (round(v, 6) if isinstance(v, float) else v) for k, v in s.as_dict().items()}
                for s in sorted(self.steps, key=lambda s: (s.start, s.pid))
            ],
        }
