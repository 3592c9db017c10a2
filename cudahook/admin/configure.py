"""`cudahook configure`: register cudahook with a container runtime, reversibly.

- runc: the CRIU action script in /etc/criu/runc.conf (runc hands that file to
  CRIU for every checkpoint and restore), or with --criu-registration
  gpu-only only a comment there, and the runtime wrapper gives each GPU
  container a CRIU configuration of its own that names the script
  (cudahook.platform.criuconf). The OCI hooks need the wrapper or hooks in
  config.json: runc has no global hook setting.
- containerd (1.6): a systemd drop-in putting a `runc` that is the cudahook
  wrapper ahead of the real one on containerd's PATH, so the runc shim goes
  through it; plus the action script.
- docker: a `runtimes` entry (optionally the default) in daemon.json, other
  keys kept; plus the action script. Checkpoints need "experimental": true.
- podman, CRI-O: hooks.d definitions (oci-hooks(5), schema 1.0.0); plus the
  action script.
Standard library only: install.sh runs this before its venv exists.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

from cudahook.platform import criuconf
from cudahook.platform.paths import CONTAINERD_DROPIN, CRIU_CONF, DOCKER_JSON, HOOKS_D

from . import registrations
from .journal import Change, Journal

RUNTIMES = ("runc", "containerd", "docker", "podman", "crio")
DEFAULT_PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"


class ConfigureError(Exception):
    pass


@dataclass
class Plan:
    changes: list[Change] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)


def _criu(j: Journal, hooks_dir: Path, mode: str | None = None) -> Change:
    """runc.conf with the action script registered `mode` (None: as it is
    registered now, else global)."""
    path = j.at(CRIU_CONF)
    script = str(hooks_dir / registrations.ACTION_NAME)
    data = path.read_bytes() if path.exists() else b""
    # One cudahook action script at a time: another installation's (replaced
    # by an install --force, and put back by its uninstall) would checkpoint
    # the same processes a second time.
    data = registrations.strip("criu", data, lambda exe: exe != script) or b""
    text = data.decode(errors="surrogateescape")
    mode = mode or criuconf.registration(text)[0] or "global"
    if mode not in criuconf.MODES:
        raise ConfigureError(f"unknown CRIU registration {mode!r} "
                             f"(one of {', '.join(criuconf.MODES)})")
    lines = ([registrations.CRIU_COMMENT, f"action-script {script}"] if mode == "global"
             else [criuconf.gpu_only_line(script)])
    if criuconf.registration(text) == (mode, script) and all(
            x in text.splitlines() for x in lines):
        return Change(path, data)
    text = criuconf.without_ours(text)
    sep = "" if not text or text.endswith("\n") else "\n"
    return Change(path, (text + sep + "".join(x + "\n" for x in lines))
                  .encode(errors="surrogateescape"))


def plan(runtime: str, hooks_dir: Path, *, root: str = "/", default: bool = False,
         criu_registration: str | None = None) -> Plan:
    if runtime not in RUNTIMES:
        raise ConfigureError(f"unknown runtime {runtime!r} (one of {', '.join(RUNTIMES)})")
    j = Journal(root, hooks_dir.parent)
    p = Plan([_criu(j, hooks_dir, criu_registration)])
    wrapper = hooks_dir / "cudahook-runtime"
    hook = hooks_dir / "cudahook-oci-hook"
    if criuconf.registration(p.changes[0].after.decode(errors="replace"))[0] == "gpu-only":
        p.notes.append(f"CRIU registration gpu-only: only GPU containers created through {wrapper} "
                       "run the action script; containers created without it (or before this "
                       "change) are not covered: recreate them through the wrapper")
        if runtime in ("podman", "crio"):
            p.notes.append(f"{runtime} creates containers without the wrapper: with gpu-only "
                           "their GPU containers are not covered; use --criu-registration global")
    if runtime == "runc":
        p.notes.append("runc reads /etc/criu/runc.conf at every checkpoint: nothing to restart. "
                       f"For the OCI hooks, run runc through {wrapper} or add the hooks to "
                       "config.json")
    elif runtime == "containerd":
        shim_path = hooks_dir / "runc-path"
        p.changes.append(Change(shim_path / "runc", None, symlink=str(wrapper)))
        p.changes.append(Change(j.at(CONTAINERD_DROPIN), (
            "# cudahook: the runc shim finds cudahook's runc wrapper first\n"
            "[Service]\n"
            f'Environment="PATH={shim_path}:{DEFAULT_PATH}"\n').encode()))
        p.notes.append("restart containerd: systemctl daemon-reload && systemctl restart containerd")
        p.notes.append("Kubernetes (CRI): or set BinaryName = \"" + str(wrapper) + "\" under "
                       "[plugins.\"io.containerd.grpc.v1.cri\".containerd.runtimes.runc.options]")
    elif runtime == "docker":
        path = j.at(DOCKER_JSON)
        try:
            cfg = json.loads(path.read_text()) if path.exists() else {}
        except ValueError as exc:
            raise ConfigureError(f"{path}: not valid JSON ({exc})") from exc
        if not isinstance(cfg, dict):
            raise ConfigureError(f"{path}: not a JSON object")
        cfg.setdefault("runtimes", {})["cudahook"] = {"path": str(wrapper)}
        if default:
            cfg["default-runtime"] = "cudahook"
        p.changes.append(Change(path, (json.dumps(cfg, indent=2) + "\n").encode()))
        p.notes.append("restart docker: systemctl restart docker")
        if not cfg.get("experimental"):
            p.notes.append('docker checkpoint needs "experimental": true in daemon.json')
        if not default:
            p.notes.append("run GPU containers with --runtime cudahook (or configure --default)")
    else:
        for stage, name in (("prestart", "create"), ("poststop", "poststop")):
            definition = {
                "version": "1.0.0",
                "hook": {"path": str(hook), "args": ["cudahook-oci-hook", stage]},
                "when": {"always": True},
                "stages": [stage],
            }
            p.changes.append(Change(j.at(f"{HOOKS_D}/50-cudahook-{name}.json"),
                                    (json.dumps(definition, indent=2) + "\n").encode()))
        p.notes.append(f"{'podman' if runtime == 'podman' else 'CRI-O'} reads {HOOKS_D} "
                       "for every new container" + ("" if runtime == "podman"
                                                    else "; restart crio if it does not watch it"))
    return p


def configure(runtime: str, hooks_dir: Path, *, root: str = "/", default: bool = False,
              dry_run: bool = False, revert: bool = False,
              criu_registration: str | None = None) -> list[str]:
    """Apply (or revert) one runtime's registration; lines to print. The
    journal is that of the installation whose hooks are in `hooks_dir`."""
    j = Journal(root, hooks_dir.parent)
    out: list[str] = []
    if revert:
        groups = {runtime}
        others = {e["group"] for e in j.entries()} - {runtime, "criu", "install"}
        if not others:
            # No other runtime needs the action script any more.
            groups.add("criu")
        restored, kept = j.revert(groups, dry_run=dry_run)
        verb = "would restore" if dry_run else "restored"
        out += [f"{verb} {p}" for p in restored] + kept
        if not restored and not kept:
            out.append(f"nothing to revert for {runtime}")
        return out
    p = plan(runtime, hooks_dir, root=root, default=default,
             criu_registration=criu_registration)
    # The action script serves every runtime: its own group, reverted last.
    diffs = j.apply("criu", p.changes[:1], dry_run=dry_run)
    diffs += j.apply(runtime, p.changes[1:], dry_run=dry_run)
    out += diffs if dry_run else [f"{runtime}: changed {len(diffs)} file(s)"]
    if not diffs:
        out.append(f"{runtime}: already configured")
    out += [f"note: {n}" for n in p.notes]
    return out
