"""A drop-in CUDA VMM coordinator (`snapshot-cuda-vmm`) for the simulated GPU.

    --prepare --proc-root /proc --checkpoint-dir DIR --process HOSTPID NSPID ...
    --restore --proc-root "" --checkpoint-dir DIR --process HOSTPID NSPID ...

Prepare asks each process's shim for its VMM mappings and writes them to
DIR/cuda-vmm.state atomically; restore replays them into the processes. An
empty --proc-root means the default /proc: this coordinator runs on the host
beside the workload and reaches each shim through /proc/HOSTPID/root.
Faults: rules in the node's faults.json with action vmm-prepare / vmm-restore
(modes in `_fault`).
"""

from __future__ import annotations

import json
import os
import signal
import sys
import time

from .protocol import connect_unix, recv, send

STATE = "cuda-vmm.state"


def _shim(proc_root: str, host_pid: int, nspid: int, msg: dict) -> dict:  # type: ignore[type-arg]
    path = f"{proc_root or '/proc'}/{host_pid}/root/snapshot-control/cuda-vmm-{nspid}.sock"
    sock = connect_unix(path, timeout=30)
    try:
        stream = sock.makefile("rwb")
        send(stream, msg)
        reply, _ = recv(stream)
    finally:
        sock.close()
    if not reply.get("ok"):
        raise RuntimeError(f"shim of process {host_pid}: {reply.get('error')}")
    return reply


def _fault(sim_dir: str, op: str, procs: list[tuple[int, int]]) -> None:
    """The injected fault for this run, if any. Modes: `error` (the default:
    fail with `message`), `hang` (never return), `crash` (the target process
    `pid`, else the first, is killed; replaying into it then fails), `segv` (the
    coordinator itself dies of SIGSEGV, nothing printed)."""
    path = os.path.join(sim_dir, "faults.json")
    try:
        with open(path) as f:
            rules = json.load(f)
    except (OSError, ValueError):
        return
    for rule in rules:
        if rule.get("action") == f"vmm-{op}":
            mode = rule.get("mode", "error")
            if mode == "hang":
                while True:
                    time.sleep(3600)
            if mode == "segv":
                sys.stdout.flush()
                signal.signal(signal.SIGSEGV, signal.SIG_DFL)
                os.kill(os.getpid(), signal.SIGSEGV)
            if mode == "crash":
                os.kill(int(rule.get("pid") or procs[0][0]), signal.SIGKILL)
                return
            raise RuntimeError(rule.get("message") or f"injected {op} failure")


def main(argv: list[str], sim_dir: str) -> int:
    op = None
    proc_root, directory, procs = "/proc", "", []
    try:
        i = 0
        while i < len(argv):
            a = argv[i]
            if a in ("--prepare", "--restore"):
                op = a[2:]
            elif a == "--proc-root":
                proc_root, i = argv[i + 1], i + 1
            elif a == "--checkpoint-dir":
                directory, i = argv[i + 1], i + 1
            elif a == "--process":
                procs.append((int(argv[i + 1]), int(argv[i + 2])))
                i += 2
            else:
                raise ValueError(f"unknown argument {a}")
            i += 1
        if op is None or not directory or not procs:
            raise ValueError("need --prepare|--restore, --checkpoint-dir and --process")
    except (ValueError, IndexError) as exc:
        print(f"snapshot-cuda-vmm: {exc}", file=sys.stderr)
        return 2
    with open(os.path.join(sim_dir, "vmm-calls.log"), "a") as log:
        log.write(json.dumps({"op": op, "proc_root": proc_root, "dir": directory,
                              "processes": procs}) + "\n")
    try:
        _fault(sim_dir, op, procs)
        state_path = os.path.join(directory, STATE)
        if op == "prepare":
            state = {"version": 1, "processes": {
                str(ns): _shim(proc_root, pid, ns, {"op": "export"})["mappings"]
                for pid, ns in procs}}
            tmp = f"{state_path}.tmp.{os.getpid()}"
            with open(tmp, "w") as f:
                json.dump(state, f)
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, state_path)
            print(f"prepared CUDA VMM state for {len(procs)} processes")
        else:
            with open(state_path) as f:
                state = json.load(f)
            for pid, ns in procs:
                mappings = state["processes"].get(str(ns))
                if mappings is None:
                    raise RuntimeError(f"no VMM state for namespace pid {ns}")
                _shim(proc_root, pid, ns, {"op": "import", "mappings": mappings})
            print(f"restored CUDA VMM state into {len(procs)} processes")
    except (OSError, RuntimeError, ValueError, KeyError) as exc:
        print(f"snapshot-cuda-vmm: {op} failed: {exc}", file=sys.stderr)
        return 1
    return 0
