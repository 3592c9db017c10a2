"""P8: GPU memory in storage vs in host memory, through runc and CRIU: 8 GPUs.

One SimLab (a CUDA 13.4 driver: custom storage, 8 GPUs, each link at
--bandwidth MiB/s) and two runc containers, each with one process per GPU
holding --mib MiB, the driver-API backend for both:
  host        gpu_memory: host - the driver copies GPU memory into the
              processes and CRIU dumps it with their pages
  storage     the annotation cudahook.io/gpu-memory=storage - the GPU memory
              goes as checksummed chunk files into the CRIU image
Each repetition cycles both (runc checkpoint, then runc restore, fresh image
directory each time), in a rotating order; the timed figure is checkpoint +
restore wall time. Untimed after each restore: every workload ran again and
its whole device memory checked intact.

Peak host memory, sampled every 20 ms during each cycle: the container's
processes' RSS plus the host copies the simulated driver holds for them
(memfds: the real driver's copy is the process's own memory), plus the
anonymous and file RSS of each driver-API helper started on the node's libcuda (the storage path's pinned
staging buffers; not the target's device memory it maps). The
container's memory cgroup peak is noted beside it when the cgroup shows one.

The storage path against its own limit: its GPU-memory copy-out (the
checkpoint phase's checkpoint step, first start to last end over the
processes: the driver call, the chunks copied, hashed and written, fsynced,
completed; from the hook's recorded timeline) against
  limit = max(largest per-GPU MiB / link MiB/s, the disk's sequential write
          of all the GPU memory, measured each repetition on the images'
          filesystem: one stream of 16 MiB O_DIRECT writes, then fsync)

  targets: time storage/host <= 0.6, peak host memory storage/host <= 0.2,
           storage copy-out / limit <= 1.2
"""

from __future__ import annotations

import os
import shutil
import sys
import threading
import time
from pathlib import Path

if __package__ in (None, ""):  # run as a file: bench/_checkout.py
    import _checkout  # noqa: F401

from bench.common import (
    Result,
    arg_parser,
    benchmark,
    log,
    reps_of,
    run_main,
    sim_node_options,
    tmpdir,
    verify_restored,
)

TITLE = "GPU memory in storage vs host memory: runc checkpoint + restore, 8 GPUs"
TIME_TARGET = 0.6
MEMORY_TARGET = 0.2
LIMIT_TARGET = 1.2
DISK_BLOCK = 16 << 20
VARIANTS = ("host", "storage")
MIB, QUICK_MIB = 256, 64  # per process; --quick takes the smaller unless --mib says


class Peak:
    """The largest host memory seen while it runs (see the module notes)."""

    def __init__(self, cgroup: Path | None, memory: Path | None, libcuda: Path):
        self.cgroup, self.memory = cgroup, memory
        self.libcuda = os.fsencode(libcuda)
        self.peak = 0
        self.cgroup_peak = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def __enter__(self) -> Peak:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()

    def _run(self) -> None:
        while not self._stop.is_set():
            self.peak = max(self.peak, self.sample())
            usage = _cgroup_usage(self.memory)
            self.cgroup_peak = max(self.cgroup_peak, usage)
            self._stop.wait(0.02)

    def sample(self) -> int:
        # A helper maps the target's device memory (custom storage): in the
        # simulator that is a shared memfd, on a GPU it is device memory, so
        # a helper counts only its own anonymous and file pages.
        helpers = _helpers(self.libcuda)
        procs = _procs(self.cgroup) - helpers
        memfds: dict[tuple[int, int], int] = {}  # each once, however many hold it
        for p in procs:
            memfds.update(_memfds(p))
        return sum(_rss(p, ("RssAnon", "RssFile")) for p in helpers) + sum(
            _rss(p, ("VmRSS",)) for p in procs) + sum(memfds.values())


def _procs(cgroup: Path | None) -> set[int]:
    if cgroup is None:
        return set()
    try:
        return {int(x) for x in (cgroup / "cgroup.procs").read_text().split()}
    except OSError:
        return set()


def _helpers(libcuda: bytes) -> set[int]:
    """This node's driver-API helpers: started on its libcuda (a shared
    machine runs others' helpers too)."""
    out = set()
    for d in os.listdir("/proc"):
        if d.isdigit():
            try:
                argv = Path(f"/proc/{d}/cmdline").read_bytes().split(b"\0")
                if any(a.endswith(b"driver_helper.py") for a in argv) and libcuda in argv:
                    out.add(int(d))
            except OSError:
                continue
    return out


def _rss(pid: int, fields: tuple[str, ...]) -> int:
    total = 0
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.split(":", 1)[0] in fields:
                total += int(line.split()[1]) * 1024
    except OSError:
        pass
    return total


def _memfds(pid: int) -> dict[tuple[int, int], int]:
    """The memfds a process holds, by identity: their sizes."""
    out = {}
    try:
        for fd in os.listdir(f"/proc/{pid}/fd"):
            try:
                if os.readlink(f"/proc/{pid}/fd/{fd}").startswith("/memfd:"):
                    st = os.stat(f"/proc/{pid}/fd/{fd}")
                    out[(st.st_dev, st.st_ino)] = st.st_size
            except OSError:
                continue
    except OSError:
        pass
    return out


def _cgroup_of(pid: int) -> tuple[Path | None, Path | None]:
    """(a cgroup directory listing the container's processes, its memory
    cgroup) of the container whose init is `pid`."""
    procs = memory = None
    for line in Path(f"/proc/{pid}/cgroup").read_text().splitlines():
        _, controllers, path = line.split(":", 2)
        path = path.lstrip("/")
        if controllers == "memory":
            memory = Path("/sys/fs/cgroup/memory") / path
        elif controllers == "pids":
            procs = Path("/sys/fs/cgroup/pids") / path
        elif controllers == "":
            for base in (Path("/sys/fs/cgroup/unified"), Path("/sys/fs/cgroup")):
                if (base / path / "cgroup.procs").exists():
                    procs = procs or base / path
                    memory = memory or base / path
                    break
    return procs or memory, memory


def _cgroup_usage(memory: Path | None) -> int:
    for name in ("memory.usage_in_bytes", "memory.current"):
        try:
            return int((memory / name).read_text()) if memory else 0
        except (OSError, ValueError):
            continue
    return 0


@benchmark("P8", TITLE)
def run(args) -> Result:  # type: ignore[no-untyped-def]
    import yaml

    from cudahook.admin import hookfiles
    from cudahook.sim.lab import SimLab
    from cudahook.sim.runcbox import RuncBox

    if os.geteuid() != 0 or shutil.which("runc") is None:
        raise RuntimeError("needs root and runc")
    reps = reps_of(args)
    if args.quick and args.mib == MIB:
        args.mib = QUICK_MIB
    res = Result("P8", TITLE)
    samples: dict[str, list[float]] = {}
    with tmpdir("p8") as tmp:
        lab = SimLab(tmp / "node", driver=590, gpus=args.gpus, attach_latency_s=args.attach_latency,
                     bandwidth_mib_s=args.bandwidth, memory_mib=max(1024, 2 * args.mib)).start()
        box = None
        try:
            lab.set(cuda_version=13040)
            config = tmp / "cudahook.yaml"
            settings = lab.settings(backend="driver-api", gpu_memory="host", call_timeout_s=300.0,
                                    lock_timeout_ms=10000)
            config.write_text(yaml.safe_dump(dict(settings.__dict__)))
            hooks = tmp / "hooks"
            hookfiles.install(hooks, config=str(config))
            box = RuncBox(tmp / "runc", lab, hooks_dir=hooks)
            boxes = {}
            for v in VARIANTS:
                tags = [f"{v}{i}" for i in range(args.gpus)]
                bundle = box.bundle(
                    v, [(t, {"mib": args.mib, "gpu": i, "interval_ms": 500,
                             "check_every": 100000, "check_after_restore": True})
                        for i, t in enumerate(tags)],
                    visible=lab.uuids,
                    annotations={"cudahook.io/gpu-memory": v})
                cid = f"p8-{v}-{os.getpid()}"
                r = box.run(cid, bundle)
                if r.returncode:
                    raise RuntimeError(f"runc run {v}: {r.stderr.strip()}")
                for t in tags:
                    lab.wait_counter(t, 2, timeout=120)
                boxes[v] = (cid, bundle, tags)
            log(f"P8: {args.gpus} processes, {args.mib} MiB each, one per GPU, per container")
            total = args.gpus * args.mib << 20
            for r in range(reps):
                disk = disk_write_s(tmp, total)
                samples.setdefault("disk-write", []).append(disk)
                samples.setdefault("limit-copy-out", []).append(
                    max(args.mib / args.bandwidth, disk))
                order = VARIANTS[r % 2:] + VARIANTS[:r % 2]
                for v in order:
                    cid, bundle, tags = boxes[v]
                    dt, peak, cg_peak, image_mib = cycle(box, cid, bundle, tmp / f"img-{v}-{r}",
                                                         lab.libcuda)
                    for step, took in copy_steps(settings.state_dir, cid).items():
                        samples.setdefault(f"{step}-{v}", []).append(took)
                    samples.setdefault(f"cycle-{v}", []).append(dt)
                    samples.setdefault(f"peak-MiB-{v}", []).append(peak / 2**20)
                    samples.setdefault(f"cgroup-peak-MiB-{v}", []).append(cg_peak / 2**20)
                    samples.setdefault(f"criu-image-MiB-{v}", []).append(image_mib)
                    verify_restored(lab, tags, r + 1)
                log(f"P8 rep {r + 1}/{reps}: " + ", ".join(
                    f"{k} {v[-1]:.2f}" for k, v in samples.items()))
        finally:
            if box is not None:
                box.close()
            lab.stop()
    res.add_samples(samples, {
        **{f"peak-MiB-{v}": "MiB, not s: container RSS + driver host copies + helpers"
           for v in VARIANTS},
        **{f"cgroup-peak-MiB-{v}": "MiB, not s: the container's memory cgroup" for v in VARIANTS},
        **{f"criu-image-MiB-{v}": "MiB, not s: CRIU's image without cudahook-gpu/"
           for v in VARIANTS},
        "disk-write": f"{args.gpus * args.mib} MiB, one O_DIRECT stream + fsync",
        "limit-copy-out": "max(per-GPU MiB / link MiB/s, disk-write)",
        **{f"copy-out-{v}": "the checkpoint step (GPU memory out), all processes"
           for v in VARIANTS},
        **{f"copy-in-{v}": "the restore step (GPU memory in), all processes"
           for v in VARIANTS},
    })
    res.ratio("time storage/host", "cycle-storage", "cycle-host", TIME_TARGET)
    res.ratio("peak host memory storage/host", "peak-MiB-storage", "peak-MiB-host",
              MEMORY_TARGET)
    res.ratio("storage copy-out/limit", "copy-out-storage", "limit-copy-out", LIMIT_TARGET)
    res.ratio("CRIU image storage/host", "criu-image-MiB-storage", "criu-image-MiB-host", None,
              headline=False)
    res.extra["settings"] = {"gpus": args.gpus, "mib": args.mib,
                             "bandwidth_mib_s": args.bandwidth,
                             "attach_latency_s": args.attach_latency, "cuda_version": 13040}
    return res


def cycle(box, cid: str, bundle: Path, image: Path,  # type: ignore[no-untyped-def]
          libcuda: Path) -> tuple[float, int, int, float]:
    """runc checkpoint + runc restore: (seconds, peak host memory, the memory
    cgroup's peak or 0, CRIU's image in MiB without cudahook-gpu/)."""
    procs, memory = _cgroup_of(int(box.state(cid)["pid"]))
    with Peak(procs, memory, libcuda) as peak:
        t0 = time.perf_counter()
        r = box.checkpoint(cid, image)
        if r.returncode:
            raise RuntimeError(f"runc checkpoint {cid}: {r.stderr.strip()[-400:]}")
        r = box.restore(cid, bundle, image)
        dt = time.perf_counter() - t0
        if r.returncode:
            raise RuntimeError(f"runc restore {cid}: {r.stderr.strip()[-400:]}")
    image_mib = sum(f.stat().st_size for f in image.rglob("*")
                    if f.is_file() and "cudahook-gpu" not in f.parts) / 2**20
    for path in (image, Path(f"{image}.work"), Path(f"{image}.rwork")):
        shutil.rmtree(path, ignore_errors=True)
    return dt, peak.peak, peak.cgroup_peak, image_mib


def copy_steps(state_dir: str, cid: str) -> dict[str, float]:
    """The GPU-memory steps of the container's last checkpoint and restore,
    from the timelines the hooks recorded: {"copy-out": s, "copy-in": s}."""
    from cudahook.platform import metrics
    from cudahook.platform.store import Store

    history = Store(state_dir).history().get(cid, {})
    out = {}
    for kind, name in (("checkpoint", "copy-out"), ("restore", "copy-in")):
        spans = metrics.phases((history.get(kind) or {}).get("timeline"))
        if kind in spans:
            out[name] = spans[kind]
    return out


def disk_write_s(where: Path, size: int) -> float:
    """Seconds to write `size` bytes to a new file under `where` in one
    stream of 16 MiB O_DIRECT writes (through the page cache where the
    filesystem refuses O_DIRECT), then fsync: the disk's sequential write."""
    import mmap

    buf = mmap.mmap(-1, DISK_BLOCK)  # page-aligned, as O_DIRECT needs
    buf.write(os.urandom(1 << 20) * (DISK_BLOCK >> 20))
    path = where / "disk-write"
    flags = os.O_WRONLY | os.O_CREAT | os.O_TRUNC
    try:
        fd = os.open(path, flags | os.O_DIRECT, 0o600)
    except OSError:
        fd = os.open(path, flags, 0o600)
    view = memoryview(buf)
    try:
        t0 = time.perf_counter()
        done = 0
        while done < size:
            done += os.write(fd, view[:min(DISK_BLOCK, size - done)])
        os.fsync(fd)
        return time.perf_counter() - t0
    finally:
        os.close(fd)
        path.unlink()
        view.release()
        buf.close()


def parser():  # type: ignore[no-untyped-def]
    p = arg_parser(__doc__.split("\n")[0], reps=3, quick_reps=1)
    p.add_argument("--gpus", type=int, default=8, help="GPUs, one process each (default 8)")
    sim_node_options(p, mib=MIB, bandwidth=1024.0)
    return p


if __name__ == "__main__":
    sys.exit(run_main(run, parser()))
