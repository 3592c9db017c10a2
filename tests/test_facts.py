"""Each fact about the node is defined in one module, and the package has no
import cycles.

A fact parsed in two places drifts: one copy learns a new `criu --version`
format or a new cgroup file and the other keeps deciding on the old one.
These tests read the source, so they fail as soon as a second copy appears.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

PKG = Path(__file__).resolve().parent.parent / "cudahook"

# fact -> (where it must live, a regex that finds its definition in source).
# The simulator stands in for the driver and reads its own configuration,
# not the node: the driver facts are the product's, so cudahook/sim is not
# searched for them.
FACTS: dict[str, tuple[str, str, bool]] = {
    # `criu --version`'s number: a regex taking a major and a minor apart.
    "criu version regex": ("platform/criu.py", r"Version:\\s|\(\\d\+\)\\\.\(\\d\+\)", True),
    # The driver's version text, and its branch (the major number).
    "driver version regex": ("core/backends/base.py",
                             r"\\d(\{3,\}|\+)\\\.\\d\+|version[^\n]*\.split\(\"\.\"", False),
    # The oldest CRIU cudahook works with, and what to do about an older one.
    "CRIU minimum version": ("platform/criu.py",
                             r"\(4, 0\)|install CRIU >= 4|CRIU is older than 4", True),
    "CRIU plugin directories": ("platform/criu.py", r"\"/usr/lib/criu\"", True),
    # How a CRIU configuration line names an action script.
    "action-script tokenizer": ("platform/criu.py", r"\[0\] == \"action-script\"", True),
    # The script gpu-only registration's comment in runc.conf names.
    "gpu-only comment": ("platform/criuconf.py", r"len\([\w.]*GPU_ONLY\)", True),
    # The cgroup v1/v2 memory limit and usage files.
    "cgroup memory files": ("platform/cgroups.py",
                            r"\"memory\.(max|current|limit_in_bytes|usage_in_bytes)\"", True),
    # A stopped or traced process, from /proc/<pid>/status.
    "stopped or traced": ("platform/procfs.py", r"\"TracerPid\"", True),
}


def _modules(with_sim: bool) -> list[Path]:
    return [p for p in sorted(PKG.rglob("*.py"))
            if with_sim or "sim" not in p.relative_to(PKG).parts[:1]]


@pytest.mark.parametrize("fact", sorted(FACTS))
def test_each_fact_is_defined_in_one_module(fact: str) -> None:
    owner, pattern, with_sim = FACTS[fact]
    found = sorted(str(p.relative_to(PKG)) for p in _modules(with_sim)
                   if re.search(pattern, p.read_text()))
    assert found == [owner], f"{fact}: defined in {found}, not in {owner} alone"


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(PKG.parent).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _imports(path: Path, name: str, known: set[str]) -> set[str]:
    """Every cudahook module `path` imports, at any depth of its code (a
    function-local import closes a cycle as surely, only later)."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    out: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                up = package.split(".")
                up = up[:len(up) - node.level + 1]
                base = ".".join(up + ([base] if base else []))
            # `from pkg import mod` imports the module pkg.mod; else pkg itself.
            targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in known else base
                       for a in node.names]
        else:
            continue
        for t in targets:
            while t and t not in known:  # `import a.b.c` of a package: its module
                t = t.rpartition(".")[0]
            if t and t != name:
                out.add(t)
    return out


def import_graph() -> dict[str, set[str]]:
    paths = {_module_name(p): p for p in PKG.rglob("*.py")}
    known = set(paths)
    graph = {n: _imports(p, n, known) for n, p in paths.items()}
    # Importing a.b.c runs a/__init__ and a/b/__init__ first.
    for n in list(graph):
        for t in list(graph[n]):
            parent = t.rpartition(".")[0]
            while parent:
                if parent != n and not n.startswith(parent + "."):
                    graph[n].add(parent)
                parent = parent.rpartition(".")[0]
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    out: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in sorted(graph.get(v, ())):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return out


def test_the_cycle_finder_finds_a_cycle() -> None:
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert cycles({"a": {"b"}, "b": set()}) == []


def test_the_graph_sees_function_local_imports(tmp_path: Path) -> None:
    # A cycle closed inside a function is one all the same: it only bites later.
    mod = tmp_path / "a.py"
    mod.write_text("import os\n\ndef f():\n    from .b import g\n    from . import c\n"
                   "    import cudahook.x.y\n")
    known = {"cudahook.p.a", "cudahook.p.b", "cudahook.p.c", "cudahook.x"}
    assert _imports(mod, "cudahook.p.a", known) == {"cudahook.p.b", "cudahook.p.c", "cudahook.x"}


def test_no_import_cycles() -> None:
    found = cycles(import_graph())
    assert found == [], "import cycles: " + "; ".join(" <-> ".join(c) for c in found)


def test_cacheable_reasons_are_never_here_and_about_the_node() -> None:
    # A remembered refusal is given again without looking: only one no
    # retry on this node can change, and not one a fresh copy of the image
    # mends (its files, its manifest).
    from cudahook.platform import reasons

    cacheable = sorted(r.code for r in reasons.REASONS.values() if r.cacheable)
    assert cacheable == ["DEVICE_MAP_UNSUPPORTED", "DRIVER_BRANCH", "GPU_MISMATCH", "GPU_MISSING"]
    assert all(reasons.get(c).never_here and reasons.get(c).side == "restore" for c in cacheable)
