"""The OCI hook: keep track of GPU containers.

createRuntime/prestart (run again by runc on restore, with the restored
init's PID) record the container; poststop forgets it and removes interposer
sockets and the per-container CRIU configuration it left behind. Non-GPU
containers leave after reading config.json: no schema validation, no config
file, no tool call.
"""

from __future__ import annotations

import sys

from cudahook.flow import tracking
from cudahook.platform.errors import Exit, UsageError, one_line, report
from cudahook.platform.ids import PID_MAX_LIMIT

from . import oci_state

CREATE_STAGES = ("prestart", "createRuntime")
STAGES = (*CREATE_STAGES, "poststart", "poststop")
# Run inside the container's namespaces, where the host's /proc, state
# directory and tools are not what they seem.
REFUSED_STAGES = ("createContainer", "startContainer")


def main(argv: list[str]) -> int:
    try:
        stage = _stage(argv)
        state = oci_state.read_state(_read_stdin())
        if stage in CREATE_STAGES:
            # The PID is parsed only for a container cudahook tracks: any
            # other runs as it would without cudahook.
            return tracking.track(stage, state["id"], state["bundle"], lambda: _pid(state),
                                  state.get("status"))
        if stage == "poststop":
            return tracking.forget(state["id"], state["bundle"])
        return Exit.OK
    except Exception as exc:  # every failure is one line and a documented code
        return report(exc)


def _stage(argv: list[str]) -> str:
    if len(argv) == 1 and argv[0] in REFUSED_STAGES:
        raise UsageError(f"{argv[0]} runs inside the container's namespaces: register "
                         "cudahook-oci-hook for createRuntime (or prestart) and poststop")
    if len(argv) != 1 or argv[0] not in STAGES:
        raise UsageError(f"usage: cudahook-oci-hook {{{'|'.join(STAGES)}}} < state.json")
    return argv[0]


def _read_stdin() -> str:
    """At most MAX_STATE + 1 bytes of stdin (read_state refuses more), as
    UTF-8 text (RFC 8259). The shell hook hands on the state with a newline
    added: one trailing newline is not counted."""
    data = sys.stdin.buffer.read(oci_state.MAX_STATE + 2)
    if data.endswith(b"\n"):
        data = data[:-1]
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError:
        raise UsageError("container state on stdin is not JSON: not UTF-8") from None


def _pid(state: dict) -> int | None:  # type: ignore[type-arg]
    """The state's init PID: absent (or 0) before the runtime has one."""
    pid = state.get("pid")
    if pid is None or (pid == 0 and type(pid) is int):
        return None
    if type(pid) is not int or not 1 < pid <= PID_MAX_LIMIT:
        raise UsageError(f"container state: pid {one_line(repr(pid), 40)} is not a PID")
    return pid
