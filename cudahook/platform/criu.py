"""CRIU as cudahook meets it on the node: where it loads plugins from."""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path

# Where CRIU looks for plugins (its --libdir default and distributions' builds);
# CRIU_LIBS_DIR, when CRIU runs with it, comes first.
CRIU_PLUGIN_DIRS = ("/usr/lib/criu", "/usr/local/lib/criu", "/usr/lib64/criu",
                    "/usr/lib/x86_64-linux-gnu/criu")
CUDA_PLUGIN = "cuda_plugin.so"


def cuda_plugins(env: Mapping[str, str] | None = None, root: str | None = None) -> list[str]:
    """CRIU's own CUDA plugin files that this CRIU run may load.

    Node paths move with CUDAHOOK_ROOT (or `root`), so tests stand a plugin
    directory in.
    """
    from cudahook.platform import paths

    env = os.environ if env is None else env
    dirs = [paths.at(d, root) for d in CRIU_PLUGIN_DIRS]
    if env.get("CRIU_LIBS_DIR"):
        dirs.insert(0, Path(env["CRIU_LIBS_DIR"]))
    return [str(d / CUDA_PLUGIN) for d in dirs if (d / CUDA_PLUGIN).exists()]
