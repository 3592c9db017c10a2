"""The package layout is the architecture: imports flow one way.

hooks -> flow -> vmm -> core -> platform; admin uses flow and below, never
hooks; nothing of the product imports the simulator except the demo, which
runs on it by definition.
"""

from __future__ import annotations

import ast
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


def module_name(path: Path) -> str:
    parts = list(path.relative_to(PKG.parent).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imports_of(path: Path) -> set[str]:
    mod = module_name(path)
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


MODULES = sorted(p for p in PKG.rglob("*.py") if "__pycache__" not in p.parts)


def test_every_module_lives_in_a_subpackage() -> None:
    loose = [module_name(p) for p in MODULES
             if p.parent == PKG and p.name not in ("__init__.py", "__main__.py")]
    assert loose == []


@pytest.mark.parametrize("path", MODULES, ids=lambda p: module_name(p))
def test_imports_flow_one_way(path: Path) -> None:
    mod = module_name(path)
    own = subpackage(mod)
    bad = []
    for target in imports_of(path):
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
    assert bad == [], f"{mod} may not import {sorted(set(bad))}"


def test_the_rule_sees_a_wrong_import(tmp_path: Path) -> None:
    """The checker itself: a core module importing an adapter is caught."""
    fake = PKG / "core" / "_layout_probe.py"
    try:
        fake.write_text("from ..hooks import oci_hook\nfrom cudahook.admin import cli\n")
        assert {"cudahook.hooks.oci_hook", "cudahook.admin.cli"} <= imports_of(fake)
        with pytest.raises(AssertionError, match="may not import"):
            test_imports_flow_one_way(fake)
    finally:
        fake.unlink()
