"""A drop-in `nvidia-smi` for the simulated GPU: the queries cudahook makes.

Supports `--query-gpu=FIELDS` and `--query-compute-apps=FIELDS` with
`--format=csv[,noheader][,nounits]`, and `-L`. Like the real one it prints
"No devices were found" and exits 6 when the node has no GPU, reports each
GPU's persistence mode as configured ("Enabled" unless a GPU says
"Disabled"), and prints "[N/A]" for fields a GPU's spec marks so.
"""

from __future__ import annotations

import json
import os
import sys

from .protocol import Channel, connect_unix

GPU_FIELDS = {
    "index": ("index", lambda g, i: str(g["index"])),
    "uuid": ("uuid", lambda g, i: g.get("parent", g["uuid"])),
    "name": ("name", lambda g, i: g["name"]),
    "memory.total": ("memory.total [MiB]", lambda g, i: f"{g['memory_total_mib']}"),
    "memory.used": ("memory.used [MiB]", lambda g, i: f"{g['memory_used_mib']}"),
    "driver_version": ("driver_version", lambda g, i: i["driver_version"]),
    "persistence_mode": ("persistence_mode", lambda g, i: g.get("persistence_mode", "Enabled")),
    "pci.bus_id": ("pci.bus_id", lambda g, i: f"00000000:{0x18 + g['index']:02X}:00.0"),
}
APP_FIELDS = {
    "pid": ("pid", lambda g, p: str(p["pid"])),
    "gpu_uuid": ("gpu_uuid", lambda g, p: g["uuid"]),
    "used_memory": ("used_gpu_memory [MiB]", lambda g, p: str(p["used_bytes"] >> 20)),
    "used_gpu_memory": ("used_gpu_memory [MiB]", lambda g, p: str(p["used_bytes"] >> 20)),
}


# What the real nvidia-smi prints (exit 9) when it cannot reach the driver.
NO_DRIVER = ("NVIDIA-SMI has failed because it couldn't communicate with the NVIDIA driver. "
             "Make sure that the latest NVIDIA driver is installed and running.")


def _fault(sim_dir: str) -> int | None:
    """An injected fault (faults.json, action "nvidia-smi"): mode `error`
    answers as the real tool does when it cannot reach the driver (exit 9),
    `hang` never returns."""
    try:
        with open(os.path.join(sim_dir, "faults.json")) as f:
            rules = json.load(f)
    except (OSError, ValueError):
        return None
    for rule in rules:
        if rule.get("action") == "nvidia-smi":
            if rule.get("mode") == "hang":
                import time

                while True:
                    time.sleep(3600)
            print(NO_DRIVER)
            return 9
    return None


def main(argv: list[str], sim_dir: str) -> int:
    failed = _fault(sim_dir)
    if failed is not None:
        return failed
    try:
        chan = Channel(connect_unix(os.path.join(sim_dir, "gpu.sock"), timeout=10))
        info, _ = chan.call({"op": "info"})
        chan.close()
        # The loaded driver, as /proc/driver/nvidia/version says it, and
        # what the node's configuration says of each GPU beyond the service.
        with open(os.path.join(sim_dir, "sim.json")) as f:
            config = json.load(f)
        info["driver_version"] = config["driver_version"]
    except OSError:
        print(NO_DRIVER)
        return 9
    if not config.get("gpus"):
        print("No devices were found")
        return 6
    by_uuid = {g["uuid"]: g for g in config["gpus"]}
    for g in info["gpus"]:
        spec = by_uuid.get(g["uuid"], {})
        if "persistence_mode" in spec:
            g["persistence_mode"] = spec["persistence_mode"]
        g["fields"] = spec.get("fields", {})
        if g["uuid"].startswith("MIG-"):
            # A MIG instance: the GPU query shows its parent GPU, -L both.
            g["parent"] = spec.get("parent") or "GPU-" + g["uuid"][4:]
    if argv[:1] in (["-pm"], ["--persistence-mode"]) and argv[1:2] in (["0"], ["1"]):
        # Every GPU's mode, kept in the node's configuration for later queries.
        mode = "Enabled" if argv[1] == "1" else "Disabled"
        for g, spec in zip(info["gpus"], config["gpus"], strict=False):
            spec["persistence_mode"] = mode
            print(f"{mode} persistence mode for GPU 00000000:{0x18 + g['index']:02X}:00.0.")
        print("All done.")
        tmp = os.path.join(sim_dir, ".sim.json.smi")
        with open(tmp, "w") as f:
            json.dump(config, f, indent=1)
        os.replace(tmp, os.path.join(sim_dir, "sim.json"))
        return 0
    fmt = next((a.split("=", 1)[1] for a in argv if a.startswith("--format=")), "")
    opts = set(fmt.split(",")) if fmt else set()
    if "-L" in argv or "--list-gpus" in argv:
        for g in info["gpus"]:
            print(f"GPU {g['index']}: {g['name']} (UUID: {g.get('parent', g['uuid'])})")
            if "parent" in g:
                print(f"  MIG 1g.10gb     Device  0: (UUID: {g['uuid']})")
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
                # A field the GPU cannot report reads "[N/A]" (MIG, vGPU), no unit.
                raw = a.get("fields", {}) if kind == "query-gpu" else {}
                values = [raw.get(n) or table[n][1](a, b) for n in names]
                if "nounits" not in opts:
                    values = [v + " MiB" if table[n][0].endswith("[MiB]") and n not in raw else v
                              for n, v in zip(names, values, strict=True)]
                print(", ".join(values))
            return 0
    for g in info["gpus"]:
        print(f"GPU {g['index']}: {g['name']} {g['memory_used_mib']}MiB / "
              f"{g['memory_total_mib']}MiB  driver {info['driver_version']}")
    return 0
