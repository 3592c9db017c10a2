"""The one undo stack of a checkpoint and a restore (flow/undo.py)."""

from __future__ import annotations

import pytest

from cudahook.flow.undo import Undo
from cudahook.platform.errors import EnvironmentProblem


def _failing(what: str) -> None:
    raise OSError(f"{what} went wrong")


def test_unwind_runs_every_undo_last_first_and_reports_each_failure() -> None:
    done: list[str] = []
    undo = Undo()
    undo.always("cannot freeze", lambda: done.append("freeze"))
    undo.push("VMM mappings not restored", lambda: _failing("replay"))
    undo.push("rolling back failed", lambda: done.append("restore"))
    undo.push("cannot remove the manifest", lambda: _failing("unlink"))
    failed = undo.unwind()
    # A failed undo never stops the next one.
    assert done == ["restore", "freeze"]
    assert failed == ["cannot remove the manifest: unlink went wrong",
                      "VMM mappings not restored: replay went wrong"]
    assert undo.unwind() == [] and done == ["restore", "freeze"]  # the stack is spent


def test_commit_runs_only_what_always_runs() -> None:
    done: list[str] = []
    undo = Undo()
    undo.always("cannot freeze", lambda: done.append("freeze"))
    undo.push("rolling back failed", lambda: done.append("restore"))
    assert undo.commit() == [] and done == ["freeze"]
    assert undo.unwind() == [] and done == ["freeze"]


def test_an_exception_unwinds_and_keeps_its_cause_first() -> None:
    done: list[str] = []
    with pytest.raises(RuntimeError, match="the step") as info, Undo() as undo:
        undo.push("rolling back failed", lambda: done.append("restore"))
        undo.push("cannot remove the manifest", lambda: _failing("unlink"))
        raise RuntimeError("the step")
    assert done == ["restore"]
    assert info.value.__notes__ == ["cannot remove the manifest: unlink went wrong"]


def test_a_clean_exit_commits_and_a_failed_always_step_is_an_error() -> None:
    done: list[str] = []
    with Undo() as undo:
        undo.push("rolling back failed", lambda: done.append("restore"))
        undo.always("cannot freeze", lambda: done.append("freeze"))
    assert done == ["freeze"]
    with pytest.raises(EnvironmentProblem, match="cannot freeze: frozen went wrong"), Undo() as undo:
        undo.always("cannot freeze", lambda: _failing("frozen"))
