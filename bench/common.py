"""Shared machinery for the benchmarks: interleaved timing, results, cleanup.

Every benchmark compares variants of one operation SIDE BY SIDE in one run:
repetition r runs every variant once, in an order rotated by r, so drift on a
shared machine (other jobs, page cache, CPU frequency) hits all variants alike.
Each variant's figure is the median of its samples; the benchmark's figure is
a RATIO of two medians. Absolute times are reported but are noise.

Benchmarks measure; they never assert. They exit 0 unless they could not run.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

from bench._checkout import ROOT as REPO

RunFn = Callable[[argparse.Namespace], "Result"]

VENV_PY = REPO / ".venv" / "bin" / "python"
PYTHON = str(VENV_PY) if VENV_PY.exists() else sys.executable


# -- timing --------------------------------------------------------------------


def interleave(
    variants: dict[str, Callable[[], float | None]],
    reps: int,
    *,
    warmup: int = 1,
    between: Callable[[], None] | None = None,
    progress: str | None = None,
) -> dict[str, list[float]]:
    """Run each variant `reps` times, interleaved with a rotating order.

    A variant returns its own measured seconds (so it can leave set-up and
    tear-down out of the timed part) or None for "no sample".
    """
    names = list(variants)
    samples: dict[str, list[float]] = {n: [] for n in names}
    for _ in range(warmup):
        for n in names:
            variants[n]()
            if between:
                between()
    for r in range(reps):
        k = r % len(names)
        order = names[k:] + names[:k]
        if r % 2:
            order.reverse()
        for n in order:
            t = variants[n]()
            if t is not None:
                samples[n].append(t)
            if between:
                between()
        if progress and reps >= 5 and (r + 1) % max(1, reps // 5) == 0:
            log(f"{progress}: {r + 1}/{reps}")
    return samples


def timed(fn: Callable[[], Any]) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


_DEVNULL = os.devnull


def timed_phase(settings: Any, phase: str, pids: Sequence[int]) -> tuple[float, Any]:
    """One engine phase ("checkpoint" or "restore") over `pids` through a
    fresh backend, as one hook run makes it: (seconds, the backend, closed)."""
    from cudahook.core.backends import make_backend
    from cudahook.core.engine import Engine
    from cudahook.platform.host import Host

    host = Host()
    backend = make_backend(settings, host)
    engine = Engine(backend, settings, host)
    try:
        t0 = time.perf_counter()
        result = (engine.checkpoint if phase == "checkpoint" else engine.restore)(pids)
        dt = time.perf_counter() - t0
        if not result.ok:
            raise RuntimeError(f"{settings.backend} {phase}: {result.errors}")
    finally:
        close = getattr(backend, "close", None)
        if close:
            close()
    return dt, backend


def verify_restored(lab: Any, tags: Sequence[str], restores: int) -> None:
    """Each workload's memory check after its `restores`-th restore, just
    made (untimed): it ran again and its whole device memory is what it was."""
    deadline = time.monotonic() + 120
    for tag in tags:
        while True:
            st = lab.status(tag)
            if st.get("errors") or st.get("intact") is False:
                raise RuntimeError(f"workload {tag} after a restore: {st}")
            if st.get("checked_restores") == restores:
                break
            if time.monotonic() > deadline:
                raise RuntimeError(f"workload {tag} did not check its memory: {st}")
            time.sleep(0.05)


def spawn_wait(argv: Sequence[str], env: dict[str, str] | None = None,
               stdin_data: bytes | None = None) -> tuple[float, int]:
    """(seconds, exit status) of one fork+exec+wait, stdio on /dev/null.

    os.posix_spawn (vfork in glibc) keeps the harness's own cost per launch
    small and equal for every variant.
    """
    actions: list[tuple[Any, ...]] = [
        (os.POSIX_SPAWN_OPEN, 1, _DEVNULL, os.O_WRONLY, 0),
        (os.POSIX_SPAWN_OPEN, 2, _DEVNULL, os.O_WRONLY, 0),
    ]
    rfd = wfd = -1
    if stdin_data is None:
        actions.insert(0, (os.POSIX_SPAWN_OPEN, 0, _DEVNULL, os.O_RDONLY, 0))
    else:
        rfd, wfd = os.pipe()
        actions.insert(0, (os.POSIX_SPAWN_DUP2, rfd, 0))
        actions.append((os.POSIX_SPAWN_CLOSE, wfd))
    env = os.environ.copy() if env is None else env
    t0 = time.perf_counter()
    pid = os.posix_spawn(argv[0], list(argv), env, file_actions=actions)
    if stdin_data is not None:
        os.close(rfd)
        with contextlib.suppress(BrokenPipeError):
            os.write(wfd, stdin_data)
        os.close(wfd)
    _, status = os.waitpid(pid, 0)
    dt = time.perf_counter() - t0
    return dt, os.waitstatus_to_exitcode(status)


def med(xs: Sequence[float]) -> float | None:
    return statistics.median(xs) if xs else None


def fmt_s(x: float | None) -> str:
    if x is None:
        return "-"
    if x < 0.01:
        return f"{x * 1000:.2f} ms"
    if x < 1:
        return f"{x * 1000:.0f} ms"
    return f"{x:.2f} s"


def is_size(variant: str) -> bool:
    """Whether a variant's figures are MiB, kept in the seconds fields (one
    shape for every figure of a result)."""
    return "MiB" in variant


def fmt_variant(variant: str, x: float | None) -> str:
    return f"{x:.1f} MiB" if x is not None and is_size(variant) else fmt_s(x)


def log(msg: str) -> None:
    print(f"  .. {msg}", file=sys.stderr, flush=True)


# -- results -------------------------------------------------------------------


class Result:
    """One benchmark's figures: per-variant samples, ratios vs targets, notes."""

    def __init__(self, bench_id: str, title: str):
        self.id = bench_id
        self.title = title
        self.variants: dict[str, dict[str, Any]] = {}
        self.ratios: list[dict[str, Any]] = []
        self.notes: list[str] = []
        self.extra: dict[str, Any] = {}
        self.error: str | None = None
        self.started = time.time()
        self.wall_s = 0.0

    def add_samples(self, samples: dict[str, list[float]], descr: dict[str, str] | None = None
                    ) -> None:
        for name, xs in samples.items():
            self.variants[name] = {
                "median_s": med(xs),
                "mean_s": statistics.fmean(xs) if xs else None,
                "min_s": min(xs) if xs else None,
                "max_s": max(xs) if xs else None,
                "n": len(xs),
                "samples_s": [round(x, 6) for x in xs],
                "what": (descr or {}).get(name, ""),
            }

    def median(self, name: str) -> float | None:
        v = self.variants.get(name)
        return v["median_s"] if v else None

    def ratio(self, label: str, num: str, den: str, target: float | None = None,
              *, headline: bool = True, stat: str = "median") -> float | None:
        """num/den of medians (or of means, for stat="mean": runc's timings are
        quantised by its retry sleeps, and a median then jumps between steps)."""
        if stat == "mean":
            a, b = (self.variants.get(x, {}).get("mean_s") for x in (num, den))
        else:
            a, b = self.median(num), self.median(den)
        value = a / b if a is not None and b else None
        self.ratios.append({
            "label": label, "num": num, "den": den,
            "value": round(value, 4) if value is not None else None,
            "target": target,
            "pass": (value <= target) if (value is not None and target is not None) else None,
            "headline": headline, "stat": stat,
        })
        return value

    def to_dict(self) -> dict[str, Any]:
        return {
            "id": self.id, "title": self.title, "variants": self.variants,
            "ratios": self.ratios, "notes": self.notes, "extra": self.extra,
            "error": self.error, "started": self.started, "wall_s": round(self.wall_s, 2),
        }

    def print(self) -> None:
        print(f"\n== {self.id}: {self.title}")
        if self.error:
            print(f"   ERROR: {self.error}")
        if self.variants:
            w = max(len(n) for n in self.variants)
            print(f"   {'variant':<{w}}  {'median':>11}  {'mean':>11}  {'min':>11}  {'max':>11}  n")
            for n, v in self.variants.items():
                cells = (fmt_variant(n, v[k]) for k in ("median_s", "mean_s", "min_s", "max_s"))
                print(f"   {n:<{w}}  " + "  ".join(f"{c:>11}" for c in cells) + f"  {v['n']}")
        for r in self.ratios:
            print("   " + ratio_line(r))
        for note in self.notes:
            print(f"   note: {note}")
        print(f"   ({self.wall_s:.1f} s)")


def ratio_line(r: dict[str, Any]) -> str:
    val = "-" if r["value"] is None else f"{r['value']:.3f}x"
    tgt = "" if r["target"] is None else f"  target <= {r['target']}x"
    verdict = "" if r["pass"] is None else ("  PASS" if r["pass"] else "  MISS")
    of = "" if r.get("stat", "median") == "median" else f" [{r['stat']}s]"
    return f"RATIO {r['label']}: {val}  ({r['num']} / {r['den']}){of}{tgt}{verdict}"


def arg_parser(description: str, *, reps: int, quick_reps: int) -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=description)
    p.add_argument("--quick", action="store_true", help=f"short run ({quick_reps} reps)")
    p.add_argument("--reps", type=int, default=None, help=f"repetitions (default {reps})")
    p.add_argument("--json", default=None, help="write the results as JSON to this path")
    p.set_defaults(default_reps=reps, quick_reps=quick_reps)
    return p


def reps_of(args: argparse.Namespace) -> int:
    if args.reps is not None:
        return max(1, args.reps)
    return args.quick_reps if args.quick else args.default_reps


def run_main(run: Callable[[argparse.Namespace], Result], parser: argparse.ArgumentParser,
             argv: Sequence[str] | None = None) -> int:
    args = parser.parse_args(argv)
    res = execute(run, args)
    res.print()
    if args.json:
        write_json(args.json, {"results": [res.to_dict()], "meta": meta(args)})
    return 0


def benchmark(bench_id: str, title: str) -> Callable[[RunFn], RunFn]:
    """Names a benchmark's run(args): execute() reports a run that raises
    under that id and title."""

    def name(run: RunFn) -> RunFn:
        run.bench_id = bench_id  # type: ignore[attr-defined]
        run.title = title  # type: ignore[attr-defined]
        return run

    return name


def execute(run: Callable[[argparse.Namespace], Result], args: argparse.Namespace) -> Result:
    t0 = time.monotonic()
    load0 = os.getloadavg()
    git0 = git_state()  # others edit this checkout: record what THIS benchmark ran
    untouched = {p: os.path.lexists(p) for p in NODE_PATHS}
    with cleanup_on_signals(), node_root() as root:
        try:
            res = run(args)
        except Exception as exc:  # a benchmark that cannot run reports why
            import traceback

            res = Result(getattr(run, "bench_id", "?"), getattr(run, "title", "?"))
            res.error = f"{type(exc).__name__}: {exc}"
            res.extra["traceback"] = traceback.format_exc()
    res.wall_s = time.monotonic() - t0
    res.extra["loadavg_start_end"] = [load0, os.getloadavg()]
    res.extra["git_at_start"] = git0
    res.extra["node_root"] = str(root)
    touched = [p for p, was in untouched.items() if os.path.lexists(p) != was]
    if touched:  # a variant ran without the node root: the benchmark is wrong
        res.notes.append(f"WROTE THE NODE'S {', '.join(touched)}: remove, fix the benchmark")
    return res


# The node's own cudahook paths: a benchmark must leave them as it found them.
NODE_PATHS = ("/run/cudahook", "/run/cudahook-marks", "/etc/cudahook", "/etc/criu/runc.conf",
              "/var/log/cudahook.log", "/var/lib/cudahook", "/opt/cudahook")


@contextlib.contextmanager
def node_root() -> Iterator[Path]:
    """A node root of the benchmark's own (CUDAHOOK_ROOT, see
    cudahook/platform/paths.py) for the whole run: the marks, state,
    registration files and journals that the hooks and installs under test
    write go there, never to the node's /run, /etc or /var. Hooks installed
    meanwhile carry it baked in (runtimes start hooks with an environment
    of their own); CRIU and the hooks' own children inherit it."""
    old = os.environ.get("CUDAHOOK_ROOT")
    d = Path(tempfile.mkdtemp(prefix="cudahook-bench-root-"))
    os.environ["CUDAHOOK_ROOT"] = str(d)
    try:
        yield d
    finally:
        if old is None:
            os.environ.pop("CUDAHOOK_ROOT", None)
        else:
            os.environ["CUDAHOOK_ROOT"] = old
        shutil.rmtree(d, ignore_errors=True)


def meta(args: argparse.Namespace | None = None) -> dict[str, Any]:
    import platform

    return {
        "git": git_state(),
        "time": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "host": platform.node(), "kernel": platform.release(),
        "cpus": os.cpu_count(), "python": PYTHON,
        "loadavg_start": os.getloadavg(),
        "args": {k: v for k, v in vars(args).items()} if args else {},
    }


def git_state() -> dict[str, Any]:
    """HEAD, and what the working tree changes: others edit this checkout while
    benchmarks run, so results say exactly which code they measured."""
    import hashlib

    def git(*a: str) -> str:
        try:
            return subprocess.run(["git", "-C", str(REPO), *a], capture_output=True, text=True,
                                  timeout=30).stdout.strip()
        except (OSError, subprocess.SubprocessError):
            return ""

    hooks = {p.name: hashlib.sha256(p.read_bytes()).hexdigest()[:12]
             for p in sorted((REPO / "hooks").glob("*")) if p.is_file()}
    return {"head": git("rev-parse", "--short", "HEAD"),
            "modified": git("status", "--porcelain", "--untracked-files=no").splitlines(),
            "hooks_sha256": hooks}


def write_json(path: str, data: Any) -> None:
    p = Path(path)
    p.parent.mkdir(parents=True, exist_ok=True)
    tmp = p.with_name(f".{p.name}.tmp")
    tmp.write_text(json.dumps(data, indent=1, default=str) + "\n")
    os.replace(tmp, p)


# -- cleanup -------------------------------------------------------------------


@contextlib.contextmanager
def cleanup_on_signals() -> Iterator[None]:
    """SIGTERM/SIGHUP become KeyboardInterrupt, so every `finally` runs."""

    def raise_kbi(signum: int, _frame: Any) -> None:
        raise KeyboardInterrupt(f"signal {signum}")

    old = {s: signal.signal(s, raise_kbi) for s in (signal.SIGTERM, signal.SIGHUP)}
    try:
        yield
    finally:
        for s, h in old.items():
            signal.signal(s, h)


def kill_group(proc: subprocess.Popen[Any] | None, timeout: float = 10) -> None:
    """SIGKILL a process started with start_new_session=True, and its group."""
    if proc is None:
        return
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(proc.pid, signal.SIGKILL)
    with contextlib.suppress(ProcessLookupError):
        proc.kill()
    with contextlib.suppress(subprocess.TimeoutExpired):
        proc.wait(timeout=timeout)


@contextlib.contextmanager
def tmpdir(prefix: str) -> Iterator[Path]:
    d = Path(tempfile.mkdtemp(prefix=f"cudahook-bench-{prefix}-"))
    try:
        yield d
    finally:
        shutil.rmtree(d, ignore_errors=True)


def write_config(path: Path, **settings: Any) -> Path:
    """A cudahook config YAML (keys as in config/config.yaml)."""
    import yaml

    path.write_text(yaml.safe_dump(settings))
    return path


class Runc:
    """runc with a private --root, stdio on /dev/null, and guaranteed deletion."""

    def __init__(self, work: Path, criu: Path | None = None, runc: str | None = None):
        self.work = work
        self.root = work / "runc-root"
        self.root.mkdir(parents=True, exist_ok=True)
        self.logfile = work / "runc.log"
        self.criu = criu
        self.ids: set[str] = set()
        # `runc`: a runtime wrapper standing in for runc (cudahook-runtime).
        self.runc = runc or shutil.which("runc") or "runc"

    def argv(self, *args: str) -> list[str]:
        base = [self.runc, "--root", str(self.root), "--log", str(self.logfile)]
        if self.criu is not None:
            base += ["--criu", str(self.criu)]
        return [*base, *args]

    def call(self, *args: str, timeout: float = 120, cid: str | None = None) -> float:
        """Seconds taken; raises with runc's log tail on failure."""
        if cid:
            self.ids.add(cid)
        offset = self.logfile.stat().st_size if self.logfile.exists() else 0
        t0 = time.perf_counter()
        # All stdio /dev/null: a detached container inherits runc's stdio (a
        # pipe would never see EOF, a host file makes it undumpable); runc's
        # own errors go to --log.
        r = subprocess.run(self.argv(*args), stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                           stderr=subprocess.DEVNULL, timeout=timeout)
        dt = time.perf_counter() - t0
        if r.returncode != 0:
            tail = ""
            if self.logfile.exists():
                with open(self.logfile, "rb") as f:
                    f.seek(offset)
                    tail = f.read().decode(errors="replace")[-1500:]
            raise RuntimeError(f"runc {' '.join(args[:1])} failed ({r.returncode}): {tail}")
        return dt

    def delete(self, cid: str) -> None:
        for args in (("kill", cid, "KILL"), ("delete", "-f", cid)):
            with contextlib.suppress(Exception):
                subprocess.run(self.argv(*args), stdin=subprocess.DEVNULL,
                               stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, timeout=30)
        self.ids.discard(cid)

    def close(self) -> None:
        for cid in sorted(self.ids):
            self.delete(cid)
        # Anything runc still lists under our root (e.g. a half-made container).
        with contextlib.suppress(Exception):
            out = subprocess.run(self.argv("list", "-q"), capture_output=True, text=True,
                                 timeout=30).stdout
            for cid in out.split():
                self.delete(cid)



# -- a simulated GPU node (P3, P6, P7) -------------------------------------------

SIM_DRIVER = 580  # the driver branch every simulated node reports


class SimNode:
    """A simulated GPU node (cudahook.sim.lab.SimLab) and the workloads a
    benchmark started on it, which sim_node kills before it stops the node."""

    def __init__(self, lab: Any):
        self.lab = lab
        self.procs: list[subprocess.Popen[bytes]] = []

    def spawn(self, tag: str, **opts: Any) -> None:
        """Start workload `tag` (SimLab.spawn's options; procs=N: N CUDA processes)."""
        self.procs.append(self.lab.spawn(tag, **opts))

    def pids(self, tag: str, procs: int = 1, timeout: float = 60) -> list[int]:
        """The pids of workload `tag`'s processes, once each has done GPU work
        (a workload of N > 1 processes reports them as tag.0 .. tag.N-1)."""
        tags = [f"{tag}.{i}" for i in range(procs)] if procs > 1 else [tag]
        return [self.lab.wait_counter(t, timeout=timeout)["pid"] for t in tags]


def sim_node_options(p: argparse.ArgumentParser, *, mib: int, bandwidth: float) -> None:
    """The options that shape a benchmark's simulated node and its workloads."""
    p.add_argument("--attach-latency", type=float, default=1.0)
    p.add_argument("--bandwidth", type=float, default=bandwidth, help="MiB/s per GPU link")
    p.add_argument("--mib", type=int, default=mib, help="device memory per process")

@contextlib.contextmanager
def sim_node(prefix: str, *, gpus: int, attach_latency: float, bandwidth: float,
             driver_api: bool = False, **lab_opts: Any) -> Iterator[SimNode]:
    """A started simulated node under a tmp dir of its own; `driver_api`: the
    benchmark needs the fake libcuda.so.1 (built from C where the node starts)."""
    from cudahook.sim.lab import SimLab

    with tmpdir(prefix) as tmp:
        lab = SimLab(tmp / "node", driver=SIM_DRIVER, gpus=gpus, attach_latency_s=attach_latency,
                     bandwidth_mib_s=bandwidth, **lab_opts)
        node = SimNode(lab)
        try:
            lab.start()
            if driver_api and not lab.libcuda.exists():
                raise RuntimeError("the fake libcuda.so.1 was not built (is gcc installed?)")
            yield node
        finally:
            for p in node.procs:
                kill_group(p)
            lab.stop()

# -- the simulator's own host copies (P7, P9) -------------------------------------

# One copier: it copies each memfd it was handed (one thread each) with the
# simulator's own copy function, between a "go" line and a "done" line, and
# holds its copies until told to exit, as the simulator holds them.
_COPIER = """
import sys, threading
from cudahook.sim.gpu import copy_memfd
size, fds, copies = int(sys.argv[1]), [int(x) for x in sys.argv[2:]], []
def one(fd):
    copies.append(copy_memfd(fd, size))
print("ready", flush=True)
if sys.stdin.readline() == "go\\n":
    threads = [threading.Thread(target=one, args=(fd,)) for fd in fds]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    print("done" if len(copies) == len(fds) else "failed", flush=True)
    sys.stdin.read()
"""


def _copy_wall(sources: Sequence[int], size: int, groups: list[list[int]]) -> float:
    """Seconds from "go" until every copier has copied its memfds."""
    procs: list[subprocess.Popen[str]] = []
    try:
        for group in groups:
            procs.append(subprocess.Popen(
                [PYTHON, "-c", _COPIER, str(size), *map(str, group)], pass_fds=group,
                stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
                start_new_session=True))
        for p in procs:
            assert p.stdout is not None
            if p.stdout.readline() != "ready\n":
                raise RuntimeError("a copier of the host-copy floor did not start")
        t0 = time.perf_counter()
        for p in procs:
            assert p.stdin is not None
            p.stdin.write("go\n")
            p.stdin.flush()
        for p in procs:
            assert p.stdout is not None
            if p.stdout.readline() != "done\n":
                raise RuntimeError("a copy of the host-copy floor failed")
        dt = time.perf_counter() - t0
        for p in procs:
            assert p.stdin is not None
            p.stdin.close()
            p.wait(30)
        return dt
    finally:
        for p in procs:
            kill_group(p)


def sim_copy_floor(copies: int, mib: int, reps: int) -> dict[str, list[float]]:
    """The wall time of one cycle's host copies as the simulator makes them
    (cudahook.sim.gpu.copy_memfd, from memfds of device memory), `reps`
    samples of each direction, made here on this machine's CPUs:

      sim-copy-checkpoint  `copies` processes at once, each copying a memfd
                           of `mib` MiB into one of its own (SimCuda.checkpoint
                           in each simulated CUDA process)
      sim-copy-restore     one process copying them all back, a thread each
                           (the GPU service's per-client recharge)

    A real GPU makes these copies by DMA, within its link's time; the
    simulator makes them on the CPUs, which may not keep up with the link
    it models: this is the floor that puts under a simulated phase."""
    from cudahook.sim.gpu import memfd

    size = mib << 20
    block = os.urandom(min(size, 16 << 20)) if size else b""
    sources: list[int] = []
    samples: dict[str, list[float]] = {"sim-copy-checkpoint": [], "sim-copy-restore": []}
    try:
        for _ in range(copies):  # device memory: every page written, as a workload's is
            sources.append(memfd(size))
            for off in range(0, size, len(block)):
                os.pwrite(sources[-1], block[:size - off], off)
        for _ in range(reps):
            samples["sim-copy-checkpoint"].append(
                _copy_wall(sources, size, [[fd] for fd in sources]))
            samples["sim-copy-restore"].append(_copy_wall(sources, size, [sources]))
    finally:
        for fd in sources:
            os.close(fd)
    return samples


def floor_limits(link_s: float, attach_s: float, floor: dict[str, list[float]]) -> list[float]:
    """The limit of one checkpoint+restore cycle under the simulator's
    host-copy floor, one per floor sample: per phase, its attach plus the
    longer of its link time and the CPU copies the simulator makes within
    that phase. The checkpoint's copies run within the link's time; the
    restore's copy back runs once each restored process touches the GPU
    again (after the phase, in the benchmarks' untimed memory check), so the
    restore phase's floor is its link time."""
    return [2 * attach_s + max(link_s, c) + link_s for c in floor["sim-copy-checkpoint"]]


# -- cgroups (v1 pids hierarchy or v2), for "containers" without runc ------------


def cgroup_base() -> Path | None:
    for base in (Path("/sys/fs/cgroup/pids"), Path("/sys/fs/cgroup/unified"),
                 Path("/sys/fs/cgroup")):
        if (base / "cgroup.procs").exists() and os.access(base, os.W_OK):
            return base
    return None


def make_cgroup(tag: str) -> Path | None:
    base = cgroup_base()
    if base is None:
        return None
    import uuid

    cg = base / f"cudahook-bench-{tag}-{uuid.uuid4().hex[:8]}"
    try:
        cg.mkdir()
    except OSError:
        return None
    return cg


def cgroup_pids(cg: Path) -> list[int]:
    try:
        return [int(x) for x in (cg / "cgroup.procs").read_text().split()]
    except OSError:
        return []


def wait_members(cg: Path, n: int, timeout: float = 30) -> None:
    deadline = time.monotonic() + timeout
    while len(cgroup_pids(cg)) < n:
        if time.monotonic() > deadline:
            raise TimeoutError(f"{cg}: {len(cgroup_pids(cg))} of {n} processes after {timeout}s")
        time.sleep(0.02)


def remove_cgroup(cg: Path | None, timeout: float = 10) -> None:
    """Kill whatever is left in the cgroup, then remove it."""
    if cg is None:
        return
    deadline = time.monotonic() + timeout
    while True:
        for pid in cgroup_pids(cg):
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        try:
            cg.rmdir()
            return
        except FileNotFoundError:
            return
        except OSError:
            if time.monotonic() > deadline:
                log(f"could not remove {cg}")
                return
            time.sleep(0.05)
