"""The package layout is the architecture: imports flow one way.

hooks -> flow -> vmm -> core -> platform; admin uses flow and below, never
hooks; nothing of the product imports the simulator except the demo, which
runs on it by definition. The policy in flow/ reads in short functions.
"""

from __future__ import annotations

import ast
import shutil
from pathlib import Path

import pytest

PKG = Path(__file__).resolve().parents[1] / "cudahook"

# What each subpackage may import of cudahook (besides itself).
ALLOWED = {
    "platform": set(),
    "core": {"platform"},
    "vmm": {"core", "platform"},
    "flow": {"vmm", "core", "platform"},
    "hooks": {"flow", "vmm", "core", "platform"},
    "admin": {"flow", "vmm", "core", "platform"},
    "sim": {"admin", "hooks", "flow", "vmm", "core", "platform"},
}
# `cudahook demo` runs the simulator: the one way from the product into it.
SIM_DOORS = {"cudahook.admin.commands.demo"}


# hooks/ holds the executables' entry points and their input parsers:
# started by runtimes and CRIU, never imported by the rest of the product.
ENTRY_POINTS = "hooks"
# The longest a function of the checkpoint and restore policy may be.
FLOW_MAX_LINES = 60


def module_name(path: Path, root: Path = PKG) -> str:
    parts = list(path.relative_to(root.parent).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imports_of(path: Path, root: Path = PKG) -> set[str]:
    mod = module_name(path, root)
    package = mod if path.name == "__init__.py" else mod.rsplit(".", 1)[0]
    out = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            out |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[: len(package.split(".")) - node.level + 1]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module or ""
            out.add(target)
            out |= {f"{target}.{a.name}" for a in node.names}  # `from pkg import module`
    return {m for m in out if m == "cudahook" or m.startswith("cudahook.")}


def subpackage(mod: str) -> str | None:
    parts = mod.split(".")
    return parts[1] if len(parts) > 1 and parts[1] in ALLOWED else None


def modules(root: Path) -> list[Path]:
    return sorted(p for p in root.rglob("*.py") if "__pycache__" not in p.parts)


MODULES = modules(PKG)


def wrong_imports(path: Path, root: Path = PKG) -> list[str]:
    """What `path` imports against the arrows."""
    mod = module_name(path, root)
    own = subpackage(mod)
    bad = []
    for target in imports_of(path, root):
        other = subpackage(target)
        if other is None or other == own:
            continue
        if other == "sim" and mod in SIM_DOORS:
            continue
        if own is None:  # cudahook/__main__.py: the command line's entry
            if mod == "cudahook.__main__" and target.startswith("cudahook.admin"):
                continue
        elif other in ALLOWED[own]:
            continue
        bad.append(target)
    return sorted(set(bad))


def hooks_importers(root: Path) -> dict[str, list[str]]:
    """Product modules (all but the simulator, which drives the hooks as
    runtimes do) outside hooks/ that import from it."""
    found = {}
    for path in modules(root):
        mod = module_name(path, root)
        if subpackage(mod) in (ENTRY_POINTS, "sim"):
            continue
        targets = sorted(t for t in imports_of(path, root)
                         if subpackage(t) == ENTRY_POINTS)
        if targets:
            found[mod] = targets
    return found


def long_functions(root: Path, limit: int) -> list[str]:
    """Functions (methods and nested ones too) of root's modules longer
    than `limit` lines, each as module:name:lines."""
    out = []
    for path in modules(root):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                length = (node.end_lineno or node.lineno) - node.lineno + 1
                if length > limit:
                    out.append(f"{path.relative_to(root.parent)}:{node.name}:{length}")
    return out


def test_every_module_lives_in_a_subpackage() -> None:
    loose = [module_name(p) for p in MODULES
             if p.parent == PKG and p.name not in ("__init__.py", "__main__.py")]
    assert loose == []


@pytest.mark.parametrize("path", MODULES, ids=lambda p: module_name(p))
def test_imports_flow_one_way(path: Path) -> None:
    bad = wrong_imports(path)
    assert bad == [], f"{module_name(path)} may not import {bad}"


def test_only_the_entry_points_import_hooks() -> None:
    assert hooks_importers(PKG) == {}


def _copy_of_the_package(tmp_path: Path) -> Path:
    copy = tmp_path / "cudahook"
    shutil.copytree(PKG, copy, ignore=shutil.ignore_patterns("__pycache__"))
    return copy


def test_the_rule_sees_a_wrong_import(tmp_path: Path) -> None:
    """The checkers themselves, on a copy of the package: a core module
    importing an entry point and the command line is caught, and is the
    only module caught."""
    copy = _copy_of_the_package(tmp_path)
    probe = copy / "core" / "_layout_probe.py"
    probe.write_text("from ..hooks import oci_hook\nfrom cudahook.admin import cli\n")
    assert {"cudahook.hooks.oci_hook", "cudahook.admin.cli"} <= imports_of(probe, copy)
    wrong = {module_name(p, copy): bad for p in modules(copy) if (bad := wrong_imports(p, copy))}
    assert wrong == {"cudahook.core._layout_probe": [
        "cudahook.admin", "cudahook.admin.cli", "cudahook.hooks", "cudahook.hooks.oci_hook"]}
    assert hooks_importers(copy) == {"cudahook.core._layout_probe": [
        "cudahook.hooks", "cudahook.hooks.oci_hook"]}


def test_the_rule_sees_admin_importing_hooks(tmp_path: Path) -> None:
    """An admin command reaching into an entry point (what admin must get
    from flow/) is caught on a copy of the package; the simulator may."""
    copy = _copy_of_the_package(tmp_path)
    (copy / "admin" / "_probe.py").write_text("import cudahook.hooks.criu_action\n")
    (copy / "sim" / "_probe.py").write_text("from cudahook.hooks import criu_action\n")
    assert hooks_importers(copy) == {"cudahook.admin._probe": ["cudahook.hooks.criu_action"]}


def test_flow_functions_are_short() -> None:
    assert long_functions(PKG / "flow", FLOW_MAX_LINES) == []


def test_the_length_rule_sees_a_long_function(tmp_path: Path) -> None:
    flow = _copy_of_the_package(tmp_path) / "flow"
    body = "".join(f"    x{i} = {i}\n" for i in range(FLOW_MAX_LINES))
    (flow / "_probe.py").write_text(f"def short():\n    pass\n\n\ndef long():\n{body}")
    assert [f for f in long_functions(flow, FLOW_MAX_LINES) if "_probe" in f] == [
        f"flow/_probe.py:long:{FLOW_MAX_LINES + 1}"]
