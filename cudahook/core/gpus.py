"""GPU identity from nvidia-smi: which GPUs this node (or container) sees."""

from __future__ import annotations

import re

from cudahook.platform.config import Settings
from cudahook.platform.errors import EnvironmentProblem
from cudahook.platform.host import Host
from cudahook.platform.record import Record

FIELDS = "index,uuid,name,memory.total,driver_version,persistence_mode"
# nvidia-smi's exit status when the driver is loaded but no GPU is visible.
NO_DEVICES_EXIT = 6


class NoGpuVisible(EnvironmentProblem):
    """nvidia-smi runs but sees no GPU ("No devices were found")."""


class Gpu(Record, frozen=True):
    index: int
    uuid: str
    name: str
    memory_mib: int | None  # None: nvidia-smi says [N/A] (MIG, some vGPUs)
    driver_version: str
    persistence: bool | None  # None: [N/A]


def _na(value: str) -> bool:
    return value.startswith("[") or value in ("", "N/A")  # "[N/A]", "[Not Supported]"


def query_gpus(host: Host, settings: Settings) -> list[Gpu]:
    smi = settings.tool("nvidia_smi")
    result = host.run([smi, f"--query-gpu={FIELDS}", "--format=csv,noheader,nounits"], 30)
    said = (result.stdout + result.stderr).strip()
    if result.returncode == NO_DEVICES_EXIT or "No devices were found" in said:
        raise NoGpuVisible("nvidia-smi: no GPU visible (No devices were found)")
    if not result.ok:
        why = "timed out" if result.timed_out else (result.stderr.strip() or f"exit {result.returncode}")
        raise EnvironmentProblem(f"nvidia-smi failed: {why}")
    gpus = []
    for line in result.stdout.splitlines():
        if not line.strip():
            continue
        cols = [c.strip() for c in line.split(",")]
        if len(cols) != 6 or not cols[0].isdigit() or _na(cols[1]):
            raise EnvironmentProblem(f"nvidia-smi: unexpected line {line!r}")
        index, uuid, name, mem, driver, persist = cols
        try:
            memory = None if _na(mem) else int(float(mem))
        except ValueError:
            raise EnvironmentProblem(f"nvidia-smi: unexpected line {line!r}") from None
        gpus.append(Gpu(int(index), uuid, name, memory, "" if _na(driver) else driver,
                        None if _na(persist) else persist == "Enabled"))
    return gpus


def mig_uuids(host: Host, settings: Settings) -> list[str]:
    """MIG instances this node has (`nvidia-smi -L`): --query-gpu lists whole
    GPUs only, so a container on a MIG instance is checked against these."""
    result = host.run([settings.tool("nvidia_smi"), "-L"], 30)
    if not result.ok:
        return []
    return re.findall(r"\(UUID: (MIG-[^)\s]+)\)", result.stdout)
