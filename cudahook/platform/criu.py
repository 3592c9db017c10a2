"""CRIU as cudahook meets it on the node: its version, the lines of its
configuration files that name action scripts, and where it loads plugins
from. Standard library only: install.sh runs criuconf, which reads lines
through this module, before any virtual environment.
"""

from __future__ import annotations

import os
import re
from collections.abc import Mapping
from pathlib import Path

from . import paths

# Where CRIU looks for plugins (its --libdir default and distributions' builds);
# CRIU_LIBS_DIR, when CRIU runs with it, comes first.
CRIU_PLUGIN_DIRS = ("/usr/lib/criu", "/usr/local/lib/criu", "/usr/lib64/criu",
                    "/usr/lib/x86_64-linux-gnu/criu")
CUDA_PLUGIN = "cuda_plugin.so"

# The oldest CRIU cudahook checkpoints with (as `cudahook doctor` says).
MIN_VERSION = (4, 0)
# `criu --version` prints "Version: 4.1.1" (a third number for point
# releases only), then a "GitID:" line for a build from git, whose text may
# hold other dotted numbers: only the Version line counts.
_VERSION = re.compile(r"^Version:\s*(\d+)\.(\d+)(?:\.(\d+))?", re.MULTILINE)


def parse_version(text: str) -> tuple[int, ...]:
    """`criu --version`'s output as (major, minor[, sub]), which compares as
    versions do; () when no Version line is there."""
    m = _VERSION.search(text)
    return tuple(int(x) for x in m.groups() if x is not None) if m else ()


def version_text(version: tuple[int, ...]) -> str:
    return ".".join(map(str, version)) or "?"


# What to do about a missing or too old CRIU (doctor and the reason codes).
INSTALL_HINT = f"install CRIU >= {version_text(MIN_VERSION)}, e.g. ./install.sh --with-criu"
# CRIU 3.19 up to 4.2 runs every action script twice per dump or restore
# (a CRIU bug): cudahook runs each action once per CRIU run.
TWICE = ((3, 19), (4, 2))


def version_problem(version: tuple[int, ...], criu: str) -> tuple[str, str] | None:
    """(reason code, one line) when the CRIU at `criu`, of `version` (from
    parse_version), cannot be used; None when it can."""
    if not version:
        return "CRIU_MISSING", f"{criu} --version said nothing recognisable"
    if version < MIN_VERSION:
        return "CRIU_TOO_OLD", f"CRIU {version_text(version)} at {criu}"
    return None


def action_script(line: str) -> str | None:
    """The script an `action-script` line of a CRIU configuration names
    (quotes around it dropped), or None for any other line. Which lines CRIU
    could read as running code is criuconf's stricter question."""
    words = line.split(None, 1)
    if len(words) == 2 and words[0] == "action-script":
        return words[1].strip().strip('"')
    return None


def cuda_plugins(env: Mapping[str, str] | None = None, root: str | None = None) -> list[str]:
    """CRIU's own CUDA plugin files that this CRIU run may load.

    Node paths move with CUDAHOOK_ROOT (or `root`), so tests stand a plugin
    directory in.
    """
    env = os.environ if env is None else env
    dirs = [paths.at(d, root) for d in CRIU_PLUGIN_DIRS]
    if env.get("CRIU_LIBS_DIR"):
        dirs.insert(0, Path(env["CRIU_LIBS_DIR"]))
    return [str(d / CUDA_PLUGIN) for d in dirs if (d / CUDA_PLUGIN).exists()]
