"""The simulator's cuda.h declarations (cudahook/sim/libcuda/fake_cuda.h) and
the driver helper's ctypes structs against NVIDIA's real cuda.h.

The real header comes from the `nvidia-cuda-runtime` wheel (CUDA 13.x),
fetched with pip into .cache/cuda-header/ the first time; without it (no
network) the comparisons skip and say why. It is never part of the project.
"""

from __future__ import annotations

import ctypes
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

from cudahook.core.backends import driver_helper
from cudahook.sim import fakelib

ROOT = Path(__file__).resolve().parents[1]
CACHE = ROOT / ".cache" / "cuda-header"
MEMBER = "nvidia/cu13/include/cuda.h"

# Every checkpoint struct, field by field, as the real header names them.
STRUCTS = {
    "CUuuid": ["bytes"],
    "CUcheckpointLockArgs": ["timeoutMs", "reserved0", "reserved1"],
    "CUcheckpointCheckpointArgs": ["customStorageInfo_out", "reserved"],
    "CUcheckpointGpuPair": ["oldUuid", "newUuid"],
    "CUcheckpointRestoreArgs": ["gpuPairs", "gpuPairsCount", "padding0", "customStorageInfo_out",
                                "reserved"],
    "CUcheckpointUnlockArgs": ["reserved"],
    "CUcheckpointCustomStorageInfo": ["handle", "perDeviceData", "deviceCount"],
    "CUcheckpointCustomStoragePerDeviceData": ["devPtr", "size", "stream"],
}
TYPES = ["CUresult", "CUprocessState", "CUdeviceptr", "CUdevice", "CUcontext", "CUstream",
         "CUcheckpointOperationHandle", "CUdriverProcAddressQueryResult"]
CONSTANTS = ["CU_PROCESS_STATE_RUNNING", "CU_PROCESS_STATE_LOCKED",
             "CU_PROCESS_STATE_CHECKPOINTED", "CU_PROCESS_STATE_FAILED",
             "CU_PROCESS_STATE_CHECKPOINTING", "CU_PROCESS_STATE_RESTORING",
             "CU_GET_PROC_ADDRESS_SUCCESS", "CU_GET_PROC_ADDRESS_SYMBOL_NOT_FOUND",
             "CU_GET_PROC_ADDRESS_VERSION_NOT_SUFFICIENT",
             "CUDA_ERROR_INVALID_VALUE", "CUDA_ERROR_OUT_OF_MEMORY", "CUDA_ERROR_NOT_INITIALIZED",
             "CUDA_ERROR_NO_DEVICE", "CUDA_ERROR_INVALID_DEVICE", "CUDA_ERROR_INVALID_CONTEXT",
             "CUDA_ERROR_INVALID_HANDLE", "CUDA_ERROR_ILLEGAL_STATE", "CUDA_ERROR_NOT_SUPPORTED",
             "CUDA_ERROR_TIMEOUT", "CUDA_ERROR_UNKNOWN"]


def program(include: str) -> str:
    """C that prints every size, offset and constant above, one per line."""
    lines = [include, "#include <stdio.h>", "#include <stddef.h>", "int main(void) {"]
    for struct, fields in STRUCTS.items():
        lines.append(f'printf("sizeof {struct} %zu\\n", sizeof({struct}));')
        for f in fields:
            lines.append(f'printf("offsetof {struct}.{f} %zu\\n", offsetof({struct}, {f}));')
            lines.append(f'printf("sizeof {struct}.{f} %zu\\n", sizeof((({struct} *)0)->{f}));')
    for t in TYPES:
        lines.append(f'printf("sizeof {t} %zu\\n", sizeof({t}));')
    for c in CONSTANTS:
        lines.append(f'printf("value {c} %lld\\n", (long long){c});')
    lines += ["return 0;", "}"]
    return "\n".join(lines) + "\n"


def layout(tmp: Path, include: str, include_dir: Path) -> dict[str, int]:
    """What the header in include_dir says, compiled and run with gcc."""
    cc = fakelib.compiler()
    if not cc:
        pytest.skip("no C compiler")
    src, exe = tmp / "abi.c", tmp / "abi"
    src.write_text(program(include))
    built = subprocess.run([cc, "-std=c11", "-Wall", "-Werror", "-I", str(include_dir), "-o",
                            str(exe), str(src)], capture_output=True, text=True, timeout=120)
    if built.returncode != 0:
        raise AssertionError(f"{include} does not compile: {built.stderr[-2000:]}")
    out = subprocess.run([str(exe)], capture_output=True, text=True, timeout=30, check=True)
    return {k: int(v) for k, v in (line.rsplit(" ", 1) for line in out.stdout.splitlines())}


def differences(ours: dict[str, int], real: dict[str, int]) -> list[str]:
    return [f"{k}: ours {ours.get(k)}, cuda.h {real.get(k)}"
            for k in sorted(set(ours) | set(real)) if ours.get(k) != real.get(k)]


@pytest.fixture(scope="module")
def real_header(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The include directory holding NVIDIA's cuda.h, fetched once with pip."""
    header = CACHE / MEMBER
    if header.is_file():
        return header.parent
    wheels = tmp_path_factory.mktemp("wheel")
    try:
        got = subprocess.run(
            [sys.executable, "-m", "pip", "download", "--no-deps", "--quiet",
             "nvidia-cuda-runtime", "-d", str(wheels)],
            capture_output=True, text=True, timeout=300)
    except subprocess.TimeoutExpired:
        pytest.skip("the real cuda.h is not in .cache/cuda-header and pip timed out fetching "
                    "nvidia-cuda-runtime (no network?)")
    found = sorted(wheels.glob("nvidia_cuda_runtime-*.whl"))
    if got.returncode != 0 or not found:
        last = (got.stderr.strip().splitlines() or ["no wheel"])[-1]
        pytest.skip("the real cuda.h is not in .cache/cuda-header and pip could not fetch "
                    f"nvidia-cuda-runtime (no network?): {last}")
    with zipfile.ZipFile(found[-1]) as wheel:
        if MEMBER not in wheel.namelist():
            pytest.skip(f"{found[-1].name} holds no {MEMBER}")
        tmp = header.with_name(".cuda.h.tmp")
        tmp.parent.mkdir(parents=True, exist_ok=True)
        with wheel.open(MEMBER) as src, open(tmp, "wb") as dst:
            shutil.copyfileobj(src, dst)
        tmp.replace(header)
    return header.parent


def ours(tmp: Path, header: Path = fakelib.HEADER) -> dict[str, int]:
    return layout(tmp, f'#include "{header.name}"', header.parent)


def test_the_simulators_declarations_match_cuda_h(real_header: Path, tmp_path: Path) -> None:
    real = layout(tmp_path, "#include <cuda.h>", real_header)
    assert len(real) > 60
    assert differences(ours(tmp_path), real) == []


def test_a_wrong_layout_is_caught(real_header: Path, tmp_path: Path) -> None:
    """The comparison can fail: two fields swapped (same size, other offsets)."""
    text = fakelib.HEADER.read_text()
    swapped = text.replace("    unsigned int gpuPairsCount;\n    unsigned int padding0;\n",
                           "    unsigned int padding0;\n    unsigned int gpuPairsCount;\n")
    assert swapped != text
    wrong = tmp_path / "wrong" / fakelib.HEADER.name
    wrong.parent.mkdir()
    wrong.write_text(swapped)
    real = layout(tmp_path, "#include <cuda.h>", real_header)
    assert differences(ours(tmp_path, wrong), real) == [
        "offsetof CUcheckpointRestoreArgs.gpuPairsCount: ours 12, cuda.h 8",
        "offsetof CUcheckpointRestoreArgs.padding0: ours 8, cuda.h 12",
    ]


def test_the_driver_helpers_structs_match_cuda_h(real_header: Path, tmp_path: Path) -> None:
    """The ctypes structs the helper hands the real driver: every field cuda.h
    names sits where cuda.h puts it (reserved space may be split)."""
    real = layout(tmp_path, "#include <cuda.h>", real_header)
    wrong = []
    for struct, fields in STRUCTS.items():
        ctype = getattr(driver_helper, struct)
        if ctypes.sizeof(ctype) != real[f"sizeof {struct}"]:
            wrong.append(f"sizeof {struct}")
        for f in fields:
            if getattr(ctype, f).offset != real[f"offsetof {struct}.{f}"]:
                wrong.append(f"{struct}.{f}")
    assert wrong == []
