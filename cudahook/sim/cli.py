"""`cudahook-sim`: run the simulated GPU node's parts by hand."""

from __future__ import annotations

import argparse
import json
import sys


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["workload"]:
        from .workload import main as workload

        return workload(argv[1:])
    if argv[:1] in (["cuda-checkpoint"], ["nvidia-smi"]):
        p = argparse.ArgumentParser(prog=f"cudahook-sim {argv[0]}")
        p.add_argument("--dir", required=True)
        ns, rest = p.parse_known_args(argv[1:])
        if argv[0] == "cuda-checkpoint":
            from .tool import main as tool
        else:
            from .smi import main as tool
        return tool(rest, ns.dir)

    p = argparse.ArgumentParser(prog="cudahook-sim", description=__doc__)
    sub = p.add_subparsers(dest="cmd", required=True)
    g = sub.add_parser("gpu", help="run the GPU service in the foreground")
    g.add_argument("--dir", required=True)
    up = sub.add_parser("up", help="set up a simulated node and start its GPU service")
    up.add_argument("--dir", required=True)
    up.add_argument("--driver", type=int, default=580, choices=(550, 555, 570, 580, 590))
    up.add_argument("--gpus", type=int, default=2)
    up.add_argument("--memory-mib", type=int, default=81559)
    up.add_argument("--attach-latency", type=float, default=0.0, help="seconds per tool call")
    up.add_argument("--bandwidth", type=float, default=0.0, help="copy MiB/s (0: unlimited)")
    up.add_argument("--seed", default="node-a", help="GPU UUIDs derive from this")
    down = sub.add_parser("down", help="stop a simulated node's GPU service")
    down.add_argument("--dir", required=True)
    f = sub.add_parser("fault", help="inject a fault into the fake cuda-checkpoint")
    f.add_argument("--dir", required=True)
    f.add_argument("--clear", action="store_true")
    f.add_argument("--action", default="*")
    f.add_argument("--mode", choices=("error", "hang", "delay", "crash", "segv"),
                   default="error", help="delay: the call waits --seconds, then is carried "
                   "out; crash: the target process is killed; segv: the tool itself crashes")
    f.add_argument("--seconds", type=float, help="delay: how long the call waits")
    f.add_argument("--pid", type=int)
    f.add_argument("--tag")
    f.add_argument("--code", type=int)
    f.add_argument("--times", type=int)
    f.add_argument("--skip", type=int, help="let this many matching calls through first")
    f.add_argument("--after", action="store_true",
                   help="segv: crash only once the driver carried the call out")
    sub.add_parser("demo", help="checkpoint and restore simulated CUDA processes")
    args = p.parse_args(argv)

    from .lab import SimLab

    if args.cmd == "gpu":
        from pathlib import Path

        from .gpu import serve

        serve(Path(args.dir))
        return 0
    if args.cmd == "up":
        lab = SimLab(args.dir, driver=args.driver, gpus=args.gpus, memory_mib=args.memory_mib,
                     attach_latency_s=args.attach_latency, bandwidth_mib_s=args.bandwidth,
                     seed=args.seed).start()
        print(json.dumps({"dir": str(lab.root), "socket": str(lab.socket),
                          "cuda_checkpoint": str(lab.cuda_checkpoint),
                          "nvidia_smi": str(lab.nvidia_smi), "gpus": lab.uuids}, indent=1))
        return 0
    if args.cmd == "down":
        SimLab(args.dir).stop()
        return 0
    if args.cmd == "fault":
        lab = SimLab(args.dir)
        if args.clear:
            lab.clear_faults()
            return 0
        match = {k: v for k in ("pid", "tag", "code", "times", "skip", "after", "seconds")
                 if (v := getattr(args, k)) is not None}
        lab.fault(args.action, args.mode, **match)
        return 0
    if args.cmd == "demo":
        from .demo import process_demo as demo

        return demo()
    return 2
