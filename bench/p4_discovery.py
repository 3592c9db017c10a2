"""P4: discovery of a 50-process container on a host with 5,000 extra processes vs none.

The container: `unshare --pid --fork` running a shell init and 49 `sleep`s
(50 processes in their own PID namespace), the init joined to its own pids
cgroup first, as runc does (like tests/test_discovery.py's start_container).
A second such container WITHOUT its own cgroup shows the fallback
(a scan of every PID on the host for the namespace: "pidns-scan").

The crowd: one helper process forks 5,000 children that only wait (own
process group, PR_SET_PDEATHSIG, and a SIGTERM handler that kills and reaps
them all); it is started and stopped between blocks of measurements, and
blocks alternate (none, crowd, crowd, none, ...) so drift cancels.

Variants, each the median over many calls within a block:
  container_pids  cudahook.core.discovery.container_pids(host, init)   (cgroup scope)
  discover        cudahook.core.discovery.discover(...)  (+ device-fd filter of the 50)
  pidns-scan      container_pids for the container without its own cgroup

Target: discover with crowd / without <= 1.2.
"""

from __future__ import annotations

import os
import resource
import signal
import subprocess
import sys
import time
from pathlib import Path

if __package__ in (None, ""):  # run as a file: bench/_checkout.py
    import _checkout  # noqa: F401

from bench.common import (
    PYTHON,
    Result,
    arg_parser,
    benchmark,
    kill_group,
    log,
    make_cgroup,
    med,
    remove_cgroup,
    reps_of,
    run_main,
    timed,
    wait_members,
)

TITLE = "Discovery: 50-process container, host with 5,000 extra processes vs none"

CROWD = r"""
import ctypes, os, signal, sys, time
n = int(sys.argv[1])
libc = ctypes.CDLL(None)
kids = []
def stop(*_):
    for k in kids:
        try: os.kill(k, signal.SIGKILL)
        except ProcessLookupError: pass
    for k in kids:
        try: os.waitpid(k, 0)
        except ChildProcessError: pass
    os._exit(0)
signal.signal(signal.SIGTERM, stop)
for i in range(n):
    try:
        pid = os.fork()
    except OSError as e:
        print(f"fork failed after {i}: {e}", flush=True); stop()
    if pid == 0:
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        libc.prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
        if os.getppid() == 1: os._exit(0)
        while True: signal.pause()
    kids.append(pid)
print("ready", flush=True)
while True: signal.pause()
"""


class Crowd:
    """N idle processes, reliably gone after stop()."""

    def __init__(self, n: int):
        self.n = n
        self.proc: subprocess.Popen[str] | None = None

    def start(self) -> float:
        t0 = time.perf_counter()
        self.proc = subprocess.Popen([PYTHON, "-I", "-c", CROWD, str(self.n)],
                                     stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                                     stderr=subprocess.DEVNULL, text=True,
                                     start_new_session=True)
        line = self.proc.stdout.readline() if self.proc.stdout else ""
        if line.strip() != "ready":
            self.stop()
            raise RuntimeError(f"crowd of {self.n} did not start: {line.strip()!r}")
        return time.perf_counter() - t0

    def stop(self) -> None:
        p, self.proc = self.proc, None
        if p is None:
            return
        try:
            p.send_signal(signal.SIGTERM)
            p.wait(timeout=60)
        except Exception:
            pass
        finally:
            kill_group(p)  # and anything that escaped the handler
            if p.stdout:
                p.stdout.close()


def host_procs() -> int:
    return sum(1 for x in os.listdir("/proc") if x.isdigit())


def start_container(n: int, cgroup: bool):  # type: ignore[no-untyped-def]
    """(outer Popen, init host PID, cgroup dir or None)"""
    cg = make_cgroup("p4") if cgroup else None
    if cgroup and cg is None:
        raise RuntimeError("no writable pids/cgroup hierarchy for the container")
    join = f"echo $$ > {cg}/cgroup.procs; " if cg else ""
    inner = join + " ".join(["sleep 1000000 &"] * (n - 1)) + " wait"
    outer = subprocess.Popen(["unshare", "--pid", "--fork", "--kill-child", "sh", "-c", inner],
                             stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                             stderr=subprocess.DEVNULL, start_new_session=True)
    try:
        deadline = time.monotonic() + 30
        init = None
        while init is None:
            for pid in _children(outer.pid):
                init = pid
            if time.monotonic() > deadline:
                raise TimeoutError("container init did not appear")
            time.sleep(0.02)
        if cg:
            wait_members(cg, n)
        else:
            while len(_ns_members(init)) < n:
                if time.monotonic() > deadline:
                    raise TimeoutError("container processes did not appear")
                time.sleep(0.05)
    except BaseException:
        kill_group(outer)
        remove_cgroup(cg)
        raise
    return outer, init, cg


def _children(ppid: int) -> list[int]:
    from cudahook.platform.host import Host

    h = Host()
    out = []
    for p in h.all_pids():
        try:
            if h.ppid(p) == ppid:
                out.append(p)
        except Exception:
            continue
    return out


def _ns_members(init: int) -> list[int]:
    ns = os.readlink(f"/proc/{init}/ns/pid")
    out = []
    for p in os.listdir("/proc"):
        if p.isdigit():
            try:
                if os.readlink(f"/proc/{p}/ns/pid") == ns:
                    out.append(int(p))
            except OSError:
                continue
    return out


@benchmark("P4", TITLE)
def run(args) -> Result:  # type: ignore[no-untyped-def]
    from cudahook.core.discovery import container_pids, discover
    from cudahook.platform.host import Host
    from cudahook.sim.lab import SimLab

    blocks = reps_of(args)
    inner = args.inner
    res = Result("P4", TITLE)
    soft, _hard = resource.getrlimit(resource.RLIMIT_NPROC)
    pid_max = int(Path("/proc/sys/kernel/pid_max").read_text())
    need = args.crowd + args.procs * 2 + 500
    if os.geteuid() != 0 and soft != resource.RLIM_INFINITY and soft < need:
        raise RuntimeError(f"RLIMIT_NPROC {soft} < {need}")
    if pid_max < need + host_procs():
        raise RuntimeError(f"pid_max {pid_max} too small for {need} more processes")

    host = Host()
    settings = SimLab("/nonexistent").settings()  # device pattern; no tool is ever called
    from cudahook.core.backends.cli import CudaCheckpointCLI
    backend = CudaCheckpointCLI(host, settings)
    regex = settings.device_regex

    crowd = Crowd(args.crowd)
    outer = outer2 = None
    cg = None
    samples: dict[str, list[float]] = {}
    try:
        outer, init, cg = start_container(args.procs, cgroup=True)
        outer2, init2, _ = start_container(args.procs, cgroup=False)
        got, scope = container_pids(host, init)
        got2, scope2 = container_pids(host, init2)
        res.extra["scope"] = {"cgroup-container": [scope, len(got)],
                              "no-cgroup-container": [scope2, len(got2)]}
        if len(got) != args.procs or len(got2) != args.procs:
            res.notes.append(f"found {len(got)} ({scope}) and {len(got2)} ({scope2}) processes, "
                             f"expected {args.procs}")

        def block(tag: str) -> None:
            fns = {
                "container_pids": lambda: container_pids(host, init),
                "discover": lambda: discover(host, backend, init, regex),
                "pidns-scan": lambda: container_pids(host, init2),
            }
            for name, fn in fns.items():
                fn()  # warm
                xs = [timed(fn) for _ in range(inner if name != "pidns-scan" else
                                                max(3, inner // 4))]
                samples.setdefault(f"{name}-{tag}", []).append(med(xs))  # type: ignore[arg-type]

        starts = []
        counts = {}
        for b in range(blocks):
            order = ["none", "crowd"] if b % 2 == 0 else ["crowd", "none"]
            for tag in order:
                if tag == "crowd" and crowd.proc is None:
                    starts.append(crowd.start())
                if tag == "none" and crowd.proc is not None:
                    crowd.stop()
                    _wait_gone(args.crowd)
                counts.setdefault(tag, []).append(host_procs())
                block(tag)
            log(f"P4 block {b + 1}/{blocks}: host processes {counts['none'][-1]} / "
                f"{counts['crowd'][-1]}")
        crowd.stop()
        res.extra["host_processes"] = {k: [min(v), max(v)] for k, v in counts.items()}
        res.extra["crowd_start_s"] = [round(x, 2) for x in starts]
    finally:
        crowd.stop()
        kill_group(outer)
        kill_group(outer2)
        remove_cgroup(cg)

    res.add_samples(samples, {
        "container_pids-none": "cgroup-scoped container_pids, quiet host",
        "container_pids-crowd": "the same, +crowd processes on the host",
        "discover-none": "discover() (scope + device-fd filter of 50), quiet host",
        "discover-crowd": "the same, +crowd",
        "pidns-scan-none": "container without its own cgroup: /proc-wide namespace scan",
        "pidns-scan-crowd": "the same, +crowd",
    })
    res.ratio("discover crowd / none", "discover-crowd", "discover-none", 1.2)
    res.ratio("container_pids crowd / none", "container_pids-crowd", "container_pids-none", 1.2,
              headline=False)
    res.ratio("pidns-scan crowd / none", "pidns-scan-crowd", "pidns-scan-none", None,
              headline=False)
    hp = res.extra.get("host_processes", {})
    res.notes.append(f"host processes: none {hp.get('none')}, crowd {hp.get('crowd')}; each "
                     f"sample is the median of {inner} calls in one block")
    return res


def _wait_gone(n: int, timeout: float = 60) -> None:
    """Until the crowd's processes have left /proc (reaped, not zombies)."""
    deadline = time.monotonic() + timeout
    base = host_procs()
    while time.monotonic() < deadline:
        time.sleep(0.1)
        now = host_procs()
        if now < n or now == base:
            return
        base = now


def parser():  # type: ignore[no-untyped-def]
    p = arg_parser(__doc__.split("\n")[0], reps=6, quick_reps=2)
    p.add_argument("--crowd", type=int, default=5000, help="extra host processes")
    p.add_argument("--procs", type=int, default=50, help="container processes")
    p.add_argument("--inner", type=int, default=40, help="calls per block")
    return p


if __name__ == "__main__":
    sys.exit(run_main(run, parser()))
