"""A drop-in `cuda-checkpoint` for the simulated GPU.

Same command line, outputs, exit statuses and error texts as NVIDIA's tool
for the emulated driver branch (R550: --toggle only; R555/R570: actions,
--get-state, --get-restore-tid, --timeout, short options; R580: --device-map).
Like the real tool it talks to the target's own restore thread, so a frozen
or stopped target makes it hang; every invocation pays the configured driver
attach latency. Faults can be injected per PID, per workload tag and action.

Kept to the standard library and cheap imports: benchmarks start dozens of
these at once on two cores, and their start-up counts against the engine.
"""

from __future__ import annotations

import os
import sys
import time

from . import wire
from .wire import CUDA_ERRORS, INVALID_VALUE, NOT_INITIALIZED, UNKNOWN, CudaError

VERSIONS = {550: "550.54.15", 555: "555.42.06", 570: "570.86.10", 580: "580.65.06"}

HELP_550 = """CUDA checkpoint and restore utility.
Version {version}. Copyright (C) 2024 NVIDIA Corporation. All rights reserved.

    --toggle --pid <pid>
        Toggles the CUDA state in the specified process between the running and checkpointed states

    --help
        Print this help message
"""

HELP_555 = """CUDA checkpoint and restore utility.
Version {version}. Copyright (C) 2025 NVIDIA Corporation. All rights reserved.

Operations:
--get-state --pid <pid>
        Prints the current checkpoint state of the process specified by <pid>

--action lock | checkpoint | restore | unlock --pid <pid> [--timeout <ms>]{map_usage}
        Performs the specified action on <pid>.
        For the lock action a timeout can be provided, the lock operation will wait up to <ms> milliseconds for the operation to succeed.

--toggle --pid <pid>
        Toggles the CUDA state in the specified process between the running and checkpointed states

--get-restore-tid --pid <pid>
        Retrieves the CUDA restore thread ID of the process specified by <pid>

Options:
--pid|-p <pid>
        The pid upon which to perform the operation

--timeout|-t <timeout>
        Optional timeout that can be specified for the lock action in milliseconds
{map_option}
--help|-h
        Print this help message
"""

MAP_USAGE = " [--device-map <old_uuid>=<new_uuid>,...]"
MAP_OPTION = """
--device-map <old_uuid>=<new_uuid>,...
        Optional GPU remapping for the restore action, with UUIDs in GPU-xxxxxxxx-... form.
        Every GPU used by the checkpointed process must be listed.
"""

# What each operation's failure message says, by action.
FAIL_TEXT = {
    "lock": "Could not lock on process ID {pid}",
    "checkpoint": "Could not checkpoint on process ID {pid}",
    "restore": "Could not restore on process ID {pid}",
    "unlock": "Could not unlock on process ID {pid}",
    "get-state": "Could not get state of process ID {pid}",
    "get-restore-tid": "Could not find restore thread for process ID {pid}",
    "toggle": "Error toggling CUDA in process ID {pid}",
}


def help_text(major: int) -> str:
    version = VERSIONS.get(major, f"{major}.00.00")
    if major < 555:
        return HELP_550.format(version=version)
    with_map = major >= 580
    return HELP_555.format(
        version=version,
        map_usage=MAP_USAGE if with_map else "",
        map_option=MAP_OPTION if with_map else "",
    )


class Usage(Exception):
    pass


def parse_args(argv: list[str], major: int) -> dict[str, str]:
    longs = {"--toggle": None, "--pid": "pid", "--help": None}
    shorts: dict[str, str] = {}
    if major >= 555:
        longs.update({"--get-state": None, "--get-restore-tid": None, "--action": "action",
                      "--timeout": "timeout"})
        shorts = {"-p": "--pid", "-t": "--timeout", "-h": "--help"}
    if major >= 580:
        longs["--device-map"] = "device_map"
    opts: dict[str, str] = {}
    i = 0
    while i < len(argv):
        arg = argv[i]
        name, eq, value = arg.partition("=")
        name = shorts.get(name, name)
        if name not in longs:
            raise Usage(f"unrecognized option '{arg}'")
        key = longs[name]
        if key is None:
            if eq:
                raise Usage(f"option '{name}' doesn't allow an argument")
            opts[name.lstrip("-")] = ""
        else:
            if not eq:
                i += 1
                if i >= len(argv):
                    raise Usage(f"option '{name}' requires an argument")
                value = argv[i]
            opts[key] = value
        i += 1
    return opts


def main(argv: list[str], sim_dir: str) -> int:
    try:
        with open(os.path.join(sim_dir, "sim.json")) as f:
            config = wire.loads(f.read())
    except OSError as exc:
        print(f"cuda-checkpoint: simulator not set up: {exc}", file=sys.stderr)
        return UNKNOWN & 0xFF
    major = int(str(config["driver_version"]).split(".")[0])
    try:
        opts = parse_args(argv, major)
    except Usage as exc:
        sys.stderr.write(f"cuda-checkpoint: {exc}\n{help_text(major)}")
        return INVALID_VALUE
    if "help" in opts or not opts:
        sys.stdout.write(help_text(major))
        return 0
    ops = [k for k in ("toggle", "get-state", "get-restore-tid", "action") if k in opts]
    if len(ops) != 1 or "pid" not in opts:
        sys.stderr.write(f"cuda-checkpoint: exactly one operation and --pid are required\n"
                         f"{help_text(major)}")
        return INVALID_VALUE
    op = opts.get("action") if ops[0] == "action" else ops[0]
    if op not in FAIL_TEXT or op is None:
        sys.stderr.write(f"cuda-checkpoint: invalid action '{op}'\n{help_text(major)}")
        return INVALID_VALUE
    request: dict[str, object] = {"op": op}
    try:
        pid = int(opts["pid"])
        if "timeout" in opts:
            if op != "lock":
                raise ValueError("--timeout applies to the lock action only")
            request["timeout_ms"] = int(opts["timeout"])
        if "device_map" in opts:
            if op != "restore":
                raise ValueError("--device-map applies to the restore action only")
            request["device_map"] = _parse_map(opts["device_map"])
    except ValueError as exc:
        sys.stderr.write(f"cuda-checkpoint: {exc}\n")
        return INVALID_VALUE

    # Every invocation initialises the driver before it can do anything.
    time.sleep(float(config.get("attach_latency_s", 0)))
    try:
        _inject_fault(sim_dir, pid, op)
        reply = _ask(pid, request) if op != "toggle" else _toggle(pid)
    except CudaError as exc:
        sys.stderr.write(f'{FAIL_TEXT[op].format(pid=pid)}: "{exc}"\n')
        return exc.code & 0xFF
    if op == "get-state":
        print(reply["state"])
    elif op == "get-restore-tid":
        print(reply["tid"])
    return 0


def _parse_map(text: str) -> dict[str, str]:
    mapping = {}
    for part in text.split(","):
        old, sep, new = part.partition("=")
        if not sep or not old.startswith("GPU-") or not new.startswith("GPU-"):
            raise ValueError(f"invalid device map entry '{part}'")
        mapping[old] = new
    return mapping


def _target(pid: int) -> tuple[str, int]:
    """The control socket of the target's restore thread, through its own root."""
    proc = f"/proc/{pid}"
    try:
        with open(f"{proc}/status") as f:
            nspid = next(int(line.split()[-1]) for line in f if line.startswith("NSpid:"))
        with open(f"{proc}/environ", "rb") as f:
            env = dict(
                item.split(b"=", 1) for item in f.read().split(b"\0") if b"=" in item
            )
    except (OSError, StopIteration) as exc:
        raise CudaError(INVALID_VALUE) from exc
    ctl_dir = env.get(b"CUDA_SIM_CTL_DIR", b"/dev/shm").decode()
    return f"{proc}/root{ctl_dir}/cuda-sim-{nspid}.sock", nspid


def _ask(pid: int, request: dict[str, object]) -> dict[str, object]:
    path, _ = _target(pid)
    if not os.path.exists(path):
        raise CudaError(NOT_INITIALIZED)  # no CUDA in that process
    try:
        line = wire.request(path, (wire.dumps(request) + "\n").encode())
        if not line:
            raise EOFError("no reply")
        reply = wire.loads(line.decode())
    except ConnectionRefusedError as exc:
        raise CudaError(NOT_INITIALIZED) from exc
    except (OSError, EOFError, ValueError) as exc:
        raise CudaError(UNKNOWN) from exc
    if not reply.get("ok"):
        raise CudaError(int(reply.get("code", UNKNOWN)), str(reply.get("error") or ""))
    return reply


def _toggle(pid: int) -> dict[str, object]:
    state = _ask(pid, {"op": "get-state"})["state"]
    if state == "running":
        _ask(pid, {"op": "lock", "timeout_ms": 0})
        _ask(pid, {"op": "checkpoint"})
    elif state == "checkpointed":
        _ask(pid, {"op": "restore"})
        _ask(pid, {"op": "unlock"})
    else:
        raise CudaError(401)
    return {}


def _inject_fault(sim_dir: str, pid: int, op: str) -> None:
    path = os.path.join(sim_dir, "faults.json")
    if not os.path.exists(path):
        return
    import fcntl
    import json

    with open(path, "r+") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        rules = json.loads(f.read() or "[]")
        hit = None
        for rule in rules:
            if rule.get("action", "*") not in ("*", op):
                continue
            if "pid" in rule and int(rule["pid"]) != pid:
                continue
            if "tag" in rule and rule["tag"] != _tag(pid):
                continue
            if rule.get("times", 1) <= 0:
                continue
            hit = rule
            if "times" in rule:
                rule["times"] -= 1
                f.seek(0)
                f.truncate()
                f.write(json.dumps(rules))
            break
    if hit is None:
        return
    mode = hit.get("mode", "error")
    if mode == "hang":
        while True:
            time.sleep(3600)
    if mode == "crash":
        import signal

        os.kill(pid, signal.SIGKILL)
        raise CudaError(UNKNOWN)
    code = int(hit.get("code", UNKNOWN))
    raise CudaError(code, hit.get("message") or CUDA_ERRORS.get(code, "unknown error"))


def _tag(pid: int) -> str | None:
    try:
        return str(_ask(pid, {"op": "status"}).get("tag"))
    except CudaError:
        return None
