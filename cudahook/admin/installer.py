"""What install.sh does once the virtual environment exists: place the hook
executables, the configuration, the log rotation rule, the node agent's
systemd unit and the commands, register runtimes, run the node agent's
service where systemd runs and it is asked for (and restart a running agent
on the new code), and undo all of it on --uninstall. Every file it touches
outside the prefix goes through the prefix's own journal, so uninstall puts
the system back byte for byte and touches nothing another installation did.
Standard library only (install.sh may run it with the system Python).

Exit codes: 0 done; 1 failed; 2 refused (bad arguments, or cudahook already
installed at another prefix without --force): nothing was changed.
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

from cudahook.core.agent_client import EXIT_ANOTHER_AGENT
from cudahook.platform import paths

from . import configure, hookfiles
from .journal import Change, Journal

MARKER = ".installed-by-cudahook"  # install.sh made the prefix: uninstall removes it whole
CRIU_GROUP = "criu-binary"
# Used by every installation on the node alike: an uninstall while another
# installation remains hands these over to it instead of removing them.
SHARED = (paths.CONFIG, paths.LOGROTATE)


class Refused(Exception):
    pass


def logrotate_rule(log_file: Path) -> str:
    # Debian's conventions (/etc/logrotate.d, weekly, compressed, one
    # generation uncompressed). `maxsize` rotates early on a busy node at
    # logrotate's daily run; eventlog.log's own size cap is the backstop.
    # Every hook opens the log afresh for each line: `create`, no copytruncate.
    return (f"# cudahook: rotate its structured log (installed by install.sh)\n"
            f"{log_file} {{\n"
            "\tweekly\n\tmaxsize 8M\n\trotate 4\n\tcompress\n\tdelaycompress\n"
            "\tmissingok\n\tnotifempty\n\tcreate 0600 root root\n}\n")


# The node agent's service (core/agent.py): always installed; enabled and
# started only where systemd runs and the agent is asked for (install.sh
# --agent, or `agent: auto` in the configuration). Hooks fall back to
# attaching themselves while it is not up.
AGENT_UNIT = "/etc/systemd/system/cudahook-agent.service"
UNIT_NAME = "cudahook-agent.service"
SYSTEMCTL_TIMEOUT_S = 90  # a stop lets the calls in flight finish first


def agent_unit(python: str, config: Path) -> str:
    return ("# cudahook: the node agent (installed by install.sh; removed by --uninstall).\n"
            "# install.sh --agent enables and starts it; by hand: "
            "systemctl enable --now cudahook-agent\n"
            "[Unit]\n"
            "Description=cudahook node agent: driver calls served warm for GPU checkpoints\n"
            "After=nvidia-persistenced.service\n\n"
            "[Service]\nType=simple\n"
            f"ExecStart={python} -I -m cudahook.core.agent --config {config}\n"
            "Restart=on-failure\n"
            f"RestartPreventExitStatus={EXIT_ANOTHER_AGENT}\n\n"
            "[Install]\nWantedBy=multi-user.target\n")


def systemd_runs(root: str) -> bool:
    """PID 1 is systemd and systemctl answers. /proc/1/comm is read under
    the root like every node path: a node kept in a directory never reaches
    the host's systemd."""
    try:
        comm = paths.at("/proc/1/comm", root).read_text().strip()
    except OSError:
        return False
    if comm != "systemd" or not shutil.which("systemctl"):
        return False
    try:
        return _systemctl("show", "--property=Version").returncode == 0
    except (OSError, subprocess.TimeoutExpired):
        return False


def _systemctl(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(["systemctl", *args], capture_output=True, text=True,
                          timeout=SYSTEMCTL_TIMEOUT_S, stdin=subprocess.DEVNULL)


def config_asks_agent(config: Path) -> bool:
    """`agent: auto` in the configuration (a plain top-level line: the
    installer reads no YAML, it may run on the system Python)."""
    try:
        text = config.read_text(errors="replace")
    except OSError:
        return False
    found = re.findall(r"(?m)^agent:[ \t]*['\"]?([A-Za-z]+)", text)
    return bool(found) and found[-1] == "auto"


def _agent_cli(python: str, root: str, config: Path, *args: str) -> subprocess.CompletedProcess[str]:
    """`cudahook agent ...` on the installed code, for this root's node."""
    env = {**os.environ, paths.ROOT_ENV: "" if root in ("", "/") else root}
    return subprocess.run([python, "-I", "-m", "cudahook", "agent", *args,
                           "--config", str(config)], capture_output=True, text=True, env=env,
                          timeout=SYSTEMCTL_TIMEOUT_S, stdin=subprocess.DEVNULL)


def agent_running(python: str, root: str, config: Path) -> bool:
    import json

    try:
        r = _agent_cli(python, root, config, "status", "--json")
        return r.returncode == 0 and json.loads(r.stdout).get("up") is True
    except (OSError, ValueError, AttributeError, subprocess.TimeoutExpired):
        return False


def agent_service(python: str, root: str, config: Path, *, want: bool, dry_run: bool) -> list[str]:
    """The node agent after the files changed, as lines to print. systemd:
    reload the unit, restart a running agent on the new code (try-restart),
    and enable and start it when `want`. Elsewhere hooks start it on demand
    (`agent: auto`): an agent running now is restarted on the new code.
    Raises OSError when a step fails."""
    if systemd_runs(root):
        steps = [("daemon-reload",), ("try-restart", UNIT_NAME)]
        if want:
            steps.append(("enable", "--now", UNIT_NAME))
        out = []
        for step in steps:
            if dry_run:
                out.append(f"would run systemctl {' '.join(step)}")
                continue
            r = _systemctl(*step)
            if r.returncode != 0:
                raise OSError(f"systemctl {' '.join(step)} failed: {r.stderr.strip()[:300]}")
            out.append(f"ran systemctl {' '.join(step)}")
        return out
    out = []
    if want:
        out.append("no systemd here: the node agent starts on demand with `agent: auto` "
                   "(or by `cudahook agent start`)")
    if not agent_running(python, root, config):
        return out
    if dry_run:
        return [*out, "would restart the running node agent on the new code"]
    for action in ("stop", "start"):
        r = _agent_cli(python, root, config, action)
        if r.returncode != 0:
            raise OSError(f"cudahook agent {action} failed: {(r.stdout + r.stderr).strip()[:300]}")
    return [*out, "restarted the running node agent on the new code"]


def agent_remove(python: str, root: str, config: Path, dry_run: bool) -> list[str]:
    """Before the files go: the service stopped and disabled (systemd), or
    a running agent stopped."""
    verb = "would run" if dry_run else "ran"
    if systemd_runs(root):
        step = ("disable", "--now", UNIT_NAME)
        if not dry_run:
            r = _systemctl(*step)
            if r.returncode != 0 and paths.at(AGENT_UNIT, root).exists():
                raise OSError(f"systemctl {' '.join(step)} failed: {r.stderr.strip()[:300]}")
        return [f"{verb} systemctl {' '.join(step)}"]
    if not Path(python).exists() or not agent_running(python, root, config):
        return []
    if dry_run:
        return ["would stop the running node agent"]
    r = _agent_cli(python, root, config, "stop")
    if r.returncode != 0:
        raise OSError(f"cudahook agent stop failed: {(r.stdout + r.stderr).strip()[:300]}")
    return ["stopped the running node agent"]


def install_changes(prefix: Path, python: str, root: str, source: Path,
                    criu: str | None = None) -> list[Change]:
    j = Journal(root, prefix)
    libexec = prefix / "libexec"
    config = paths.at(paths.CONFIG, root)
    values = {"RUNC": hookfiles.real_runc(exclude=libexec / "runc-path"),
              "HOOK": str(libexec / "cudahook-oci-hook")}
    changes = [
        Change(libexec / name, hookfiles.render(name, python, str(config), values, root=root).encode(),
               mode=0o755)
        for name in hookfiles.NAMES
    ]
    if not config.exists():
        changes.append(Change(config, (source / "config" / "config.yaml").read_bytes(),
                              mode=0o644))
    changes.append(Change(paths.at(paths.LOGROTATE, root),
                          logrotate_rule(paths.at(paths.LOG_FILE, root)).encode(), mode=0o644))
    changes.append(Change(paths.at(AGENT_UNIT, root), agent_unit(python, config).encode(),
                          mode=0o644))
    venv_bin = Path(python).parent
    for name, target in (("cudahook", venv_bin / "cudahook"),
                         ("cudahook-sim", venv_bin / "cudahook-sim"),
                         ("cudahook-runtime", libexec / "cudahook-runtime")):
        changes.append(Change(j.at(f"{paths.BIN_DIR}/{name}"), None, symlink=str(target)))
    return changes


def criu_link(root: str, target: str) -> Change | None:
    """`criu` on PATH for the CRIU install.sh provided; None where a real
    file (someone's own CRIU) is in the way."""
    link = paths.at(f"{paths.CRIU_LINK_DIR}/criu", root)
    if link.exists() and not link.is_symlink():
        return None
    return Change(link, None, symlink=target)


def others(root: str, prefix: Path) -> list[Journal]:
    """Installations journaled at other prefixes."""
    mine = Journal(root, prefix)
    return [j for j in Journal.all(root) if j.path != mine.path]


def preflight(root: str, prefix: Path, force: bool) -> None:
    # An installation already here (made with --force, say) is repaired or
    # updated by running install.sh again: no new conflict.
    mine = Journal(root, prefix)
    found = [] if mine.entries() or mine.owned() else others(root, prefix)
    if found and not force:
        at = found[0].prefix
        raise Refused(f"cudahook is already installed at {at}; uninstall it first "
                      f"(install.sh --uninstall --prefix {at}) or pass --force to install "
                      "over it (uninstalling this one then puts it back)")


def install(args: argparse.Namespace) -> int:
    prefix = Path(args.prefix)
    preflight(args.root, prefix, args.force)
    j = Journal(args.root, prefix)
    libexec_new = not (prefix / "libexec").exists()
    changes = install_changes(prefix, args.python, args.root, Path(args.source))
    diffs = j.apply("install", changes, dry_run=args.dry_run)
    if args.criu_link:
        link = criu_link(args.root, args.criu_link)
        if link is None:
            print(f"kept {paths.at(paths.CRIU_LINK_DIR + '/criu', args.root)}: not a link "
                  f"cudahook made; the provided CRIU is {args.criu_link}")
        else:
            diffs += j.apply(CRIU_GROUP, [link], dry_run=args.dry_run)
    for d in diffs:
        print(d if args.dry_run else d.splitlines()[1].replace("+++ ", "installed "))
    if not args.dry_run:
        owned = [str(prefix / "libexec")] if libexec_new else []
        owned += [str(Path(d)) for d in args.owns]
        if owned:
            j.own(*owned)
    for rt in ["runc", *[r for r in args.runtime if r != "runc"]]:
        for line in configure.configure(rt, prefix / "libexec", root=args.root,
                                        default=args.default_runtime and rt == "docker",
                                        dry_run=args.dry_run,
                                        criu_registration=args.criu_registration):
            print(line)
    config = paths.at(paths.CONFIG, args.root)
    for line in agent_service(args.python, args.root, config, dry_run=args.dry_run,
                              want=args.agent or config_asks_agent(config)):
        print(line)
    return 0


def uninstall(args: argparse.Namespace) -> int:
    """Registrations first, then the files they name, then the directories.
    Says what it kept and why."""
    prefix = Path(args.prefix)
    root = args.root
    j = Journal(root, prefix)
    dry = args.dry_run
    verb = "would remove" if dry else "removed"
    marker = (prefix / MARKER).exists()
    if not j.path.exists() and not marker:
        print(f"nothing installed at {prefix} (no journal at {j.path})")
        return 0
    rest = others(root, prefix)
    if not rest:  # the last installation: its agent goes first
        for line in agent_remove(str(prefix / "venv/bin/python"), root,
                                 paths.at(paths.CONFIG, root), dry):
            print(line)
    skip = _hand_over(j, rest, root, dry)
    criu_owned = [d for d in j.owned() if Path(d) == prefix / "criu"]
    if args.keep_criu:
        skip |= {e["path"] for e in j.entries() if e["group"] == CRIU_GROUP}
    restored, kept = j.revert(None, dry_run=dry, skip=skip)
    for path in restored:
        print(f"{'would restore' if dry else 'restored'} {path}")
    for line in kept:
        print(f"kept {line}")
    if args.keep_criu:
        links = [e["path"] for e in j.entries() if e["group"] == CRIU_GROUP]
        what = " and ".join([str(prefix / "criu"), *links]) if criu_owned or links else None
        if what:
            print(f"kept {what}: --keep-criu (no longer tracked by cudahook)")
        if not dry:
            j._save([e for e in j.entries() if e["group"] != CRIU_GROUP])
            j.forget_owned(*criu_owned)
    for d in j.owned():
        if args.keep_criu and Path(d) == prefix / "criu":
            continue
        if os.path.lexists(d):
            print(f"{verb} {d}")
            if not dry:
                shutil.rmtree(d, ignore_errors=True)
        if not dry:
            j.forget_owned(d)
    for node_dir in (paths.STATE_DIR, paths.MARKS_DIR):
        d = paths.at(node_dir, root)
        if not d.exists():
            continue
        if rest:
            print(f"kept {d}: the installation at {rest[0].prefix} uses it")
            continue
        print(f"{verb} {d}")
        if not dry:
            shutil.rmtree(d, ignore_errors=True)
    _remove_prefix(prefix, marker, args.keep_criu and criu_owned, dry)
    if not dry:  # what is left was handed over or kept: this installation is gone
        j._write({"entries": [], "owned": []})
    if not rest and not dry and systemd_runs(root):
        _systemctl("daemon-reload")  # the unit file is gone
    log = paths.at(paths.LOG_FILE, root)
    if log.exists():
        print(f"kept {log}: the record of past checkpoints and restores (remove it and "
              f"{log.name}.* by hand when no longer needed)")
    return 0


def _hand_over(j: Journal, rest: list[Journal], root: str, dry: bool) -> set[str]:
    """What another installation still needs from this one, made its own.

    An installation made over this one (--force) journaled this one's files
    as what to put back: it now puts back what was there before either.
    Shared files (configuration, log rotation) stay for it and are journaled
    there. Returns the paths this uninstall must leave as they are.
    """
    skip: set[str] = set()
    shared = {str(paths.at(p, root)) for p in SHARED}
    for other in rest:
        theirs = other.entries()
        changed = False
        for mine in j.entries():
            if mine["path"] in skip:
                continue
            for e in theirs:
                if e["path"] == mine["path"] and _before_sha(e) == mine.get("after_sha"):
                    e.update(before=mine["before"], mode=mine.get("mode"),
                             created_dirs=mine.get("created_dirs", []))
                    skip.add(mine["path"])
                    changed = True
                    print(f"kept {mine['path']}: the installation at {other.prefix} replaced "
                          "it and now puts back what was there before either")
            if (mine["path"] not in skip and mine["group"] == "install"
                    and mine["path"] in shared):
                skip.add(mine["path"])
                if all(e["path"] != mine["path"] for e in theirs):
                    theirs.append(mine)
                    changed = True
                print(f"kept {mine['path']}: the installation at {other.prefix} uses it")
        if changed and not dry:
            other._save(theirs)
    return skip


def _before_sha(entry: dict) -> str | None:  # type: ignore[type-arg]
    import base64
    import hashlib

    before = entry.get("before")
    return None if before is None else hashlib.sha256(base64.b64decode(before)).hexdigest()


def _remove_prefix(prefix: Path, marker: bool, keep_criu: bool | list[str], dry: bool) -> None:
    verb = "would remove" if dry else "removed"
    if not prefix.is_dir():
        return
    if marker:
        # install.sh made the prefix: all of it is cudahook's.
        for entry in sorted(prefix.iterdir()):
            if keep_criu and entry.name == "criu":
                continue
            if not dry:
                if entry.is_dir() and not entry.is_symlink():
                    shutil.rmtree(entry, ignore_errors=True)
                else:
                    entry.unlink(missing_ok=True)
        if keep_criu:
            print(f"{verb} {prefix} except {prefix / 'criu'} (--keep-criu)")
            return
        print(f"{verb} {prefix}")
        if not dry:
            with_retry_rmdir(prefix)
        return
    left = sorted(p.name for p in prefix.iterdir())
    if not left:
        if not dry:
            with_retry_rmdir(prefix)
        return
    print(f"kept {prefix} ({', '.join(left)}): it was there before cudahook was installed")


def with_retry_rmdir(path: Path) -> None:
    try:
        path.rmdir()
    except OSError:
        shutil.rmtree(path, ignore_errors=True)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="install.sh (cudahook installer)")
    p.add_argument("action", choices=("check", "install", "uninstall"))
    p.add_argument("--prefix", default=None)
    p.add_argument("--python", default=sys.executable)
    p.add_argument("--root", default=os.environ.get(paths.ROOT_ENV) or "/")
    p.add_argument("--source", default=str(Path(__file__).resolve().parents[2]))
    p.add_argument("--runtime", action="append", default=[])
    p.add_argument("--default-runtime", action="store_true")
    p.add_argument("--criu-registration", choices=("global", "gpu-only"), default=None)
    p.add_argument("--dry-run", action="store_true")
    p.add_argument("--force", action="store_true")
    p.add_argument("--keep-criu", action="store_true")
    p.add_argument("--owns", action="append", default=[],
                   help="a directory install.sh created in the prefix (removed on uninstall)")
    p.add_argument("--criu-link", help="the CRIU install.sh provided: link it as criu on PATH")
    p.add_argument("--agent", action="store_true",
                   help="run the node agent's service (where systemd runs)")
    args = p.parse_args(argv)
    args.prefix = os.path.normpath(args.prefix or str(paths.at(paths.PREFIX, args.root)))
    try:
        if args.action == "check":
            preflight(args.root, Path(args.prefix), args.force)
            return 0
        if args.action == "uninstall":
            return uninstall(args)
        return install(args)
    except Refused as exc:
        print(f"install.sh: {exc}", file=sys.stderr)
        return 2
    except (configure.ConfigureError, OSError) as exc:
        print(f"install.sh: {exc}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
