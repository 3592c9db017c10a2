"""A drop-in `cuda-checkpoint` for the simulated GPU.

The real tool is a stub that hands its arguments to the installed driver, so
everything here follows the emulated driver branch: R550 calls cuInit first
and takes exactly `--toggle --pid N`; R555/R570 parse with getopt_long
(actions, --get-state, --get-restore-tid, --timeout, `--pid=N`, `-pN`,
unique abbreviations); R580 adds --device-map/-d. Help and usage texts are
the recorded ones; every failure exits 1 (R555+) or 255 (R550) with the
CUDA error only in stderr. Like the real tool it talks to the target's own
restore thread, so a frozen or stopped target makes it hang; every
invocation but R555+'s usage and help pays the configured driver attach
latency and per-call cost. Faults can be injected per PID, per workload tag and action.

Kept to the standard library and cheap imports: benchmarks start dozens of
these at once on two cores, and their start-up counts against the engine.
"""

from __future__ import annotations

import os
import sys
import time

from . import wire
from .wire import (
    CUDA_ERRORS,
    ILLEGAL_STATE,
    INVALID_VALUE,
    NO_DEVICE,
    NOT_INITIALIZED,
    UNKNOWN,
    CudaError,
)

# The driver release each emulated branch reports (R550 and R555 as recorded).
VERSIONS = {550: "550.163.01", 555: "555.58.02", 570: "570.86.10", 580: "580.65.06",
            590: "590.44.01"}
COPYRIGHT = {550: 2024, 555: 2024}

# The real help text (recorded from driver 555.58.02; 570.86.10 prints the
# same lines), tabs included. Only the version line changes with the driver.
HELP = (
    "CUDA checkpoint and restore utility.\n"
    "Version {version}. Copyright (C) {year} NVIDIA Corporation. All rights reserved.\n"
    "\n"
    "Operations:\n"
    "--get-state --pid <pid>\n"
    "\tPrints the current checkpoint state of the process specified by <pid>\n"
    "\n"
    "--action lock | checkpoint | restore | unlock --pid <pid> [--timeout <ms>]\n"
    "\tPerforms the specified action on <pid>.\n"
    "\tFor the lock action a timeout can be provided, the lock operation will wait up to "
    "<ms> milliseconds for the operation to succeed.\n"
    "\n"
    "--toggle --pid <pid>\n"
    "\tToggles the CUDA state in the specified process between the running and "
    "checkpointed states\n"
    "\n"
    "--get-restore-tid --pid <pid>\n"
    "\tRetrieves the CUDA restore thread ID of the process specified by <pid>\n"
    "\n"
    "{job_operation}"
    "Options:\n"
    "--pid|-p <pid>\n"
    "\tThe pid upon which to perform the operation\n"
    "\n"
    "--timeout|-t <timeout>\n"
    "\tOptional timeout that can be specified for the lock action in milliseconds\n"
    "\n"
    "{map_option}"
    "--help|-h\n"
    "\tPrint this help message\n"
)
# R580 adds the device map option (restore only, every GPU listed).
MAP_OPTION = (
    "--device-map|-d <old_uuid>=<new_uuid>,...\n"
    "\tOptional GPU remapping for the restore action, with UUIDs in GPU-xxxxxxxx-... form. "
    "Every GPU used by the checkpointed process must be listed.\n"
    "\n"
)
# R590 adds jobs. Not recorded from a real driver yet: the evidence
# recorder compares it on the first R590 node it meets.
JOB_OPERATION = (
    "--launch-job <job_file> <command> [<args>...]\n"
    "\tLaunches <command> as a member of the job described by <job_file>; operations on "
    "the processes of one job must be performed one at a time\n"
    "\n"
)
INVALID = "Invalid option(s) or option(s) not supported by this CUDA Driver"
ACTIONS = ("lock", "checkpoint", "restore", "unlock")


def help_text(major: int) -> str:
    """The help the emulated driver prints; R550 has none (see `main`)."""
    version = VERSIONS.get(major, f"{major}.00.00")
    return HELP.format(version=version, year=COPYRIGHT.get(major, 2025),
                       map_option=MAP_OPTION if major >= 580 else "",
                       job_operation=JOB_OPERATION if major >= 590 else "")


def fail_text(op: str, pid: int, error: str) -> str:
    """The driver's failure line for `op` on `pid`, as the driver prints it (docs/drivers.md)."""
    if op == "get-state":
        return f'Error getting process state for process ID {pid}: "{error}"\n'
    if op == "get-restore-tid":
        return f"Could not find restore thread for process ID {pid}\n"
    return f'Could not {op} on process ID {pid}: "{error}"\n'


class Usage(Exception):
    """Bad command line: the getopt messages, if any, then the tool's own line."""

    def __init__(self, message: str, getopt_lines: list[str] | None = None):
        self.getopt_lines = getopt_lines or []
        super().__init__(message)


def _longopts(major: int) -> dict[str, bool]:
    """Long option -> takes an argument."""
    longs = {"get-state": False, "action": True, "toggle": False, "get-restore-tid": False,
             "pid": True, "timeout": True, "help": False}
    if major >= 580:
        longs["device-map"] = True
    return longs


def parse_args(argv: list[str], major: int, prog: str = "cuda-checkpoint") -> dict[str, str]:
    """getopt_long as glibc does it: `--pid=N`, `--pid N`, `-pN`, `-p N`,
    unique abbreviations of long options, non-options skipped."""
    longs = _longopts(major)
    shorts = {"p": "pid", "t": "timeout", "h": "help"}
    if major >= 580:
        shorts["d"] = "device-map"
    opts: dict[str, str] = {}
    errors: list[str] = []

    def put(name: str, value: str) -> None:
        if name in ("get-state", "toggle", "get-restore-tid"):
            opts["op"] = name
        elif name == "action":
            opts["op"] = "action"
            opts["action"] = value
        else:
            opts[name] = value

    i = 0
    while i < len(argv):
        arg = argv[i]
        i += 1
        if arg == "--":
            break
        if arg.startswith("--"):
            body, eq, value = arg[2:].partition("=")
            if body in longs:
                name = body
            else:
                found = [n for n in longs if n.startswith(body)] if body else []
                if len(found) > 1:
                    errors.append(f"{prog}: option '--{body}' is ambiguous; possibilities:"
                                  + "".join(f" '--{n}'" for n in found))
                    continue
                if not found:
                    errors.append(f"{prog}: unrecognized option '{arg}'")
                    continue
                name = found[0]
            if not longs[name]:
                if eq:
                    errors.append(f"{prog}: option '--{name}' doesn't allow an argument")
                    continue
                put(name, "")
                continue
            if not eq:
                if i >= len(argv):
                    errors.append(f"{prog}: option '--{name}' requires an argument")
                    continue
                value = argv[i]
                i += 1
            put(name, value)
        elif arg.startswith("-") and arg != "-":
            j = 1
            while j < len(arg):
                c = arg[j]
                j += 1
                if c not in shorts:
                    errors.append(f"{prog}: invalid option -- '{c}'")
                    continue
                name = shorts[c]
                if not longs[name]:
                    put(name, "")
                    continue
                if j < len(arg):
                    value = arg[j:]
                elif i < len(argv):
                    value = argv[i]
                    i += 1
                else:
                    errors.append(f"{prog}: option requires an argument -- '{c}'")
                    break
                put(name, value)
                break
        # getopt_long moves non-options to the end; the tool never reads them.
    if errors:
        raise Usage(INVALID, errors)
    return opts


def _usage(exc: Usage, major: int) -> int:
    lines = "".join(f"{line}\n" for line in exc.getopt_lines)
    sys.stderr.write(f"{lines}{exc}\n\n{help_text(major)}")
    return 1


def _cuda_init(config: dict, sim_dir: str) -> str | None:
    """cuInit: the driver attach every call pays, then the call's own cost;
    why it failed, or None."""
    time.sleep(float(config.get("attach_latency_s", 0)) + float(config.get("call_cost_s", 0)))
    if not config.get("gpus"):
        return CUDA_ERRORS[NO_DEVICE]
    try:
        with open(os.path.join(sim_dir, "gpu.pid")) as f:
            os.kill(int(f.read()), 0)
    except PermissionError:
        pass  # alive, run by another user
    except (OSError, ValueError):
        return CUDA_ERRORS[NO_DEVICE]  # the GPU service (the "driver") is not up
    return None


def main(argv: list[str], sim_dir: str, prog: str = "cuda-checkpoint") -> int:
    try:
        with open(os.path.join(sim_dir, "sim.json")) as f:
            config = wire.loads(f.read())
    except OSError as exc:
        print(f"cuda-checkpoint: simulator not set up: {exc}", file=sys.stderr)
        return 1
    major = int(str(config["driver_version"]).split(".")[0])
    if major < 555:
        return _main_r550(argv, config, sim_dir)
    if major >= 590 and argv[:1] == ["--launch-job"]:
        return _launch_job(argv[1:], major)
    try:
        opts = parse_args(argv, major, prog)
    except Usage as exc:
        return _usage(exc, major)
    if "help" in opts:
        sys.stdout.write(help_text(major))
        return 0
    if "op" not in opts:
        return _usage(Usage("No operation selected"), major)
    if "pid" not in opts:
        return _usage(Usage("Missing pid to perform operation on"), major)
    why = _cuda_init(config, sim_dir)
    if why:
        sys.stderr.write(f'Error initializing CUDA: "{why}"\n')
        return 1
    op = opts["action"] if opts["op"] == "action" else opts["op"]
    if op == "toggle" or op in ("get-state", "get-restore-tid"):
        pass
    elif op not in ACTIONS:
        return _usage(Usage(INVALID), major)
    try:
        pid = int(opts["pid"])
        timeout_ms = int(opts.get("timeout", "0"))
        if pid <= 0 or timeout_ms < 0:
            raise ValueError
    except ValueError:
        return _usage(Usage(INVALID), major)
    request: dict[str, object] = {"op": op}
    if op == "lock":
        request["timeout_ms"] = timeout_ms  # 0: no timeout; other actions ignore it
    elif op in ("checkpoint", "restore") and config.get("transient_states"):
        request["transient"] = True  # CUDA 13.4+: get-state reports the phase meanwhile
    try:
        # --device-map only means something to a restore action; with --toggle
        # the real tool accepts it and ignores it.
        if op == "restore" and "device-map" in opts:
            request["device_map"] = _parse_map(opts["device-map"])
        crash_after = _inject_fault(sim_dir, pid, op)
        reply = _ask(pid, request) if op != "toggle" else _toggle(pid)
    except CudaError as exc:
        sys.stderr.write(fail_text(op, pid, str(exc)))
        return 1
    if crash_after:
        _segv()
    if op == "get-state":
        print(reply["state"])
    elif op == "get-restore-tid":
        print(reply["tid"])
    return 0


def _launch_job(argv: list[str], major: int) -> int:
    """`--launch-job FILE CMD...`: CMD runs as a job member (its CUDA runtime
    reads CUDA_CHECKPOINT_JOB_FILE)."""
    if len(argv) < 2:
        return _usage(Usage("Missing job file or command to launch"), major)
    os.environ["CUDA_CHECKPOINT_JOB_FILE"] = os.path.abspath(argv[0])
    try:
        os.execvp(argv[1], argv[1:])
    except OSError as exc:
        sys.stderr.write(f"Could not launch {argv[1]}: {exc.strerror}\n")
    return 1


def _main_r550(argv: list[str], config: dict, sim_dir: str) -> int:
    """R550: cuInit before anything, even --help; then exactly `--toggle --pid N`.

    Exit status 255 on every failure. R550's help and usage texts were never
    recorded with a working GPU, so every other command line fails with the
    driver's generic invalid-option line and no help.
    """
    why = _cuda_init(config, sim_dir)
    if why:
        sys.stderr.write(f'Error initializing CUDA: "{why}"\n')
        return 255
    if len(argv) != 3 or argv[:2] != ["--toggle", "--pid"] or not argv[2].isdigit():
        sys.stderr.write(f"{INVALID}\n")
        return 255
    pid = int(argv[2])
    try:
        crash_after = _inject_fault(sim_dir, pid, "toggle")
        _toggle(pid)
    except CudaError as exc:
        sys.stderr.write(fail_text("toggle", pid, str(exc)))
        return 255
    if crash_after:
        _segv()
    return 0


def _parse_map(text: str) -> dict[str, str]:
    mapping = {}
    for part in text.split(","):
        old, sep, new = part.partition("=")
        if not sep or not old.startswith(("GPU-", "MIG-")) or not new.startswith(("GPU-", "MIG-")):
            raise CudaError(INVALID_VALUE)
        mapping[old] = new
    return mapping


def _target(pid: int) -> tuple[str, int]:
    """The control socket of the target's restore thread, through its own root."""
    try:
        # A thread ID works too: /proc/TID is its thread group's view.
        with open(f"/proc/{pid}/status") as f:
            tgid = next(int(line.split()[1]) for line in f if line.startswith("Tgid:"))
        proc = f"/proc/{tgid}"
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
        raise CudaError(ILLEGAL_STATE)
    return {}


def _inject_fault(sim_dir: str, pid: int, op: str) -> bool:
    """Apply the first fault rule that matches this call. Modes: `error`
    (the CUDA error `code`, default 999), `hang` (never returns), `delay`
    (waits `seconds`, then the call is carried out as asked), `crash`
    (the TARGET process is killed, then the call fails), `segv` (the tool
    itself dies of SIGSEGV, no message, as a crash inside the driver
    library would; with `after` it dies only once the driver carried the
    call out, so the process HAS changed state). `skip` lets that many
    matching calls through first, `times` fires that many times.
    True when the tool must crash after the call."""
    path = os.path.join(sim_dir, "faults.json")
    if not os.path.exists(path):
        return False
    import fcntl
    import json

    with open(path, "r+") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        rules = json.loads(f.read() or "[]")
        hit = None
        changed = False
        for rule in rules:
            if rule.get("action", "*") not in ("*", op):
                continue
            if "pid" in rule and int(rule["pid"]) != pid:
                continue
            if "tag" in rule and rule["tag"] != _tag(pid):
                continue
            if rule.get("times", 1) <= 0:
                continue
            if rule.get("skip", 0) > 0:
                rule["skip"] -= 1
                changed = True
                continue
            hit = rule
            if "times" in rule:
                rule["times"] -= 1
                changed = True
            break
        if changed:
            f.seek(0)
            f.truncate()
            f.write(json.dumps(rules))
    if hit is None:
        return False
    mode = hit.get("mode", "error")
    if mode == "hang":
        while True:
            time.sleep(3600)
    if mode == "delay":
        time.sleep(float(hit.get("seconds", 0)))
        return False
    if mode == "segv":
        if hit.get("after"):
            return True
        _segv()
    if mode == "crash":
        import signal

        os.kill(pid, signal.SIGKILL)
        raise CudaError(UNKNOWN)
    code = int(hit.get("code", UNKNOWN))
    raise CudaError(code, hit.get("message") or CUDA_ERRORS.get(code, "unknown error"))


def _segv() -> None:
    """Die as a crash in the driver library does: SIGSEGV, nothing printed."""
    import signal

    sys.stdout.flush()
    signal.signal(signal.SIGSEGV, signal.SIG_DFL)
    os.kill(os.getpid(), signal.SIGSEGV)
    time.sleep(60)  # the signal is delivered before this returns


def _tag(pid: int) -> str | None:
    try:
        return str(_ask(pid, {"op": "status"}).get("tag"))
    except CudaError:
        return None
