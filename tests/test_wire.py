"""The fake tool's own JSON codec agrees with the json module both ways."""

from __future__ import annotations

import json

import pytest
from hypothesis import given
from hypothesis import strategies as st

from cudahook.sim import wire

VALUES = st.recursive(
    st.none() | st.booleans() | st.integers() | st.text()
    | st.floats(allow_nan=False, allow_infinity=False),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(), inner, max_size=4),
    max_leaves=12,
)


@given(VALUES)
def test_reads_what_json_writes(value: object) -> None:
    assert wire.loads(json.dumps(value)) == value
    assert wire.loads(json.dumps(value, indent=1, ensure_ascii=False)) == value


@given(VALUES)
def test_json_reads_what_it_writes(value: object) -> None:
    assert json.loads(wire.dumps(value)) == value


@pytest.mark.parametrize("text", ["", "{", '{"a" 1}', '{"a": 1,}', '"x', "[1 2]", "nul", "{} x"])
def test_malformed_input_is_a_value_error(text: str) -> None:
    with pytest.raises(ValueError):
        wire.loads(text)
