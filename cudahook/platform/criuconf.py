"""CRIU configuration files, as cudahook registers its action script in them.

Two ways to register (the operator's choice, `--criu-registration`):

- global: an `action-script` line in /etc/criu/runc.conf, which runc hands
  CRIU for every container. Every container is covered, whoever created it,
  and every checkpoint and restore of every container runs the script.
- gpu-only: /etc/criu/runc.conf carries only a comment naming the script;
  the runtime wrapper points a GPU container's `org.criu.config`
  annotation (runc reads it from the container's config at checkpoint and
  restore) at a copy of the container's CRIU configuration with the
  `action-script` line added. Other containers run CRIU without it; a
  container created without the wrapper is not covered.

The per-container copies live in `<state_dir>/criu/<container key>.conf`
(store.container_key: two containers of one id under two runtime roots
have two), at most MAX_FILES of them; poststop removes a container's copy.

CRIU runs as root with whatever a configuration file tells it, and the
annotations come from the container's author: a copy's base is runc's
default file, or a file directly in the operator's CRIU directory
(OPERATOR_DIR) that the container names, and from such a named file every
line that could make CRIU run or load code is dropped (CODE_OPTIONS). Files
are read as outside files are (platform/safeio: no links, regular files
only, capped, with a deadline).
Standard library only: install.sh runs this before any virtual environment.
"""

from __future__ import annotations

import contextlib
import os
import time
from pathlib import Path

from . import paths
from .atomic import write_atomic
from .criu import action_script
from .errors import UsageError
from .ids import check_key
from .privdir import ensure_private_dir
from .safeio import read_bytes

ACTION_NAME = "cudahook-criu-action"
# runc's annotation naming a container's CRIU configuration file ("" = none;
# absent = /etc/criu/runc.conf).
ANNOTATION = "org.criu.config"
# Where the wrapper keeps what org.criu.config named before it pointed the
# annotation at cudahook's copy (absent: runc's default file).
BASE_ANNOTATION = "cudahook.io/criu-config"
COMMENT = "# cudahook: CUDA checkpoint around CRIU dumps"
GPU_ONLY = "# cudahook: gpu-only registration of "
MODES = ("global", "gpu-only")
SUBDIR = "criu"
# A site's CRIU configuration is a few lines; a larger one is not copied.
MAX_CONF = 64 * 1024
# Copies kept at most: one per GPU container the wrapper created and whose
# poststop has not run yet.
MAX_FILES = 4096
# A copy with no container record this long after it was written is stale
# (the record is written by createRuntime, moments after the copy).
STALE_S = 600.0
# The operator's CRIU configuration directory (root's own, as /etc is): the
# only place a container's annotation may name its base configuration from.
OPERATOR_DIR = os.path.dirname(paths.CRIU_CONF)
# CRIU options that run or load code (action scripts, plugins from a library
# directory, a command after restore) or name a further file: never taken
# from a file a container chose. getopt also accepts any unambiguous prefix
# ("--action" is --action-script), so prefixes count too.
CODE_OPTIONS = ("action-script", "libdir", "exec-cmd", "config")
# Short options CRIU takes that load code: -L is --libdir.
CODE_SHORT = "L"
# What a named base's file name may hold: a value the annotations' schema and
# a log line carry unchanged (no control character, no quoting).
_NAME_CHARS = frozenset("ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789._-")
MAX_NAME = 255


def installed_script(hook: str) -> str:
    """The installed action script's path: it sits beside the OCI hook."""
    return os.path.join(os.path.dirname(hook), ACTION_NAME)


def is_ours(script: str, installed: str) -> bool:
    """Does an action-script line name this installation's script? Only its
    exact path does: a foreign `/tmp/x/cudahook-criu-action` is not cudahook."""
    return script == installed


def names_action(script: str) -> bool:
    """Does the line name a script called like cudahook's, of any prefix?
    Only for the admin tools that find and rewrite cudahook's lines in
    runc.conf; whether a container is covered is is_ours' question."""
    return script.endswith("/" + ACTION_NAME)


def registers(text: str, installed: str) -> bool:
    """Does a CRIU configuration already name this installation's script?"""
    return any(is_ours(s, installed) for s in action_scripts(text))


def operator_file(path: str) -> bool:
    """May a container name `path` as its base CRIU configuration? "" (no
    file at all) or a plainly named file directly in OPERATOR_DIR under the
    node root: no "..", no "//", nothing a link in a subdirectory could bend."""
    if path == "":
        return True
    where = str(paths.at(OPERATOR_DIR))
    name = os.path.basename(path)
    return (os.path.dirname(path) == where and 0 < len(name) <= MAX_NAME
            and name not in (".", "..") and set(name) <= _NAME_CHARS)


def _runs_code(line: str) -> bool:
    """Could CRIU read `line` (one line of a configuration file) as an option
    that runs or loads code? CRIU splits a line into words at spaces and
    tabs, prefixes the first with "--" and hands them all to getopt_long, so
    any later word may be an option too. What this cannot read as CRIU does
    (quotes, other whitespace, control or non-ASCII characters) counts."""
    if any(not (" " <= c <= "~" or c == "\t") for c in line) or '"' in line:
        return True
    for i, word in enumerate(line.split()):
        if word.startswith("#"):  # CRIU ignores the rest of the line
            return False
        if i == 0:
            if word.startswith("-"):
                return True
            name = word
        elif word == "--":
            return True
        elif word.startswith("--"):
            name = word[2:]
        elif word.startswith("-") and len(word) > 1:
            if CODE_SHORT in word[1:]:
                return True
            continue
        else:
            continue  # an option's value
        name = name.split("=", 1)[0]
        if name and any(opt.startswith(name) for opt in CODE_OPTIONS):
            return True
    return False


def without_code(text: str, installed: str) -> tuple[str, list[str]]:
    """`text` without the lines that could run or load code (see _runs_code)
    other than `action-script <installed>` itself, and those lines. Split at
    newlines only, as CRIU's getline does."""
    keep, dropped = [], []
    for line in text.split("\n"):
        own = line.split() == ["action-script", installed]
        (dropped if _runs_code(line) and not own else keep).append(line)
    return "\n".join(keep), dropped


def action_scripts(text: str) -> list[str]:
    """Every action script a CRIU configuration names (CRIU runs each one)."""
    return [s for line in text.splitlines() if (s := action_script(line)) is not None]


def registration(text: str) -> tuple[str | None, str | None]:
    """(mode, script) runc.conf's text shows: ("global", script) for an
    action-script line of cudahook's, ("gpu-only", script) for the comment
    gpu-only leaves, (None, None) for neither."""
    ours = [s for s in action_scripts(text) if names_action(s)]
    if ours:
        return "global", ours[0]
    for line in text.splitlines():
        if (script := gpu_only_script(line)) is not None:
            return "gpu-only", script
    return None, None


def gpu_only_script(line: str) -> str | None:
    """The script gpu-only's comment line (gpu_only_line) names, or None."""
    if line.startswith(GPU_ONLY):
        return line[len(GPU_ONLY):].split(" (", 1)[0].strip()
    return None


def gpu_only_line(script: str) -> str:
    return f"{GPU_ONLY}{script} (the runtime wrapper names it for GPU containers only)"


def without_ours(text: str) -> str:
    """`text` without cudahook's lines: its action scripts and its comments."""
    keep = []
    for line in text.splitlines(keepends=True):
        script = action_script(line)
        if script is not None and names_action(script):
            continue
        if line.startswith("# cudahook: "):
            continue
        keep.append(line)
    return "".join(keep)


def for_container(base: str, script: str) -> str:
    """A container's CRIU configuration: the site's options, then the script."""
    text = without_ours(base)
    sep = "" if not text or text.endswith("\n") else "\n"
    return f"{text}{sep}{COMMENT}\naction-script {script}\n"


def read_base(path: str) -> str:
    """A CRIU configuration file's text ("" for none, or a missing file: CRIU
    ignores a file that does not exist), read as an outside file: FileRefused
    for a symlink, a FIFO or device, a file past MAX_CONF, or no answer
    within safeio's deadline; OSError if it cannot be read."""
    if not path:
        return ""
    try:
        data = read_bytes(path, MAX_CONF)
    except FileNotFoundError:
        return ""
    return data.decode(errors="surrogateescape")


def conf_dir(state_dir: str | os.PathLike[str]) -> Path:
    return Path(state_dir) / SUBDIR


def conf_path(state_dir: str | os.PathLike[str], key: str) -> Path:
    """The copy's path; UsageError for a key the state directory never names."""
    return conf_dir(state_dir) / f"{check_key(key)}.conf"


def is_copy(path: str, state_dir: str | os.PathLike[str]) -> bool:
    return os.path.dirname(os.path.normpath(path)) == str(conf_dir(state_dir))


def write(state_dir: str | os.PathLike[str], key: str, text: str) -> Path:
    """Write a container's copy (0600 in a root-only directory). Past
    MAX_FILES copies, stale ones go first; if none is, raises OSError."""
    path = conf_path(state_dir, key)
    ensure_private_dir(Path(state_dir))
    ensure_private_dir(path.parent)
    if not path.exists() and len(os.listdir(path.parent)) >= MAX_FILES:
        prune(state_dir)
        if len(os.listdir(path.parent)) >= MAX_FILES:
            raise OSError(f"{path.parent} already holds {MAX_FILES} CRIU configurations")
    write_atomic(path, text.encode(errors="surrogateescape"), 0o600)
    return path


def remove(state_dir: str | os.PathLike[str], key: str) -> None:
    with contextlib.suppress(UsageError):  # not a key: never written
        conf_path(state_dir, key).unlink(missing_ok=True)


def prune(state_dir: str | os.PathLike[str], *, now: float | None = None) -> int:
    """Remove copies of containers without a record in the state directory
    (the store's containers/<key>.json), once older than STALE_S. Returns how
    many went."""
    d = conf_dir(state_dir)
    try:
        live = {n[:-5] for n in os.listdir(Path(state_dir) / "containers") if n.endswith(".json")}
    except OSError:
        live = set()
    cutoff = (time.time() if now is None else now) - STALE_S
    gone = 0
    try:
        names = os.listdir(d)
    except OSError:
        return 0
    for name in names:
        if not name.endswith(".conf") or name[:-5] in live:
            continue
        p = d / name
        try:
            if p.lstat().st_mtime < cutoff:
                p.unlink()
                gone += 1
        except OSError:
            continue
    return gone
