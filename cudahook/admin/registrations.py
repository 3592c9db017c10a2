"""cudahook's registrations in files other tools own, found and removed piecewise.

A registration names one of cudahook's executables: the action-script line in
/etc/criu/runc.conf, the hooks.d definitions, docker's `cudahook` runtime, the
containerd drop-in's runc wrapper directory. One that outlives its executable
breaks the runtime for every container (runc checkpoint fails when CRIU
cannot run an action script), so uninstall removes each registration before
the files it names, and `cudahook doctor` reports any left dangling.

`strip` removes only cudahook's part of such a file, for files someone else
changed since cudahook wrote them. Standard library only: install.sh runs
this before any virtual environment exists.
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from cudahook.platform import criuconf, paths
from cudahook.platform.criu import action_script

CRIU_COMMENT = criuconf.COMMENT
ACTION_NAME = criuconf.ACTION_NAME
HOOKS_D_NAMES = ("50-cudahook-create.json", "50-cudahook-poststop.json")
_DROPIN_PATH = re.compile(r'PATH=([^:"\s]+)')


def files(root: str | os.PathLike[str]) -> dict[str, Path]:
    """Every registration file, by kind, under the node root."""
    out = {"criu": paths.at(paths.CRIU_CONF, root),
           "docker": paths.at(paths.DOCKER_JSON, root),
           "containerd": paths.at(paths.CONTAINERD_DROPIN, root)}
    for name in HOOKS_D_NAMES:
        out[f"hooks.d/{name}"] = paths.at(f"{paths.HOOKS_D}/{name}", root)
    return out


def kind_of(path: Path, root: str | os.PathLike[str]) -> str | None:
    for kind, p in files(root).items():
        if p == path:
            return kind
    return None


def executable(path: str) -> bool:
    return os.path.isfile(path) and os.access(path, os.X_OK)


# -- what each file registers -----------------------------------------------------


action_scripts = criuconf.action_scripts


def executables(kind: str, data: bytes) -> list[str]:
    """The executables of cudahook that a registration file's content names."""
    text = data.decode(errors="replace")
    if kind == "criu":
        return [s for s in action_scripts(text) if criuconf.names_action(s)]
    if kind == "containerd":
        m = _DROPIN_PATH.search(text) if "cudahook" in text else None
        return [f"{m.group(1)}/runc"] if m else []
    try:
        cfg = json.loads(text)
    except ValueError:
        return []
    if not isinstance(cfg, dict):
        return []
    if kind == "docker":
        rt = (cfg.get("runtimes") or {}).get("cudahook") if isinstance(cfg.get("runtimes"),
                                                                         dict) else None
        return [rt["path"]] if isinstance(rt, dict) and isinstance(rt.get("path"), str) else []
    hook = cfg.get("hook")
    if isinstance(hook, dict) and isinstance(hook.get("path"), str) \
            and "cudahook" in hook["path"]:
        return [hook["path"]]
    return []


def strip(kind: str, data: bytes, drop: Callable[[str], bool],
          before: bytes | None = None) -> bytes | None:
    """`data` without cudahook's registrations of executables `drop` selects.

    None means the file is cudahook's alone and goes; unchanged bytes mean
    there was nothing to remove. `before` (the file as it was before
    cudahook) tells which keys of a shared JSON file cudahook added.
    """
    if kind == "criu":
        lines = data.decode(errors="surrogateescape").splitlines(keepends=True)
        keep: list[str] = []
        for line in lines:
            named = criuconf.gpu_only_script(line)  # gpu-only's comment names the script
            if named is not None and criuconf.names_action(named) and drop(named):
                continue
            script = action_script(line)
            if script is not None and criuconf.names_action(script) and drop(script):
                if keep and keep[-1].rstrip("\n") == CRIU_COMMENT:
                    keep.pop()
                continue
            keep.append(line)
        out = "".join(keep).encode(errors="surrogateescape")
        return None if not out and before is None and out != data else out
    if kind == "containerd" or kind.startswith("hooks.d/"):
        exes = executables(kind, data)
        return None if exes and all(drop(e) for e in exes) else data
    if kind == "docker":
        exes = executables(kind, data)
        if not exes or not drop(exes[0]):
            return data
        cfg = json.loads(data)
        try:
            old = json.loads(before) if before else {}
        except ValueError:
            old = {}
        old = old if isinstance(old, dict) else {}
        del cfg["runtimes"]["cudahook"]
        if not cfg["runtimes"] and "runtimes" not in old:
            del cfg["runtimes"]
        if cfg.get("default-runtime") == "cudahook":
            if old.get("default-runtime") not in (None, "cudahook"):
                cfg["default-runtime"] = old["default-runtime"]
            else:
                del cfg["default-runtime"]
        return (json.dumps(cfg, indent=2) + "\n").encode()
    return data


# -- dangling registrations (doctor) ---------------------------------------------


@dataclass
class Dangling:
    kind: str
    path: Path  # the registration file
    target: str  # the executable it names, missing or not executable
    fix: str


def dangling(root: str | os.PathLike[str]) -> list[Dangling]:
    """Registrations naming an executable that is missing or not executable."""
    out = []
    for kind, path in files(root).items():
        try:
            data = path.read_bytes()
        except OSError:
            continue
        names = (action_scripts(data.decode(errors="replace")) if kind == "criu"
                 else executables(kind, data))
        for exe in names:
            if executable(exe):
                continue
            if kind == "criu":
                fix = (f"remove the line 'action-script {exe}' from {path} (or re-run "
                       "install.sh to repair the installation): CRIU fails every checkpoint "
                       "while it names a missing script")
            elif kind == "docker":
                fix = (f"remove runtimes.cudahook from {path} and restart docker, or re-run "
                       "install.sh --runtime docker")
            else:
                fix = f"remove {path} (or re-run install.sh --runtime {_runtime(kind)})"
            out.append(Dangling(kind, path, exe, fix))
    return out


def _runtime(kind: str) -> str:
    return "podman" if kind.startswith("hooks.d/") else kind
