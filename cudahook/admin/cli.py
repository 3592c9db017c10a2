"""`cudahook`: the administrator's command line.

Exit codes (also in the README): 0 done; 1 the operation failed and the
workload was rolled back to running (`check`: it would fail now); 2 bad
arguments or input; 3 invalid configuration; 4 the workload could not be
brought back to a safe state; 5 a required tool or driver feature is
missing; 6 (`check --image`) this image can never be restored on this node.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any, NoReturn

from cudahook.platform.errors import (
    EnvironmentProblem,
    Exit,
    UsageError,
    escape_lines,
    one_line,
    report,
)

# The kernel's PID range: pid_max is at most 4194304 (2^22).
PID_MAX = 1 << 22


def pid_arg(text: str) -> int:
    """A PID argument: 1 to PID_MAX. PID 0 names no process (kill(0) means
    the caller's own process group), so it is refused as bad input (exit 2)
    before anything is looked at."""
    try:
        value = int(text, 10)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a PID: {text[:40]!r}") from None
    if not 1 <= value <= PID_MAX:
        raise argparse.ArgumentTypeError(f"not a PID: {value} (1 to {PID_MAX})")
    return value


def seconds_arg(text: str) -> float:
    """A deadline argument: a positive, finite number of seconds (float()
    also takes "nan" and "inf", which no deadline can be)."""
    import math

    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a number of seconds: {text[:40]!r}") from None
    if not (math.isfinite(value) and value > 0):
        raise argparse.ArgumentTypeError(f"not a positive number of seconds: {text[:40]!r}")
    return value


def lock_ms_arg(text: str) -> int:
    """--lock-timeout-ms: the range config.schema.json allows lock_timeout_ms."""
    try:
        value = int(text, 10)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a number of ms: {text[:40]!r}") from None
    if not 0 <= value <= 3600000:
        raise argparse.ArgumentTypeError(f"{value} ms: not within 0 to 3600000")
    return value


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> NoReturn:
        raise UsageError(f"{message} (see '{self.prog} --help')")


def build_parser() -> argparse.ArgumentParser:
    p = _Parser(prog="cudahook", description="Checkpoint and restore CUDA processes and "
                "GPU containers around NVIDIA cuda-checkpoint.")
    # The common options go before or after the command alike. The command's
    # copies default to SUPPRESS, so that leaving them out there keeps what
    # was given before the command.
    for parser, default in ((p, None), (common := _Parser(add_help=False), argparse.SUPPRESS)):
        parser.add_argument("--config", default=default,
                            help="configuration file (default /etc/cudahook/config.yaml)")
        parser.add_argument("--json", action="store_true",
                            default=False if default is None else default,
                            help="machine-readable output")
    sub = p.add_subparsers(dest="cmd", required=True, parser_class=_Parser)
    add = sub.add_parser

    def add_parser(name: str, **kw: Any) -> argparse.ArgumentParser:
        return add(name, parents=[common], **kw)  # type: ignore[no-any-return]

    sub.add_parser = add_parser  # type: ignore[method-assign]

    def targets(sp: argparse.ArgumentParser) -> None:
        g = sp.add_mutually_exclusive_group(required=True)
        g.add_argument("--pid", type=pid_arg, action="append",
                       help="a CUDA process (repeatable)")
        g.add_argument("--init-pid", type=pid_arg,
                       help="a container's init PID: act on all its CUDA processes")

    d = sub.add_parser("discover", help="list a container's CUDA processes")
    d.add_argument("--init-pid", type=pid_arg, required=True)
    d.add_argument("--checkpointed", action="store_true",
                   help="also find processes that hold no device node (already checkpointed)")
    c = sub.add_parser("checkpoint", help="lock and checkpoint CUDA processes")
    targets(c)
    c.add_argument("--sequential", action="store_true", default=None)
    c.add_argument("--lock-timeout-ms", type=lock_ms_arg, metavar="MS")
    r = sub.add_parser("restore", help="restore and unlock CUDA processes")
    targets(r)
    r.add_argument("--device-map", help="old=new GPU UUID pairs, comma separated")
    r.add_argument("--source-gpus", help="GPU UUIDs at checkpoint time (comma separated); "
                   "with --target-gpus, the device map is computed")
    r.add_argument("--target-gpus", help="GPU UUIDs to restore onto (comma separated)")
    r.add_argument("--sequential", action="store_true", default=None)
    s = sub.add_parser("state", help="the checkpoint state of processes")
    s.add_argument("--pid", type=pid_arg, action="append", required=True)
    sub.add_parser("gpus", help="the GPUs nvidia-smi reports")
    sub.add_parser("features", help="what the installed cuda-checkpoint supports")
    st = sub.add_parser("status", help="GPU containers and their last results, one line each; "
                        "with an ID, that container in detail")
    st.add_argument("container", nargs="?", metavar="ID",
                    help="one container (its id or a unique prefix): its CUDA processes, "
                    "last results and checkpoint timeline")
    st.add_argument("--all", "-a", action="store_true",
                    help="also the containers that are not running or gone")
    st.add_argument("--manifest", metavar="IMAGE_DIR",
                    help="show a checkpoint's per-process timeline from its manifest")
    st.add_argument("--no-live", action="store_true",
                    help="do not query process states (no cuda-checkpoint calls)")
    from . import check as check_cmd

    check_cmd.add_parser(sub)
    from . import agent_cmd

    agent_cmd.add_arguments(sub.add_parser("agent", help=agent_cmd.HELP))
    doc = sub.add_parser("doctor", help="check this node and explain problems")
    doc.add_argument("--root", default=None, help=argparse.SUPPRESS)
    cf = sub.add_parser("configure", help="register cudahook with a container runtime")
    cf.add_argument("--runtime", required=True,
                    choices=("runc", "containerd", "docker", "podman", "crio"))
    cf.add_argument("--dry-run", action="store_true", help="show the changes, make none")
    cf.add_argument("--revert", action="store_true", help="undo this runtime's registration")
    cf.add_argument("--default", action="store_true", help="docker: make it the default runtime")
    cf.add_argument("--criu-registration", choices=("global", "gpu-only"), default=None,
                    help="the CRIU action script for every container (global: in "
                    "/etc/criu/runc.conf) or only for GPU containers created through the "
                    "runtime wrapper (gpu-only); default: as registered now, else global")
    cf.add_argument("--hooks-dir", help="where the hook executables are "
                    "(default: PREFIX/libexec of this installation)")
    cf.add_argument("--root", default=None, help=argparse.SUPPRESS)
    mg = sub.add_parser("migrate", help="move a GPU container to another node (podman)")
    mgs = mg.add_subparsers(dest="migrate_cmd", required=True, parser_class=_Parser)
    mgc = mgs.add_parser("checkpoint", parents=[common],
                         help="checkpoint a container into an archive (and ARCHIVE.sha256)")
    mgc.add_argument("container")
    mgc.add_argument("archive")
    mgc.add_argument("--leave-running", action="store_true",
                     help="the container goes on here after the checkpoint")
    mgc.add_argument("--compress", choices=("gzip", "none"), default="gzip")
    mgc.add_argument("--sign-key", metavar="KEY", help="sign the archive (ARCHIVE.sig) with "
                     "this Ed25519 private key (migrate keygen)")
    mgr = mgs.add_parser("restore", parents=[common],
                         help="restore a container from an archive onto this node's GPUs")
    mgr.add_argument("archive")
    mgr.add_argument("--name", help="the restored container's name (default: the original's)")
    mgr.add_argument("--gpus", help="this node's GPU UUIDs to restore onto, comma separated "
                     "(default: the same GPUs if all are here, else the first ones)")
    mgr.add_argument("--no-verify", action="store_true",
                     help="restore without ARCHIVE.sha256 (the tar is still read to the end)")
    mgr.add_argument("--dry-run", action="store_true",
                     help="check the archive and this node (exit 0, 2, 5 or 6), restore nothing")
    mgr.add_argument("--work-dir", help="where the copy naming this node's GPUs is written "
                     "(default: $TMPDIR; as large as the archive, uncompressed)")
    mgr.add_argument("--verify-key", metavar="PUB", action="append", default=[],
                     help="a trusted Ed25519 public key: ARCHIVE.sig must be signed by one "
                     "(repeatable; also migrate_trusted_keys_dir)")
    mgk = mgs.add_parser("keygen", parents=[common],
                         help="make an Ed25519 key pair for signing archives")
    mgk.add_argument("--out", required=True, metavar="KEY",
                     help="the private key (0600); the public key is KEY.pub")
    for sp in (mgc, mgr):
        sp.add_argument("--podman", default="podman",
                        help="the podman command line, global options included "
                        "(default: podman)")
        sp.add_argument("--timeout", type=seconds_arg, default=3600.0,
                        help="deadline for podman's checkpoint or restore, in seconds")
    dm = sub.add_parser("demo", help="checkpoint and restore a simulated GPU container")
    dm.add_argument("--processes", action="store_true",
                    help="the process-level demo (no runc/CRIU needed)")
    return p


def main(argv: list[str] | None = None) -> int:
    """Run one command. Whatever goes wrong ends as one escaped line on
    stderr and a documented exit code (platform/errors.py `report`): a bug
    is "internal error: ..." with exit 1, its traceback in the log only."""
    args: argparse.Namespace | None = None
    try:
        args = build_parser().parse_args(argv)
        return run(args)
    except KeyboardInterrupt:
        print("cudahook: interrupted", file=sys.stderr)
        return 130
    except PermissionError as exc:
        # Looking into another user's processes (/proc/PID/ns, fds) needs root.
        where = f"{exc.filename}: " if exc.filename else ""
        return report(EnvironmentProblem(f"{where}{exc.strerror or 'permission denied'} "
                                         "(cudahook's commands need root)"))
    except Exception as exc:
        log_file = getattr(args, "log_file", None)
        if log_file is None:
            from cudahook.platform import paths

            log_file = str(paths.at(paths.LOG_FILE))
        return report(exc, log_file=log_file)


def _emit(args: argparse.Namespace, data: Any, text: str) -> None:
    # Text output quotes container ids, GPU models, archive and manifest
    # fields: escaped, so none of them can drive the terminal. JSON escapes
    # control characters itself (and surrogates: ensure_ascii).
    print(json.dumps(data, indent=1) if args.json else escape_lines(text))


def run(args: argparse.Namespace) -> int:
    from cudahook.core.backends import make_backend
    from cudahook.platform import config
    from cudahook.platform.host import Host

    if args.cmd == "configure":
        from cudahook.platform import paths

        from .configure import ConfigureError, configure

        hooks_dir = Path(args.hooks_dir) if args.hooks_dir else Path(sys.prefix).parent / "libexec"
        root = args.root if args.root is not None else str(paths.root())
        try:
            lines = configure(args.runtime, hooks_dir, root=root, default=args.default,
                              dry_run=args.dry_run, revert=args.revert,
                              criu_registration=args.criu_registration)
        except ConfigureError as exc:
            raise UsageError(str(exc)) from None
        print(escape_lines("\n".join(lines)))
        return Exit.OK
    if args.cmd == "agent":
        from . import agent_cmd

        return agent_cmd.run(args)
    if args.cmd == "demo":
        from cudahook.sim.demo import main as demo

        return demo(processes_only=args.processes)

    settings = config.load(args.config)
    args.log_file = settings.log_file  # where `main` writes an internal error's traceback
    if args.cmd == "migrate":
        return _migrate(args, settings, Host())
    if getattr(args, "sequential", None):
        settings = settings.with_overrides(sequential=True)
    if getattr(args, "lock_timeout_ms", None) is not None:
        settings = settings.with_overrides(lock_timeout_ms=args.lock_timeout_ms)
    host = Host()

    if args.cmd == "gpus":
        from cudahook.core.gpus import query_gpus

        gpus = query_gpus(host, settings)
        _emit(args, [g.__dict__ for g in gpus],
              "\n".join(f"{g.index}  {g.uuid}  {g.name}  "
                        f"{'[N/A]' if g.memory_mib is None else g.memory_mib} MiB  driver "
                        f"{g.driver_version}" for g in gpus))
        return Exit.OK

    if args.cmd in ("status", "doctor", "check"):
        from cudahook.flow.context import Context

        ctx = Context(settings, host)
        if args.cmd == "check":
            from . import check

            verdict = check.run(ctx, args)
            _emit(args, verdict.to_dict(), check.render(verdict))
            return verdict.exit_code
        if args.cmd == "doctor":
            from . import doctor

            checks = doctor.run_checks(ctx, root=args.root)
            _emit(args, doctor.as_json(checks), doctor.render(checks))
            return Exit.FAILED if any(c.status == "fail" for c in checks) else Exit.OK
        from . import status

        if args.manifest:
            from .check import _is_dir

            if not _is_dir(Path(args.manifest)):
                raise UsageError(f"--manifest {args.manifest}: not a directory")
            _emit(args, _manifest_json(args.manifest), status.manifest_chart(args.manifest))
            return Exit.OK
        # The table shows no process states: probe only for the detail and --json.
        data = status.gather(ctx, live=not args.no_live and bool(args.container or args.json))
        if args.container:
            one = status.select(data, args.container)
            _emit(args, {**data, "containers": [one]}, status.render_one(one))
        else:
            _emit(args, data, status.render(data, show_all=args.all))
        return Exit.OK

    backend = make_backend(settings, host)
    if args.cmd == "features":
        f = backend.features
        # Which backend runs the calls, and why (`backend: auto` decides per node).
        _emit(args, {**f.__dict__, "backend": backend.name, "backend_why": backend.why},
              f"{f.describe()}\nbackend: {backend.name} ({backend.why})")
        return Exit.OK

    from cudahook.core.discovery import discover
    from cudahook.core.engine import Engine

    if args.cmd == "state":
        engine = Engine(backend, settings, host)
        states = {}
        for pid in args.pid:
            states[pid] = engine.read_state(pid)
        _emit(args, {str(k): v for k, v in states.items()},
              "\n".join(f"{pid}  {state}" for pid, state in states.items()))
        return Exit.OK

    def resolve(require_fd: bool) -> list[int]:
        if args.pid:
            return list(args.pid)
        if not host.exists(args.init_pid):
            raise UsageError(f"no process {args.init_pid}")
        found = discover(host, backend, args.init_pid, settings.device_regex,
                         require_device_fd=require_fd, max_parallel=settings.max_parallel)
        for w in found.warnings:
            print(f"cudahook: warning: {one_line(w)}", file=sys.stderr)
        return found.pids

    if args.cmd == "discover":
        if not host.exists(args.init_pid):
            raise UsageError(f"no process {args.init_pid}")
        found = discover(host, backend, args.init_pid, settings.device_regex,
                         require_device_fd=not args.checkpointed,
                         max_parallel=settings.max_parallel)
        data = {
            "init_pid": found.init_pid, "scope": found.scope, "scanned": found.scanned,
            "processes": [p.__dict__ for p in found.processes],
            "skipped": {str(k): v for k, v in found.skipped.items()},
            "warnings": found.warnings,
        }
        lines = [f"{p.pid}  nspid {p.nspid}  {p.state or ''}" for p in found.processes]
        lines += [f"{pid}  skipped: {why}" for pid, why in found.skipped.items()]
        _emit(args, data, "\n".join(lines) or "no CUDA processes")
        return Exit.OK

    engine = Engine(backend, settings, host)
    device_map = _device_map(args) if args.cmd == "restore" else None
    # A pre-dump or a guardian moving the same container's processes: wait
    # for it (bounded), as they wait for each other, or refuse. Discovery
    # probes too, so it runs inside.
    from cudahook.flow import guardian
    from cudahook.flow.context import Context

    cid = _container_of(settings, host, args)
    with guardian.exclusive(Context(settings, host), cid, BUSY_WAIT_S, args.cmd):
        if args.cmd == "checkpoint":
            result = engine.checkpoint(resolve(True))
        else:
            result = engine.restore(resolve(False), device_map)
    _emit(args, result.to_dict(), _summary(result))
    return Exit.OK


# How long `checkpoint`/`restore` wait for a hook or `status` holding the container.
BUSY_WAIT_S = 30.0


def _container_of(settings: Any, host: Any, args: argparse.Namespace) -> str | None:
    """The key of the recorded container the targets belong to, if any: the
    one whose init is --init-pid, or whose init shares the --pid processes'
    PID namespace."""
    from cudahook.platform.host import ProcessGone
    from cudahook.platform.store import Store

    records = [r for r in Store(settings.state_dir).records()
               if isinstance(r.get("id"), str) and type(r.get("pid")) is int]
    if args.init_pid:
        from cudahook.flow.containers import lock_key
        from cudahook.flow.context import Context

        # Without a record, the init itself: what a pre-dump of it serialises on.
        record = next((r for r in records if r["pid"] == args.init_pid), None)
        return lock_key(Context(settings, host), record, args.init_pid)
    try:
        spaces = {host.pidns(p) for p in args.pid}
        own = host.own_pidns()
    except (ProcessGone, PermissionError, OSError):
        return None
    if len(spaces) != 1 or own in spaces:
        return None
    for r in records:
        try:
            if host.pidns(r["pid"]) in spaces:
                return str(r["key"])
        except (ProcessGone, PermissionError, OSError):
            continue
    return None


def _migrate(args: argparse.Namespace, settings: Any, host: Any) -> int:
    from cudahook.flow.context import Context

    from . import migrate

    if args.migrate_cmd == "keygen":
        from . import signing

        keys = signing.keygen(Path(args.out))
        _emit(args, keys, f"{keys['private_key']} (keep it on the checkpointing nodes), "
              f"{keys['public_key']} (for restoring nodes), {keys['key_id']}")
        return Exit.OK
    ctx = Context(settings, host)
    podman = migrate.podman_argv(args.podman)
    if args.migrate_cmd == "checkpoint":
        out = migrate.checkpoint(ctx, podman, args.container, Path(args.archive),
                                 leave_running=args.leave_running, compress=args.compress,
                                 timeout=args.timeout,
                                 sign_key=Path(args.sign_key) if args.sign_key else None)
        _emit(args, out, f"{out['container']}: checkpointed into {out['archive']} "
              f"({out['bytes']} bytes, sha256 {out['sha256']}); copy it with "
              f"{Path(out['archive']).name}{migrate.SIDECAR}")
        return Exit.OK
    gpus = [u.strip() for u in args.gpus.split(",") if u.strip()] if args.gpus else None
    out = migrate.restore(ctx, podman, Path(args.archive), name=args.name, gpus=gpus,
                          verify=not args.no_verify, timeout=args.timeout,
                          work_dir=args.work_dir, dry_run=args.dry_run,
                          verify_keys=[Path(k) for k in args.verify_key])
    moved = ", ".join(f"{a}={b}" for a, b in (out["device_map"] or {}).items())
    _emit(args, out, f"{out['container']}: {'would be restored' if args.dry_run else 'restored'}"
          + (f" onto {', '.join(out['gpus'])}" if out["gpus"] else "")
          + (f" (device map {moved})" if moved else "")
          + f"\n  verified: {', '.join(out['verified'])}"
          + (f"\n  not verified: {', '.join(out['not_verified'])}" if out["not_verified"] else "")
          + (f"\n  dropped from the spec: {', '.join(out['dropped_annotations'])} (this node's "
             "CRIU configuration applies)" if out["dropped_annotations"] else ""))
    return Exit.OK


def _manifest_json(image_dir: str) -> Any:
    from cudahook.core.manifest import read

    return read(Path(image_dir))


def _device_map(args: argparse.Namespace) -> dict[str, str] | None:
    from cudahook.core.devicemap import compute_device_map, parse_device_map

    if args.device_map and (args.source_gpus or args.target_gpus):
        raise UsageError("give either --device-map or --source-gpus/--target-gpus")
    if args.device_map:
        return parse_device_map(args.device_map)
    if args.source_gpus or args.target_gpus:
        if not (args.source_gpus and args.target_gpus):
            raise UsageError("--source-gpus and --target-gpus go together")
        split = lambda s: [u.strip() for u in s.split(",") if u.strip()]  # noqa: E731
        return compute_device_map(split(args.source_gpus), split(args.target_gpus))
    return None


def _summary(result: Any) -> str:
    moved = ", ".join(map(str, result.changed)) or "none"
    return (f"{result.phase}: {len(result.pids)} process(es), changed: {moved}, "
            f"{result.timeline.total():.3f}s")
