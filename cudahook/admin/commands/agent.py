"""`cudahook agent start|stop|status`: the node agent's lifecycle (core/agent.py).

`start` starts it detached (or, with --foreground, runs it in this process:
a service manager's ExecStart) and waits until its socket answers; `stop`
asks it to end (SIGTERM: it stops listening, lets the sessions in flight
finish within their deadlines, then exits); `status` says whether it is up
and what it holds. Exit 0 when done (`status`: when it is up), 1 otherwise.
"""

from __future__ import annotations

import argparse
import json
import os
import time

from cudahook.platform.errors import Exit, escape_lines

from .common import Command

HELP = "the node agent that keeps the driver attached (start, stop, status)"
START_WAIT_S = 10.0


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("action", choices=("start", "stop", "status"))
    parser.add_argument("--foreground", action="store_true",
                        help="start: run in this process (for a service manager)")


def run(args: argparse.Namespace) -> int:
    from cudahook.core import agent
    from cudahook.platform import config

    settings = config.load(args.config)
    if args.action == "status":
        from cudahook.admin.status import agent_text, agent_view

        view = agent_view(settings, full=True)
        if getattr(args, "json", False):
            print(json.dumps(view, indent=1))
        else:
            print(f"agent: {agent_text(view)}")
        return Exit.OK if view["up"] else Exit.FAILED
    if args.action == "start":
        info = agent.status(settings, timeout=1.0)
        if info is not None:
            print(f"agent: already running, pid {info.get('pid')}")
            return Exit.OK
        if args.foreground:
            return agent.Agent(settings).run()
        child = agent.start_detached(settings)
        deadline = time.monotonic() + START_WAIT_S
        while time.monotonic() < deadline:
            info = agent.status(settings, timeout=1.0)
            if info is not None:
                print(f"agent: started, pid {info.get('pid')}, socket "
                      f"{escape_lines(agent.socket_path(settings))}")
                return Exit.OK
            if child.poll() is not None:
                break
            time.sleep(0.05)
        print(f"agent: did not start (see {escape_lines(str(settings.log_file))})")
        return Exit.FAILED
    return _stop(settings)


def _stop(settings: object) -> int:
    import signal

    from cudahook.core import agent
    from cudahook.platform.host import Host

    pid = agent.running_pid(settings)  # type: ignore[arg-type]
    if pid is None:
        print("agent: not running")
        return Exit.OK
    host = Host()
    start = host.start_time(pid)
    os.kill(pid, signal.SIGTERM)
    # It lets the calls in flight finish within their deadlines first.
    deadline = time.monotonic() + settings.call_timeout_s + 10  # type: ignore[attr-defined]
    while time.monotonic() < deadline:
        if not host.alive(pid, start):
            print(f"agent: stopped (pid {pid})")
            return Exit.OK
        time.sleep(0.05)
    print(f"agent: pid {pid} still running after SIGTERM")
    return Exit.FAILED


COMMAND = Command("agent", HELP, add_arguments, run)
