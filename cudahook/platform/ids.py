"""What names a container's state: its id as a runtime gives it, and the
key (id and bundle) or init process that tells two containers of one id
apart. The state store, the busy locks, the marks and the CRIU
configuration copies all name files by these.
"""

from __future__ import annotations

import os
import re

from .errors import UsageError

# The kernel's ceiling for pid_max (PID_MAX_LIMIT on 64-bit): no real PID is larger.
PID_MAX_LIMIT = 1 << 22

# typing costs milliseconds at every hook start: annotations only.
TYPE_CHECKING = False
if TYPE_CHECKING:
    from typing import Any


# At most 250 characters: "<id>.json" must fit NAME_MAX (255); a longer id
# used to end in an OSError traceback (ENAMETOOLONG) instead of a clear error.
ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.+-]{0,249}$")


def check_id(container_id: str) -> str:
    # fullmatch: with match, "$" also accepts a trailing newline ("abc\n").
    if not isinstance(container_id, str) or not ID.fullmatch(container_id):
        raise UsageError(f"invalid container id {container_id!r}")
    return container_id


# What names a container's state: "<id>@<16 hex digits>" (container_key);
# "@<init pid>-<its start time>" for a container without a record (init_key);
# a bare id, as written before keys, still read and swept.
ID_CUT = 250 - 17
KEY = re.compile(rf"[A-Za-z0-9][A-Za-z0-9_.+-]{{0,{ID_CUT - 1}}}@[0-9a-f]{{16}}"
              r"|@[1-9][0-9]{0,9}-[0-9]{1,20}")


def container_key(container_id: str, bundle: str) -> str:
    """The one identity of a container on this node, which names its state.

    The OCI hooks see the id and the bundle in the runtime's state; the
    runtime wrapper sees the id and runc's --bundle; the CRIU action script
    finds the record by its init's PID, and with it the key. The bundle
    tells apart containers of one id under two runc roots, containerd
    namespaces or podman storages. runc reports as the bundle its working
    directory once there, which may be spelt through a symlink (or its
    caller's $PWD): the real path is what counts. The key starts with the
    id (cut to fit a file name; the digest covers all of it), for whoever
    reads the state directory."""
    cid = check_id(container_id)
    if not isinstance(bundle, str) or not bundle or "\0" in bundle:
        raise UsageError(f"container {cid}: invalid bundle {bundle!r}")
    where = os.path.realpath(bundle)
    digest = _sha256(f"{cid}\0{where}".encode(errors="surrogateescape")).hexdigest()
    return f"{cid[:ID_CUT]}@{digest[:16]}"


def _sha256(data: bytes) -> Any:
    """SHA-256 from CPython's built-in module where there is one: importing
    hashlib starts OpenSSL, about 3.5 ms at every GPU container's hook."""
    try:
        from _sha2 import sha256  # Python 3.12+
    except ImportError:
        try:
            from _sha256 import sha256  # Python 3.11
        except ImportError:
            from hashlib import sha256
    return sha256(data)


def init_key(pid: int, start: int) -> str:
    """What serialises the checkpoints of a container the OCI hook never
    recorded (created before cudahook, or by a runtime without the hook):
    its init process, which every CRIU run of it names."""
    if type(pid) is not int or type(start) is not int or pid <= 0 or start < 0:
        raise UsageError(f"invalid init process {pid!r} (start {start!r})")
    return f"@{pid}-{start}"


def check_key(key: str) -> str:
    """A key (or a bare id of an older record); UsageError for anything else."""
    if not isinstance(key, str) or not (KEY.fullmatch(key) or ID.fullmatch(key)):
        raise UsageError(f"invalid container id {key!r}")
    return key


def init_of(key: str) -> tuple[int, int] | None:
    """The (pid, start time) an init_key names; None for any other key."""
    if not key.startswith("@"):
        return None
    pid, _, start = key[1:].partition("-")
    return int(pid), int(start)
