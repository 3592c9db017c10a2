"""Backend over NVIDIA's `cuda-checkpoint` executable.

Each call is a separate process that attaches to the driver (seconds on real
hardware), so callers batch calls in parallel; this module only makes each
call safe: a deadline, a killed process group on expiry, and errors that say
which PID, which action, what exit status and what the tool printed.
"""

from __future__ import annotations

import contextlib
import os
import re
import threading
from dataclasses import asdict
from pathlib import Path

from cudahook.platform.config import Settings
from cudahook.platform.errors import EnvironmentProblem, ToolError
from cudahook.platform.host import Host
from cudahook.platform.store import read_json, write_json_atomic

from . import STATES, Features

_VERSION = re.compile(r"Version\s+(\d+(?:\.\d+)*)")


def parse_help(text: str) -> Features:
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


def format_device_map(device_map: dict[str, str]) -> str:
    return ",".join(f"{old}={new}" for old, new in device_map.items())


class CudaCheckpointCLI:
    name = "cuda-checkpoint"

    def __init__(self, host: Host, settings: Settings, features: Features | None = None):
        self.host = host
        self.path = settings.tool("cuda_checkpoint")
        self.timeout = settings.call_timeout_s
        self.cache = Path(settings.state_dir) / "features.json"
        self._features = features
        self._probe = threading.Lock()

    @property
    def features(self) -> Features:
        # Engine threads all ask at once: probe once. Every hook invocation is
        # a new process, so the answer is also kept on disk for this binary.
        with self._probe:
            if self._features is None:
                self._features = self._cached() or self._probe_help()
            return self._features

    def _key(self) -> list[object] | None:
        try:
            st = os.stat(self.path)
        except OSError:
            return None
        return [self.path, st.st_mtime_ns, st.st_size, st.st_ino]

    def _cached(self) -> Features | None:
        key = self._key()
        data = read_json(self.cache)
        if key is None or not isinstance(data, dict) or data.get("key") != key:
            return None
        try:
            return Features(**data["features"])
        except (KeyError, TypeError):
            return None

    def _probe_help(self) -> Features:
        result = self.host.run([self.path, "--help"], timeout=min(self.timeout, 30))
        text = result.stdout + result.stderr
        if result.returncode == 127 or not text.strip():
            raise EnvironmentProblem(
                f"cuda-checkpoint not usable at {self.path}: "
                f"{result.stderr.strip() or 'no --help output'}"
            )
        features = parse_help(text)
        key = self._key()
        if key is not None:
            with contextlib.suppress(OSError):
                self.cache.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
                write_json_atomic(self.cache, {"key": key, "features": asdict(features)})
        return features

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
            raise ToolError(pid, "get-state", 0, f"unexpected state {out!r}")
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
