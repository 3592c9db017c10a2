"""Build and install the fake `libcuda.so.1` (libcuda/fake_libcuda.c).

The library (and its header, fake_cuda.h) is compiled with the system C compiler, once per source
version, into a cache beside the checkout (`.cache/libcuda/<digest>/`, or
`$CUDA_SIM_LIB_CACHE`), and a simulated node gets a copy at
`ROOT/lib/libcuda.so.1`: the library finds the node from its own path.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
import tempfile
from pathlib import Path

SOURCE = Path(__file__).resolve().parent / "libcuda" / "fake_libcuda.c"
# cuda.h's declarations as the library implements them (tests/test_cuda_abi.py
# holds them against the real header).
HEADER = SOURCE.with_name("fake_cuda.h")
SONAME = "libcuda.so.1"
CACHE_ENV = "CUDA_SIM_LIB_CACHE"
FLAGS = ["-shared", "-fPIC", "-O2", "-Wall", "-Wextra", "-Werror", "-Wno-format-truncation",
         "-fvisibility=hidden", f"-Wl,-soname,{SONAME}"]


class BuildError(Exception):
    """No compiler, or the source does not compile."""


def compiler() -> str | None:
    return os.environ.get("CC") or shutil.which("gcc") or shutil.which("cc")


def _cache_root() -> Path:
    if os.environ.get(CACHE_ENV):
        return Path(os.environ[CACHE_ENV])
    return SOURCE.parents[3] / ".cache" / "libcuda"


def build(out_dir: str | os.PathLike[str] | None = None, timeout: float = 120) -> Path:
    """The built library (built now unless this source version already is)."""
    digest = hashlib.sha256(SOURCE.read_bytes() + HEADER.read_bytes()
                            + " ".join(FLAGS).encode()).hexdigest()[:16]
    target = Path(out_dir) if out_dir else _cache_root() / digest
    lib = target / SONAME
    if lib.exists():
        return lib
    cc = compiler()
    if not cc:
        raise BuildError("no C compiler (install gcc) to build the fake libcuda.so.1")
    target.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=".libcuda.", dir=target)
    os.close(fd)
    try:
        result = subprocess.run([cc, *FLAGS, "-o", tmp, str(SOURCE)], capture_output=True,
                                text=True, timeout=timeout)
        if result.returncode != 0:
            raise BuildError(f"{cc} failed on {SOURCE.name}: {result.stderr.strip()}")
        os.chmod(tmp, 0o755)
        os.replace(tmp, lib)  # concurrent builders: the last complete one wins
    finally:
        Path(tmp).unlink(missing_ok=True)
    return lib


def install(root: str | os.PathLike[str]) -> Path | None:
    """Put the library at ROOT/lib/libcuda.so.1; None when it cannot be built."""
    try:
        built = build()
    except (BuildError, OSError, subprocess.TimeoutExpired):
        return None
    dest = Path(root) / "lib" / SONAME
    dest.parent.mkdir(parents=True, exist_ok=True)
    tmp = dest.with_name(f".{SONAME}.tmp")
    shutil.copyfile(built, tmp)
    os.chmod(tmp, 0o755)
    os.replace(tmp, dest)
    return dest
