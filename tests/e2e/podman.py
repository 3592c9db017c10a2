"""Podman for end-to-end tests, on storage of its own.

Nothing here touches the node's podman: every command runs with its own
``--root``, ``--runroot`` and ``--tmpdir`` under a temporary directory, the
cgroupfs manager, the file events backend and runc (Debian's crun 1.8 has no
checkpoint support). Images come from no registry: :meth:`Podman.import_rootfs`
is ``podman import`` of a tar of a rootfs directory.

The storage driver is overlay where the kernel lets podman mount it in the
suite's mount namespace, else vfs (slower, always works). ``close()`` removes
every container of its storage (``rm -a -f -t 0``), unmounts what is left under its
directories and removes them.

A :class:`NodeNamespace` is a mount namespace standing for another node on
the same machine: the same path (the simulated GPU's directory, hooks.d,
``/etc/criu``) names that node's own files. Commands run in it through
``nsenter``.
"""

from __future__ import annotations

import contextlib
import json
import os
import shlex
import shutil
import signal
import subprocess
import tarfile
import tempfile
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from cudahook.sim.bundle import DEFAULT_PATH, find_criu

from .daemons import RUNC, DaemonError, pids_with_args, unmount_under

PODMAN = "/usr/bin/podman"
#: The VM's hard limits are lower than podman's defaults (nofile 1048576):
#: every container gets limits the host can grant.
ULIMITS = ("--ulimit", "nofile=4096:4096", "--ulimit", "nproc=4096:4096")


def criu_path_env(extra: Mapping[str, str] | None = None) -> dict[str, str]:
    """An environment whose PATH finds the suite's CRIU first: podman checks
    ``criu`` on PATH and runc (run by podman and by conmon) runs it from there."""
    criu = find_criu()
    path = DEFAULT_PATH if criu is None else f"{criu.parent}:{DEFAULT_PATH}"
    env = {k: v for k, v in os.environ.items() if k not in ("PATH",)}
    env.update({"PATH": path, **(extra or {})})
    return env


class NodeNamespace:
    """A mount namespace (a child of the suite's) where each ``(source,
    target)`` bind makes ``target`` name ``source``: another node's view of
    the same paths. A sleeping holder keeps it alive until :meth:`close`."""

    def __init__(self, binds: Sequence[tuple[str, str]]):
        script = ["set -e"]
        for source, target in binds:
            script.append(f"mkdir -p {shlex.quote(target)}")
            script.append(f"mount --bind {shlex.quote(source)} {shlex.quote(target)}")
        script.append("echo ready")
        script.append("exec sleep 100000")
        self.proc = subprocess.Popen(
            ["unshare", "--mount", "--propagation", "private", "sh", "-c", "\n".join(script)],
            stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
            start_new_session=True, text=True)
        assert self.proc.stdout is not None
        if self.proc.stdout.readline().strip() != "ready":
            err = self.proc.stderr.read() if self.proc.stderr else ""
            self.proc.wait(5)
            raise DaemonError(f"node namespace did not start: {err}")

    def wrap(self, argv: Sequence[str]) -> list[str]:
        return ["nsenter", "-t", str(self.proc.pid), "-m", "--", *argv]

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGKILL)
            self.proc.wait(10)


class Podman:
    """``podman`` with private storage (see the module docstring)."""

    def __init__(self, tmpdir: Path | str, *, ns: NodeNamespace | None = None,
                 env: Mapping[str, str] | None = None, hooks_dir: str | None = None):
        self.dir = Path(tmpdir)
        self.dir.mkdir(parents=True, exist_ok=True)
        # podman refuses a runroot longer than 50 characters: a short one in /tmp.
        self.short = Path(tempfile.mkdtemp(prefix="pm", dir="/tmp"))
        self.root, self.runroot, self.tmp = self.dir / "root", self.short / "run", self.dir / "tmp"
        for d in (self.root, self.runroot, self.tmp):
            d.mkdir(parents=True, exist_ok=True)
        self.ns = ns
        self.hooks_dir = hooks_dir
        # Image copies go to TMPDIR (else /var/tmp, outside the suite's overlays).
        self.env = criu_path_env({"TMPDIR": str(self.tmp), **(env or {})})
        self.driver = "overlay"
        #: why podman's storage fell back to vfs (None: overlay works here)
        self.overlay_error: str | None = None

    def global_args(self) -> list[str]:
        return [PODMAN, "--root", str(self.root), "--runroot", str(self.runroot),
                "--tmpdir", str(self.tmp), "--cgroup-manager", "cgroupfs",
                "--events-backend", "file", "--runtime", RUNC,
                "--storage-driver", self.driver,
                *(["--hooks-dir", self.hooks_dir] if self.hooks_dir else [])]

    def command(self) -> str:
        """The podman command line with this instance's global options (for
        ``cudahook migrate --podman``)."""
        return shlex.join(self.global_args())

    def wrap(self, argv: Sequence[str]) -> list[str]:
        return self.ns.wrap(argv) if self.ns is not None else list(argv)

    def __call__(self, *args: str, check: bool = True, timeout: float = 180
                 ) -> subprocess.CompletedProcess[str]:
        argv = self.wrap([*self.global_args(), *args])
        try:
            res = subprocess.run(argv, env=self.env, stdin=subprocess.DEVNULL,
                                 capture_output=True, text=True, timeout=timeout, check=False)
        except subprocess.TimeoutExpired as exc:
            raise DaemonError(f"{shlex.join(argv)}: timed out after {timeout}s") from exc
        if check and res.returncode != 0:
            raise DaemonError(f"{shlex.join(argv)} exited {res.returncode}\n"
                              f"{res.stdout}\n{res.stderr}")
        return res

    def import_rootfs(self, rootfs: Path, name: str) -> str:
        """``podman import`` a tar of `rootfs` as `name`; overlay, else vfs."""
        tar = self.dir / "rootfs.tar"
        with tarfile.open(tar, "w") as t:
            t.add(rootfs, arcname=".")
        res = self("import", str(tar), name, check=False)
        if res.returncode != 0:
            self.overlay_error = res.stderr.strip()
            # overlay may not mount here (nested overlays): vfs always does.
            self.close_storage()
            self.driver = "vfs"
            self("import", str(tar), name)
        tar.unlink()
        return name

    def save(self, name: str, out: Path) -> Path:
        """The image as an archive: loaded elsewhere, it keeps its ID (a
        checkpoint restores only onto the same image, as from a registry)."""
        self("save", "--format", "oci-archive", "-o", str(out), name)
        return out

    def load(self, archive: Path) -> None:
        res = self("load", "-i", str(archive), check=False)
        if res.returncode != 0:
            self.overlay_error = res.stderr.strip()
            self.close_storage()
            self.driver = "vfs"
            self("load", "-i", str(archive))

    def run(self, name: str, image: str, cmd: Sequence[str], *, env: Sequence[str] = (),
            binds: Sequence[tuple[str, str, bool]] = (), devices: Sequence[tuple[str, str]] = (),
            extra: Sequence[str] = ()) -> str:
        args = ["run", "-d", "--name", name, "--network", "none", *ULIMITS, *extra]
        for host, dest, ro in binds:  # not recursive, as RuncBox's binds
            args += ["-v", f"{host}:{dest}:{'ro' if ro else 'rw'},bind"]
        for host, dest in devices:
            args += ["--device", f"{host}:{dest}:rwm"]
        for e in env:
            args += ["-e", e]
        return self(*args, image, *cmd).stdout.strip()

    def inspect(self, name: str) -> dict[str, Any]:
        return json.loads(self("container", "inspect", name).stdout)[0]

    def state(self, name: str) -> str:
        return str(self.inspect(name)["State"]["Status"])

    def pid(self, name: str) -> int:
        return int(self.inspect(name)["State"]["Pid"])

    def close_storage(self) -> None:
        unmount_under([self.root, self.runroot])
        for d in (self.root, self.runroot):
            shutil.rmtree(d, ignore_errors=True)
            d.mkdir(parents=True, exist_ok=True)

    def close(self) -> None:
        # Every container of this storage (restored ones too): it is ours alone.
        with contextlib.suppress(DaemonError):
            self("rm", "-a", "-f", "-t", "0", check=False, timeout=120)
        # conmon runs `podman container cleanup` after a container dies, on
        # its own: wait for those (they name our runroot), or one would make
        # the runroot again after it is removed.
        deadline = time.monotonic() + 30
        while pids_with_args(str(self.runroot)) and time.monotonic() < deadline:
            time.sleep(0.1)
        if self.ns is None:
            # In a node namespace the mounts go with the namespace.
            unmount_under([self.root, self.runroot, self.tmp])
        shutil.rmtree(self.short, ignore_errors=True)
