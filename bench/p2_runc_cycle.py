"""P2: whole `runc checkpoint` + `runc restore` cycle of a busybox container, no GPU.

One long-lived container per variant (busybox `sleep`, own netns, stdio
/dev/null), cycled checkpoint -> restore -> checkpoint ... with a fresh image
directory each time (absolute paths; removed after each cycle, untimed):
  none        no OCI hooks; annotation org.criu.config="" (CRIU gets no config)
  hooks       cudahook registered: createRuntime + poststop OCI hooks, and
              org.criu.config -> criu.conf with `action-script <installed script>`
  proto       the same registration with the PROTOTYPE shell fast paths
              (bench/prototypes/*.sh) instead of the installed scripts
  true        the same registration with /bin/true as hooks and action script:
              the floor any registered hook can reach
  true-oci    only the OCI hooks (/bin/true); true-criu: only the action script
  gpu-only    cudahook installed with --criu-registration gpu-only: every runc
              call through the installed runtime wrapper, which leaves a
              container without a GPU alone; runc hands CRIU the node's
              runc.conf as `configure` left it (no action-script line)

What cudahook adds per cycle: every CRIU action runs the action script twice
(CRIU 4.1.1, issue #2727); pre-dump/post-restore/post-resume start Python;
runc runs poststop at the checkpoint's destroy and createRuntime at restore.

Target: (checkpoint+restore) gpu-only / none <= 1.02, as a ratio of MEANS:
the wall times are quantised here (~50 ms steps), so medians jump whole
steps; medians are printed too. hooks / none (the global registration) is
reported beside it against its old target, 1.10.
"""

from __future__ import annotations

import json
import os
import shutil
import sys
import uuid
from pathlib import Path

if __package__ in (None, ""):  # run as a file: bench/_checkout.py
    import _checkout  # noqa: F401

from bench.common import (
    Result,
    Runc,
    arg_parser,
    benchmark,
    interleave,
    log,
    med,
    reps_of,
    run_main,
    tmpdir,
)
from bench.containers import GpuOnlyInstall, Install, TrueInstall, busybox_bundle

TITLE = "runc checkpoint + restore (busybox, no GPU), cudahook registered vs not"


@benchmark("P2", TITLE)
def run(args) -> Result:  # type: ignore[no-untyped-def]
    from cudahook.sim.bundle import find_criu

    criu = find_criu()
    if criu is None:
        raise RuntimeError("criu >= 4.0 not found (scripts/provision-criu.sh)")
    reps = reps_of(args)
    res = Result("P2", TITLE)
    with tmpdir("p2") as tmp:
        inst = Install(tmp / "cudahook")
        proto = Install(tmp / "cudahook-proto", prototype=True)
        gpu_only = GpuOnlyInstall(tmp / "cudahook-gpu-only", Path(os.environ["CUDAHOOK_ROOT"]))
        installs = {"none": None, "gpu-only": gpu_only, "hooks": inst, "proto": proto,
                    "true": TrueInstall(tmp / "true"),
                    "true-oci": TrueInstall(tmp / "true-oci"),
                    "true-criu": TrueInstall(tmp / "true-criu", oci=False)}
        chosen = getattr(args, "variants", None)
        if chosen:  # a longer run of a few, e.g. --variants none,gpu-only
            installs = {n: v for n, v in installs.items() if n in chosen.split(",")}
        plain = Runc(tmp, criu=criu)
        wrapped = Runc(tmp / "wrapped", criu=criu, runc=str(gpu_only.runtime))
        via = {n: wrapped if n == "gpu-only" else plain for n in installs}
        cids: dict[str, str] = {}
        bundles: dict[str, Path] = {}
        ckpt: dict[str, list[float]] = {n: [] for n in installs}
        rest: dict[str, list[float]] = {n: [] for n in installs}
        try:
            for name, ins in installs.items():
                bundles[name] = busybox_bundle(tmp / f"b-{name}", ["/bin/sleep", "1000000"], ins,
                                               action_script=name != "true-oci")
                cids[name] = f"p2-{name}-{uuid.uuid4().hex[:6]}"
                via[name].call("run", "-d", "-b", str(bundles[name]), cids[name], cid=cids[name])
            res.extra["gpu_only_runc_conf"] = gpu_only.criu_conf.read_text()

            def cycle(name: str):  # type: ignore[no-untyped-def]
                def go() -> float:
                    cid = cids[name]
                    runc = via[name]
                    image = tmp / f"img-{name}"
                    try:
                        t1 = runc.call("checkpoint", "--image-path", str(image),
                                       "--work-path", f"{image}.work", cid, cid=cid)
                        t2 = runc.call("restore", "-d", "-b", str(bundles[name]),
                                       "--image-path", str(image), "--work-path",
                                       f"{image}.rwork", cid, cid=cid)
                    finally:
                        for d in (image, Path(f"{image}.work"), Path(f"{image}.rwork")):
                            shutil.rmtree(d, ignore_errors=True)
                    ckpt[name].append(t1)
                    rest[name].append(t2)
                    return t1 + t2
                return go

            log(f"P2: {reps} reps")
            cyc = interleave({n: cycle(n) for n in installs}, reps, warmup=1, progress="P2")
            # warmup samples went into ckpt/rest too: drop them
            for n in installs:
                del ckpt[n][0]
                del rest[n][0]
            # Each container survived every cycle?
            for name, cid in cids.items():
                out = __import__("subprocess").run(via[name].argv("state", cid),
                                                   capture_output=True, text=True,
                                                   timeout=30).stdout
                st = json.loads(out).get("status") if out else None
                if st != "running":
                    res.notes.append(f"{name}: container {cid} ended {st!r}")
            events = inst.dir / "cudahook.log"
            if events.exists():
                lines = [json.loads(x) for x in events.read_text().splitlines() if x.strip()]
                kinds: dict[str, int] = {}
                for e in lines:
                    kinds[e["event"]] = kinds.get(e["event"], 0) + 1
                res.extra["hook_events"] = kinds
            # gpu-only: nothing of cudahook's ran for the container (no hook
            # logged an event) and its bundle has no hooks and no CRIU copy.
            ev = gpu_only.dir / "cudahook.log"
            cfg = (json.loads((bundles["gpu-only"] / "config.json").read_text())
                   if "gpu-only" in bundles else {})
            res.extra["gpu_only_check"] = {
                "events": len(ev.read_text().splitlines()) if ev.exists() else 0,
                "hooks": cfg.get("hooks"), "annotations": cfg.get("annotations")}
            if res.extra["gpu_only_check"]["events"] or cfg.get("hooks"):
                res.notes.append(f"gpu-only: cudahook ran for the plain container: "
                                 f"{res.extra['gpu_only_check']}")
        finally:
            wrapped.close()
            plain.close()

    samples = {f"cycle-{n}": v for n, v in cyc.items()}
    samples.update({f"checkpoint-{n}": v for n, v in ckpt.items()})
    samples.update({f"restore-{n}": v for n, v in rest.items()})
    res.add_samples(samples, {
        "cycle-none": "runc checkpoint + runc restore, nothing registered",
        "cycle-gpu-only": "the same, cudahook installed gpu-only, runc through its wrapper",
        "cycle-hooks": "the same with cudahook's OCI hooks and action script",
        "cycle-proto": "the same with the PROTOTYPE shell fast paths",
        "cycle-true": "the same with OCI hooks and action script = /bin/true (the floor)",
        "cycle-true-oci": "only the OCI hooks, = /bin/true (no CRIU config)",
        "cycle-true-criu": "only the action script, = /bin/true (no OCI hooks)",
    })
    # Headline on MEANS: runc/CRIU wall times come in ~50 ms steps here.
    res.ratio("cycle gpu-only / none (no GPU)", "cycle-gpu-only", "cycle-none", 1.02,
              stat="mean")
    res.ratio("cycle gpu-only / none (no GPU)", "cycle-gpu-only", "cycle-none", 1.02,
              headline=False)
    res.ratio("checkpoint gpu-only / none", "checkpoint-gpu-only", "checkpoint-none", 1.02,
              headline=False, stat="mean")
    res.ratio("restore gpu-only / none", "restore-gpu-only", "restore-none", 1.02,
              headline=False, stat="mean")
    res.ratio("cycle hooks (global) / none", "cycle-hooks", "cycle-none", 1.10, stat="mean",
              headline=False)
    res.ratio("cycle hooks / none", "cycle-hooks", "cycle-none", 1.10, headline=False)
    res.ratio("checkpoint hooks / none", "checkpoint-hooks", "checkpoint-none", 1.10,
              headline=False)
    res.ratio("restore hooks / none", "restore-hooks", "restore-none", 1.10, headline=False)
    res.ratio("cycle proto / none", "cycle-proto", "cycle-none", 1.10, headline=False)
    res.ratio("cycle proto / none", "cycle-proto", "cycle-none", 1.10, headline=False,
              stat="mean")
    res.ratio("cycle true / none", "cycle-true", "cycle-none", 1.10, headline=False)
    res.ratio("cycle true / none", "cycle-true", "cycle-none", 1.10, headline=False,
              stat="mean")
    for v in ("true-oci", "true-criu"):
        res.ratio(f"cycle {v} / none", f"cycle-{v}", "cycle-none", 1.10, headline=False,
                  stat="mean")
        res.ratio(f"restore {v} / none", f"restore-{v}", "restore-none", 1.10, headline=False,
                  stat="mean")
    res.notes.append("runc/CRIU wall times are quantised here (~50 ms steps), so a median can "
                     "jump a whole step: means shown beside")
    res.ratios = [r for r in res.ratios if r["value"] is not None]  # variants left out
    h, n = med(cyc.get("hooks", [])), med(cyc.get("none", []))
    if h and n:
        res.notes.append(f"cudahook adds {(h - n) * 1000:.0f} ms per cycle")
    return res


def parser():  # type: ignore[no-untyped-def]
    p = arg_parser(__doc__.split("\n")[0], reps=40, quick_reps=4)
    p.add_argument("--variants", default="",
                   help="only these variants, comma separated (default: all)")
    return p


if __name__ == "__main__":
    sys.exit(run_main(run, parser()))
