"""Busybox bundles and cudahook installations for the runc benchmarks (P2, P5)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from bench.common import PYTHON, write_config

PROTOS = Path(__file__).resolve().parent / "prototypes"


class Install:
    """cudahook's hooks installed into a tmp dir, with a config whose state_dir
    and log_file are there too; and a criu.conf that registers the action script."""

    def __init__(self, tmp: Path, *, prototype: bool = False):
        from cudahook.admin import hookfiles

        self.dir = tmp
        tmp.mkdir(parents=True, exist_ok=True)
        self.state = tmp / "state"
        self.config = write_config(tmp / "cudahook.yaml", state_dir=str(self.state),
                                   log_file=str(tmp / "cudahook.log"))
        hooks = hookfiles.install(tmp / "hooks", python=PYTHON, config=str(self.config))
        self.oci_hook = hooks["cudahook-oci-hook"]
        self.action = hooks["cudahook-criu-action"]
        self.runtime = hooks.get("cudahook-runtime")  # the runc wrapper, where shipped
        if prototype:
            self.oci_hook = self._proto("oci-hook-fastpath.sh")
            self.action = self._proto("criu-action-fastpath.sh")
        self.criu_conf = tmp / "criu.conf"
        self.criu_conf.write_text(f"action-script {self.action}\n")

    def _proto(self, name: str) -> Path:
        text = ((PROTOS / name).read_text().replace("@PYTHON@", PYTHON)
                .replace("@CONFIG@", str(self.config)).replace("@STATE@", str(self.state)))
        out = self.dir / "hooks" / f"proto-{name.removesuffix('.sh')}"
        out.write_text(text)
        out.chmod(0o755)
        return out

    def oci_hooks(self) -> dict[str, list[dict[str, Any]]]:
        h = str(self.oci_hook)
        return {
            "createRuntime": [{"path": h, "args": ["cudahook-oci-hook", "createRuntime"]}],
            "poststop": [{"path": h, "args": ["cudahook-oci-hook", "poststop"]}],
        }


def busybox_bundle(path: Path, args: list[str],
                   install: Install | TrueInstall | GpuOnlyInstall | None, *,
                   action_script: bool = True) -> Path:
    """A busybox-only bundle; with `install`, cudahook registered the way an
    operator would: OCI hooks in config.json and (for CRIU) the action script
    through the org.criu.config annotation. Without it, org.criu.config=""
    (runc hands CRIU no config file at all)."""
    from cudahook.sim.bundle import make_bundle

    notes = {"org.criu.config": str(install.criu_conf) if install and action_script else ""}
    return make_bundle(path, args, host_usr=False, annotations=notes,
                       hooks=install.oci_hooks() if install else None)


class GpuOnlyInstall:
    """cudahook installed as an operator would with `--criu-registration
    gpu-only`: hooks in a tmp dir, the node root's runc.conf registered
    gpu-only (the site's options kept, a comment naming the script), and
    every runc call through the installed wrapper (`runtime`). A container
    without a GPU gets no OCI hooks from the wrapper, and runc hands CRIU the
    node's runc.conf: named here through org.criu.config, as the node lives
    under a root of its own."""

    def __init__(self, tmp: Path, root: Path, site_conf: str = ""):
        from cudahook.admin.configure import configure

        self.install = Install(tmp)
        self.dir = tmp
        self.runtime = self.install.runtime
        self.criu_conf = root / "etc/criu/runc.conf"
        self.criu_conf.parent.mkdir(parents=True, exist_ok=True)
        if site_conf:
            self.criu_conf.write_text(site_conf)
        configure("runc", self.install.oci_hook.parent, root=str(root),
                  criu_registration="gpu-only")

    def oci_hooks(self) -> None:
        return None  # the wrapper adds them to GPU containers only


class TrueInstall:
    """The floor of any registration: OCI hooks and action script = /bin/true."""

    def __init__(self, tmp: Path, *, oci: bool = True):
        tmp.mkdir(parents=True, exist_ok=True)
        self.oci = oci
        self.dir = tmp
        self.criu_conf = tmp / "criu.conf"
        self.criu_conf.write_text("action-script /bin/true\n")

    def oci_hooks(self) -> dict[str, list[dict[str, Any]]] | None:
        if not self.oci:
            return None
        return {s: [{"path": "/bin/true", "args": ["true", s]}]
                for s in ("createRuntime", "poststop")}
