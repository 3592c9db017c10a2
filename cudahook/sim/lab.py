"""One directory that holds a whole simulated GPU node.

    ROOT/sim.json          driver branch, GPUs, attach latency, copy bandwidth
    ROOT/driver/version    the driver's /proc/driver/nvidia/version
    ROOT/gpu.sock          the GPU service
    ROOT/bin/cuda-checkpoint, ROOT/bin/nvidia-smi   drop-in tools
    ROOT/lib/libcuda.so.1  the driver API (fake_libcuda.c), when a C compiler is there
    ROOT/dev/nvidia0..N, nvidiactl, nvidia-uvm      device nodes (plain files, for host
                                                    workloads; runc containers get real
                                                    character nodes, see runcbox)
    ROOT/ctl/              workloads' restore-thread sockets (host workloads)
    ROOT/status/           workloads' status reports
    ROOT/faults.json       injected faults, read by the fake cuda-checkpoint and libcuda

Containers bind-mount ROOT (for gpu.sock) at /run/cuda-sim and see device
nodes at /dev/nvidia*; host processes use the paths as they are.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

from cudahook.platform.config import Settings

PKG_PARENT = str(Path(__file__).resolve().parent.parent.parent)
_NS = uuid.UUID("6f1c4a52-7d8e-4b1a-9c53-2a7e9d0c1b44")


def gpu_uuid(seed: str, index: int) -> str:
    return "GPU-" + str(uuid.uuid5(_NS, f"{seed}/{index}"))


class SimLab:
    def __init__(
        self,
        root: str | os.PathLike[str],
        *,
        driver: int = 580,
        gpus: int = 2,
        memory_mib: int = 81559,
        attach_latency_s: float = 0.0,
        bandwidth_mib_s: float = 0.0,
        seed: str = "node-a",
        python: str = sys.executable,
        gpu_specs: list[dict[str, Any]] | None = None,
    ):
        from .tool import VERSIONS

        self.root = Path(root).resolve()
        self.python = python
        self.config: dict[str, Any] = {
            "driver_version": VERSIONS.get(driver, f"{driver}.00.00"),
            "attach_latency_s": attach_latency_s,
            "bandwidth_mib_s": bandwidth_mib_s,
            "gpus": [
                {"uuid": gpu_uuid(seed, i), "name": "NVIDIA H100 80GB HBM3 (simulated)",
                 "memory_mib": memory_mib}
                for i in range(gpus)
            ],
        }
        # Per-GPU overrides: another chip ("name"), size ("memory_mib"), a MIG
        # instance ("uuid": "MIG-..."), "persistence_mode" or raw nvidia-smi
        # "fields" such as "[N/A]".
        for g, spec in zip(self.config["gpus"], gpu_specs or [], strict=False):
            g.update(spec)

    # -- layout --------------------------------------------------------------

    @property
    def socket(self) -> Path:
        return self.root / "gpu.sock"

    @property
    def dev(self) -> Path:
        return self.root / "dev"

    @property
    def ctl(self) -> Path:
        return self.root / "ctl"

    @property
    def status_dir(self) -> Path:
        return self.root / "status"

    @property
    def cuda_checkpoint(self) -> Path:
        return self.root / "bin" / "cuda-checkpoint"

    @property
    def libcuda(self) -> Path:
        return self.root / "lib" / "libcuda.so.1"

    @property
    def nvidia_smi(self) -> Path:
        return self.root / "bin" / "nvidia-smi"

    @property
    def vmm_coordinator(self) -> Path:
        return self.root / "bin" / "snapshot-cuda-vmm"

    def vmm_calls(self) -> list[dict[str, Any]]:
        path = self.root / "vmm-calls.log"
        if not path.exists():
            return []
        return [json.loads(x) for x in path.read_text().splitlines() if x.strip()]

    @property
    def uuids(self) -> list[str]:
        return [g["uuid"] for g in self.config["gpus"]]

    def setup(self) -> SimLab:
        for d in (self.root / "bin", self.dev, self.ctl, self.status_dir):
            d.mkdir(parents=True, exist_ok=True)
        os.chmod(self.ctl, 0o777)
        self.write_config()
        for name in ("nvidiactl", "nvidia-uvm", *(f"nvidia{i}" for i in range(len(self.uuids)))):
            (self.dev / name).touch()
        for path, module in ((self.cuda_checkpoint, "tool"), (self.nvidia_smi, "smi"),
                             (self.vmm_coordinator, "vmm")):
            # -I -S: these run dozens of times per phase; skip site and user paths.
            path.write_text(
                f"#!{self.python} -IS\n"
                "import sys\n"
                f"sys.path.insert(0, {PKG_PARENT!r})\n"
                f"from cudahook.sim.{module} import main\n"
                f"sys.exit(main(sys.argv[1:], {str(self.root)!r}"
                + (", sys.argv[0]" if module == "tool" else "") + "))\n"
            )
            path.chmod(0o755)
        from .fakelib import install

        install(self.root)
        # What an NVML user maps (see the workload's --nvml): a stand-in file.
        nvml = self.root / "lib" / "libnvidia-ml.so.1"
        nvml.parent.mkdir(parents=True, exist_ok=True)
        if not nvml.exists():
            nvml.write_bytes(b"\x7fELF" + bytes(4092))
        return self

    @property
    def driver_version_file(self) -> Path:
        """This node's stand-in for /proc/driver/nvidia/version."""
        return self.root / "driver" / "version"

    def write_config(self) -> None:
        tmp = self.root / ".sim.json.tmp"
        tmp.write_text(json.dumps(self.config, indent=1))
        os.replace(tmp, self.root / "sim.json")
        self.driver_version_file.parent.mkdir(parents=True, exist_ok=True)
        tmp = self.driver_version_file.with_name(".version.tmp")
        tmp.write_text(
            "NVRM version: NVIDIA UNIX Open Kernel Module for x86_64  "
            f"{self.config['driver_version']}  Release Build  (sim@cudahook)  "
            "Thu Jan  1 00:00:00 UTC 2026\nGCC version:  gcc version 12.2.0 (Debian 12.2.0-14)\n")
        os.replace(tmp, self.driver_version_file)

    def set(self, **changes: Any) -> None:
        """Change the emulated driver's behaviour for the next tool calls."""
        if "driver" in changes:
            from .tool import VERSIONS

            major = changes.pop("driver")
            changes["driver_version"] = VERSIONS.get(major, f"{major}.00.00")
        self.config.update(changes)
        self.write_config()

    # -- the GPU service -------------------------------------------------------

    def start(self) -> SimLab:
        self.setup()
        if self.running():
            return self
        with open(self.root / "gpu.log", "ab") as log:
            subprocess.Popen(
                [self.python, "-m", "cudahook.sim", "gpu", "--dir", str(self.root)],
                stdin=subprocess.DEVNULL, stdout=log, stderr=log, start_new_session=True,
                env={**os.environ, "PYTHONPATH": PKG_PARENT},
            )
        wait_for(lambda: self.running(), 10, "simulated GPU service did not start")
        return self

    def running(self) -> bool:
        from .protocol import connect_unix

        try:
            connect_unix(str(self.socket), timeout=1).close()
            return True
        except OSError:
            return False

    def stop(self) -> None:
        try:
            pid = int((self.root / "gpu.pid").read_text())
            os.kill(pid, signal.SIGTERM)
        except (OSError, ValueError):
            pass

    def info(self) -> dict[str, Any]:
        from .protocol import Channel, connect_unix

        chan = Channel(connect_unix(str(self.socket), timeout=10))
        try:
            return chan.call({"op": "info"})[0]
        finally:
            chan.close()

    # -- cudahook settings that point at this node -----------------------------

    def settings(self, **overrides: Any) -> Settings:
        dev = re.escape(str(self.dev))
        base = Settings(
            cuda_checkpoint=str(self.cuda_checkpoint),
            libcuda=str(self.libcuda),
            nvidia_smi=str(self.nvidia_smi),
            driver_version_file=str(self.driver_version_file),
            vmm_coordinator=str(self.vmm_coordinator),
            vmm_timeout_s=10.0,
            device_pattern=rf"^(/dev|{dev})/nvidia([0-9]+|ctl|-uvm|-uvm-tools)$",
            call_timeout_s=30.0,
            lock_timeout_ms=5000,
            state_dir=str(self.root / "state"),
            log_file=str(self.root / "cudahook.log"),
        )
        return base.with_overrides(**overrides)

    # -- workloads on the host -------------------------------------------------

    def workload_argv(self, tag: str, **opts: Any) -> list[str]:
        return workload_argv(self.python, tag, **opts)

    def workload_env(self) -> dict[str, str]:
        return {
            **os.environ,
            "PYTHONPATH": PKG_PARENT,
            "CUDA_SIM_SOCKET": str(self.socket),
            "CUDA_SIM_DEV_DIR": str(self.dev),
            "CUDA_SIM_CTL_DIR": str(self.ctl),
            "CUDA_SIM_STATUS_DIR": str(self.status_dir),
        }

    def spawn(self, tag: str, **opts: Any) -> subprocess.Popen[bytes]:
        """Start a workload as a host process (its own session, like a container's init)."""
        return subprocess.Popen(
            self.workload_argv(tag, **opts), env=self.workload_env(),
            stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
            start_new_session=True,
        )

    def status(self, tag: str) -> dict[str, Any]:
        try:
            return json.loads((self.status_dir / f"{tag}.json").read_text())
        except (OSError, ValueError):
            return {}

    def wait_counter(self, tag: str, above: int = 0, timeout: float = 15) -> dict[str, Any]:
        """Wait until the workload has done GPU work past `above`; its status."""
        wait_for(lambda: self.status(tag).get("counter", 0) > above, timeout,
                 f"workload {tag} made no progress past {above}: {self.status(tag)}")
        return self.status(tag)

    def force_state(self, pid: int, state: str) -> None:
        """Put a host workload's CUDA state where the driver can leave one
        ("failed", "unknown", ...), as no cuda-checkpoint call would."""
        from . import wire

        reply = wire.request(str(self.ctl / f"cuda-sim-{pid}.sock"),
                             (wire.dumps({"op": "sim-force-state", "state": state}) + "\n").encode(),
                             timeout=10)
        if not wire.loads(reply.decode()).get("ok"):  # type: ignore[union-attr]
            raise ValueError(f"cannot force state {state!r} on {pid}")

    # -- faults ----------------------------------------------------------------

    def fault(self, action: str, mode: str = "error", **match: Any) -> None:
        """Make the fake cuda-checkpoint and libcuda fail `action`: mode
        error (CUDA error `code`), hang, delay (the call waits `seconds`,
        then is carried out), crash (the target process is killed) or segv
        (the tool or library itself dies; `after=True`: once the call was
        carried out). `skip=N` lets N matching calls through
        first; `times=N` fires N times. vmm-prepare / vmm-restore faults
        apply to the VMM coordinator (see sim/vmm.py)."""
        path = self.root / "faults.json"
        rules = json.loads(path.read_text()) if path.exists() else []
        rules.append({"action": action, "mode": mode, **match})
        path.write_text(json.dumps(rules))

    def clear_faults(self) -> None:
        (self.root / "faults.json").unlink(missing_ok=True)


def workload_argv(python: str, tag: str, **opts: Any) -> list[str]:
    """The simulated workload's command line; options as keyword arguments
    (True: a flag, False/None: left out)."""
    argv = [python, "-m", "cudahook.sim", "workload", "--tag", tag]
    for key, value in opts.items():
        flag = "--" + key.replace("_", "-")
        if value is True:
            argv.append(flag)
        elif value not in (False, None):
            argv += [flag, str(value)]
    return argv


def wait_for(cond: Callable[[], bool], timeout: float, message: str) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        if time.monotonic() > deadline:
            raise TimeoutError(message)
        time.sleep(0.02)
