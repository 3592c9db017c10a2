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

Peak host memory, sampled every 20 ms during each cycle, as a real node
would see it: the container's memory cgroup (its processes, their host
copies of GPU memory on the host path - the simulator charges them there, as
the real driver's copy is the process's own memory - and, during the
restore, CRIU and its action script's driver helpers, which runc runs inside
it), plus the anonymous and file RSS of this node's driver-API helpers
outside it (pre-dump's, in runc's cgroup: the storage path's pinned staging
buffers; not the target's device memory they map). The cgroup's own peak is
noted beside it.

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
        # a helper outside the container counts only its own anonymous and
        # file pages. Those inside are in the cgroup's figure already.
        outside = _helpers(self.libcuda) - _procs(self.cgroup)
        return _cgroup_usage(self.memory) + sum(_rss(p, ("RssAnon", "RssFile")) for p in outside)


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

            def start(v: str, name: str) -> tuple[str, Path, list[str]]:
                tags = [f"{name}{i}" for i in range(args.gpus)]
                bundle = box.bundle(
                    name, [(t, {"mib": args.mib, "gpu": i, "interval_ms": 500,
                                "check_every": 100000, "check_after_restore": True})
                           for i, t in enumerate(tags)],
                    visible=lab.uuids,
                    annotations={"cudahook.io/gpu-memory": v})
                cid = f"p8-{name}-{os.getpid()}"
                r = box.run(cid, bundle)
                if r.returncode:
                    raise RuntimeError(f"runc run {v}: {r.stderr.strip()}")
                for t in tags:
                    lab.wait_counter(t, 2, timeout=120)
                return cid, bundle, tags

            # Both containers live through the run, unless their device
            # memory and the host path's copies would not fit in this
            # machine's memory together (--one-at-a-time: each variant's
            # container is started for its cycle and removed after, untimed).
            boxes = {} if args.one_at_a_time else {v: start(v, v) for v in VARIANTS}
            log(f"P8: {args.gpus} processes, {args.mib} MiB each, one per GPU, per container"
                + (", one container at a time" if args.one_at_a_time else ""))
            total = args.gpus * args.mib << 20
            for r in range(reps):
                disk = disk_write_s(tmp, total)
                samples.setdefault("disk-write", []).append(disk)
                samples.setdefault("limit-copy-out", []).append(
                    max(args.mib / args.bandwidth, disk))
                order = VARIANTS[r % 2:] + VARIANTS[:r % 2]
                for v in order:
                    if args.one_at_a_time:
                        boxes[v] = start(v, f"{v}{r}-")
                    cid, bundle, tags = boxes[v]
                    dt, peak, cg_peak, image_mib = cycle(box, cid, bundle, tmp / f"img-{v}-{r}",
                                                         lab.libcuda)
                    for step, took in copy_steps(settings.state_dir, cid).items():
                        samples.setdefault(f"{step}-{v}", []).append(took)
                    samples.setdefault(f"cycle-{v}", []).append(dt)
                    samples.setdefault(f"peak-MiB-{v}", []).append(peak / 2**20)
                    samples.setdefault(f"cgroup-peak-MiB-{v}", []).append(cg_peak / 2**20)
                    samples.setdefault(f"criu-image-MiB-{v}", []).append(image_mib)
                    verify_restored(lab, tags, 1 if args.one_at_a_time else r + 1)
                    if args.one_at_a_time:
                        box.delete(cid)
                log(f"P8 rep {r + 1}/{reps}: " + ", ".join(
                    f"{k} {v[-1]:.2f}" for k, v in samples.items()))
        finally:
            if box is not None:
                box.close()
            lab.stop()
    res.add_samples(samples, {
        **{f"peak-MiB-{v}": "MiB, not s: the container's memory cgroup + helpers outside it"
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
                             "one_at_a_time": args.one_at_a_time,
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
    p.add_argument("--one-at-a-time", action="store_true",
                   help="start each variant's container for its cycle only (for --mib 1024 "
                        "where both would not fit in memory together)")
    sim_node_options(p, mib=MIB, bandwidth=1024.0)
    return p


# -- the chunk format: digest, dedupe, compression (--format) ----------------------------------
#
# Separate from the runc cycle above: the chunk format's own costs and gains.
#   digest       each candidate's GB/s over 16 MiB chunks, one thread, and one
#                thread per core hashing chunks side by side (blake3 also with
#                its own threads on one chunk)
#   dedupe       N processes holding the same weights (random content, as
#                model weights are), checkpointed to storage in parallel by
#                one helper: bytes stored / bytes of GPU memory, and the
#                checkpoint's time with and without dedupe
#   compression  zstd on data that compresses (a repeated block) and on data
#                that does not (random): ratio and MB/s of the compressor, and
#                the stored ratio of a storage checkpoint with it on

FORMAT_TITLE = "the storage chunk format: digest GB/s, dedupe, zstd"
FORMAT_CHUNK = 16 << 20


def digest_rates(seconds: float = 1.0) -> dict[str, float]:
    """GB/s (10^9 bytes) of each digest over 16 MiB chunks."""
    import hashlib

    import blake3

    data = os.urandom(FORMAT_CHUNK)
    threads = os.cpu_count() or 1
    candidates = {
        "sha256": lambda d: hashlib.sha256(d).digest(),
        "blake2b": lambda d: hashlib.blake2b(d).digest(),
        "blake3": lambda d: blake3.blake3(d).digest(),
        "blake3-auto": lambda d: blake3.blake3(d, max_threads=blake3.blake3.AUTO).digest(),
    }
    out = {}
    for name, fn in candidates.items():
        out[f"{name} 1 thread"] = _rate(fn, data, 1, seconds)
        if name != "blake3-auto":
            out[f"{name} {threads} threads"] = _rate(fn, data, threads, seconds)
    return out


def _rate(fn, data: bytes, threads: int, seconds: float) -> float:  # type: ignore[no-untyped-def]
    """Bytes per second, in GB/s, of `threads` threads each running fn(data)."""
    done = [0] * threads
    stop = time.perf_counter() + seconds

    def work(i: int) -> None:
        while time.perf_counter() < stop:
            fn(data)
            done[i] += len(data)

    t0 = time.perf_counter()
    workers = [threading.Thread(target=work, args=(i,)) for i in range(threads)]
    for w in workers:
        w.start()
    for w in workers:
        w.join()
    return sum(done) / (time.perf_counter() - t0) / 1e9


def zstd_rates(level: int = 3) -> dict[str, tuple[float, float]]:
    """(ratio raw/stored, compression MB/s) of one 16 MiB chunk per content."""
    import zstandard

    from cudahook.sim.protocol import pattern

    out = {}
    for content in ("pattern", "random"):
        data = pattern(1, FORMAT_CHUNK, content)
        z = zstandard.ZstdCompressor(level=level)
        t0 = time.perf_counter()
        n = 0
        while time.perf_counter() - t0 < 1.0:
            frame = z.compress(data)
            n += 1
        dt = time.perf_counter() - t0
        out[content] = (len(data) / min(len(frame), len(data)), n * len(data) / dt / 1e6)
    return out


def storage_checkpoint(lab, procs: int, mib: int, content: str, same: bool,  # type: ignore[no-untyped-def]
                       dedupe: bool, compression: str, where: Path) -> tuple[float, float, int]:
    """N workload processes checkpointed to storage in parallel, one helper,
    then restored and checked: (checkpoint seconds, stored/raw, raw bytes)."""
    from cudahook.core.backends import make_backend
    from cudahook.platform.host import Host

    tag = f"f{next(_tags)}"
    proc = lab.spawn(tag, mib=mib, procs=procs, content=content, same_weights=same,
                     check_after_restore=True, interval_ms=200)
    try:
        tags = [f"{tag}.{i}" for i in range(procs)] if procs > 1 else [tag]
        pids = [lab.wait_counter(t, timeout=120)["pid"] for t in tags]
        api = make_backend(lab.settings(backend="driver-api", gpu_storage_compression=compression,
                                        call_timeout_s=600.0), Host())
        try:
            for p in pids:
                api.lock(p, 0)
            where.mkdir()
            t0 = time.perf_counter()
            done = _parallel(lambda p: api.checkpoint_to_storage(  # type: ignore[attr-defined]
                p, str(where / str(p)), dedupe=dedupe), pids)
            dt = time.perf_counter() - t0
            raw = sum(d["bytes"] for d in done)
            stored = _stored_bytes(where)
            _parallel(lambda p: api.restore_from_storage(p, str(where / str(p))), pids)  # type: ignore[attr-defined]
            for p in pids:
                api.unlock(p)
        finally:
            api.close()
        verify_restored(lab, tags, 1)
    finally:
        from bench.common import kill_group

        kill_group(proc)
        shutil.rmtree(where, ignore_errors=True)
    return dt, stored / raw, raw


_tags = iter(range(1 << 30))


def _parallel(fn, items):  # type: ignore[no-untyped-def]
    from concurrent.futures import ThreadPoolExecutor

    with ThreadPoolExecutor(len(items)) as pool:
        return list(pool.map(fn, items))


def _stored_bytes(root: Path) -> int:
    """What the files take, each inode once (dedupe's links share one)."""
    seen, total = set(), 0
    for f in root.rglob("*.chunk"):
        st = f.stat()
        if st.st_ino not in seen:
            seen.add(st.st_ino)
            total += st.st_size
    return total


def run_format(args) -> Result:  # type: ignore[no-untyped-def]
    from cudahook.sim.lab import SimLab

    res = Result("P8-format", FORMAT_TITLE)
    reps = reps_of(args)
    mib = min(args.mib, QUICK_MIB if args.quick else 128)
    for name, gbs in digest_rates(0.5 if args.quick else 2.0).items():
        res.notes.append(f"digest {name}: {gbs:.2f} GB/s")
    for content, (ratio, mbs) in zstd_rates().items():
        res.notes.append(f"zstd level 3 on {content} data: ratio {ratio:.2f}x, {mbs:.0f} MB/s")
    samples: dict[str, list[float]] = {}
    with tmpdir("p8f") as tmp:
        lab = SimLab(tmp / "node", driver=590, gpus=4, attach_latency_s=0.0,
                     bandwidth_mib_s=args.bandwidth, memory_mib=max(1024, 2 * mib)).start()
        try:
            lab.set(cuda_version=13040)
            for r in range(reps):
                for label, kw in (
                        ("dedupe", dict(content="random", same=True, dedupe=True,
                                        compression="off")),
                        ("no-dedupe", dict(content="random", same=True, dedupe=False,
                                           compression="off")),
                        ("zstd-compressible", dict(content="pattern", same=False, dedupe=False,
                                                   compression="zstd")),
                        ("zstd-random", dict(content="random", same=False, dedupe=False,
                                             compression="zstd")),
                        ("raw-random", dict(content="random", same=False, dedupe=False,
                                            compression="off"))):
                    dt, ratio, raw = storage_checkpoint(lab, 4, mib, where=tmp / f"{label}-{r}",
                                                        **kw)  # type: ignore[arg-type]
                    samples.setdefault(f"checkpoint-{label}", []).append(dt)
                    samples.setdefault(f"stored-ratio-{label}", []).append(ratio)
                    samples.setdefault(f"MBps-{label}", []).append(raw / dt / 1e6)
                log(f"P8-format rep {r + 1}/{reps}: " + ", ".join(
                    f"{k} {v[-1]:.3f}" for k, v in samples.items()))
        finally:
            lab.stop()
    res.add_samples(samples, {
        **{k: "stored bytes / GPU-memory bytes, not s" for k in samples if "ratio" in k},
        **{k: "MB/s of GPU memory checkpointed, not s" for k in samples if "MBps" in k}})
    res.ratio("dedupe: stored/raw, 4 processes of the same weights", "stored-ratio-dedupe",
              "stored-ratio-no-dedupe", None)
    res.ratio("dedupe: checkpoint time with/without", "checkpoint-dedupe",
              "checkpoint-no-dedupe", None)
    res.ratio("zstd: checkpoint time on random data, with/without", "checkpoint-zstd-random",
              "checkpoint-raw-random", None)
    res.extra["settings"] = {"processes": 4, "mib": mib, "bandwidth_mib_s": args.bandwidth,
                             "zstd_level": 3, "cpus": os.cpu_count()}
    return res


if __name__ == "__main__":
    p = parser()
    p.add_argument("--format", action="store_true",
                   help="measure the chunk format instead: digest GB/s, dedupe, zstd")
    a = p.parse_known_args()[0]
    sys.exit(run_main(run_format if a.format else run, p))
