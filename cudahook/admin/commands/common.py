"""What the commands share: the shape of a command, the parser that turns
bad arguments into exit 2, the argument types, the configuration they run
with, and how a result is printed."""

from __future__ import annotations

import argparse
import json
import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, NoReturn

from cudahook.platform.errors import UsageError, escape_lines
from cudahook.platform.ids import PID_MAX_LIMIT

if TYPE_CHECKING:
    from cudahook.platform.config import Settings

# The kernel's PID range: pid_max is at most 4194304 (2^22).


@dataclass(frozen=True)
class Command:
    """One `cudahook` command: its name and help as `--help` lists them, the
    arguments it adds to its own parser, and what it does (an exit code).
    A command with `subcommands` (migrate) runs the one named on the line."""

    name: str
    help: str
    add_arguments: Callable[[argparse.ArgumentParser], None]
    run: Callable[[argparse.Namespace], int] | None = None
    description: str | None = None
    subcommands: tuple[Command, ...] = ()

    @property
    def dest(self) -> str:
        """Where the parser puts the name of the subcommand given."""
        return f"{self.name}_cmd"


class Parser(argparse.ArgumentParser):
    """Bad arguments are bad input: one line and exit 2, not argparse's usage
    block and its own exit."""

    def error(self, message: str) -> NoReturn:
        raise UsageError(f"{message} (see '{self.prog} --help')")


def no_arguments(parser: argparse.ArgumentParser) -> None:
    """For a command that takes only the common options."""


def pid_arg(text: str) -> int:
    """A PID argument: 1 to PID_MAX_LIMIT. PID 0 names no process (kill(0) means
    the caller's own process group), so it is refused as bad input (exit 2)
    before anything is looked at."""
    try:
        value = int(text, 10)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a PID: {text[:40]!r}") from None
    if not 1 <= value <= PID_MAX_LIMIT:
        raise argparse.ArgumentTypeError(f"not a PID: {value} (1 to {PID_MAX_LIMIT})")
    return value


def seconds_arg(text: str) -> float:
    """A deadline argument: a positive, finite number of seconds (float()
    also takes "nan" and "inf", which no deadline can be)."""
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


def settings(args: argparse.Namespace) -> Settings:
    """The configuration a command runs with: --config (else the default
    file), with the command's own overrides (--sequential, --lock-timeout-ms)
    applied. Remembers its log file in `args`: where `cli.main` writes an
    internal error's traceback."""
    from cudahook.platform import config

    loaded = config.load(args.config)
    args.log_file = loaded.log_file
    if getattr(args, "sequential", None):
        loaded = loaded.with_overrides(sequential=True)
    if getattr(args, "lock_timeout_ms", None) is not None:
        loaded = loaded.with_overrides(lock_timeout_ms=args.lock_timeout_ms)
    return loaded


def emit(args: argparse.Namespace, data: Any, text: str) -> None:
    """Print a command's result: `data` as JSON with --json, else `text`.
    Text output quotes container ids, GPU models, archive and manifest
    fields: escaped, so none of them can drive the terminal. JSON escapes
    control characters itself (and surrogates: ensure_ascii)."""
    print(json.dumps(data, indent=1) if args.json else escape_lines(text))
