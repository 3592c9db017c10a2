#!/usr/bin/env python3
"""Small real CUDA workloads for checking checkpoint/restore on a real GPU.

    python3 tests/gpu/workloads.py memory --status FILE [--gib 2]
    python3 tests/gpu/workloads.py busy   --status FILE [--kernel-ms 1000]
    python3 tests/gpu/workloads.py multi  --status FILE [--procs 2] [--gib 0.5]
    python3 tests/gpu/workloads.py nvml   --status FILE

`memory` holds GIB of device memory filled with a pattern that can be
regenerated from its index, advances a counter on the GPU and runs a matmul
each step, and checks the buffer against the pattern every few steps - so a
checkpoint that loses or corrupts device memory shows up as `intact: false`,
and one that loses the context as a CUDA error. `busy` is `memory` plus long
kernels kept in flight on a second stream, so a lock has in-flight work to
wait for. `multi` is a parent that never touches CUDA and spawns CUDA
children (each with its own status file, FILE with `.N` before the suffix).
`nvml` only uses NVML: it holds the device nodes open but is no CUDA process.

Status files are JSON written atomically (write + rename), so a reader never
sees half a file; the keys match the simulator's workload reports (pid,
counter, checks, intact, errors, state, gpu, time) so one checker reads both.

Standard library only at import time: `multi`'s children are started with
the spawn method, which imports this file again in each child, and the
parent must not initialise CUDA (a forked CUDA context is unusable).
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import json
import os
import signal
import sys
import time
from pathlib import Path
from typing import Any

PR_SET_PDEATHSIG = 1
# Pattern constants: values stay below 2**62 for buffers up to 2**30 int64
# elements (8 GiB), so the generator never relies on integer overflow, which
# the GPU libraries do not promise to wrap.
MULT = 2654435761
# 128 MiB of int64: bounds the temporaries of filling and verifying, so the
# process's device memory (what a checkpoint copies) stays close to --gib.
CHUNK_ELEMS = 1 << 24


class Status:
    """The status file: atomic rewrite on every change."""

    def __init__(self, path: str, **fields: Any):
        self.path = Path(path)
        self.fields: dict[str, Any] = {
            "pid": os.getpid(), "counter": 0, "checks": 0, "intact": True, "errors": [],
            "state": "starting", "started": time.time(), **fields,
        }
        self.write()

    def write(self, **changes: Any) -> None:
        self.fields.update(changes)
        self.fields["time"] = time.time()
        tmp = self.path.with_name(f".{self.path.name}.{os.getpid()}.tmp")
        tmp.write_text(json.dumps(self.fields))
        os.replace(tmp, self.path)

    def error(self, text: str) -> None:
        # Keep the file small: a workload stuck in a failure loop must not grow it.
        errs = self.fields["errors"]
        if len(errs) < 50:
            errs.append(text)
        self.write()


def die_with_parent() -> None:
    """Be killed with the process that started us, however it ends.

    A harness killed by a timeout must not leave GPU processes holding memory
    behind for the next run. (The signal fires when the parent *thread* ends,
    so harnesses start workloads from their main thread.)
    """
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGKILL)


def child_status_path(path: str, index: int) -> str:
    p = Path(path)
    return str(p.with_name(f"{p.stem}.{index}{p.suffix}"))


# -- GPU backends -------------------------------------------------------------


class TorchGpu:
    name = "torch"

    def __init__(self) -> None:
        import torch

        if not torch.cuda.is_available():
            raise RuntimeError("torch sees no CUDA device (torch.cuda.is_available() is False)")
        self.t = torch
        self.dev = torch.device("cuda", 0)
        torch.cuda.set_device(self.dev)
        props = torch.cuda.get_device_properties(self.dev)
        self.device_name = props.name
        raw = str(getattr(props, "uuid", "") or "")
        self.uuid = raw if not raw or raw.startswith("GPU-") else f"GPU-{raw}"
        self.version = f"torch {torch.__version__} (CUDA {torch.version.cuda})"
        self.side = torch.cuda.Stream()  # non-blocking: its kernels never sync the main stream

    def pattern(self, start: int, count: int, seed: int) -> Any:
        idx = self.t.arange(start, start + count, dtype=self.t.int64, device=self.dev)
        idx.mul_(MULT)
        return idx.bitwise_xor_(idx >> 17).bitwise_xor_(seed * 0x9E3779B9)

    def empty(self, count: int) -> Any:
        return self.t.empty(count, dtype=self.t.int64, device=self.dev)

    def checksum(self, buf: Any) -> int:
        # Sum of the low 20 bits: cannot overflow int64 for any buffer we hold.
        return int((buf & 0xFFFFF).sum().item())

    def trim(self) -> int:
        """Give cached temporaries back to the driver; the bytes still reserved."""
        self.t.cuda.empty_cache()
        return int(self.t.cuda.memory_reserved(self.dev))

    def mismatches(self, a: Any, b: Any) -> int:
        return int((a != b).sum().item())

    def counter(self) -> Any:
        return self.t.zeros((), dtype=self.t.int64, device=self.dev)

    def incr(self, counter: Any) -> int:
        counter.add_(1)
        return int(counter.item())  # synchronises: the step really ran on the GPU

    def matrices(self, seed: int) -> tuple[Any, Any]:
        gen = self.t.Generator().manual_seed(seed)
        a = self.t.rand((512, 512), generator=gen).to(self.dev)
        b = self.t.rand((512, 512), generator=gen).to(self.dev)
        return a, b

    def close_enough(self, x: Any, y: Any) -> bool:
        return bool(self.t.allclose(x, y, rtol=1e-4, atol=1e-3))

    def sleep_kernel(self, cycles: int) -> Any:
        """Launch a kernel spinning `cycles` GPU clocks on the side stream; its event."""
        with self.t.cuda.stream(self.side):
            self.t.cuda._sleep(int(cycles))
            ev = self.t.cuda.Event()
            ev.record(self.side)
        return ev

    def done(self, ev: Any) -> bool:
        return bool(ev.query())

    def time_sleep(self, cycles: int) -> float:
        """Seconds one sleep kernel of `cycles` takes, measured with events."""
        start, end = self.t.cuda.Event(enable_timing=True), self.t.cuda.Event(enable_timing=True)
        with self.t.cuda.stream(self.side):
            start.record(self.side)
            self.t.cuda._sleep(int(cycles))
            end.record(self.side)
        end.synchronize()
        return float(start.elapsed_time(end)) / 1000


class CupyGpu:
    name = "cupy"
    _SPIN = r"""
    extern "C" __global__ void spin(long long cycles) {
        long long t0 = clock64();
        while (clock64() - t0 < cycles) { }
    }
    """

    def __init__(self) -> None:
        import cupy

        self.cp = cupy
        if cupy.cuda.runtime.getDeviceCount() < 1:
            raise RuntimeError("CuPy sees no CUDA device")
        cupy.cuda.Device(0).use()
        props = cupy.cuda.runtime.getDeviceProperties(0)
        name = props.get("name", b"")
        self.device_name = name.decode() if isinstance(name, bytes) else str(name)
        raw = props.get("uuid", b"")
        if isinstance(raw, bytes) and len(raw) == 16:
            h = raw.hex()
            self.uuid = f"GPU-{h[:8]}-{h[8:12]}-{h[12:16]}-{h[16:20]}-{h[20:]}"
        else:
            self.uuid = ""
        self.version = f"cupy {cupy.__version__}"
        self.side = cupy.cuda.Stream(non_blocking=True)
        self._spin = cupy.RawKernel(self._SPIN, "spin")

    def pattern(self, start: int, count: int, seed: int) -> Any:
        cp = self.cp
        idx = cp.arange(start, start + count, dtype=cp.int64)
        idx *= MULT
        idx ^= idx >> 17
        idx ^= seed * 0x9E3779B9
        return idx

    def empty(self, count: int) -> Any:
        return self.cp.empty(count, dtype=self.cp.int64)

    def checksum(self, buf: Any) -> int:
        return int((buf & 0xFFFFF).sum().get())

    def trim(self) -> int:
        pool = self.cp.get_default_memory_pool()
        pool.free_all_blocks()
        return int(pool.total_bytes())

    def mismatches(self, a: Any, b: Any) -> int:
        return int((a != b).sum().get())

    def counter(self) -> Any:
        return self.cp.zeros((), dtype=self.cp.int64)

    def incr(self, counter: Any) -> int:
        counter += 1
        return int(counter.get())

    def matrices(self, seed: int) -> tuple[Any, Any]:
        rs = self.cp.random.RandomState(seed)
        return rs.rand(512, 512, dtype=self.cp.float32), rs.rand(512, 512, dtype=self.cp.float32)

    def close_enough(self, x: Any, y: Any) -> bool:
        return bool(self.cp.allclose(x, y, rtol=1e-4, atol=1e-3))

    def sleep_kernel(self, cycles: int) -> Any:
        ev = self.cp.cuda.Event(disable_timing=True)
        with self.side:
            self._spin((1,), (1,), (self.cp.int64(cycles),))
            ev.record(self.side)
        return ev

    def done(self, ev: Any) -> bool:
        return bool(ev.done)

    def time_sleep(self, cycles: int) -> float:
        start, end = self.cp.cuda.Event(), self.cp.cuda.Event()
        with self.side:
            start.record(self.side)
            self._spin((1,), (1,), (self.cp.int64(cycles),))
            end.record(self.side)
        end.synchronize()
        return float(self.cp.cuda.get_elapsed_time(start, end)) / 1000


def open_gpu() -> TorchGpu | CupyGpu:
    """PyTorch, else CuPy; fail loudly, naming both reasons, when neither has a GPU."""
    reasons = []
    for cls in (TorchGpu, CupyGpu):
        try:
            return cls()
        except Exception as exc:  # ImportError, or the library's own CUDA error types
            reasons.append(f"{cls.name}: {type(exc).__name__}: {exc}")
    raise RuntimeError("no usable CUDA device: " + "; ".join(reasons))


# -- workloads ------------------------------------------------------------------


def run_memory(status_path: str, gib: float, seed: int, interval_ms: float, check_every: int,
               kernel_ms: float, kind: str) -> int:
    status = Status(status_path, kind=kind, gib=gib, seed=seed)
    try:
        gpu = open_gpu()
    except RuntimeError as exc:
        status.write(state="failed")
        status.error(str(exc))
        print(f"workloads.py {kind}: {exc}", file=sys.stderr)
        return 2
    count = max(1, int(gib * (1 << 30)) // 8)
    chunks = [(s, min(CHUNK_ELEMS, count - s)) for s in range(0, count, CHUNK_ELEMS)]
    buf = gpu.empty(count)
    for start, n in chunks:
        buf[start:start + n] = gpu.pattern(start, n, seed)

    def checksum() -> int:
        return sum(gpu.checksum(buf[s:s + n]) for s, n in chunks)

    checksum_start = checksum()
    a, b = gpu.matrices(seed)
    product = a @ b
    counter = gpu.counter()

    cycles = 0
    inflight: list[Any] = []
    if kernel_ms > 0:
        # Calibrate the spin kernel: the GPU clock is not known in advance.
        probe = 10_000_000
        per_s = probe / max(gpu.time_sleep(probe), 1e-6)
        cycles = int(per_s * kernel_ms / 1000)

    status.write(state="running", backend=gpu.version, device=gpu.device_name, gpu=gpu.uuid,
                 bytes=count * 8, checksum_start=checksum_start, checksum=checksum_start,
                 kernel_cycles=cycles, reserved=gpu.trim())
    last = 0
    step = 0
    while True:
        try:
            if cycles:
                # Keep two long kernels queued, so some GPU work is always in flight.
                inflight = [ev for ev in inflight if not gpu.done(ev)]
                while len(inflight) < 2:
                    inflight.append(gpu.sleep_kernel(cycles))
            product = a @ b
            value = gpu.incr(counter)
            if value != last + 1:
                status.error(f"counter jumped from {last} to {value}")
            last = value
            step += 1
            changes: dict[str, Any] = {"counter": value, "state": "running"}
            if step % check_every == 0:
                bad = sum(gpu.mismatches(buf[s:s + n], gpu.pattern(s, n, seed)) for s, n in chunks)
                total = checksum()
                ok = bad == 0 and total == checksum_start and gpu.close_enough(product, a @ b)
                if not ok:
                    status.fields["intact"] = False
                    status.error(f"device memory changed: {bad} words differ, "
                                 f"checksum {total} != {checksum_start}")
                changes.update(checks=status.fields["checks"] + 1, checksum=total,
                               mismatches=bad, last_check=time.time(), reserved=gpu.trim())
            status.write(**changes)
        except Exception as exc:  # any CUDA error: the context or its memory is gone
            status.fields["intact"] = False
            status.write(state="lost")
            status.error(f"GPU work failed: {type(exc).__name__}: {exc}")
            print(f"workloads.py {kind}: GPU work failed: {exc}", file=sys.stderr)
            # Stay alive and visible: the checker reads the failure from the status file.
            while True:
                time.sleep(3600)
        time.sleep(interval_ms / 1000)


def _child(status_path: str, gib: float, seed: int, interval_ms: float, check_every: int) -> None:
    die_with_parent()
    sys.exit(run_memory(status_path, gib, seed, interval_ms, check_every, 0.0, "multi-child"))


def run_multi(status_path: str, procs: int, gib: float, seed: int, interval_ms: float,
              check_every: int) -> int:
    import multiprocessing

    # spawn, never fork: the children must start without any inherited CUDA state.
    ctx = multiprocessing.get_context("spawn")
    paths = [child_status_path(status_path, i) for i in range(procs)]
    children = [
        ctx.Process(target=_child, args=(p, gib, seed + i + 1, interval_ms, check_every),
                    name=f"cuda-child-{i}")
        for i, p in enumerate(paths)
    ]
    for c in children:
        c.start()
    status = Status(status_path, kind="multi", children=[c.pid for c in children],
                    child_status=paths, state="running")

    def stop(*_: Any) -> None:
        for c in children:
            with contextlib.suppress(ProcessLookupError, TypeError):
                os.kill(c.pid, signal.SIGKILL)  # type: ignore[arg-type]
        os._exit(0)

    signal.signal(signal.SIGTERM, stop)
    n = 0
    while True:
        dead = [c for c in children if not c.is_alive()]
        if dead:
            status.write(state="failed")
            status.error(f"child {dead[0].pid} exited with {dead[0].exitcode}")
            for c in children:
                c.kill()
            return 1
        n += 1
        status.write(counter=n)
        time.sleep(0.2)


def run_nvml(status_path: str, interval_ms: float) -> int:
    status = Status(status_path, kind="nvml")
    try:
        import pynvml

        pynvml.nvmlInit()
        handles = [pynvml.nvmlDeviceGetHandleByIndex(i) for i in range(pynvml.nvmlDeviceGetCount())]
        if not handles:
            raise RuntimeError("NVML reports no GPU")
        driver = pynvml.nvmlSystemGetDriverVersion()
    except Exception as exc:  # ImportError or pynvml.NVMLError
        status.write(state="failed")
        status.error(f"NVML unavailable: {type(exc).__name__}: {exc}")
        print(f"workloads.py nvml: {exc}", file=sys.stderr)
        return 2
    status.write(state="running", driver=str(driver), gpus=len(handles))
    n = 0
    while True:
        try:
            used = [int(pynvml.nvmlDeviceGetMemoryInfo(h).used) for h in handles]
            apps = sum(len(pynvml.nvmlDeviceGetComputeRunningProcesses(h)) for h in handles)
            n += 1
            status.write(counter=n, memory_used=used, compute_apps=apps)
        except Exception as exc:
            status.error(f"NVML query failed: {type(exc).__name__}: {exc}")
        time.sleep(interval_ms / 1000)


def parse(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="workloads.py", description=__doc__.split("\n\n")[0])
    p.add_argument("kind", choices=["memory", "busy", "multi", "nvml"])
    p.add_argument("--status", required=True, help="JSON status file (rewritten atomically)")
    p.add_argument("--gib", type=float, default=None,
                   help="device memory per CUDA process (default 2; multi 0.5; busy 0.25)")
    p.add_argument("--procs", type=int, default=2, help="multi: number of CUDA children")
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--interval-ms", type=float, default=50.0)
    p.add_argument("--check-every", type=int, default=10, help="verify memory every N steps")
    p.add_argument("--kernel-ms", type=float, default=1000.0, help="busy: length of each long kernel")
    p.add_argument("--no-die-with-parent", action="store_true")
    return p.parse_args(argv)


def main(argv: list[str]) -> int:
    args = parse(argv)
    if not args.no_die_with_parent:
        die_with_parent()
    signal.signal(signal.SIGTERM, lambda *_: os._exit(0))
    if args.kind == "nvml":
        return run_nvml(args.status, args.interval_ms)
    if args.kind == "multi":
        gib = 0.5 if args.gib is None else args.gib
        return run_multi(args.status, args.procs, gib, args.seed, args.interval_ms, args.check_every)
    if args.kind == "busy":
        gib = 0.25 if args.gib is None else args.gib
        return run_memory(args.status, gib, args.seed, args.interval_ms, args.check_every,
                          args.kernel_ms, "busy")
    gib = 2.0 if args.gib is None else args.gib
    return run_memory(args.status, gib, args.seed, args.interval_ms, args.check_every, 0.0, "memory")


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
