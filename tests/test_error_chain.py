"""Errors chain their cause: a `raise` inside `except ... as exc` says where
it came from (`raise X(...) from exc`), re-raises, or drops the cause on
purpose (`from None`) with a comment saying why. An error whose message
merely quotes the cause loses its type, errno and traceback for the log."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

PKG = Path(__file__).resolve().parents[1] / "cudahook"

# Files the rule skips (none): every product module is checked.
NOT_YET_CHECKED: set[str] = set()


def _raises_in(handler: ast.ExceptHandler) -> list[ast.Raise]:
    """The raise statements that run while `handler` handles its exception:
    not those of a function defined there, nor those of a nested handler
    (checked as a handler of its own)."""
    found: list[ast.Raise] = []
    stack: list[ast.AST] = list(handler.body)
    while stack:
        node = stack.pop()
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda, ast.ClassDef,
                             ast.ExceptHandler)):
            continue
        if isinstance(node, ast.Raise):
            found.append(node)
        stack.extend(ast.iter_child_nodes(node))
    return found


def _commented(lines: list[str], node: ast.Raise) -> bool:
    """A `#` comment on the raise's own lines, or a comment line just above
    it (a comment on the `except` line says what is caught, not why the
    cause is dropped)."""
    own = lines[node.lineno - 1:node.end_lineno or node.lineno]
    above = lines[node.lineno - 2].strip() if node.lineno >= 2 else ""
    return any("#" in line for line in own) or above.startswith("#")


def unchained(source: str) -> list[int]:
    """Lines of `source` that raise a new error inside `except ... as name`
    without chaining it: no `from`, or `from None` without a comment."""
    lines = source.splitlines()
    bad = []
    for handler in ast.walk(ast.parse(source)):
        if not isinstance(handler, ast.ExceptHandler) or handler.name is None:
            continue
        for node in _raises_in(handler):
            if node.exc is None:  # bare `raise`: the same exception goes on
                continue
            if isinstance(node.exc, ast.Name) and node.exc.id == handler.name:
                continue
            dropped = isinstance(node.cause, ast.Constant) and node.cause.value is None
            if node.cause is None or (dropped and not _commented(lines, node)):
                bad.append(node.lineno)
    return sorted(bad)


def test_errors_chain_their_cause() -> None:
    bad = []
    for path in sorted(PKG.rglob("*.py")):
        rel = path.relative_to(PKG).as_posix()
        if rel in NOT_YET_CHECKED or "__pycache__" in path.parts:
            continue
        bad += [f"cudahook/{rel}:{line}" for line in unchained(path.read_text())]
    assert bad == [], "raise ... from exc (or a commented `from None`) at:\n" + "\n".join(bad)


@pytest.mark.parametrize(("body", "caught"), [
    ("raise ValueError(f'bad: {exc}')", True),
    ("raise ValueError('bad') from None", True),
    ("raise ValueError('bad') from exc", False),
    ("# the path is the whole story\n        raise ValueError('bad') from None", False),
    ("raise ValueError('bad') from None  # the path is the whole story", False),
    ("raise", False),
    ("raise exc", False),
    ("def later():\n            raise ValueError('not now')\n        return later", False),
])
def test_errors_chain_their_cause__the_rule_sees_it(body: str, caught: bool) -> None:
    source = f"def f():\n    try:\n        pass\n    except OSError as exc:  # why\n        {body}\n"
    assert bool(unchained(source)) is caught, source

