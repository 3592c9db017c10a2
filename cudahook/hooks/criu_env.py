"""What CRIU tells an action script, from its environment."""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

from cudahook.platform.errors import UsageError

ACTIONS = {
    "pre-dump", "network-lock", "post-dump", "network-unlock", "pre-restore",
    "setup-namespaces", "post-setup-namespaces", "post-restore", "pre-resume",
    "post-resume", "orphan-pts-master", "pre-stream", "query-ext-files",
}


@dataclass(frozen=True)
class CriuCall:
    action: str
    image_dir: Path | None
    init_pid: int | None  # host PID of the container's init (unset at pre-restore)
    criu_pid: int  # the CRIU process that runs us; identifies this dump or restore


def from_env(env: Mapping[str, str] | None = None, criu_pid: int | None = None) -> CriuCall:
    env = os.environ if env is None else env
    action = env.get("CRTOOLS_SCRIPT_ACTION", "")
    if not action:
        raise UsageError("CRTOOLS_SCRIPT_ACTION is not set: run this as a CRIU action script")
    image = env.get("CRTOOLS_IMAGE_DIR") or None
    pid_text = env.get("CRTOOLS_INIT_PID", "")
    # isascii: str.isdigit() accepts "²", which int() then rejects.
    if pid_text and not (pid_text.isascii() and pid_text.isdigit()):
        raise UsageError(f"CRTOOLS_INIT_PID is not a PID: {pid_text!r}")
    return CriuCall(
        action=action,
        image_dir=Path(image) if image else None,
        init_pid=int(pid_text) if pid_text else None,
        criu_pid=os.getppid() if criu_pid is None else criu_pid,
    )


# Where CRIU looks for plugins (its --libdir default and distributions' builds);
# CRIU_LIBS_DIR, when CRIU runs with it, comes first.
CRIU_PLUGIN_DIRS = ("/usr/lib/criu", "/usr/local/lib/criu", "/usr/lib64/criu",
                    "/usr/lib/x86_64-linux-gnu/criu")
CUDA_PLUGIN = "cuda_plugin.so"


def cuda_plugins(env: Mapping[str, str] | None = None) -> list[str]:
    """CRIU's own CUDA plugin files that this CRIU run may load.

    Node paths move with CUDAHOOK_ROOT, so tests stand a plugin directory in.
    """
    from cudahook.platform import paths

    env = os.environ if env is None else env
    dirs = [paths.at(d) for d in CRIU_PLUGIN_DIRS]
    if env.get("CRIU_LIBS_DIR"):
        dirs.insert(0, Path(env["CRIU_LIBS_DIR"]))
    return [str(d / CUDA_PLUGIN) for d in dirs if (d / CUDA_PLUGIN).exists()]
