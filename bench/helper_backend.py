"""PROTOTYPE backend for P3 (benchmark evidence only): one driver attach per phase.

What a driver-API backend (cuCheckpointProcess{Lock,Checkpoint,Restore,
Unlock,GetState}, or a persistent helper process that calls them) would do,
against the simulator: pay the attach latency ONCE per backend instance (per
hook invocation) instead of once per `cuda-checkpoint` process, then talk to
each target's restore thread directly - the same requests, replies, copy
costs and errors the fake tool produces, without starting a process per call.
It plugs into the unchanged Engine through the Backend protocol.
"""

from __future__ import annotations

import json
import threading
import time
from pathlib import Path

from cudahook.core.backends import STATES, Features
from cudahook.core.backends.cli import features_for
from cudahook.platform.errors import ToolError


class OneAttachBackend:
    name = "one-attach (prototype)"

    def __init__(self, sim_root: Path):
        self.root = Path(sim_root)
        cfg = json.loads((self.root / "sim.json").read_text())
        self.latency = float(cfg.get("attach_latency_s", 0))
        self._features = features_for(str(cfg["driver_version"]))
        self._attached = False
        self._lock = threading.Lock()

    @property
    def features(self) -> Features:
        return self._features

    def _attach(self) -> None:
        with self._lock:  # every thread waits for the one attach
            if not self._attached:
                time.sleep(self.latency)
                self._attached = True

    def _ask(self, pid: int, action: str, request: dict[str, object]) -> dict[str, object]:
        from cudahook.sim.protocol import CudaError
        from cudahook.sim.tool import _ask, fail_text

        self._attach()
        try:
            return _ask(pid, request)
        except CudaError as exc:
            raise ToolError(pid, action, 1, fail_text(action, pid, str(exc))) from None

    def get_state(self, pid: int) -> str:
        state = str(self._ask(pid, "get-state", {"op": "get-state"})["state"])
        if state not in STATES:
            raise ToolError(pid, "get-state", 0, f"unexpected state {state!r}")
        return state

    def get_restore_tid(self, pid: int) -> int:
        return int(self._ask(pid, "get-restore-tid", {"op": "get-restore-tid"})["tid"])  # type: ignore[call-overload]

    def lock(self, pid: int, timeout_ms: int) -> None:
        self._ask(pid, "lock", {"op": "lock", "timeout_ms": timeout_ms})

    def checkpoint(self, pid: int) -> None:
        self._ask(pid, "checkpoint", {"op": "checkpoint"})

    def restore(self, pid: int, device_map: dict[str, str] | None = None) -> None:
        req: dict[str, object] = {"op": "restore"}
        if device_map:
            req["device_map"] = device_map
        self._ask(pid, "restore", req)

    def unlock(self, pid: int) -> None:
        self._ask(pid, "unlock", {"op": "unlock"})

    def toggle(self, pid: int) -> None:
        raise ToolError(pid, "toggle", 1, "not implemented in the prototype")
