"""`cudahook doctor`: check the node and explain what is wrong.

Each check says ok, warn or fail with a reason and, when not ok, what to do.
A fail is blocking: checkpoints would not work, or would not be safe.
"""

from __future__ import annotations

import json
import os
import shutil
import stat
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from cudahook.admin import registrations
from cudahook.flow.context import Context
from cudahook.platform import criu as criu_node
from cudahook.platform import paths

from .journal import Journal


@dataclass
class Check:
    name: str
    status: str  # ok | warn | fail
    detail: str
    hint: str = ""


def _gpu_memory(ctx: Context) -> Check:
    """Where a checkpoint would put the containers' GPU memory, and why."""
    from cudahook.core.backends import gpu_memory_path, probe

    try:
        path, why = gpu_memory_path(ctx.settings.gpu_memory, probe(ctx.backend))
    except Exception as exc:
        if ctx.settings.gpu_memory == "host":  # the driver's answer changes nothing then
            return Check("gpu memory", "ok", "host (gpu_memory: host in the configuration)")
        # The driver cannot be asked (the backend check above says why).
        return Check("gpu memory", "fail", str(exc))
    if path is None:
        return Check("gpu memory", "fail", why, "set gpu_memory: host (or auto) in "
                     "/etc/cudahook/config.yaml, or use a CUDA 13.4+ driver with backend: "
                     "driver-api")
    if path == "storage":
        return Check("gpu memory", "warn", f"storage ({why})", "checkpoints write GPU memory "
                     "into the CRIU image (cudahook-gpu/): keep the image of a failed dump "
                     "until the workload runs again - the guardian restores from it")
    return Check("gpu memory", "ok", f"host ({why})")


def _agent(ctx: Context) -> Check:
    """The node agent: up (what it holds), or why phases attach themselves."""
    from .status import agent_text, agent_view

    view = agent_view(ctx.settings)
    hint = "" if view["up"] or ctx.settings.agent == "auto" else (
        "`cudahook agent start` (or the cudahook-agent service) takes the attach off the "
        "critical path")
    return Check("node agent", "ok", agent_text(view), hint)


def run_checks(ctx: Context, root: str | None = None) -> list[Check]:
    checks: list[Check] = []
    host = ctx.host
    root = str(root if root is not None else paths.root())
    j = Journal(root)

    runc = shutil.which("runc")
    if runc:
        r = host.run([runc, "--version"], 10)
        checks.append(Check("runc", "ok", r.stdout.splitlines()[0] if r.ok else r.stderr.strip()))
    else:
        checks.append(Check("runc", "warn", "runc not found on PATH",
                            "install runc (containerd and docker ship or need one)"))

    criu = shutil.which("criu")
    if not criu:
        checks.append(Check("criu", "fail", "criu not found on PATH",
                            criu_node.INSTALL_HINT))
    else:
        version = criu_node.parse_version(host.run([criu, "--version"], 10).stdout)
        if problem := criu_node.version_problem(version, criu):
            checks.append(Check("criu", "fail", problem[1],
                                criu_node.INSTALL_HINT))
        else:
            checks.append(Check("criu", "ok", f"CRIU {criu_node.version_text(version)} at {criu}"))
        r = host.run([criu, "check"], 60)
        good = r.ok and "Looks good" in (r.stdout + r.stderr)
        checks.append(Check("criu check", "ok" if good else "fail",
                            "Looks good" if good else (r.stderr.strip().splitlines() or ["failed"])[-1],
                            "" if good else "run `criu check` and fix what it reports"))
        if criu_node.TWICE[0] <= version < criu_node.TWICE[1]:
            checks.append(Check("criu action scripts", "warn",
                                f"CRIU {criu_node.version_text(version)} runs every action script "
                                "twice (CRIU issue #2727)",
                                "nothing to do: cudahook runs each action once per CRIU run"))
    plugins = criu_node.cuda_plugins(root=root)
    if plugins:
        checks.append(Check("criu cuda plugin", "fail", f"CRIU's own CUDA plugin is installed: "
                            f"{', '.join(plugins)}",
                            "it would lock and checkpoint the same processes as cudahook: remove "
                            "it (or the criu-cuda package), or uninstall cudahook"))
    else:
        checks.append(Check("criu cuda plugin", "ok", "not installed (no conflict)"))

    tool = ctx.settings.tool("cuda_checkpoint")
    if not os.access(tool, os.X_OK):
        checks.append(Check("cuda-checkpoint", "fail", f"not found at {tool}",
                            "install the NVIDIA driver R550+ (it ships cuda-checkpoint) or set "
                            "cuda_checkpoint in /etc/cudahook/config.yaml"))
    else:
        try:
            feats = ctx.backend.features
            level = "ok" if feats.actions else "warn"
            checks.append(Check("cuda-checkpoint", level, f"{tool}: {feats.describe()}",
                                "" if feats.actions else "driver R555+ adds lock timeouts and "
                                "state queries; R580+ GPU remapping"))
        except Exception as exc:
            checks.append(Check("cuda-checkpoint", "fail", str(exc)))
    try:
        backend = ctx.backend
        checks.append(Check("backend", "ok", f"{backend.name} ({backend.why})"))
    except Exception as exc:
        checks.append(Check("backend", "fail", str(exc)))

    checks.append(_gpu_memory(ctx))
    checks.append(_agent(ctx))
    checks += _gpu_checks(ctx)

    checks += _registrations(j)
    checks += _dangling(j.root)
    checks.append(_state_dir(ctx))
    return checks


def _gpu_checks(ctx: Context) -> list[Check]:
    """What nvidia-smi says: GPUs, driver, persistence mode.

    Restore needs persistence mode on: with it off the driver tears a GPU
    down once its last client (a checkpointed process is none) has gone.
    """
    from cudahook.core.gpus import NoGpuVisible, query_gpus
    from cudahook.platform.errors import EnvironmentProblem

    try:
        gpus = query_gpus(ctx.host, ctx.settings)
    except NoGpuVisible:
        return [Check("driver", "warn", "no GPU visible (nvidia-smi: No devices were found)",
                      "check the GPUs with nvidia-smi; nothing can be checkpointed without one")]
    except EnvironmentProblem as exc:
        return [Check("driver", "warn", str(exc), "is the NVIDIA driver installed?")]
    drivers = sorted({g.driver_version or "?" for g in gpus})
    out = [Check("driver", "ok" if gpus else "warn",
                 f"{len(gpus)} GPU(s), driver {', '.join(drivers) or '?'}")]
    off = [str(g.index) for g in gpus if g.persistence is False]
    unknown = [str(g.index) for g in gpus if g.persistence is None]
    if off:
        out.append(Check("persistence mode", "fail", f"Disabled on GPU {', '.join(off)}",
                         "restore needs it on: nvidia-smi -pm 1, or run nvidia-persistenced"))
    elif unknown:
        out.append(Check("persistence mode", "warn", f"[N/A] on GPU {', '.join(unknown)}",
                         "make sure the driver stays initialised (nvidia-persistenced)"))
    else:
        out.append(Check("persistence mode", "ok", "enabled on every GPU"))
    return out


def _registrations(j: Journal) -> list[Check]:
    from cudahook.platform import criuconf

    out = []
    conf = j.at(paths.CRIU_CONF)
    text = conf.read_text(errors="replace") if conf.exists() else ""
    mode, script = criuconf.registration(text)
    if mode and script and os.access(script, os.X_OK):
        what = (f"global: action-script {script} for every container" if mode == "global" else
                f"gpu-only: {script} for GPU containers created through the runtime wrapper "
                "(others run CRIU without it; containers created without the wrapper are "
                "not covered)")
        out.append(Check("runc/criu registration", "ok", what))
    elif mode:
        out.append(Check("runc/criu registration", "fail",
                         f"registered script is not executable: {script}",
                         "re-run install.sh to repair the installation, or remove cudahook's "
                         f"lines from {conf}"))
    else:
        out.append(Check("runc/criu registration", "fail",
                         f"no cudahook action-script in {conf}",
                         "cudahook configure --runtime runc"))
    daemon = j.at(paths.DOCKER_JSON)
    if daemon.exists():
        try:
            cfg: dict[str, Any] = json.loads(daemon.read_text())
            has = "cudahook" in (cfg.get("runtimes") or {})
            exp = bool(cfg.get("experimental"))
            level = "ok" if has and exp else "warn"
            out.append(Check("docker registration", level,
                             f"runtime {'registered' if has else 'not registered'}, experimental "
                             f"{'on' if exp else 'off'}",
                             "" if level == "ok" else "cudahook configure --runtime docker; "
                             "docker checkpoint needs \"experimental\": true"))
        except ValueError:
            out.append(Check("docker registration", "warn", f"{daemon} is not valid JSON"))
    dropin = j.at(paths.CONTAINERD_DROPIN)
    if shutil.which("containerd") or dropin.exists():
        out.append(Check("containerd registration", "ok" if dropin.exists() else "warn",
                         "runc wrapper on containerd's PATH" if dropin.exists() else "not registered",
                         "" if dropin.exists() else "cudahook configure --runtime containerd"))
    hooks_d = j.at(f"{paths.HOOKS_D}/50-cudahook-create.json")
    if shutil.which("podman") or shutil.which("crio") or hooks_d.exists():
        out.append(Check("podman/CRI-O registration", "ok" if hooks_d.exists() else "warn",
                         "hooks.d definitions present" if hooks_d.exists() else "not registered",
                         "" if hooks_d.exists() else "cudahook configure --runtime podman"))
    if shutil.which("podman"):
        out.append(_podman_runtime(j.root, shutil.which("crun") is not None))
    return out


# containers.conf files in the order podman reads them: a later one wins.
CONTAINERS_CONF = ("/usr/share/containers/containers.conf", "/etc/containers/containers.conf")
CONTAINERS_CONF_D = "/etc/containers/containers.conf.d"


def podman_runtime(root: Path, crun_installed: bool) -> tuple[str, str]:
    """The OCI runtime podman runs by default, and where that was decided:
    `runtime` under [engine] in the last containers.conf that sets it, else
    podman 4's own choice (crun where installed, else runc)."""
    import tomllib

    conf_d = root / CONTAINERS_CONF_D.lstrip("/")
    files = [root / f.lstrip("/") for f in CONTAINERS_CONF]
    if conf_d.is_dir():
        files += sorted(p for p in conf_d.iterdir() if p.suffix == ".conf")
    found = ("crun" if crun_installed else "runc", "podman's default")
    for f in files:
        try:
            engine = tomllib.loads(f.read_text()).get("engine") or {}
        except (OSError, ValueError):
            continue  # podman refuses a broken file itself
        if isinstance(engine, dict) and isinstance(engine.get("runtime"), str):
            found = (engine["runtime"], str(f))
    return found


def _podman_runtime(root: Path, crun_installed: bool) -> Check:
    runtime, where = podman_runtime(root, crun_installed)
    if Path(runtime).name.startswith("crun"):
        return Check("podman runtime", "warn",
                     f"podman runs {runtime} ({where}): crun's restore runs no OCI hooks "
                     "(no restore onto other GPUs), and crun before containers/crun#1892 with "
                     "libcriu 4.2 names no CRIU configuration (the action script does not run)",
                     'set runtime = "runc" under [engine] in /etc/containers/containers.conf, '
                     "or run GPU containers with podman --runtime runc")
    return Check("podman runtime", "ok", f"podman runs {runtime} ({where})")


def _dangling(root: Path) -> list[Check]:
    """A registration naming a missing executable breaks the runtime for every
    container (CRIU fails each checkpoint whose action script is gone)."""
    found = registrations.dangling(root)
    if not found:
        return [Check("dangling registrations", "ok",
                      "every registration names an existing executable")]
    return [Check("dangling registration", "fail",
                  f"{d.path} names {d.target}, which is missing or not executable", d.fix)
            for d in found]


def _state_dir(ctx: Context) -> Check:
    path = Path(ctx.settings.state_dir)
    if not path.exists():
        return Check("state dir", "ok", f"{path} not created yet (made 0700 on first use)")
    st = path.stat()
    if st.st_uid != 0 or stat.S_IMODE(st.st_mode) & 0o077:
        return Check("state dir", "fail", f"{path} is mode {stat.S_IMODE(st.st_mode):o}, "
                     f"owner uid {st.st_uid}", f"chown root {path} && chmod 700 {path}")
    return Check("state dir", "ok", f"{path} root-only")


def render(checks: list[Check]) -> str:
    mark = {"ok": "ok  ", "warn": "WARN", "fail": "FAIL"}
    lines = []
    for c in checks:
        lines.append(f"[{mark[c.status]}] {c.name}: {c.detail}")
        if c.hint:
            lines.append(f"       -> {c.hint}")
    fails = sum(c.status == "fail" for c in checks)
    lines.append(f"{fails} blocking problem(s)" if fails else "no blocking problems")
    return "\n".join(lines)


def as_json(checks: list[Check]) -> list[dict[str, str]]:
    return [asdict(c) for c in checks]
