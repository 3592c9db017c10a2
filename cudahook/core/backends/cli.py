"""Backend over NVIDIA's `cuda-checkpoint` executable.

Each call is a separate process that attaches to the driver (seconds on real
hardware), so callers batch calls in parallel; this module only makes each
call safe: a deadline, a killed process group on expiry, and errors that say
which PID, which action, what exit status and what the tool printed.
"""

from __future__ import annotations

import os
import re
import threading

from cudahook.platform.config import Settings
from cudahook.platform.errors import EnvironmentProblem, ToolError
from cudahook.platform.host import Host

from .base import RELEASE, STATES, Features, driver_major, parse_nvrm

_VERSION = re.compile(r"Version\s+(\d+(?:\.\d+)*)")


def parse_help(text: str) -> Features:
    """What a --help text advertises (kept for diagnostics: features follow the driver)."""
    version = _VERSION.search(text)
    return Features(
        version=version.group(1) if version else "",
        toggle="--toggle" in text,
        actions="--action" in text,
        get_state="--get-state" in text,
        restore_tid="--get-restore-tid" in text,
        device_map="--device-map" in text,
        launch_job="--launch-job" in text,
    )


def features_for(version: str) -> Features:
    """What cuda-checkpoint can do on this driver release.

    The tool is a stub: its parser and operations live in libcuda, so the
    driver branch decides (docs/drivers.md), whatever the binary.
    """
    major = driver_major(version) or 0
    return Features(
        version=version,
        toggle=major >= 550,
        actions=major >= 555,
        get_state=major >= 555,
        restore_tid=major >= 555,
        device_map=major >= 580,
        launch_job=major >= 590,
    )


def driver_version(host: Host, settings: Settings) -> str:
    """The installed driver's version: its /proc file, else nvidia-smi.

    EnvironmentProblem when neither says: every decision that depends on
    the branch (features, manifest, same-branch restore) needs it.
    """
    why = []
    # The message names both sources' answers; the error chains the one
    # that was an exception (the /proc file's), for the log's traceback.
    unreadable: OSError | None = None
    try:
        with open(settings.driver_version_file) as f:
            version = parse_nvrm(f.read(4096))
        if version:
            return version
        why.append(f"{settings.driver_version_file}: no NVRM version line")
    except OSError as exc:
        why.append(f"{settings.driver_version_file}: {exc.strerror or exc}")
        unreadable = exc
    smi = settings.tool("nvidia_smi")
    result = host.run([smi, "--query-gpu=driver_version", "--format=csv,noheader"], 30)
    lines = [x.strip() for x in result.stdout.splitlines() if x.strip()]
    if result.ok and lines and RELEASE.fullmatch(lines[0]):
        return lines[0]
    if result.timed_out:
        why.append("nvidia-smi timed out")
    else:
        said = (result.stderr or result.stdout).strip()
        why.append(f"nvidia-smi: {said or f'exit {result.returncode}'}")
    raise EnvironmentProblem(f"NVIDIA driver version unknown ({'; '.join(why)})") from unreadable


def format_device_map(device_map: dict[str, str]) -> str:
    return ",".join(f"{old}={new}" for old, new in device_map.items())


class CudaCheckpointCLI:
    name = "cuda-checkpoint"
    why = ""  # why this backend runs (see make_backend)

    def __init__(self, host: Host, settings: Settings, features: Features | None = None):
        self.host = host
        self.settings = settings
        self.path = settings.tool("cuda_checkpoint")
        self.timeout = settings.call_timeout_s
        self._features = features
        self._probe = threading.Lock()

    @property
    def features(self) -> Features:
        # Engine threads all ask at once: read the driver once per process.
        # A failure is raised each time, never kept: the next call reads again.
        with self._probe:
            if self._features is None:
                if not os.access(self.path, os.X_OK):
                    raise EnvironmentProblem(
                        f"cuda-checkpoint not usable at {self.path}: not an executable file",
                        reason="CHECKPOINT_TOOL_MISSING")
                self._features = features_for(driver_version(self.host, self.settings))
            return self._features

    def _call(self, pid: int, action: str, args: list[str], timeout: float | None = None) -> str:
        result = self.host.run([self.path, *args, "--pid", str(pid)], timeout or self.timeout)
        if not result.ok:
            raise ToolError(
                pid, action, result.returncode, result.stderr or result.stdout,
                timed_out=result.timed_out,
            )
        return result.stdout

    def _need(self, flag: str, what: str) -> None:
        if not getattr(self.features, flag):
            raise EnvironmentProblem(
                f"cuda-checkpoint {self.features.version or '(unknown version)'} "
                f"does not support {what}"
            )

    def get_state(self, pid: int) -> str:
        self._need("get_state", "--get-state (driver R555 or newer)")
        out = self._call(pid, "get-state", ["--get-state"]).strip()
        if out not in STATES:
            # A word we do not know is still a CUDA process answering: never
            # "not CUDA", never a state to act on.
            raise ToolError(pid, "get-state", 0, f"unexpected state {out!r}", cuda=True)
        return out

    def get_restore_tid(self, pid: int) -> int:
        self._need("restore_tid", "--get-restore-tid (driver R555 or newer)")
        out = self._call(pid, "get-restore-tid", ["--get-restore-tid"]).strip()
        if not out.isdigit():
            raise ToolError(pid, "get-restore-tid", 0, f"unexpected output {out!r}")
        return int(out)

    def lock(self, pid: int, timeout_ms: int) -> None:
        self._need("actions", "--action lock (driver R555 or newer)")
        args = ["--action", "lock"]
        if timeout_ms:
            args += ["--timeout", str(timeout_ms)]
        # The lock waits up to timeout_ms itself; our deadline must outlast it.
        self._call(pid, "lock", args, timeout=self.timeout + timeout_ms / 1000)

    def checkpoint(self, pid: int) -> None:
        self._need("actions", "--action checkpoint (driver R555 or newer)")
        self._call(pid, "checkpoint", ["--action", "checkpoint"])

    def restore(self, pid: int, device_map: dict[str, str] | None = None) -> None:
        self._need("actions", "--action restore (driver R555 or newer)")
        args = ["--action", "restore"]
        if device_map:
            self._need("device_map", "--device-map (driver R580 or newer)")
            args += ["--device-map", format_device_map(device_map)]
        self._call(pid, "restore", args)

    def unlock(self, pid: int) -> None:
        self._need("actions", "--action unlock (driver R555 or newer)")
        self._call(pid, "unlock", ["--action", "unlock"])

    def toggle(self, pid: int) -> None:
        self._need("toggle", "--toggle")
        self._call(pid, "toggle", ["--toggle"])
