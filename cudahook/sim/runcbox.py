"""GPU containers on the simulated node, run by real runc and CRIU.

Used by the end-to-end tests and the demo. A container sees the simulated
GPU as a real one would appear: character device nodes at /dev/nvidia* that
CRIU cannot dump (so an fd left open on one fails the dump, as on a GPU node),
NVIDIA_VISIBLE_DEVICES naming its GPUs, and the driver (here: the GPU
service's socket directory) bind-mounted in. Its init is a shell that starts
the simulated CUDA workloads and any other processes beside them.
"""

from __future__ import annotations

import json
import os
import shlex
import subprocess
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from .bundle import find_criu, make_bundle
from .lab import PKG_PARENT, SimLab, workload_argv

GUEST_PKG = "/opt/cudahook"
GUEST_SIM = "/run/cuda-sim"


def guest_env(visible: Sequence[str]) -> list[str]:
    """The environment of a container on the simulated GPU that sees `visible`."""
    return [
        "PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin",
        f"PYTHONPATH={GUEST_PKG}",
        f"CUDA_SIM_SOCKET={GUEST_SIM}/gpu.sock",
        f"CUDA_SIM_STATUS_DIR={GUEST_SIM}/status",
        "CUDA_SIM_DEV_DIR=/dev",
        "CUDA_SIM_CTL_DIR=/dev/shm",
        f"NVIDIA_VISIBLE_DEVICES={','.join(visible)}",
    ]


def guest_binds(lab: SimLab, *, device_files: bool = True) -> list[tuple[str, str, bool]]:
    """(host, container, read-only) binds: the package, the GPU service and,
    with `device_files`, the node's plain-file device nodes at /dev/nvidia*."""
    binds = [(PKG_PARENT, GUEST_PKG, True), (str(lab.root), GUEST_SIM, False)]
    if device_files:
        binds += [(str(lab.dev / n), f"/dev/{n}", False) for n in sorted(os.listdir(lab.dev))]
    return binds


# A harmless character device CRIU cannot dump, standing in for the real
# /dev/nvidia* (char 195:N): an fd left open on one fails the dump, as on a
# GPU node (CRIU: "Can't dump file N of that type [20600]").
STAND_IN_NODE = "/dev/loop-control"


def guest_devices(lab: SimLab) -> list[dict[str, Any]]:
    """linux.devices entries that give a container real character nodes at
    /dev/nvidia*, as the NVIDIA container toolkit injects the real ones; []
    when the stand-in node is missing on this host."""
    try:
        rdev = os.stat(STAND_IN_NODE).st_rdev
    except OSError:
        return []
    return [{"path": f"/dev/{n}", "type": "c", "major": os.major(rdev), "minor": os.minor(rdev),
             "fileMode": 0o666, "uid": 0, "gid": 0} for n in sorted(os.listdir(lab.dev))]


class RuncBox:
    def __init__(self, work: Path, lab: SimLab, *, hooks_dir: Path | None = None,
                 criu: Path | None = None, runc: str = "runc"):
        self.work = Path(work)
        self.lab = lab
        self.hooks_dir = hooks_dir
        self.criu = criu or find_criu()
        self.runc = runc
        self.root = self.work / "runc-root"
        self.root.mkdir(parents=True, exist_ok=True)
        self.criu_conf = self.work / "criu.conf"
        if hooks_dir is not None:
            self.criu_conf.write_text(f"action-script {hooks_dir / 'cudahook-criu-action'}\n")
        self.ids: set[str] = set()
        # runc checkpoint/restore in a session (and process group) of their
        # own, as a runtime's shim runs them: a test may then kill that
        # group - runc, CRIU and the action script - as a runtime would.
        self.own_session = False

    # -- bundles -----------------------------------------------------------------

    def workload_cmd(self, tag: str, **opts: Any) -> str:
        return shlex.join(workload_argv("/usr/bin/python3", tag, **opts))

    def bundle(
        self,
        name: str,
        workloads: Sequence[tuple[str, dict[str, Any]]],
        *,
        visible: Sequence[str] | None = None,
        others: Sequence[str] = (),
        oci_hooks: bool = True,
        action_script: bool | str = True,  # "system": whatever /etc/criu/runc.conf says
        annotations: dict[str, str] | None = None,
        snapshot_control: Path | None = None,
        control_symlink: str | None = None,
    ) -> Path:
        """A bundle whose init runs the workloads (and `others`, shell commands)."""
        cmds = [self.workload_cmd(t, **o) for t, o in workloads] + list(others)
        script = " ".join(f"{c} &" for c in cmds) + " wait"
        env = guest_env(list(visible) if visible is not None else self.lab.uuids[:1])
        devices = guest_devices(self.lab)
        binds = guest_binds(self.lab, device_files=not devices)
        if snapshot_control is not None:
            binds.append((str(snapshot_control), "/snapshot-control", False))
        notes = dict(annotations or {})
        # runc hands CRIU /etc/criu/runc.conf unless this names another file ("" = none).
        if action_script != "system":
            notes.setdefault("org.criu.config",
                             str(self.criu_conf) if action_script and self.hooks_dir else "")
        hooks = None
        if oci_hooks and self.hooks_dir is not None:
            hook = str(self.hooks_dir / "cudahook-oci-hook")
            hooks = {
                "createRuntime": [{"path": hook, "args": ["cudahook-oci-hook", "createRuntime"]}],
                "poststop": [{"path": hook, "args": ["cudahook-oci-hook", "poststop"]}],
            }
        bundle = make_bundle(self.work / name, ["/bin/sh", "-c", script], env=env, binds=binds,
                             annotations=notes, hooks=hooks, devices=devices)
        if control_symlink is not None:
            # The image itself makes /snapshot-control a symlink.
            (bundle / "rootfs" / "snapshot-control").symlink_to(control_symlink)
        return bundle

    # -- runc ------------------------------------------------------------------

    def _runc(self, *args: str, timeout: float = 120, detach: bool = False
              ) -> subprocess.CompletedProcess[str]:
        log = self.work / "runc.log"
        argv = [self.runc, "--root", str(self.root), "--log", str(log)]
        if self.criu is not None:
            argv += ["--criu", str(self.criu)]
        if not detach:
            return subprocess.run([*argv, *args], stdin=subprocess.DEVNULL,
                                  capture_output=True, text=True,
                                  timeout=timeout, start_new_session=self.own_session)
        # runc hands its stdio to a detached container: a pipe would never see
        # EOF, and a host file would make the container undumpable. /dev/null,
        # and runc's own log for what went wrong.
        offset = log.stat().st_size if log.exists() else 0
        r = subprocess.run([*argv, *args], stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                           stderr=subprocess.DEVNULL, timeout=timeout,
                           start_new_session=self.own_session)
        with open(log, "rb") as f:
            f.seek(offset)
            tail = f.read().decode(errors="replace")
        return subprocess.CompletedProcess(r.args, r.returncode, "", tail)

    def run(self, cid: str, bundle: Path) -> subprocess.CompletedProcess[str]:
        self.ids.add(cid)
        return self._runc("run", "-d", "-b", str(bundle), cid, detach=True)

    def checkpoint(self, cid: str, image: Path, *, leave_running: bool = False
                   ) -> subprocess.CompletedProcess[str]:
        args = ["checkpoint", "--image-path", str(image), "--work-path", str(image) + ".work"]
        if leave_running:
            args.append("--leave-running")
        return self._runc(*args, cid)

    def restore(self, cid: str, bundle: Path, image: Path) -> subprocess.CompletedProcess[str]:
        self.ids.add(cid)
        return self._runc("restore", "-d", "-b", str(bundle), "--image-path", str(image),
                          "--work-path", str(image) + ".rwork", cid, detach=True)

    def pause(self, cid: str) -> subprocess.CompletedProcess[str]:
        return self._runc("pause", cid)

    def resume(self, cid: str) -> subprocess.CompletedProcess[str]:
        return self._runc("resume", cid)

    def state(self, cid: str) -> dict[str, Any] | None:
        r = self._runc("state", cid, timeout=30)
        return json.loads(r.stdout) if r.returncode == 0 else None

    def delete(self, cid: str) -> None:
        self._runc("kill", cid, "KILL", timeout=30)
        self._runc("delete", "-f", cid, timeout=30)

    def close(self) -> None:
        for cid in sorted(self.ids):
            self.delete(cid)
