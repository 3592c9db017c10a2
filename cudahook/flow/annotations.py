"""Per-container overrides, given as OCI annotations under one prefix.

Only whitelisted keys are accepted, and a bad value stops the container at
create time with a one-line reason rather than surfacing at checkpoint time.
"""

from __future__ import annotations

from cudahook.platform.config import Settings, validate
from cudahook.platform.errors import ConfigError, DeviceMapError, UsageError
from cudahook.platform.record import Record

# typing costs milliseconds at every hook start: annotations only.
TYPE_CHECKING = False
if TYPE_CHECKING:
    from typing import Any


PREFIX = "cudahook.io/"


class Options(Record, frozen=True):
    enabled: bool | None = None  # None: decided by whether the container has GPUs
    sequential: bool | None = None
    lock_timeout_ms: int | None = None
    call_timeout_s: float | None = None
    device_map: str | None = None
    vmm_restore_before_unlock: bool | None = None
    backend: str | None = None
    gpu_memory: str | None = None  # `gpu_memory`: host, storage or auto

    def apply(self, settings: Settings) -> Settings:
        changes: dict[str, Any] = {}
        if self.sequential is not None:
            changes["sequential"] = self.sequential
        if self.lock_timeout_ms is not None:
            changes["lock_timeout_ms"] = self.lock_timeout_ms
        if self.call_timeout_s is not None:
            changes["call_timeout_s"] = self.call_timeout_s
        if self.vmm_restore_before_unlock is not None:
            changes["vmm_restore_before_unlock"] = self.vmm_restore_before_unlock
        if self.backend is not None:
            changes["backend"] = self.backend
        if self.gpu_memory is not None:
            changes["gpu_memory"] = self.gpu_memory
        return settings.with_overrides(**changes) if changes else settings


def _known() -> list[str]:
    import json

    from cudahook.platform.config import config_dir

    return list(json.loads((config_dir() / "annotations.schema.json").read_text())["properties"])


_SETTING = {"lock-timeout-ms": ("lock_timeout_ms", int), "call-timeout-s": ("call_timeout_s", float)}


def _check_limits(raw: dict[str, str]) -> None:
    values = {name: conv(raw[k]) for k, (name, conv) in _SETTING.items() if k in raw}
    if not values:
        return
    try:
        validate(values, "config.schema.json", "annotation")
    except ConfigError as exc:
        text = str(exc)
        for k, (name, _) in _SETTING.items():
            text = text.replace(f"annotation: {name}:", f"annotation {PREFIX}{k}:", 1)
        raise UsageError(text) from exc


def ours(annotations: dict[str, str] | None) -> dict[str, str]:
    return {k[len(PREFIX):]: v for k, v in (annotations or {}).items() if k.startswith(PREFIX)}


def parse(annotations: dict[str, str] | None) -> Options:
    raw = ours(annotations)
    if not raw:
        return Options()
    # Name an unknown key in full; the schema would only say "(top level)".
    known = _known()
    unknown = sorted(set(raw) - set(known))
    if unknown:
        raise UsageError(f"unknown annotation {PREFIX}{unknown[0]} "
                         f"(known: {', '.join(PREFIX + k for k in known)})")
    # The schema's patterns end in \Z (Python's "$" also matches before a
    # trailing newline); a control character anywhere is refused here first,
    # with the value named.
    for k, v in raw.items():
        if isinstance(v, str) and not v.isprintable():
            raise UsageError(f"annotation {PREFIX}{k}: {v!r} holds a control character")
    try:
        validate(raw, "annotations.schema.json", "annotation")
    except Exception as exc:  # ConfigError, reworded for where the value came from
        raise UsageError(str(exc).replace("annotation: ", f"annotation {PREFIX}", 1)) from exc
    if "device-map" in raw:
        from cudahook.core.devicemap import parse_device_map

        try:
            parse_device_map(raw["device-map"])
        except DeviceMapError as exc:  # the pattern lets e.g. "GPU-----..." or duplicates through
            raise UsageError(f"annotation {PREFIX}device-map: {exc}") from exc
    # The patterns allow values the configuration schema rejects (a call
    # timeout of 0, a lock timeout past its maximum): hold them to the same limits.
    _check_limits(raw)
    flag = {"true": True, "false": False}
    return Options(
        enabled=flag.get(raw.get("enabled", "")),
        sequential=flag.get(raw.get("sequential", "")),
        lock_timeout_ms=int(raw["lock-timeout-ms"]) if "lock-timeout-ms" in raw else None,
        call_timeout_s=float(raw["call-timeout-s"]) if "call-timeout-s" in raw else None,
        device_map=raw.get("device-map"),
        vmm_restore_before_unlock=flag.get(raw.get("vmm-restore-before-unlock", "")),
        backend=raw.get("backend"),
        gpu_memory=raw.get("gpu-memory"),
    )
