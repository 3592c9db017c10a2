"""Install the hook executables with the interpreter (and config) baked in.

Runtimes start hooks with a scrubbed environment, and CRIU takes a bare path
for an action script, so the installed copies carry the absolute interpreter
path and, when given, the configuration file to use.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

NAMES = ("cudahook-oci-hook", "cudahook-criu-action")


def templates_dir() -> Path:
    here = Path(__file__).resolve().parent.parent / "hooks"
    if here.is_dir():
        return here
    return Path(sys.prefix) / "share" / "cudahook" / "hooks"


def render(name: str, python: str, config: str | None = None) -> str:
    out = []
    for line in (templates_dir() / name).read_text().splitlines():
        if line.startswith("PYTHON="):
            out.append(f"PYTHON={python}")
            if config:
                out.append(f"CUDAHOOK_CONFIG={config}; export CUDAHOOK_CONFIG")
            continue
        out.append(line)
    return "\n".join(out) + "\n"


def install(dest: str | os.PathLike[str], python: str = sys.executable,
            config: str | None = None) -> dict[str, Path]:
    dest = Path(dest)
    dest.mkdir(parents=True, exist_ok=True)
    paths = {}
    for name in NAMES:
        path = dest / name
        tmp = dest / f".{name}.tmp"
        tmp.write_text(render(name, python, config))
        tmp.chmod(0o755)
        os.replace(tmp, path)
        paths[name] = path
    return paths
