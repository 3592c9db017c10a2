"""The simulator held to what a real driver did at custom storage's edges.

`test_simulator_matches_recorded_storage_edges` reads a recording (the
`storage_edges` part of record_evidence's JSON: $CUDAHOOK_GPU_EVIDENCE, else
docs/gpu-evidence/evidence.json), runs the same probes on a simulated node
set up as that driver, and fails on every outcome that differs: each
difference is a line of the simulator to change (or a finding to discuss).
Skipped until a recording exists.

`test_comparator__*` prove the comparator on a recording the simulator made
itself: the same answers compare equal, and a changed answer is caught.
"""

from __future__ import annotations

import copy
import json
import os
import shutil
from pathlib import Path
from typing import Any

import pytest

from .gpulib import REPO_ROOT
from .storage_edges import ENV_EVIDENCE, PROBES, compare, simulate

DEFAULT = REPO_ROOT / "docs" / "gpu-evidence" / "evidence.json"
NO_CC = shutil.which("cc") is None and shutil.which("gcc") is None
needs_cc = pytest.mark.skipif(NO_CC, reason="no C compiler for the simulator's libcuda")


def recording() -> tuple[Path, dict[str, Any]] | None:
    path = Path(os.environ.get(ENV_EVIDENCE) or DEFAULT)
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    edges = data.get("storage_edges")
    return (path, edges) if isinstance(edges, dict) else None


@needs_cc
def test_simulator_matches_recorded_storage_edges(tmp_path: Path) -> None:
    found = recording()
    if found is None:
        pytest.skip(f"no recording of the custom-storage edges yet (${ENV_EVIDENCE} or {DEFAULT})")
    path, recorded = found
    simulated = simulate(recorded, tmp_path / "sim")
    diffs = compare(recorded, simulated)
    assert not diffs, (f"the simulator differs from {path} (driver {recorded.get('driver')}, "
                       f"CUDA {recorded.get('cuda_version')}):\n" + "\n".join(diffs))


@pytest.fixture(scope="module")
def sim_recording(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """The probes run once on a simulated CUDA 13.4 node: a recording made
    the way the device run makes one."""
    return simulate({"driver": "580.65.06", "cuda_version": 13040},
                    tmp_path_factory.mktemp("edges-recorded"))


@needs_cc
def test_comparator__same_answers_compare_equal(sim_recording: dict[str, Any],
                                                 tmp_path: Path) -> None:
    assert sim_recording["supported"], sim_recording
    assert set(sim_recording["probes"]) == set(PROBES)
    assert all("outcome" in r for r in sim_recording["probes"].values()), sim_recording
    again = simulate(sim_recording, tmp_path / "again")
    assert compare(sim_recording, again) == []


@needs_cc
def test_comparator__a_different_answer_is_caught(sim_recording: dict[str, Any]) -> None:
    # A driver that keeps the operation open when its caller dies, and that
    # checks the target's state before the caller's contexts.
    real = copy.deepcopy(sim_recording)
    dies = real["probes"]["caller_dies_checkpoint"]["outcome"]
    dies["state_after_death"] = "checkpointing"
    real["probes"]["errors"]["outcome"]["no_context"] = "CUDA_ERROR_ILLEGAL_STATE"
    diffs = compare(real, sim_recording)
    assert [d.split(":")[0] for d in diffs] == [
        "caller_dies_checkpoint.state_after_death", "errors.no_context"], diffs
    # A probe the simulator leaves out, or custom storage missing, is a difference too.
    real = copy.deepcopy(sim_recording)
    sim = copy.deepcopy(sim_recording)
    del sim["probes"]["second_open"]
    assert [d.split(":")[0] for d in compare(real, sim)] == ["second_open"]
    sim["supported"] = False
    assert compare(real, sim) and "custom storage" in compare(real, sim)[0]


@needs_cc
def test_comparator__probes_not_run_there_are_not_held(sim_recording: dict[str, Any]) -> None:
    real = copy.deepcopy(sim_recording)
    real["probes"]["second_open"] = {"skipped": "out of time"}
    real["probes"]["errors"] = {"error": "Gone: the caller exited"}
    assert compare(real, sim_recording) == []
