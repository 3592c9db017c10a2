"""Run one call per item on threads, at most `workers` at once.

The hooks' start-up is on every checkpoint's critical path, and
concurrent.futures costs more to import (it pulls in logging) than this
whole module costs to run.
"""

from __future__ import annotations

import threading

# typing costs milliseconds at every hook start: annotations only.
TYPE_CHECKING = False
if TYPE_CHECKING:
    from collections.abc import Callable, Iterable
    from typing import Any


def fan_out(fn: Callable[[Any], Any], items: Iterable[Any], workers: int) -> list[Any]:
    """fn over items, results in order. fn must not raise."""
    todo = list(enumerate(items))
    results: list[Any] = [None] * len(todo)
    if len(todo) <= 1 or workers <= 1:
        return [fn(item) for _, item in todo]
    lock = threading.Lock()

    def worker() -> None:
        while True:
            with lock:
                if not todo:
                    return
                i, item = todo.pop()
            results[i] = fn(item)

    threads = [threading.Thread(target=worker, daemon=True) for _ in range(min(workers, len(todo)))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return results
