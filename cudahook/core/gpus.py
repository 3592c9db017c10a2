"""GPU identity from nvidia-smi: which GPUs this node (or container) sees."""

from __future__ import annotations

from dataclasses import dataclass

from cudahook.platform.config import Settings
from cudahook.platform.errors import EnvironmentProblem
from cudahook.platform.host import Host

FIELDS = "index,uuid,name,memory.total,driver_version,persistence_mode"


@dataclass(frozen=True)
class Gpu:
    index: int
    uuid: str
    name: str
    memory_mib: int
    driver_version: str
    persistence: bool


def query_gpus(host: Host, settings: Settings) -> list[Gpu]:
    smi = settings.tool("nvidia_smi")
    result = host.run([smi, f"--query-gpu={FIELDS}", "--format=csv,noheader,nounits"], 30)
    if not result.ok:
        why = "timed out" if result.timed_out else (result.stderr.strip() or f"exit {result.returncode}")
        raise EnvironmentProblem(f"nvidia-smi failed: {why}")
    gpus = []
    for line in result.stdout.splitlines():
        if not line.strip():
            continue
        cols = [c.strip() for c in line.split(",")]
        if len(cols) != 6:
            raise EnvironmentProblem(f"nvidia-smi: unexpected line {line!r}")
        index, uuid, name, mem, driver, persist = cols
        gpus.append(Gpu(int(index), uuid, name, int(float(mem)), driver, persist == "Enabled"))
    return gpus
