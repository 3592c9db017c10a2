"""Install the hook executables with the interpreter (and config) baked in.

Runtimes start hooks with a scrubbed environment, and CRIU takes a bare path
for an action script, so the installed copies carry the absolute interpreter
path and, when given, the configuration file to use.
"""

from __future__ import annotations

import os
import shlex
import sys
from pathlib import Path

from cudahook.platform import paths
from cudahook.platform.atomic import write_atomic

NAMES = ("cudahook-oci-hook", "cudahook-criu-action", "cudahook-runtime")
# The shell fast paths the three share: the templates source it from beside
# themselves; an installed hook carries it inline (a wrapper reached through a
# symlink in /usr/local/bin has nothing beside it).
LIB = "cudahook-lib.sh"
SOURCE_LIB = f'. "${{0%/*}}/{LIB}"'


def templates_dir() -> Path:
    here = Path(__file__).resolve().parents[2] / "hooks"
    if here.is_dir():
        return here
    return Path(sys.prefix) / "share" / "cudahook" / "hooks"


def render(name: str, python: str, config: str | None = None,
           values: dict[str, str] | None = None, root: str | None = None) -> str:
    """The template with its default lines replaced: PYTHON=, and any NAME= in
    `values` (the wrapper's RUNC= and HOOK=). A node root other than "/"
    (default: $CUDAHOOK_ROOT) is baked in too: runtimes and CRIU start hooks
    with an environment of their own."""
    if root is None:
        root = os.environ.get(paths.ROOT_ENV, "")
    root = "" if root in ("", "/") else root
    out = []
    for line in (templates_dir() / name).read_text().splitlines():
        if line.strip() == SOURCE_LIB:
            out.append(f"# --- {LIB} ---")
            out.extend((templates_dir() / LIB).read_text().splitlines())
            out.append(f"# --- end of {LIB} ---")
            continue
        key = line.split("=", 1)[0]
        if values and "=" in line and key in values and key.isupper():
            out.append(f"{key}={shlex.quote(values[key])}")
            continue
        if line.startswith("PYTHON="):
            # Quoted: a path with a space (or a shell character) must stay one word.
            out.append(f"PYTHON={shlex.quote(python)}")
            if config:
                out.append(f"CUDAHOOK_CONFIG={shlex.quote(config)}; export CUDAHOOK_CONFIG")
            if root:
                # A default: a root set in the hook's own environment wins.
                out.append(f": \"${{CUDAHOOK_ROOT={shlex.quote(root)}}}\"; export CUDAHOOK_ROOT")
            continue
        out.append(line)
    return "\n".join(out) + "\n"


def real_runc(exclude: Path | None = None) -> str:
    """The runc the wrapper execs: first on PATH that is not a cudahook wrapper."""
    for d in [*os.environ.get("PATH", "/usr/sbin:/usr/bin").split(os.pathsep), "/usr/sbin"]:
        cand = Path(d, "runc")
        if not (cand.is_file() and os.access(cand, os.X_OK)):
            continue
        if exclude and cand.resolve().parent == exclude.resolve():
            continue
        if b"cudahook" in cand.read_bytes()[:4096]:
            continue
        return str(cand)
    return "/usr/sbin/runc"


def install(dest: str | os.PathLike[str], python: str = sys.executable,
            config: str | None = None, runc: str | None = None) -> dict[str, Path]:
    dest = Path(dest)
    dest.mkdir(parents=True, exist_ok=True)
    values = {"RUNC": runc or real_runc(exclude=dest),
              "HOOK": str(dest / "cudahook-oci-hook")}
    paths = {}
    for name in NAMES:
        path = dest / name
        write_atomic(path, render(name, python, config, values).encode(), 0o755)
        paths[name] = path
    return paths
