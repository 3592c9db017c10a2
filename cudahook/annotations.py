"""Per-container overrides, given as OCI annotations under one prefix.

Only whitelisted keys are accepted, and a bad value stops the container at
create time with a one-line reason rather than surfacing at checkpoint time.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from .config import Settings, validate
from .errors import UsageError

PREFIX = "cudahook.io/"


@dataclass(frozen=True)
class Options:
    enabled: bool | None = None  # None: decided by whether the container has GPUs
    sequential: bool | None = None
    lock_timeout_ms: int | None = None
    call_timeout_s: float | None = None
    device_map: str | None = None
    vmm_restore_before_unlock: bool | None = None

    def apply(self, settings: Settings) -> Settings:
        changes: dict[str, Any] = {}
        if self.sequential is not None:
            changes["sequential"] = self.sequential
        if self.lock_timeout_ms is not None:
            changes["lock_timeout_ms"] = self.lock_timeout_ms
        if self.call_timeout_s is not None:
            changes["call_timeout_s"] = self.call_timeout_s
        return settings.with_overrides(**changes) if changes else settings


def ours(annotations: dict[str, str] | None) -> dict[str, str]:
    return {k[len(PREFIX):]: v for k, v in (annotations or {}).items() if k.startswith(PREFIX)}


def parse(annotations: dict[str, str] | None) -> Options:
    raw = ours(annotations)
    if not raw:
        return Options()
    try:
        validate(raw, "annotations.schema.json", "annotation")
    except Exception as exc:  # ConfigError, reworded for where the value came from
        raise UsageError(str(exc).replace("annotation: ", f"annotation {PREFIX}", 1)) from None
    if "device-map" in raw:
        from .devicemap import parse_device_map

        parse_device_map(raw["device-map"])
    flag = {"true": True, "false": False}
    return Options(
        enabled=flag.get(raw.get("enabled", "")),
        sequential=flag.get(raw.get("sequential", "")),
        lock_timeout_ms=int(raw["lock-timeout-ms"]) if "lock-timeout-ms" in raw else None,
        call_timeout_s=float(raw["call-timeout-s"]) if "call-timeout-s" in raw else None,
        device_map=raw.get("device-map"),
        vmm_restore_before_unlock=flag.get(raw.get("vmm-restore-before-unlock", "")),
    )
