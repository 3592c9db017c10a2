"""CUDA VMM interposer support (the ai-dynamo/snapshot contract).

Workloads that share CUDA VMM allocations run with an LD_PRELOAD shim whose
mappings cuda-checkpoint alone does not save. Each shim listens on
/snapshot-control/cuda-vmm-<nspid>.sock inside its container; a coordinator
saves their state into the checkpoint before the CUDA lock, and replays it
into the restored processes afterwards.

A container where only some CUDA processes have a shim cannot be
checkpointed consistently, so it is refused before anything is touched.
The container owns /snapshot-control: it is examined without following any
symlink (see sockets.py), so a container cannot point the hook at host paths.
"""

from __future__ import annotations

import os
import stat
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from .discovery import CudaProcess
from .errors import CudahookError, EnvironmentProblem
from .host import Host
from .sockets import list_sockets

CONTROL_DIR = "/snapshot-control"
STATE_FILE = "cuda-vmm.state"
# The coordinator's saved state is copied out of the image at post-restore
# when the image directory is out of reach by post-resume; nothing larger.
MAX_STATE_BYTES = 1 << 30


class VmmRefused(CudahookError):
    """Some but not all CUDA processes have an interposer socket."""


class CoordinatorFailed(CudahookError):
    pass


@dataclass(frozen=True)
class Detection:
    with_socket: list[CudaProcess]
    without: list[CudaProcess]

    @property
    def participates(self) -> bool:
        return bool(self.with_socket) and not self.without


def detect(host: Host, procs: Sequence[CudaProcess]) -> Detection:
    """Which CUDA processes have a valid interposer socket; refuses a partial set."""
    have, lack = [], []
    for p in procs:
        sockets = list_sockets(CONTROL_DIR, base=str(host.proc / str(p.pid) / "root"))
        (have if p.nspid in sockets else lack).append(p)
    result = Detection(have, lack)
    if have and lack:
        names = ", ".join(f"pid {p.pid} (namespace pid {p.nspid})" for p in lack)
        raise VmmRefused(
            f"CUDA VMM interposer active in {len(have)} of {len(procs)} CUDA processes; "
            f"no valid {CONTROL_DIR}/cuda-vmm-<pid>.sock for {names}: refusing the checkpoint")
    return result


def has_state(image_dir: Path) -> bool:
    """A regular file, not a link or anything else the image might hold."""
    try:
        return stat.S_ISREG(os.lstat(image_dir / STATE_FILE).st_mode)
    except OSError:
        return False


def _args(op: str, proc_root: str, directory: Path, procs: Sequence[tuple[int, int]]) -> list[str]:
    args = [f"--{op}", "--proc-root", proc_root, "--checkpoint-dir", str(directory)]
    for host_pid, nspid in procs:
        args += ["--process", str(host_pid), str(nspid)]
    return args


def run_coordinator(host: Host, coordinator: str, op: str, proc_root: str, directory: Path,
                    procs: Sequence[tuple[int, int]], timeout: float) -> str:
    """Run `--prepare` or `--restore`; its combined output, for the log."""
    if not os.access(coordinator, os.X_OK):
        raise EnvironmentProblem(f"CUDA VMM coordinator not executable: {coordinator}")
    result = host.run([coordinator, *_args(op, proc_root, directory, procs)], timeout)
    output = (result.stdout + result.stderr).strip()
    if result.timed_out:
        raise CoordinatorFailed(f"CUDA VMM coordinator --{op} timed out after {timeout:g}s")
    if result.returncode != 0:
        last = output.splitlines()[-1] if output else ""
        raise CoordinatorFailed(
            f"CUDA VMM coordinator --{op} failed (exit {result.returncode}): {last}")
    return output
