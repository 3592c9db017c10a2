"""What the real-GPU checks share: finding the real tools, starting workloads,
and reading from outside what a process holds on the GPU.

A `Rig` is either the real node (NVIDIA's `cuda-checkpoint`, `nvidia-smi`,
and `workloads.py` on PyTorch/CuPy) or the project's simulator standing in
for all three. The checks are written once against the rig, so their logic
is exercised on machines without a GPU and only the facts differ on one.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from cudahook.core.backends.cli import CudaCheckpointCLI
from cudahook.core.engine import Engine
from cudahook.platform.config import Settings
from cudahook.platform.host import Host

REPO_ROOT = Path(__file__).resolve().parents[2]
WORKLOADS = Path(__file__).resolve().with_name("workloads.py")
ENV_TOOL = "CUDAHOOK_REAL_CUDA_CHECKPOINT"
ENV_PYTHON = "CUDAHOOK_GPU_PYTHON"  # the interpreter that has PyTorch/CuPy
ENV_SIM = "CUDAHOOK_GPU_TEST_SIM"  # "1": run the checks against the simulator
# A UUID no GPU has: for restores that must fail on an unknown target.
NULL_UUID = "GPU-00000000-0000-0000-0000-000000000000"

# Where the driver packages, the NVIDIA container toolkit and a carried-in
# copy of NVIDIA's public binary put the tool.
TOOL_LOCATIONS = (
    "/usr/bin/cuda-checkpoint",
    "/usr/local/bin/cuda-checkpoint",
    "/usr/local/nvidia/bin/cuda-checkpoint",
    "/usr/local/cuda/bin/cuda-checkpoint",
    str(REPO_ROOT / ".gpu-carry" / "cuda-checkpoint"),
    str(REPO_ROOT / ".gpu-carry" / "bin" / "x86_64_Linux" / "cuda-checkpoint"),
)
SMI_LOCATIONS = ("/usr/bin/nvidia-smi", "/usr/local/nvidia/bin/nvidia-smi")


def is_elf(path: str) -> bool:
    """The real tool is a native binary; the simulator's is a Python script."""
    try:
        with open(path, "rb") as f:
            return f.read(4) == b"\x7fELF"
    except OSError:
        return False


def find_cuda_checkpoint() -> tuple[str | None, str]:
    """(path of a real, executable cuda-checkpoint, or None; what was looked at)."""
    looked: list[str] = []
    env = os.environ.get(ENV_TOOL)
    candidates = [env] if env else []
    on_path = shutil.which("cuda-checkpoint")
    if on_path:
        candidates.append(on_path)
    candidates += TOOL_LOCATIONS
    for cand in candidates:
        if not os.path.exists(cand):
            looked.append(f"{cand}: absent")
        elif not is_elf(cand):
            looked.append(f"{cand}: not a native binary (the simulator?)")
        elif not os.access(cand, os.X_OK):
            looked.append(f"{cand}: not executable")
        else:
            return cand, ""
    return None, "; ".join(looked)


def find_nvidia_smi() -> str | None:
    found = shutil.which("nvidia-smi")
    if found:
        return found
    return next((p for p in SMI_LOCATIONS if os.access(p, os.X_OK)), None)


def gpu_present() -> tuple[bool, str]:
    smi = find_nvidia_smi()
    if not smi:
        return False, "no nvidia-smi"
    try:
        out = subprocess.run([smi, "-L"], capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired) as exc:
        return False, f"nvidia-smi -L failed: {exc}"
    if out.returncode != 0 or "GPU " not in out.stdout:
        return False, f"nvidia-smi -L: exit {out.returncode}: {(out.stderr or out.stdout).strip()[:200]}"
    return True, out.stdout.strip()


def real_gpu_skip_reason() -> str | None:
    """Why the real-GPU checks cannot run here, or None when they can."""
    ok, why = gpu_present()
    if not ok:
        return f"no NVIDIA GPU ({why})"
    tool, looked = find_cuda_checkpoint()
    if tool is None:
        return f"no real cuda-checkpoint (set ${ENV_TOOL}; looked at: {looked})"
    return None


def workload_python() -> str:
    return os.environ.get(ENV_PYTHON) or sys.executable


def wait_for(cond: Callable[[], bool], timeout: float, message: Callable[[], str] | str,
             interval: float = 0.1) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        if time.monotonic() > deadline:
            raise TimeoutError(message() if callable(message) else message)
        time.sleep(interval)


# -- what a process holds -------------------------------------------------------


def device_fds(pid: int, pattern: re.Pattern[str]) -> list[str]:
    """The NVIDIA device nodes the process has open, read from /proc/PID/fd."""
    found = []
    fd_dir = f"/proc/{pid}/fd"
    for name in os.listdir(fd_dir):
        try:
            target = os.readlink(f"{fd_dir}/{name}")
        except OSError:
            continue
        if pattern.search(target):
            found.append(target)
    return sorted(found)


def compute_apps(smi: str, timeout: float = 30) -> tuple[dict[int, int] | None, str]:
    """{pid: used MiB} of the GPU's compute processes, and nvidia-smi's raw output.

    None when nvidia-smi fails. Memory may read "[N/A]" (e.g. in some
    virtualised setups); such a process counts with -1 MiB.
    """
    argv = [smi, "--query-compute-apps=pid,used_memory", "--format=csv,noheader,nounits"]
    try:
        out = subprocess.run(argv, capture_output=True, text=True, timeout=timeout)
    except (OSError, subprocess.TimeoutExpired) as exc:
        return None, str(exc)
    raw = out.stdout + out.stderr
    if out.returncode != 0:
        return None, raw
    apps: dict[int, int] = {}
    for line in out.stdout.splitlines():
        cols = [c.strip() for c in line.split(",")]
        if len(cols) < 2 or not cols[0].isdigit():
            continue
        apps[int(cols[0])] = int(cols[1]) if cols[1].isdigit() else -1
    return apps, raw


def gpu_rows(smi: str) -> tuple[list[dict[str, str]], str]:
    """nvidia-smi's GPU rows (the fields cudahook.core.gpus reads) and the raw text."""
    names = ["index", "uuid", "name", "memory.total", "driver_version", "persistence_mode"]
    argv = [smi, f"--query-gpu={','.join(names)}", "--format=csv,noheader,nounits"]
    out = subprocess.run(argv, capture_output=True, text=True, timeout=30)
    rows = []
    for line in out.stdout.splitlines():
        cols = [c.strip() for c in line.split(",")]
        if len(cols) == len(names):
            rows.append(dict(zip(names, cols, strict=True)))
    return rows, out.stdout + out.stderr


def pid_alive(pid: int) -> bool:
    """Exists and is no zombie."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            stat = f.read()
    except OSError:
        return False
    return stat[stat.rindex(")") + 2] not in "ZX"


def unused_pid() -> int:
    """A PID no process has now (probed from the top of the PID range down)."""
    try:
        top = int(Path("/proc/sys/kernel/pid_max").read_text()) - 1
    except (OSError, ValueError):
        top = 32767
    pid = top
    while os.path.exists(f"/proc/{pid}"):
        pid -= 1
    return pid


# -- workloads ---------------------------------------------------------------------


@dataclass
class Workload:
    """A started workload: its root process and one status file per process to watch."""

    name: str
    kind: str
    proc: subprocess.Popen[bytes]
    status_paths: list[Path]
    log: Path | None = None

    @property
    def pid(self) -> int:
        return self.proc.pid

    def statuses(self) -> list[dict[str, Any]]:
        out = []
        for path in self.status_paths:
            try:
                out.append(json.loads(path.read_text()))
            except (OSError, ValueError):
                out.append({})
        return out

    def pids(self) -> list[int]:
        """PIDs of the processes that use the GPU (the CUDA ones, or the NVML one)."""
        return [int(s["pid"]) for s in self.statuses() if "pid" in s]

    def counters(self) -> list[int]:
        return [int(s.get("counter", 0)) for s in self.statuses()]

    def log_tail(self, n: int = 2000) -> str:
        if self.log is None:
            return ""
        try:
            return self.log.read_text(errors="replace")[-n:]
        except OSError:
            return ""

    def describe(self) -> str:
        return f"{self.name}: exit={self.proc.poll()} status={self.statuses()} log={self.log_tail()!r}"

    def ready(self) -> bool:
        if self.proc.poll() is not None:
            raise RuntimeError(f"workload {self.describe()} exited")
        sts = self.statuses()
        for s in sts:
            if s.get("state") in ("failed", "lost") or s.get("intact") is False:
                raise RuntimeError(f"workload {self.describe()} failed")
        return all(s.get("counter", 0) > 0 for s in sts)

    def wait_ready(self, timeout: float) -> None:
        wait_for(self.ready, timeout, lambda: f"workload did not start in {timeout}s: {self.describe()}",
                 interval=0.25)

    def wait_progress(self, since: list[int], steps: int = 2, timeout: float = 60) -> list[int]:
        """Wait until every process's counter moved `steps` past `since`; the counters."""
        def moved() -> bool:
            now = self.counters()
            return len(now) == len(since) and all(n >= s + steps for n, s in zip(now, since, strict=True))

        wait_for(moved, timeout, lambda: f"no progress past {since}: {self.describe()}", interval=0.1)
        return self.counters()

    def kill(self) -> None:
        if self.proc.poll() is None:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(self.proc.pid, signal.SIGKILL)
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.proc.wait(timeout=10)
        # Children of the root that left its process group (none should) die
        # through their parent-death signal.
        for pid in self.pids():
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.kill(pid, signal.SIGKILL)


@dataclass
class Rig:
    """The node the checks run on: real tools and workloads, or the simulator."""

    sim: bool
    tool: str
    smi: str
    settings: Settings
    workdir: Path
    lab: Any = None  # cudahook.sim.lab.SimLab when sim
    workloads: list[Workload] = field(default_factory=list)
    plain: list[subprocess.Popen[bytes]] = field(default_factory=list)

    @classmethod
    def real(cls, tool: str, workdir: Path | None = None, *, call_timeout_s: float = 60.0) -> Rig:
        smi = find_nvidia_smi() or "nvidia-smi"
        wd = workdir or Path(tempfile.mkdtemp(prefix="cudahook-gpu-"))
        settings = Settings(
            cuda_checkpoint=tool, nvidia_smi=smi, call_timeout_s=call_timeout_s,
            lock_timeout_ms=10000, state_dir=str(wd / "state"), log_file=str(wd / "cudahook.log"),
        )
        return cls(False, tool, smi, settings, wd)

    @classmethod
    def simulated(cls, workdir: Path | None = None, *, root: Path | None = None,
                  call_timeout_s: float = 30.0, driver: int = 580) -> Rig:
        """A simulated one-GPU node (R580 like the real machine) at `root` or in workdir."""
        from cudahook.sim.lab import SimLab

        wd = workdir or Path(tempfile.mkdtemp(prefix="cudahook-gpu-sim-"))
        lab = SimLab(root or wd / "node", driver=driver, gpus=1).start()
        settings = lab.settings(call_timeout_s=call_timeout_s)
        return cls(True, str(lab.cuda_checkpoint), str(lab.nvidia_smi), settings, wd, lab=lab)

    @property
    def device_regex(self) -> re.Pattern[str]:
        return self.settings.device_regex

    def engine(self, **overrides: Any) -> Engine:
        settings = self.settings.with_overrides(**overrides) if overrides else self.settings
        host = Host()
        return Engine(CudaCheckpointCLI(host, settings), settings, host)

    def spawn(self, name: str, kind: str, gib: float | None = None,
              launch: list[str] | None = None, **opts: Any) -> Workload:
        """Start a workload. Call from the main thread: see workloads.die_with_parent.

        `launch`: a command line the workload's runs under, e.g.
        `[cuda-checkpoint, "--launch-job", FILE]` for an R590 job member."""
        start = self._spawn_sim if self.sim else self._spawn_real
        wl = start(name, kind, gib, launch or [], **opts)
        self.workloads.append(wl)
        return wl

    def _spawn_real(self, name: str, kind: str, gib: float | None, launch: list[str],
                    **opts: Any) -> Workload:
        status = self.workdir / f"{name}.json"
        log = self.workdir / f"{name}.log"
        argv = [*launch, workload_python(), str(WORKLOADS), kind, "--status", str(status)]
        if gib is not None:
            argv += ["--gib", str(gib)]
        for key, value in opts.items():
            argv += [f"--{key.replace('_', '-')}", str(value)]
        with open(log, "wb") as out:
            proc = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=out, stderr=out,
                                    start_new_session=True, env={**os.environ, "PYTHONUNBUFFERED": "1"})
        if kind == "multi":
            procs = int(opts.get("procs", 2))
            paths = [status.with_name(f"{status.stem}.{i}{status.suffix}") for i in range(procs)]
        else:
            paths = [status]
        return Workload(name, kind, proc, paths, log)

    def _spawn_sim(self, name: str, kind: str, gib: float | None, launch: list[str],
                   **opts: Any) -> Workload:
        # The simulator moves bytes through sockets: scale GiB down to MiB.
        mib = max(4, int((gib if gib is not None else 1.0) * 16))
        if launch:
            proc = subprocess.Popen([*launch, *self.lab.workload_argv(name, mib=mib)],
                                    env=self.lab.workload_env(), stdin=subprocess.DEVNULL,
                                    stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                                    start_new_session=True)
        elif kind == "memory":
            proc = self.lab.spawn(name, mib=mib)
        elif kind == "busy":
            # Near back-to-back long kernels, as workloads.py's busy keeps queued.
            kernel_ms = float(opts.get("kernel_ms", 1000))
            proc = self.lab.spawn(name, mib=mib, kernel_ms=kernel_ms, interval_ms=1)
        elif kind == "multi":
            procs = int(opts.get("procs", 2))
            proc = self.lab.spawn(name, mib=mib, procs=procs)
            return Workload(name, kind, proc,
                            [self.lab.status_dir / f"{name}.{i}.json" for i in range(procs)])
        elif kind == "nvml":
            proc = self.lab.spawn(name, nvml_only=True)
        else:
            raise ValueError(f"unknown workload kind {kind!r}")
        return Workload(name, kind, proc, [self.lab.status_dir / f"{name}.json"])

    def spawn_plain(self, argv: list[str]) -> subprocess.Popen[bytes]:
        """A process that is neither CUDA nor NVML (e.g. `sleep`)."""
        proc = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                                stderr=subprocess.DEVNULL, start_new_session=True)
        self.plain.append(proc)
        return proc

    def gpu_uuids(self) -> list[str]:
        rows, _ = gpu_rows(self.smi)
        return [r["uuid"] for r in rows]

    def gpu_of(self, wl: Workload) -> str:
        """The UUID of the GPU a workload runs on, in nvidia-smi's (and the tool's) form.

        The workload reports what its CUDA library says; when that is not one
        of nvidia-smi's UUIDs (another spelling), the first GPU is the one
        it uses: workloads always take device 0.
        """
        uuids = self.gpu_uuids()
        reported = str(wl.statuses()[0].get("gpu") or "")
        if reported in uuids or not uuids:
            return reported
        return uuids[0]

    def close(self) -> None:
        for wl in self.workloads:
            wl.kill()
        for p in self.plain:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(p.pid, signal.SIGKILL)
            with contextlib.suppress(subprocess.TimeoutExpired):
                p.wait(timeout=10)
        if self.lab is not None:
            self.lab.stop()


# -- custom storage (CUDA 13.4+) ---------------------------------------------------


def custom_storage_probe(rig: Rig, start: Callable[[], Workload], where: Path,
                         timeout: float = 120.0) -> dict[str, Any]:
    """GPU memory straight to storage on this node, measured once.

    Whether the driver has CUDA 13.4's custom storage (the driver-API helper
    asks cuGetProcAddress for cuCheckpointOperationComplete at 13040), with
    the driver and CUDA versions; if it does, the workload `start` gives
    (started only then) has its first process locked, checkpointed into
    chunk files under `where` and restored from them, and the result says
    how many bytes went each way in how long (GB/s for its GPU), the state
    between, and whether the process then computed
    on with its memory check passing. Whatever fails on the way, the process
    is put back to running before this returns. `supported` False, with
    `why`, is an answer, not an error."""
    from cudahook.core.backends.driver_api import DriverAPI

    settings = rig.settings.with_overrides(call_timeout_s=max(rig.settings.call_timeout_s, timeout))
    api = DriverAPI(Host(), settings)
    out: dict[str, Any] = {"supported": False, "why": "", "driver": None, "cuda_version": None,
                           "libcuda": settings.libcuda}
    try:
        features = api.probe()
        hello = getattr(api._helper, "hello", None) or {}  # the helper's answer at attach
        out.update(supported=bool(features.custom_storage), why=features.custom_storage_why,
                   driver=features.version, cuda_version=hello.get("cuda_version"))
        if not features.custom_storage:
            return out
        wl = start()
        pid = wl.pids()[0]
        gpu = rig.gpu_of(wl)
        before = wl.counters()
        checks = [int(s.get("checks", 0)) for s in wl.statuses()]
        where.mkdir(parents=True, exist_ok=True)
        directory = where / str(pid)
        api.lock(pid, settings.lock_timeout_ms)
        try:
            t0 = time.perf_counter()
            done = api.checkpoint_to_storage(pid, str(directory))
            ckpt_s = time.perf_counter() - t0
            out["state_after_checkpoint"] = api.get_state(pid)
            files = sorted(p.name for p in directory.iterdir())
            t0 = time.perf_counter()
            api.restore_from_storage(pid, str(directory))
            restore_s = time.perf_counter() - t0
            out["state_after_restore"] = api.get_state(pid)
            api.unlock(pid)
        finally:
            out["put_back"] = _back_to_running(api, pid, directory)
        size = int(done.get("bytes", 0))
        out["chunks"] = len([f for f in files if f.endswith(".chunk")])
        out["per_gpu"] = {gpu: {
            "bytes": size, "ranges": done.get("ranges"),
            "checkpoint_s": round(ckpt_s, 4), "restore_s": round(restore_s, 4),
            "checkpoint_gb_s": round(size / ckpt_s / 1e9, 3) if ckpt_s else None,
            "restore_gb_s": round(size / restore_s / 1e9, 3) if restore_s else None}}
        wl.wait_progress(before, steps=3, timeout=timeout)
        wait_for(lambda: all(int(s.get("checks", 0)) > c
                             for s, c in zip(wl.statuses(), checks, strict=True)),
                 timeout, lambda: f"no memory check since the restore: {wl.describe()}")
        st = wl.statuses()[0]
        out["intact"] = st.get("intact") is True and not st.get("errors")
        out["status_after"] = st
        return out
    finally:
        api.close()


def _back_to_running(api: Any, pid: int, directory: Path) -> list[str]:
    """Bring a probed process back whatever state it was left in; what was done."""
    done: list[str] = []
    for _ in range(3):
        try:
            state = api.get_state(pid)
        except Exception as exc:
            done.append(f"get-state: {exc}")
            return done
        try:
            if state == "checkpointed":
                if (directory / "manifest.json").exists():
                    api.restore_from_storage(pid, str(directory))
                else:
                    api.restore(pid)
            elif state == "locked":
                api.unlock(pid)
            else:
                return done
            done.append(f"from {state}")
        except Exception as exc:
            done.append(f"from {state}: {exc}")
    return done
