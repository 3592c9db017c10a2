"""A simulated CUDA program: computes on the GPU, checks its memory, reports.

Each process holds N MiB of device memory with known content and a counter
on the GPU that a "kernel" advances. It checks that the counter only ever
moves by one and that the memory still has its known content, and writes
what it sees to a status file, so a test can tell "restored intact" from
"restored but its GPU memory is gone" from outside the container.
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import hashlib
import json
import mmap
import os
import signal
import sys
import time
from pathlib import Path
from typing import Any

from .protocol import CONTENTS, CudaError, pattern
from .runtime import GpuLost, SimCuda

PR_SET_PDEATHSIG = 1


def parse(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="cudahook-sim workload")
    p.add_argument("--socket", default=os.environ.get("CUDA_SIM_SOCKET", "/run/cuda-sim/gpu.sock"))
    p.add_argument("--gpu", default=os.environ.get("CUDA_SIM_GPU", _first_visible()),
                   help="GPU UUID, or an index into the service's GPUs (default: the first "
                   "of NVIDIA_VISIBLE_DEVICES, else 0)")
    p.add_argument("--mib", type=int, default=16, help="device memory to hold (MiB)")
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--content", choices=CONTENTS, default="pattern",
                   help="what the device buffer holds: one 4 KiB block repeated, or random "
                   "bytes throughout")
    p.add_argument("--same-weights", action="store_true",
                   help="every forked worker holds the same buffer content (one model "
                   "loaded by several processes), not a seed of its own")
    p.add_argument("--tag", default=os.environ.get("CUDA_SIM_TAG", "workload"))
    p.add_argument("--status-dir", default=os.environ.get("CUDA_SIM_STATUS_DIR", ""))
    p.add_argument("--dev-dir", default=os.environ.get("CUDA_SIM_DEV_DIR", "/dev"))
    p.add_argument("--ctl-dir", default=os.environ.get("CUDA_SIM_CTL_DIR", "/dev/shm"))
    p.add_argument("--interval-ms", type=float, default=20.0)
    p.add_argument("--kernel-ms", type=float, default=0.0, help="duration of each kernel")
    p.add_argument("--check-every", type=int, default=10, help="memory check period (steps)")
    p.add_argument("--check-after-restore", action="store_true",
                   help="also check memory at the first step after each restore")
    p.add_argument("--procs", type=int, default=1, help="CUDA processes (forked workers)")
    p.add_argument("--vmm", action="store_true",
                   help="run the CUDA VMM interposer shim and hold VMM mappings")
    p.add_argument("--vmm-kib", type=int, default=64)
    p.add_argument("--vmm-dir", default=os.environ.get("CUDA_SIM_VMM_DIR", "/snapshot-control"))
    p.add_argument("--vmm-decoy", choices=("symlink", "fifo", "file"),
                   help="put this at the shim's socket path instead of a socket")
    p.add_argument("--nvml", action="store_true",
                   help="also hold NVML handles on the device nodes for life, as PyTorch and "
                   "NCCL do: a CUDA checkpoint does not release them")
    p.add_argument("--nvml-only", action="store_true",
                   help="open the device nodes like an NVML monitor, never init CUDA")
    return p.parse_args(argv)


def _first_visible() -> str:
    # As in a container set up by nvidia-container-toolkit: CUDA sees these GPUs.
    visible = os.environ.get("NVIDIA_VISIBLE_DEVICES", "")
    first = visible.split(",")[0].strip()
    return "" if first in ("all", "none", "void") else first


class Reporter:
    def __init__(self, status_dir: str, tag: str):
        self.path = Path(status_dir, f"{tag}.json") if status_dir else None
        self.fields: dict[str, Any] = {"tag": tag, "pid": os.getpid(), "errors": []}

    def write(self, **changes: Any) -> None:
        self.fields.update(changes)
        self.fields["time"] = time.time()
        if self.path is None:
            return
        # open-write-close and rename: no fd on the host directory stays open
        # across a checkpoint, which CRIU could not dump.
        tmp = self.path.with_name(f".{self.path.name}.{os.getpid()}")
        tmp.write_text(json.dumps(self.fields))
        os.replace(tmp, self.path)

    def error(self, text: str) -> None:
        self.fields["errors"].append(text)
        self.write()


def resolve_gpu(cuda_socket: str, gpu: str) -> str:
    if gpu.startswith("GPU-"):
        return gpu
    from .protocol import Channel, connect_unix

    chan = Channel(connect_unix(cuda_socket))
    try:
        reply, _ = chan.call({"op": "info"})
    finally:
        chan.close()
    return str(reply["gpus"][int(gpu or 0)]["uuid"])


def run_nvml(args: argparse.Namespace, rep: Reporter) -> None:
    fds = [os.open(os.path.join(args.dev_dir, n), os.O_RDWR)
           for n in ("nvidiactl", "nvidia0") if os.path.exists(os.path.join(args.dev_dir, n))]
    rep.write(mode="nvml", state="running", device_fds=len(fds), counter=0)
    n = 0
    while True:
        time.sleep(args.interval_ms / 1000)
        n += 1
        rep.write(counter=n)


def _map_nvml_library(socket_path: str) -> mmap.mmap | None:
    path = os.path.join(os.path.dirname(socket_path), "lib", "libnvidia-ml.so.1")
    try:
        with open(path, "rb") as f:
            return mmap.mmap(f.fileno(), 0, prot=mmap.PROT_READ)
    except (OSError, ValueError):
        return None


def run_cuda(args: argparse.Namespace, rep: Reporter) -> None:
    size = args.mib << 20
    expected = hashlib.sha256(pattern(args.seed, size, args.content)).hexdigest()
    cuda = SimCuda(args.socket, resolve_gpu(args.socket, args.gpu), args.dev_dir, args.ctl_dir,
                   tag=args.tag)
    cuda.init()
    nvml, nvml_lib = [], None
    if args.nvml:
        # nvmlInit opens the control node and each GPU's node itself, apart
        # from CUDA's context; the checkpoint only releases CUDA's.
        nvml = [os.open(os.path.join(args.dev_dir, n), os.O_RDWR | os.O_CLOEXEC)
                for n in ("nvidiactl", f"nvidia{cuda.index}")
                if os.path.exists(os.path.join(args.dev_dir, n))]
        # And the library shows in its mappings, as libnvidia-ml.so.1 does
        # in a process that called nvmlInit (the node's copy beside gpu.sock).
        nvml_lib = _map_nvml_library(args.socket)
    cuda.alloc("data", size, seed=args.seed, content=args.content)
    cuda.alloc("counter", 8)
    vmm_expected = None
    if args.vmm or args.vmm_decoy:
        size = args.vmm_kib << 10
        cuda.alloc("vmm", size, seed=args.seed + 1000, vmm=True)
        vmm_expected = hashlib.sha256(pattern(args.seed + 1000, size)).hexdigest()
        start_shim(cuda, args)
    rep.write(mode="cuda", state="running", counter=0, checks=0, intact=True,
              gpu=cuda.gpu_uuid, mib=args.mib, restore_tid=cuda.restore_tid, nvml_fds=len(nvml),
              nvml_mapped=nvml_lib is not None)
    last = 0
    step = 0
    restores = cuda.restores
    while True:
        try:
            value = cuda.incr("counter", args.kernel_ms / 1000)
            if value != last + 1:
                rep.error(f"counter jumped from {last} to {value}")
            last = value
            step += 1
            restored, restores = cuda.restores != restores, cuda.restores
            if step % args.check_every == 0 or (args.check_after_restore and restored):
                if cuda.digest("data") != expected:
                    rep.fields["intact"] = False
                    rep.error("device memory content changed")
                if vmm_expected and cuda.digest("vmm") != vmm_expected:
                    rep.fields["intact"] = False
                    rep.error("VMM mapping content changed")
                rep.fields["checks"] = rep.fields.get("checks", 0) + 1
                rep.fields["checked_restores"] = restores  # memory checked since the last
            rep.write(counter=value, gpu=cuda.gpu_uuid, state="running", restores=restores)
        except (GpuLost, CudaError) as exc:
            rep.fields["intact"] = False
            rep.write(state="lost")
            rep.error(f"GPU work failed: {exc}")
            while True:  # a real program would crash or hang here; stay visible
                time.sleep(3600)
        time.sleep(args.interval_ms / 1000)


SHIM_LIBRARY = Path(__file__).resolve().parent / "interposer" / "libcuda-vmm-interposer.so"
_shim_maps: list[mmap.mmap] = []


def load_shim_library() -> None:
    """Map the shim's library file, as the dynamic linker maps an LD_PRELOAD
    shim: it then shows in /proc/PID/maps, whatever becomes of the socket."""
    with open(SHIM_LIBRARY, "rb") as f:
        _shim_maps.append(mmap.mmap(f.fileno(), 0, prot=mmap.PROT_READ))


def start_shim(cuda: SimCuda, args: argparse.Namespace) -> None:
    load_shim_library()
    path = os.path.join(args.vmm_dir, f"cuda-vmm-{os.getpid()}.sock")
    if args.vmm_decoy == "symlink":
        # Points at a real socket elsewhere: following it would reach the GPU service.
        os.symlink(cuda.gpu_socket, path)
    elif args.vmm_decoy == "fifo":
        os.mkfifo(path)
    elif args.vmm_decoy == "file":
        Path(path).write_text("not a socket\n")
    else:
        cuda.serve_vmm(path)


def main(argv: list[str]) -> int:
    args = parse(argv)
    children = []
    for i in range(1, max(1, args.procs)):
        pid = os.fork()
        if pid == 0:
            ctypes.CDLL(None).prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
            args.tag = f"{args.tag}.{i}"
            if not args.same_weights:
                args.seed += i
            break
        children.append(pid)
    else:
        if args.procs > 1:
            args.tag = f"{args.tag}.0"
    signal.signal(signal.SIGTERM, lambda *_: _exit(children))
    rep = Reporter(args.status_dir, args.tag)
    try:
        if args.nvml_only:
            run_nvml(args, rep)
        else:
            run_cuda(args, rep)
    except (OSError, CudaError, GpuLost) as exc:
        rep.write(state="failed")
        rep.error(f"start failed: {exc}")
        print(f"cudahook-sim workload: {exc}", file=sys.stderr)
        return 1
    return 0


def _exit(children: list[int]) -> None:
    for pid in children:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
    os._exit(0)
