"""Record: the hook path's data classes, with what they used of @dataclass."""

from __future__ import annotations

import subprocess
import sys

import pytest

from cudahook.platform.record import Record


class Point(Record, frozen=True):
    x: int
    y: int = 0


class Bag(Record):
    name: str
    items: list[int] = []
    meta: dict[str, str] = {}


class Tagged(Bag):
    tag: str = ""


def test_construction_defaults_equality_and_repr() -> None:
    assert Point(1) == Point(x=1, y=0) and Point(1, 2) != Point(1, 3)
    assert repr(Point(1, 2)) == "Point(x=1, y=2)"
    assert Point(1, 2).as_dict() == {"x": 1, "y": 2}
    assert Point(1, 2).replace(y=5) == Point(1, 5)
    assert hash(Point(1, 2)) == hash(Point(1, 2)) and len({Point(1), Point(1)}) == 1
    for bad in (lambda: Point(), lambda: Point(1, 2, 3), lambda: Point(1, z=2),
                lambda: Point(1, x=2)):
        with pytest.raises(TypeError):
            bad()


def test_frozen_and_mutable_defaults_are_per_instance() -> None:
    p = Point(1)
    with pytest.raises(AttributeError):
        p.x = 2  # type: ignore[misc]
    a, b = Bag("a"), Bag("b")
    a.items.append(1)
    a.meta["k"] = "v"
    assert b.items == [] and b.meta == {} and Bag.items == []
    a.name = "c"  # not frozen
    with pytest.raises(TypeError):
        hash(a)  # like a non-frozen dataclass: unhashable
    assert Tagged._fields == ("name", "items", "meta", "tag")
    assert Tagged("n", tag="t").tag == "t"


def test_the_hooks_import_no_dataclasses() -> None:
    code = ("import sys, cudahook.hooks.criu_action, cudahook.hooks.oci_hook; "
            "print(sorted(m for m in ('dataclasses', 'inspect', 'subprocess', 'socket', "
            "'secrets', 'shutil', 'threading') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-I", "-c", code], capture_output=True, text=True,
                         check=True).stdout
    assert out.strip() == "[]"
