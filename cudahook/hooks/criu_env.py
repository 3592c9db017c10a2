"""What CRIU tells an action script, from its environment."""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path

from cudahook.platform.errors import UsageError
from cudahook.platform.ids import PID_MAX_LIMIT
from cudahook.platform.record import Record

ACTIONS = {
    "pre-dump", "network-lock", "post-dump", "network-unlock", "pre-restore",
    "setup-namespaces", "post-setup-namespaces", "post-restore", "pre-resume",
    "post-resume", "orphan-pts-master", "pre-stream", "query-ext-files",
}


class CriuCall(Record, frozen=True):
    action: str
    image_dir: Path | None
    init_pid: int | None  # host PID of the container's init (unset at pre-restore)
    criu_pid: int  # the CRIU process that runs us; identifies this dump or restore


def parse_pid(text: str) -> int:
    """CRTOOLS_INIT_PID as a container init's host PID, or UsageError.

    Everything downstream signals, freezes and kills by this number, so it
    is checked before anything acts on it: 0 (kill(0) is the caller's whole
    process group, CRIU's included), 1 (the host's init), leading zeros,
    signs and values past the kernel's PID range are not a container's init.
    """
    # isascii: str.isdigit() accepts "²", which int() then rejects.
    if not (text.isascii() and text.isdigit()) or len(text) > 7 or text.startswith("0"):
        shown = text if len(text) <= 40 else text[:40] + "..."
        raise UsageError(f"CRTOOLS_INIT_PID is not a PID: {shown!r}")
    pid = int(text)
    if pid > PID_MAX_LIMIT:
        raise UsageError(f"CRTOOLS_INIT_PID is not a PID: {text!r} (beyond the kernel's range)")
    if pid == 1:
        raise UsageError("CRTOOLS_INIT_PID is 1, the host's init: not a container's init")
    return pid


def from_env(env: Mapping[str, str] | None = None, criu_pid: int | None = None) -> CriuCall:
    env = os.environ if env is None else env
    action = env.get("CRTOOLS_SCRIPT_ACTION", "")
    if not action:
        raise UsageError("CRTOOLS_SCRIPT_ACTION is not set: run this as a CRIU action script")
    image = env.get("CRTOOLS_IMAGE_DIR") or None
    pid_text = env.get("CRTOOLS_INIT_PID", "")
    init_pid = parse_pid(pid_text) if pid_text else None
    return CriuCall(
        action=action,
        image_dir=Path(image) if image else None,
        init_pid=init_pid,
        criu_pid=os.getppid() if criu_pid is None else criu_pid,
    )

