"""`cudahook`: the administrator's command line.

Exit codes (also in the README): 0 done; 1 the operation failed and the
workload was rolled back to running (`check`: it would fail now); 2 bad
arguments or input; 3 invalid configuration; 4 the workload could not be
brought back to a safe state; 5 a required tool or driver feature is
missing; 6 (`check --image`) this image can never be restored on this node.

Each command is a module of cudahook.admin.commands (its arguments and its
`run`); this module holds their table, the options every command takes, and
the one place where whatever goes wrong becomes a line and an exit code.
"""

from __future__ import annotations

import argparse
import sys

from cudahook.platform.errors import EnvironmentProblem, report

from .commands import (
    agent,
    check,
    checkpoint,
    configure,
    demo,
    discover,
    doctor,
    features,
    gpus,
    migrate,
    restore,
    state,
    status,
)
from .commands.common import Command, Parser

# In the order `cudahook --help` lists them.
COMMANDS: tuple[Command, ...] = (
    discover.COMMAND,
    checkpoint.COMMAND,
    restore.COMMAND,
    state.COMMAND,
    gpus.COMMAND,
    features.COMMAND,
    status.COMMAND,
    check.COMMAND,
    doctor.COMMAND,
    configure.COMMAND,
    agent.COMMAND,
    migrate.COMMAND,
    demo.COMMAND,
)


def _common_options(parser: argparse.ArgumentParser, default: object) -> None:
    parser.add_argument("--config", default=default,
                        help="configuration file (default /etc/cudahook/config.yaml)")
    parser.add_argument("--json", action="store_true",
                        default=False if default is None else default,
                        help="machine-readable output")


def build_parser() -> argparse.ArgumentParser:
    p = Parser(prog="cudahook", description="Checkpoint and restore CUDA processes and "
               "GPU containers around NVIDIA cuda-checkpoint.")
    # The common options go before or after the command alike. The command's
    # copies default to SUPPRESS, so that leaving them out there keeps what
    # was given before the command.
    _common_options(p, None)
    common = Parser(add_help=False)
    _common_options(common, argparse.SUPPRESS)

    def add(sub: argparse._SubParsersAction[argparse.ArgumentParser],
            commands: tuple[Command, ...]) -> None:
        for cmd in commands:
            sp = sub.add_parser(cmd.name, parents=[common], help=cmd.help,
                                description=cmd.description)
            cmd.add_arguments(sp)
            if cmd.subcommands:
                add(sp.add_subparsers(dest=cmd.dest, required=True, parser_class=Parser),
                    cmd.subcommands)

    add(p.add_subparsers(dest="cmd", required=True, parser_class=Parser), COMMANDS)
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
        # Set by commands.common.settings once the configuration is read.
        log_file = getattr(args, "log_file", None)
        if log_file is None:
            from cudahook.platform import paths

            log_file = str(paths.at(paths.LOG_FILE))
        return report(exc, log_file=log_file)


def run(args: argparse.Namespace) -> int:
    """The command `args` names (the subcommand, for migrate), run."""
    commands, cmd = COMMANDS, None
    dest = "cmd"
    while commands:
        cmd = next(c for c in commands if c.name == getattr(args, dest))
        commands, dest = cmd.subcommands, cmd.dest
    assert cmd is not None and cmd.run is not None, "the parser requires a command"
    return cmd.run(args)
