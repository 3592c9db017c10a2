from __future__ import annotations

import uuid

import pytest
from hypothesis import given
from hypothesis import strategies as st

from cudahook.core.devicemap import compute_device_map, parse_device_map
from cudahook.platform.errors import DeviceMapError


def g(n: int) -> str:
    return "GPU-" + str(uuid.UUID(int=n))


def test_identity_gives_no_map() -> None:
    assert compute_device_map([g(1), g(2)], [g(2), g(1)]) is None


def test_present_gpus_stay_and_the_rest_pair_in_order() -> None:
    m = compute_device_map([g(1), g(2), g(3)], [g(9), g(2), g(8)])
    assert m == {g(1): g(9), g(2): g(2), g(3): g(8)}


def test_full_move_pairs_by_position() -> None:
    assert compute_device_map([g(1), g(2)], [g(3), g(4)]) == {g(1): g(3), g(2): g(4)}


def test_count_mismatch_is_an_error() -> None:
    with pytest.raises(DeviceMapError, match=r"1 GPU.*2 are available"):
        compute_device_map([g(1)], [g(2), g(3)])


def test_bad_uuid_and_duplicates_are_errors() -> None:
    with pytest.raises(DeviceMapError, match="not a GPU UUID"):
        compute_device_map(["GPU-0"], [g(1)])
    with pytest.raises(DeviceMapError, match="duplicate"):
        compute_device_map([g(1), g(1)], [g(2), g(3)])


def test_parse_round_trip_and_errors() -> None:
    assert parse_device_map(f"{g(1)}={g(2)}, {g(3)}={g(4)}") == {g(1): g(2), g(3): g(4)}
    with pytest.raises(DeviceMapError, match="not old=new"):
        parse_device_map(g(1))
    with pytest.raises(DeviceMapError, match="twice"):
        parse_device_map(f"{g(1)}={g(2)},{g(1)}={g(3)}")
    with pytest.raises(DeviceMapError, match="same target"):
        parse_device_map(f"{g(1)}={g(3)},{g(2)}={g(3)}")


@given(st.lists(st.integers(0, 40), min_size=1, max_size=8, unique=True),
       st.lists(st.integers(0, 40), min_size=1, max_size=8, unique=True))
def test_map_properties(src: list[int], dst: list[int]) -> None:
    source, target = [g(i) for i in src], [g(i) for i in dst]
    if len(source) != len(target):
        with pytest.raises(DeviceMapError):
            compute_device_map(source, target)
        return
    m = compute_device_map(source, target)
    if m is None:
        assert set(source) == set(target)
        return
    assert list(m) == source  # every checkpointed GPU listed, in order
    assert sorted(m.values()) == sorted(target)  # a bijection onto the targets
    for s in source:
        if s in target:
            assert m[s] == s  # a GPU still present never moves


MIG = "MIG-" + str(uuid.UUID(int=77))
OLD_MIG = f"MIG-{g(5)}/1/0"


def test_mig_instances_come_back_where_they_were_and_never_move() -> None:
    assert compute_device_map([MIG, OLD_MIG], [OLD_MIG, MIG]) is None
    with pytest.raises(DeviceMapError, match="cannot move MIG instances"):
        compute_device_map([MIG], ["MIG-" + str(uuid.UUID(int=78))])
    with pytest.raises(DeviceMapError, match="cannot move MIG instances"):
        parse_device_map(f"{g(1)}={MIG}")
    assert parse_device_map(f"{MIG}={MIG},{g(1)}={g(2)}") == {MIG: MIG, g(1): g(2)}


def test_targets_must_be_the_same_chip_with_enough_memory() -> None:
    from cudahook.core.devicemap import check_targets

    h100 = ("NVIDIA H100 80GB HBM3", 81559)
    models = {g(1): h100, g(2): h100}
    check_targets({g(1): g(3), g(2): g(2)}, models, {g(3): h100, g(2): h100})
    with pytest.raises(DeviceMapError, match="same GPU model"):
        check_targets({g(1): g(3)}, models, {g(3): ("NVIDIA A100-SXM4-80GB", 81920)})
    with pytest.raises(DeviceMapError, match="less memory"):
        check_targets({g(1): g(3)}, models, {g(3): ("NVIDIA H100 80GB HBM3", 40000)})
    check_targets({g(1): g(3)}, {}, {g(3): h100})  # nothing recorded: the driver decides
