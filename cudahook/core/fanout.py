"""Run one call per item on threads, at most `workers` at once.

A call that raises does not vanish with its thread: its slot in the results
holds a `Raised` with the exception, so the caller counts it as that item's
failure. The calling thread works through the items too, so every item gets
its call even when no thread can be started.

The hooks' start-up is on every checkpoint's critical path, and
concurrent.futures costs more to import (it pulls in logging) than this
whole module costs to run.
"""

from __future__ import annotations

# typing costs milliseconds at every hook start: annotations only.
TYPE_CHECKING = False
if TYPE_CHECKING:
    from collections.abc import Callable, Iterable
    from typing import Any


class Raised:
    """The result of a call that raised."""

    __slots__ = ("exc",)

    def __init__(self, exc: BaseException):
        self.exc = exc

    def __repr__(self) -> str:
        return f"Raised({self.exc!r})"


def _call(fn: Callable[[Any], Any], item: Any) -> Any:
    try:
        return fn(item)
    except BaseException as exc:  # every failure must reach the caller
        return Raised(exc)


def fan_out(fn: Callable[[Any], Any], items: Iterable[Any], workers: int) -> list[Any]:
    """fn over items, results in order; a call that raised leaves a `Raised`."""
    todo = list(enumerate(items))
    results: list[Any] = [None] * len(todo)
    if len(todo) <= 1 or workers <= 1:
        return [_call(fn, item) for _, item in todo]
    import threading  # here: a hook that fans out nothing does not load it

    lock = threading.Lock()

    def worker() -> None:
        while True:
            with lock:
                if not todo:
                    return
                i, item = todo.pop()
            results[i] = _call(fn, item)

    threads = []
    for _ in range(min(workers, len(todo)) - 1):
        t = threading.Thread(target=worker, daemon=True)
        try:
            t.start()
        except RuntimeError:  # no more threads: the ones running, and this one, carry on
            break
        threads.append(t)
    worker()
    for t in threads:
        t.join()
    return results
