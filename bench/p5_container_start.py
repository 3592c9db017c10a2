"""P5: `runc run` of a busybox container to exit, cudahook's OCI hooks registered or not.

Variants (each rep a fresh container id; `runc run` in the foreground, stdio
/dev/null, so the time covers create, start, the process (`true`), its exit
and runc's own delete, with the createRuntime and poststop hooks):
  none        no hooks in config.json
  hooks       createRuntime + poststop = the installed cudahook-oci-hook
  proto       PROTOTYPE shell fast path (bench/prototypes/oci-hook-fastpath.sh)
  true-hooks  createRuntime + poststop = /bin/true: the floor of any registered hook
  wrapper     no hooks in config.json; runc started through the installed
              cudahook-runtime wrapper (which adds hooks to GPU containers only)

Target: hooks / none <= 1.10, as a ratio of MEANS: runc run's wall time is
quantised here (~32 ms steps with or without hooks), which makes a median jump
a whole step between runs; medians are printed too.
"""

from __future__ import annotations

import subprocess
import sys
import uuid
from pathlib import Path

if __package__ in (None, ""):  # run as a file: bench/_checkout.py
    import _checkout  # noqa: F401

from bench.common import (
    PYTHON,
    Result,
    Runc,
    arg_parser,
    benchmark,
    interleave,
    log,
    reps_of,
    run_main,
    spawn_wait,
    tmpdir,
)
from bench.containers import Install, busybox_bundle
from cudahook.sim.bundle import make_bundle

TITLE = "Container start: runc run (busybox `true`) with vs without the OCI hooks"


@benchmark("P5", TITLE)
def run(args) -> Result:  # type: ignore[no-untyped-def]
    reps = reps_of(args)
    res = Result("P5", TITLE)
    with tmpdir("p5") as tmp:
        inst = Install(tmp / "cudahook")
        proto = Install(tmp / "cudahook-proto", prototype=True)
        bundles = {
            "none": busybox_bundle(tmp / "b-none", ["/bin/true"], None),
            "hooks": busybox_bundle(tmp / "b-hooks", ["/bin/true"], inst),
            "proto": busybox_bundle(tmp / "b-proto", ["/bin/true"], proto),
            "true-hooks": make_bundle(tmp / "b-true", ["/bin/true"], host_usr=False,
                                      annotations={"org.criu.config": ""}, hooks={
                s: [{"path": "/bin/true", "args": ["true", s]}]
                for s in ("createRuntime", "poststop")}),
        }
        runc = Runc(tmp)
        # The runtime-wrapper route: hooks added by cudahook-runtime to GPU
        # containers only; a plain bundle goes straight to runc.
        wrapped = None
        if inst.runtime is not None:
            wrapped = Runc(tmp)
            wrapped.runc = str(inst.runtime)
        try:
            def variant(name: str):  # type: ignore[no-untyped-def]
                r = wrapped if name == "wrapper" else runc
                bundle = bundles["none" if name == "wrapper" else name]

                def go() -> float:
                    cid = f"p5-{name}-{uuid.uuid4().hex[:8]}"
                    try:
                        return r.call("run", "-b", str(bundle), cid, cid=cid)  # type: ignore[union-attr]
                    finally:
                        runc.delete(cid)  # normally a no-op: run already deleted it
                return go

            names = [*bundles, *(["wrapper"] if wrapped else [])]
            log(f"P5: {reps} reps")
            res.add_samples(interleave({n: variant(n) for n in names}, reps, warmup=1,
                                       progress="P5"), {
                "wrapper": "cudahook-runtime wrapper in place of runc, plain bundle (no hooks)",
                "none": "runc run, no hooks",
                "hooks": "runc run, createRuntime+poststop cudahook-oci-hook",
                "proto": "runc run, PROTOTYPE shell fast-path OCI hook",
                "true-hooks": "runc run, createRuntime+poststop = /bin/true (floor of any hook)",
            })

            # Breakdown: the hook alone, as runc starts it, for a non-GPU container.
            state = ('{"ociVersion":"1.0.2","id":"p5x","status":"creating","pid":1,'
                     f'"bundle":"{bundles["hooks"]}"}}').encode()
            pstate = state.replace(str(bundles["hooks"]).encode(), str(bundles["proto"]).encode())

            def hook(path: Path, stage: str, data: bytes):  # type: ignore[no-untyped-def]
                def go() -> float:
                    dt, rc = spawn_wait([str(path), stage], {"PATH": "/usr/bin:/bin"}, data)
                    if rc != 0:
                        raise RuntimeError(f"{path} {stage} exited {rc}")
                    return dt
                return go

            parts = {
                "hook-createRuntime": hook(inst.oci_hook, "createRuntime", state),
                "hook-poststop": hook(inst.oci_hook, "poststop", state),
                "proto-createRuntime": hook(proto.oci_hook, "createRuntime", pstate),
                "proto-poststop": hook(proto.oci_hook, "poststop", pstate),
                "sh-noop": lambda: spawn_wait(["/bin/sh", "-c", ":"])[0],
            }
            res.add_samples(interleave(parts, max(10, reps), warmup=2), {
                "hook-createRuntime": "cudahook-oci-hook createRuntime alone, non-GPU bundle",
                "hook-poststop": "cudahook-oci-hook poststop alone, no record",
                "proto-createRuntime": "PROTOTYPE hook createRuntime alone",
                "proto-poststop": "PROTOTYPE hook poststop alone",
                "sh-noop": "/bin/sh -c :",
            })
            # What the poststop path imports for a container it never recorded.
            probe = subprocess.run(
                [PYTHON, "-I", "-c", "import sys; b=set(sys.modules); import cudahook.hooks.oci_hook as o, "
                 "cudahook.platform.config as c; c.load(sys.argv[1]); print(len(set(sys.modules)-b), "
                 "sorted({m.split('.')[0] for m in set(sys.modules)-b}))", str(inst.config)],
                capture_output=True, text=True, timeout=60)
            res.extra["poststop_imports"] = probe.stdout.strip()
            res.notes.append(f"poststop path (config.load) imports: {probe.stdout.strip()[:300]}")
        finally:
            runc.close()
    # Headline on MEANS: runc run's wall time comes in ~32 ms steps here, so
    # a median picks a step (none was 32 ms in one run, 64 ms in the next).
    res.ratio("hooks / none", "hooks", "none", 1.10, stat="mean")
    res.ratio("hooks / none", "hooks", "none", 1.10, headline=False)
    res.ratio("proto / none", "proto", "none", 1.10, headline=False)
    res.ratio("proto / none", "proto", "none", 1.10, headline=False, stat="mean")
    res.ratio("true-hooks / none", "true-hooks", "none", 1.10, headline=False)
    res.ratio("true-hooks / none", "true-hooks", "none", 1.10, headline=False, stat="mean")
    if "wrapper" in res.variants:
        res.ratio("wrapper / none", "wrapper", "none", 1.10, headline=False, stat="mean")
    res.notes.append("runc run's wall time is quantised here (~32 ms steps, even with /bin/true "
                     "hooks or none), so a median can jump a whole step: means shown beside")
    h, n = res.median("hooks"), res.median("none")
    c, p = res.median("hook-createRuntime"), res.median("hook-poststop")
    if h and n and c and p:
        res.notes.append(f"hooks add {(h - n) * 1000:.0f} ms per container; the two hook runs "
                         f"alone: createRuntime {c * 1000:.0f} ms + poststop {p * 1000:.0f} ms")
    return res


def parser():  # type: ignore[no-untyped-def]
    return arg_parser(__doc__.split("\n")[0], reps=80, quick_reps=10)


if __name__ == "__main__":
    sys.exit(run_main(run, parser()))
