"""What one CRIU run (one dump, or one restore) has done so far.

CRIU 3.19-4.1.1 run every action script twice per dump or restore (runc's
configuration file is parsed twice, CRIU #2727). A hook that acted on each
call would undo itself, so each action's outcome is kept per CRIU run -
keyed by CRIU's PID and its start time, so a reused PID is another run - and
the second call returns it unchanged. post-restore also leaves here what
post-resume needs: CRIU has closed the image directory by then.

Before its first driver call, each action records here the name its calls
carry (`calls`, platform/tools.py) and its own PID and start time (`hooks`):
a call whose first run was killed mid-way is told by a `hooks` entry without
an outcome, and the guardian and the restore watcher (`watcher`, recorded as
soon as it is armed) wait for those scripts, then end those calls.
"""

from __future__ import annotations

from pathlib import Path

from cudahook.platform.store import Store, read_json, write_json_atomic

# typing costs milliseconds at every hook start: annotations only.
TYPE_CHECKING = False
if TYPE_CHECKING:
    from typing import Any

    from cudahook.platform.host import Host

# The actions the action script handles, and whose outcome is kept.
HANDLED = ("pre-dump", "post-restore", "post-resume")

# The steps pre-dump records as it goes (CriuRun.step), for the guardian.
STARTED, ARMED, LOCKING = "started", "guardian armed", "locking and checkpointing"
CHECKPOINTED, RECORDED, ROLLED_BACK = "checkpointed", "recorded", "rolled back"
# A pre-dump that stopped at one of these left every process running: none
# was locked yet, or its own rollback verified them all running again.
SETTLED = (STARTED, ARMED, ROLLED_BACK)


class CriuRun:
    def __init__(self, store: Store, host: Host, criu_pid: int):
        self.key = run_key(host, criu_pid)
        self.path: Path = store.run_path(self.key)
        self.progress: dict[str, Any] = _valid(read_json(self.path))

    def outcome(self, action: str) -> int | None:
        """The exit status this run's first call of `action` gave, if any."""
        rc = self.progress["done"].get(action)
        return int(rc) if isinstance(rc, int) else None

    def step(self, name: str) -> None:
        """Where the action under way has got to, written at once: the
        guardian reads it to tell why a pre-dump it was armed by stopped."""
        self.progress["step"] = name
        self._save()

    def started(self, action: str) -> bool:
        """Whether a call of `action` in this run started acting (see own_calls)."""
        hooks = self.progress.get("hooks")
        return isinstance(hooks, dict) and action in hooks

    def own_calls(self, action: str, host: Host) -> None:
        """Name every driver call this action starts after this run, and
        record the name and this script's (pid, start time), before the
        first call: whoever judges the workload after this script died waits
        for it, then ends those calls first (platform/tools.py)."""
        import os

        from cudahook.platform.tools import own_calls

        name = calls_name(self.path)
        assert name is not None
        own_calls(name)
        self.progress["calls"] = name
        hooks = self.progress.get("hooks")
        if not isinstance(hooks, dict):
            hooks = self.progress["hooks"] = {}
        hooks[action] = [os.getpid(), host.start_time(os.getpid())]
        self._save()

    def note(self, name: str, value: Any) -> None:
        """Record `name` in the progress at once (the script may die next)."""
        self.progress[name] = value
        self._save()

    def finish(self, action: str, rc: int) -> None:
        self.progress["done"][action] = int(rc)
        self._save()

    def _save(self) -> None:
        # The manifest post-restore keeps for post-resume goes in as the
        # image holds it (core/manifest.py reads it back, see _valid).
        kept = self.progress.get("manifest")
        to_dict = getattr(kept, "to_dict", None)
        out = {**self.progress, "manifest": to_dict()} if to_dict else self.progress
        write_json_atomic(self.path, out)

    def __getitem__(self, name: str) -> Any:
        return self.progress[name]

    def __setitem__(self, name: str, value: Any) -> None:
        self.progress[name] = value

    def get(self, name: str, default: Any = None) -> Any:
        return self.progress.get(name, default)

    def __contains__(self, name: str) -> bool:
        return name in self.progress


def calls_name(run_path: str | Path | None) -> str | None:
    """The name the driver calls of a CRIU run's action scripts carry."""
    return f"criu-run-{Path(run_path).stem}" if run_path else None


def run_key(host: Host, criu_pid: int) -> str:
    try:
        return f"{criu_pid}-{host.start_time(criu_pid)}"
    except Exception:
        return str(criu_pid)


def _valid(data: Any) -> dict[str, Any]:
    """A run's progress file as CriuRun writes it: anything else in its place
    (another type, a damaged entry) counts as no progress at all."""
    from cudahook.platform.errors import Exit

    if not isinstance(data, dict):
        return {"done": {}}
    done = data.get("done")
    if not isinstance(done, dict) or not all(
            k in HANDLED and type(v) is int and v in tuple(Exit) for k, v in done.items()):
        data["done"] = {}
    # What post-restore kept for post-resume, if it has the shape it wrote.
    # One that is damaged inside stays as it is: post-resume fails closed
    # on it (kills the container) rather than take it for no CUDA state.
    kept = data.pop("manifest", None)
    if isinstance(kept, dict):
        from cudahook.core.manifest import from_dict

        try:
            data["manifest"] = from_dict(kept)
        except Exception:
            data["manifest"] = kept
    mapping = data.get("device_map")
    if mapping is not None and not (isinstance(mapping, dict) and all(
            isinstance(k, str) and isinstance(v, str) for k, v in mapping.items())):
        data.pop("device_map")
    if not isinstance(data.get("vmm_dir"), (str, type(None))):
        data.pop("vmm_dir")
    return data
