"""What `checkpoint` and `restore` share: the processes they act on, the
container lock they take, and the summary they print."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from cudahook.platform.errors import Exit, UsageError, one_line

from .common import emit, pid_arg, settings


def add_targets(p: argparse.ArgumentParser) -> None:
    g = p.add_mutually_exclusive_group(required=True)
    g.add_argument("--pid", type=pid_arg, action="append",
                   help="a CUDA process (repeatable)")
    g.add_argument("--init-pid", type=pid_arg,
                   help="a container's init PID: act on all its CUDA processes")


class Phase:
    """One checkpoint or restore from the command line: the configuration,
    the backend and the engine it runs with."""

    def __init__(self, args: argparse.Namespace) -> None:
        from cudahook.core.backends import make_backend
        from cudahook.core.engine import Engine
        from cudahook.platform.host import Host

        self.args = args
        self.settings = settings(args)
        self.host = Host()
        self.backend = make_backend(self.settings, self.host)
        self.engine = Engine(self.backend, self.settings, self.host)

    @contextmanager
    def exclusive(self) -> Iterator[None]:
        """A pre-dump or a guardian moving the same container's processes:
        wait for it (bounded), as they wait for each other, or refuse.
        Discovery probes too, so it runs inside."""
        from cudahook.flow import guardian
        from cudahook.flow.context import Context

        cid = self._container()
        with guardian.exclusive(Context(self.settings, self.host), cid, guardian.BUSY_WAIT_S,
                                self.args.cmd):
            yield

    def pids(self, *, require_device_fd: bool) -> list[int]:
        """--pid as given, or --init-pid's CUDA processes (warnings on stderr)."""
        from cudahook.core.discovery import discover

        args = self.args
        if args.pid:
            return list(args.pid)
        if not self.host.exists(args.init_pid):
            raise UsageError(f"no process {args.init_pid}")
        found = discover(self.host, self.backend, args.init_pid, self.settings.device_regex,
                         require_device_fd=require_device_fd,
                         max_parallel=self.settings.max_parallel)
        for w in found.warnings:
            print(f"cudahook: warning: {one_line(w)}", file=sys.stderr)
        return found.pids

    def done(self, result: Any) -> int:
        moved = ", ".join(map(str, result.changed)) or "none"
        emit(self.args, result.to_dict(),
             f"{result.phase}: {len(result.pids)} process(es), changed: {moved}, "
             f"{result.timeline.total():.3f}s")
        return Exit.OK

    def _container(self) -> str | None:
        """The key of the recorded container the targets belong to, if any:
        the one whose init is --init-pid, or whose init shares the --pid
        processes' PID namespace."""
        from cudahook.platform.host import ProcessGone
        from cudahook.platform.store import Store

        args, host = self.args, self.host
        records = [r for r in Store(self.settings.state_dir).records()
                   if isinstance(r.get("id"), str) and type(r.get("pid")) is int]
        if args.init_pid:
            from cudahook.flow.containers import lock_key
            from cudahook.flow.context import Context

            # Without a record, the init itself: what a pre-dump of it serialises on.
            record = next((r for r in records if r["pid"] == args.init_pid), None)
            return lock_key(Context(self.settings, host), record, args.init_pid)
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
