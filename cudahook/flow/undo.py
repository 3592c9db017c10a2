"""One undo stack for a checkpoint or a restore.

Each step that changes something pushes what puts it back, right where it
is taken. A failure unwinds the whole stack, last step first, and every
undo runs even when an earlier one failed: what failed is reported, never
hidden, and never stops the others. Success commits: only the steps that
must run whatever happened (a paused container frozen again) run then.

Two models: pip's uninstall, which commits or rolls back one set of moves
as a whole, and CRIU's CUDA plugin, whose one resume serves both its
failure path and its late resume - here the VMM replay is pushed once and
serves every way a checkpoint can fail after it.
"""

from __future__ import annotations

from collections.abc import Callable

# One entry: (what, fn, always). `what` says what failed, as the error
# reports it: "<what>: <cause>". (A tuple: typing and dataclasses would cost
# every hook start milliseconds of imports.)
_Entry = tuple[str, Callable[[], object], bool]


class Undo:
    def __init__(self) -> None:
        self._stack: list[_Entry] = []

    def push(self, what: str, fn: Callable[[], object]) -> None:
        """Run `fn` if this operation fails."""
        self._stack.append((what, fn, False))

    def always(self, what: str, fn: Callable[[], object]) -> None:
        """Run `fn` when this operation ends, failed or not."""
        self._stack.append((what, fn, True))

    def unwind(self) -> list[str]:
        """The operation failed: every undo, last first. The failures, one
        line each ("<what>: <cause>"); empty when everything was put back."""
        return self._run(lambda e: True)

    def commit(self) -> list[str]:
        """The operation succeeded: only the undos that always run."""
        return self._run(lambda e: e[2])

    def _run(self, chosen: Callable[[_Entry], bool]) -> list[str]:
        failed = []
        while self._stack:
            entry = self._stack.pop()
            if not chosen(entry):
                continue
            what, fn, _ = entry
            try:
                fn()
            except Exception as exc:  # the next undo still runs; this one is reported
                failed.append(f"{what}: {exc}")
        return failed

    def __enter__(self) -> Undo:
        return self

    def __exit__(self, kind: object, exc: BaseException | None, tb: object) -> None:
        # An exception unwinds what is left; its own failures join the
        # exception's notes, so the first cause stays the one raised.
        failed = self.unwind() if exc is not None else self.commit()
        for line in failed:
            if exc is not None:
                exc.add_note(line)
        if failed and exc is None:
            from cudahook.platform.errors import EnvironmentProblem

            raise EnvironmentProblem("; ".join(failed))
