"""What every backend shares: the driver's checkpoint states, what a driver
release can do, and how a driver version reads. The backends import it;
the package re-exports it (callers import `cudahook.core.backends`).
"""

from __future__ import annotations

import re

from cudahook.platform.record import Record

# A driver release as nvidia-smi prints it ("580.65.06"), and as the
# driver's /proc/driver/nvidia/version names it, in a line like
# "NVRM version: NVIDIA UNIX ... Kernel Module ...  580.65.06  ...".
RELEASE = re.compile(r"\d+\.\d+(?:\.\d+)?")
_NVRM = re.compile(r"^NVRM version:.*?\s(\d{3,}\.\d+(?:\.\d+)?)\s", re.MULTILINE)


def parse_nvrm(text: str) -> str:
    """The driver version in /proc/driver/nvidia/version's text, or ""."""
    m = _NVRM.search(text)
    return m.group(1) if m else ""


def driver_major(version: str) -> int | None:
    """A driver version's branch ("580.65.06": 580), which decides what its
    checkpoint support can do; None when `version` starts with no number."""
    head = version.split(".", 1)[0]
    return int(head) if head.isdigit() else None


RUNNING = "running"
LOCKED = "locked"
CHECKPOINTED = "checkpointed"
# A CUDA process in trouble (CU_PROCESS_STATE_FAILED) or one the driver cannot
# place; CUDA 13.4+ also reports an operation in progress. None of these is
# "not CUDA", and none is a state cudahook moves a process out of.
FAILED = "failed"
UNKNOWN = "unknown"
CHECKPOINTING = "checkpointing"
RESTORING = "restoring"
STABLE = (RUNNING, LOCKED, CHECKPOINTED)
STATES = (*STABLE, FAILED, UNKNOWN, CHECKPOINTING, RESTORING)


def explain_state(state: str) -> str:
    """A state as an operator should read it."""
    return {
        FAILED: "failed (the driver gave up on its CUDA state)",
        UNKNOWN: "in an unknown CUDA state",
        CHECKPOINTING: "still checkpointing",
        RESTORING: "still restoring",
    }.get(state, state)


class Features(Record, frozen=True):
    """What the installed driver's checkpoint support can do."""

    version: str = ""  # e.g. "570.86.10"; empty when the tool does not say
    toggle: bool = False  # R550+
    actions: bool = False  # R555+: lock/checkpoint/restore/unlock separately
    get_state: bool = False  # R555+
    restore_tid: bool = False  # R555+
    device_map: bool = False  # R580+
    launch_job: bool = False  # R590+
    # CUDA 13.4+ custom storage (cuCheckpointOperationComplete, driver API
    # only), as the driver itself answers cuGetProcAddress; why not, if not.
    custom_storage: bool = False
    custom_storage_why: str = "not asked"

    @property
    def major(self) -> int:
        return driver_major(self.version) or 0

    def describe(self) -> str:
        names = [n for n in ("toggle", "actions", "get_state", "restore_tid", "device_map",
                             "launch_job", "custom_storage") if getattr(self, n)]
        return f"{self.version or 'unknown version'}: {', '.join(names) or 'nothing'}"


