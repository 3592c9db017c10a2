"""A drop-in `nvidia-smi` for the simulated GPU: the queries cudahook makes.

Supports `--query-gpu=FIELDS` and `--query-compute-apps=FIELDS` with
`--format=csv[,noheader][,nounits]`, and `-L`.
"""

from __future__ import annotations

import json
import os
import sys

from .protocol import Channel, connect_unix

GPU_FIELDS = {
    "index": ("index", lambda g, i: str(g["index"])),
    "uuid": ("uuid", lambda g, i: g["uuid"]),
    "name": ("name", lambda g, i: g["name"]),
    "memory.total": ("memory.total [MiB]", lambda g, i: f"{g['memory_total_mib']}"),
    "memory.used": ("memory.used [MiB]", lambda g, i: f"{g['memory_used_mib']}"),
    "driver_version": ("driver_version", lambda g, i: i["driver_version"]),
    "persistence_mode": ("persistence_mode", lambda g, i: "Enabled"),
    "pci.bus_id": ("pci.bus_id", lambda g, i: f"00000000:{0x18 + g['index']:02X}:00.0"),
}
APP_FIELDS = {
    "pid": ("pid", lambda g, p: str(p["pid"])),
    "gpu_uuid": ("gpu_uuid", lambda g, p: g["uuid"]),
    "used_memory": ("used_gpu_memory [MiB]", lambda g, p: str(p["used_bytes"] >> 20)),
    "used_gpu_memory": ("used_gpu_memory [MiB]", lambda g, p: str(p["used_bytes"] >> 20)),
}


def main(argv: list[str], sim_dir: str) -> int:
    try:
        chan = Channel(connect_unix(os.path.join(sim_dir, "gpu.sock"), timeout=10))
        info, _ = chan.call({"op": "info"})
        chan.close()
        # The loaded driver, as /proc/driver/nvidia/version says it.
        with open(os.path.join(sim_dir, "sim.json")) as f:
            info["driver_version"] = json.load(f)["driver_version"]
    except OSError:
        print("NVIDIA-SMI has failed because it couldn't communicate with the NVIDIA driver. "
              "Make sure that the latest NVIDIA driver is installed and running.")
        return 9
    fmt = next((a.split("=", 1)[1] for a in argv if a.startswith("--format=")), "")
    opts = set(fmt.split(",")) if fmt else set()
    if "-L" in argv or "--list-gpus" in argv:
        for g in info["gpus"]:
            print(f"GPU {g['index']}: {g['name']} (UUID: {g['uuid']})")
        return 0
    for arg in argv:
        if arg.startswith(("--query-gpu=", "--query-compute-apps=")):
            kind, fields = arg[2:].split("=", 1)
            table = GPU_FIELDS if kind == "query-gpu" else APP_FIELDS
            names = [f.strip() for f in fields.split(",")]
            bad = [n for n in names if n not in table]
            if bad:
                print(f'Field "{bad[0]}" is not a valid field to query.', file=sys.stderr)
                return 2
            if "csv" not in opts:
                print("Only CSV format is supported by this nvidia-smi", file=sys.stderr)
                return 2
            if "noheader" not in opts:
                print(", ".join(table[n][0] for n in names))
            rows = (
                [(g, info) for g in info["gpus"]]
                if kind == "query-gpu"
                else [(g, p) for g in info["gpus"] for p in g["processes"] if p["kind"] == "cuda"]
            )
            for a, b in rows:
                values = [table[n][1](a, b) for n in names]
                if "nounits" not in opts:
                    values = [v + " MiB" if table[n][0].endswith("[MiB]") else v
                              for n, v in zip(names, values, strict=True)]
                print(", ".join(values))
            return 0
    for g in info["gpus"]:
        print(f"GPU {g['index']}: {g['name']} {g['memory_used_mib']}MiB / "
              f"{g['memory_total_mib']}MiB  driver {info['driver_version']}")
    return 0
