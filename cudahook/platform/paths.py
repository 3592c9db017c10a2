"""Where cudahook's files live on a node, and the one switch that moves them.

Every default path cudahook reads or writes on the node is named here, as
the path it has on a real node. `CUDAHOOK_ROOT` (environment) names a
directory that stands in for "/" for all of them at once: the configuration,
the state and marks directories, the log, the install prefix, the commands,
the journal and the runtimes' registration files. The shell hooks read the
same variable (`${CUDAHOOK_ROOT-}/run/cudahook-marks`), so one setting moves
Python and shell alike. Unset or empty means the real node.

Paths a user gives explicitly (a `--config` file, `state_dir` in a
configuration file) are taken as given: the root only moves defaults.
Standard library only: install.sh runs this before any virtual environment.
"""

from __future__ import annotations

import os
from pathlib import Path

ROOT_ENV = "CUDAHOOK_ROOT"

# The node paths, as on a real node.
CONFIG = "/etc/cudahook/config.yaml"
STATE_DIR = "/run/cudahook"
# Marks the shell fast paths test before they start Python: fixed (under the
# root), not under the configurable state directory, because the shell reads
# no configuration.
MARKS_DIR = "/run/cudahook-marks"
LOG_FILE = "/var/log/cudahook.log"
LOGROTATE = "/etc/logrotate.d/cudahook"
PREFIX = "/opt/cudahook"
BIN_DIR = "/usr/local/bin"
CRIU_LINK_DIR = "/usr/local/sbin"
JOURNAL_DIR = "/var/lib/cudahook"
CRIU_CONF = "/etc/criu/runc.conf"
DOCKER_JSON = "/etc/docker/daemon.json"
CONTAINERD_DROPIN = "/etc/systemd/system/containerd.service.d/50-cudahook.conf"
HOOKS_D = "/usr/share/containers/oci/hooks.d"


def root() -> Path:
    """The directory standing in for "/" ("/" itself when unset)."""
    value = os.environ.get(ROOT_ENV, "")
    return Path(value) if value else Path("/")


def at(path: str, base: str | os.PathLike[str] | None = None) -> Path:
    """`path` (absolute, as on a real node) under `base`, or under the root."""
    base = Path(base) if base is not None else root()
    return base / path.lstrip("/")
