"""The CRIU action script's entry point: CRIU's environment in, one action
handed to `cudahook.flow.actions` (the checkpoint in flow/checkpoint.py,
the restore in flow/restore.py), its exit status out.

CRIU runs this script at every action of every dump and restore, GPU or not
(the shell in hooks/cudahook-criu-action lets only the three actions the
flow handles, and only containers that may hold a GPU, reach Python).
"""

from __future__ import annotations

from cudahook.flow.context import Context
from cudahook.flow.criu_run import HANDLED
from cudahook.platform.errors import Exit, report

from .criu_env import CriuCall


def main() -> int:
    from cudahook.platform import config

    from . import criu_env

    try:
        call = criu_env.from_env()
        if call.action not in HANDLED:
            return Exit.OK
        return run(Context(config.load()), call)
    except Exception as exc:  # a bug must still fail the action, in one line
        return report(exc)


def run(ctx: Context, call: CriuCall) -> int:
    from cudahook.flow import actions

    return actions.run(ctx, call.action, call.image_dir, call.init_pid, call.criu_pid)
