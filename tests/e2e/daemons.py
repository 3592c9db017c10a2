"""Private containerd / dockerd instances for end-to-end tests.

Nothing here touches the system's daemons: each instance gets its own root,
state, sockets, runc root, temp dir and log file, and :meth:`stop` kills what
it started (tasks, shims, the daemon, by PID) and unmounts what is left under
its directories. Both classes are context managers.

* :class:`Containerd` runs ``/usr/bin/containerd`` (1.6) with a generated
  config (CRI plugin disabled, overlayfs snapshotter) and an environment whose
  PATH can be prefixed with a directory: a ``runc`` placed there is the one
  ``containerd-shim-runc-v2`` runs (the way a runtime wrapper gets in front of
  runc with containerd 1.6). ``ctr(...)`` runs ``ctr --address SOCK
  --namespace cudahook-test ...``.
* :class:`Dockerd` runs ``/usr/sbin/dockerd`` (20.10) with ``"experimental":
  true``, no iptables/bridge, extra ``runtimes`` from daemon.json, and a
  private :class:`Containerd` of its own (``--containerd``), so it never
  attaches to a system containerd on /run/containerd/containerd.sock.
  ``docker(...)`` runs docker.io's ``/usr/bin/docker`` (NOT a newer client that
  may sit first on PATH, e.g. /usr/local/bin/docker) with ``-H``.

Both take ``binaries``: :data:`PACKAGED` (Debian 12's packages, above) or a
set of newer ones that ``scripts/provision-runtimes.sh`` unpacked beside them
(:func:`private_binaries`: containerd 1.7, docker 26); a set's own directories
come first on the daemons' PATH, so containerd runs its own shim.

Images come from no registry: :func:`image_tar` writes a ``docker save``
style archive (manifest.json + config + one layer) of a busybox-static rootfs;
``ctr images import`` and ``docker load`` both take it.

Checkpoint/restore (containerd 1.6 ``ctr``): ``ctr c checkpoint --task ID REF``
stores a checkpoint image REF in the content store and leaves the task running
(the container must have been created from an image, not ``--rootfs``);
restore needs the container gone (kill task, ``ctr t rm``, ``ctr c rm``), then
``ctr c restore --live ID REF`` recreates container + snapshot from the image
and starts the task from the CRIU images. See :meth:`Containerd.checkpoint`.
"""

from __future__ import annotations

import atexit
import contextlib
import hashlib
import io
import json
import os
import re
import shutil
import signal
import subprocess
import tarfile
import tempfile
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from cudahook.sim.bundle import DEFAULT_PATH, find_busybox, find_criu

__all__ = [
    "CONTAINERD",
    "CTR",
    "DOCKER",
    "DOCKERD",
    "PACKAGED",
    "Binaries",
    "Containerd",
    "DaemonError",
    "Dockerd",
    "busybox_rootfs",
    "image_tar",
    "pids_with_args",
    "private_binaries",
    "runc_wrapper",
    "unmount_under",
]

CONTAINERD = "/usr/bin/containerd"
CTR = "/usr/bin/ctr"
SHIM = "/usr/bin/containerd-shim-runc-v2"
DOCKERD = "/usr/sbin/dockerd"
#: docker.io's client (20.10); /usr/local/bin/docker may be a newer one.
DOCKER = "/usr/bin/docker"
RUNC = "/usr/sbin/runc"
NAMESPACE = "cudahook-test"
#: where scripts/provision-runtimes.sh unpacks the newer runtimes
PRIVATE_RUNTIMES = Path(__file__).resolve().parents[2] / ".cache" / "runtimes"
IMAGE = "cudahook/busybox:test"


#: dockerd's containerd namespace
DOCKER_NAMESPACE = "moby"
#: containerd refusing a blob its store still holds (moby/moby#42900)
CONTENT_RACE = re.compile(r"content (sha256:[0-9a-f]{64}): already exists")
#: how long a checkpoint command waits for the content store to settle
CONTENT_SETTLE_S = 60.0
CONTENT_ATTEMPTS = 3


def _stores_checkpoint(args: Sequence[str]) -> bool:
    """docker commands that pass a checkpoint through containerd's content store."""
    if tuple(args[:2]) == ("checkpoint", "create"):
        return True
    return bool(args) and args[0] == "start" and any(
        a == "--checkpoint" or a.startswith("--checkpoint=") for a in args[1:])


def _checkpoint_target(args: Sequence[str]) -> str | None:
    """The container of ``checkpoint create [OPTIONS] CONTAINER CHECKPOINT``."""
    rest = list(args[2:])
    words = []
    while rest:
        a = rest.pop(0)
        if a in ("--checkpoint-dir",) and rest:
            rest.pop(0)
        elif not a.startswith("-"):
            words.append(a)
    return words[0] if len(words) == 2 else None


class DaemonError(RuntimeError):
    """A daemon did not start, died, or a client command failed."""


@dataclass(frozen=True)
class Binaries:
    """One version of containerd (and the docker on top of it) to drive."""

    name: str = "containerd 1.6, docker 20.10"
    #: the versions the daemons must report (a prefix: "1.6", "20.10")
    containerd_version: str = "1.6"
    docker_version: str = "20.10"
    containerd: str = CONTAINERD
    ctr: str = CTR
    shim: str = SHIM
    dockerd: str = DOCKERD
    docker: str = DOCKER
    #: directories put first on the daemons' PATH (the set's shims)
    path: tuple[str, ...] = ()

    def missing(self, *, docker: bool = True) -> list[str]:
        """The executables of this set that are not there."""
        want = [self.containerd, self.ctr, self.shim, RUNC]
        if docker:
            want += [self.dockerd, self.docker]
        return [b for b in want if not os.access(b, os.X_OK)]


#: Debian 12's packages
PACKAGED = Binaries()


def private_binaries(containerd: str, docker: str | None = None) -> Binaries:
    """The set unpacked as PRIVATE_RUNTIMES/containerd-<containerd>* (and
    docker-<docker>*), e.g. ``private_binaries("1.7", "26")``. Paths that are
    not there stay in the set, so :meth:`Binaries.missing` names them."""

    def find(name: str, version: str) -> Path:
        hits = sorted(PRIVATE_RUNTIMES.glob(f"{name}-{version}.*"))
        return hits[-1] if hits else PRIVATE_RUNTIMES / f"{name}-{version}"

    c = find("containerd", containerd) / "usr" / "bin"
    d = find("docker", docker) if docker else None
    return Binaries(
        name=f"containerd {containerd}" + (f", docker {docker}" if docker else ""),
        containerd_version=containerd, docker_version=docker or "",
        containerd=str(c / "containerd"), ctr=str(c / "ctr"),
        shim=str(c / "containerd-shim-runc-v2"),
        dockerd=str(d / "usr" / "sbin" / "dockerd") if d else DOCKERD,
        docker=str(d / "usr" / "bin" / "docker") if d else DOCKER,
        path=(str(c),),
    )


def tail(path: Path, n: int = 40) -> str:
    try:
        lines = path.read_text(errors="replace").splitlines()
    except OSError as exc:
        return f"<{path}: {exc}>"
    return "\n".join(lines[-n:])


def _short_dir(prefix: str) -> Path:
    """A short directory in /tmp for Unix sockets (sun_path is 108 bytes)."""
    return Path(tempfile.mkdtemp(prefix=prefix, dir="/tmp"))


def _mounts_under(dirs: Iterable[Path]) -> list[str]:
    """Mount points at or below any of ``dirs``, deepest first."""
    roots = [os.path.realpath(d).rstrip("/") for d in dirs if d]
    found: list[str] = []
    try:
        lines = Path("/proc/self/mountinfo").read_text().splitlines()
    except OSError:
        return []
    for line in lines:
        fields = line.split()
        if len(fields) < 5:
            continue
        mp = fields[4].replace("\\040", " ").replace("\\011", "\t").replace("\\134", "\\")
        if any(mp == r or mp.startswith(r + "/") for r in roots):
            found.append(mp)
    return sorted(set(found), key=lambda p: (-p.count("/"), p))


def unmount_under(dirs: Iterable[Path]) -> list[str]:
    """Lazily unmount everything at or below ``dirs``; return what was unmounted."""
    done: list[str] = []
    for _ in range(3):  # stacked mounts on one point need several passes
        points = _mounts_under(dirs)
        if not points:
            break
        for mp in points:
            res = subprocess.run(["umount", "-l", mp], capture_output=True, text=True, check=False)
            if res.returncode == 0:
                done.append(mp)
    return done


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    # a zombie still answers kill(0): look at its state
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
        return stat.rsplit(")", 1)[1].split()[0] != "Z"
    except (OSError, IndexError):
        return False


def pids_with_args(*needle: str) -> list[int]:
    """PIDs whose argv contains ``needle`` as consecutive arguments (exact match).

    Used with an instance's private socket path (``-address /tmp/chdXXX/c.sock``)
    to find the shims of that instance only.
    """
    want = [a.encode() for a in needle]
    found = []
    for entry in os.scandir("/proc"):
        if not entry.name.isdigit():
            continue
        try:
            argv = Path(entry.path, "cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        if any(argv[i : i + len(want)] == want for i in range(len(argv) - len(want) + 1)):
            found.append(int(entry.name))
    return found


def _kill_pid(pid: int, sig: int = signal.SIGKILL) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.kill(pid, sig)


def _wait_gone(pids: Sequence[int], timeout: float) -> list[int]:
    deadline = time.monotonic() + timeout
    left = [p for p in pids if _pid_alive(p)]
    while left and time.monotonic() < deadline:
        time.sleep(0.05)
        left = [p for p in left if _pid_alive(p)]
    return left


def _stop_process(proc: subprocess.Popen[Any] | None, timeout: float = 10) -> None:
    if proc is None or proc.poll() is not None:
        return
    proc.send_signal(signal.SIGTERM)
    try:
        proc.wait(timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait(5)


# --------------------------------------------------------------------------- images


def busybox_rootfs(dest: Path | str, extra_dirs: Sequence[str] = ("data",)) -> Path:
    """A self-contained busybox-static rootfs: /bin/busybox + one symlink per applet."""
    rootfs = Path(dest)
    busybox = find_busybox()
    (rootfs / "bin").mkdir(parents=True, exist_ok=True)
    target = rootfs / "bin" / "busybox"
    if not target.exists():
        shutil.copy2(busybox, target)
    listing = subprocess.run(
        [str(busybox), "--list-full"], check=True, capture_output=True, text=True
    ).stdout.split()
    for rel in listing:
        link = rootfs / rel
        if rel == "bin/busybox" or link.exists() or link.is_symlink():
            continue
        link.parent.mkdir(parents=True, exist_ok=True)
        link.symlink_to("/bin/busybox")
    for name in ("dev", "etc", "proc", "sys", "tmp", "root", "run", *extra_dirs):
        (rootfs / name).mkdir(parents=True, exist_ok=True)
    (rootfs / "tmp").chmod(0o1777)
    return rootfs


def _layer_tar(rootfs: Path) -> bytes:
    """Deterministic uncompressed tar of ``rootfs`` (mtime 0, uid/gid 0)."""
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w", format=tarfile.PAX_FORMAT) as tar:
        for path in sorted(rootfs.rglob("*")):
            rel = path.relative_to(rootfs).as_posix()
            info = tar.gettarinfo(str(path), arcname=rel)
            info.mtime = 0
            info.uid = info.gid = 0
            info.uname = info.gname = "root"
            if info.isreg():
                with path.open("rb") as fh:
                    tar.addfile(info, fh)
            else:
                tar.addfile(info)
    return buf.getvalue()


def image_tar(
    out: Path | str,
    rootfs: Path | str | None = None,
    name: str = IMAGE,
    cmd: Sequence[str] = ("sh",),
    env: Sequence[str] = ("PATH=/usr/sbin:/usr/bin:/sbin:/bin",),
) -> Path:
    """Write a ``docker save`` style archive of ``rootfs`` (default: busybox) to ``out``.

    Loadable with ``ctr images import`` (the name becomes ``docker.io/<name>``)
    and ``docker load``.
    """
    out = Path(out)
    if rootfs is None:
        rootfs = busybox_rootfs(out.parent / (out.name + ".rootfs"))
    layer = _layer_tar(Path(rootfs))
    layer_id = hashlib.sha256(layer).hexdigest()
    config = {
        "architecture": "amd64",
        "os": "linux",
        "created": "1970-01-01T00:00:00Z",
        "config": {"Env": list(env), "Cmd": list(cmd), "WorkingDir": "/"},
        "rootfs": {"type": "layers", "diff_ids": [f"sha256:{layer_id}"]},
        "history": [{"created": "1970-01-01T00:00:00Z", "created_by": "cudahook tests/e2e/daemons.py"}],
    }
    config_bytes = json.dumps(config, sort_keys=True).encode()
    config_id = hashlib.sha256(config_bytes).hexdigest()
    manifest = [{"Config": f"{config_id}.json", "RepoTags": [name], "Layers": [f"{layer_id}/layer.tar"]}]
    repositories = {name.rsplit(":", 1)[0]: {name.rsplit(":", 1)[1]: layer_id}}

    def add(tar: tarfile.TarFile, arcname: str, data: bytes | None) -> None:
        info = tarfile.TarInfo(arcname)
        info.mtime = 0
        if data is None:
            info.type = tarfile.DIRTYPE
            info.mode = 0o755
            tar.addfile(info)
        else:
            info.size = len(data)
            info.mode = 0o644
            tar.addfile(info, io.BytesIO(data))

    tmp = out.with_name(out.name + ".tmp")
    with tarfile.open(tmp, "w", format=tarfile.PAX_FORMAT) as tar:
        add(tar, f"{layer_id}/", None)
        add(tar, f"{layer_id}/VERSION", b"1.0")
        add(tar, f"{layer_id}/json", json.dumps({"id": layer_id}).encode())
        add(tar, f"{layer_id}/layer.tar", layer)
        add(tar, f"{config_id}.json", config_bytes)
        add(tar, "manifest.json", json.dumps(manifest).encode())
        add(tar, "repositories", json.dumps(repositories).encode())
    tmp.replace(out)
    return out


def runc_wrapper(path: Path | str, log: Path | str, real: str = RUNC) -> Path:
    """A ``runc`` wrapper script that appends its argv (one line) to ``log`` and execs ``real``."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(f'#!/bin/sh\nprintf "%s\\n" "$*" >> "{log}"\nexec "{real}" "$@"\n')
    path.chmod(0o755)
    return path


# --------------------------------------------------------------------------- containerd


def _launch(argv: list[str], env: dict[str, str], log: Any) -> subprocess.Popen[bytes]:
    """A daemon in its own session, its output in its log file."""
    return subprocess.Popen(argv, env=env, stdin=subprocess.DEVNULL, stdout=log,
                            stderr=subprocess.STDOUT, start_new_session=True)


def _wait_ready(name: str, proc: subprocess.Popen[bytes], address: str,
                ready: Callable[[], bool], timeout: float, log_tail: Callable[[], str],
                interval: float) -> None:
    """Until the daemon's socket exists and it answers; its log tail if it never does."""
    deadline = time.monotonic() + timeout
    while True:
        if proc.poll() is not None:
            raise DaemonError(f"{name} exited with {proc.returncode} during start\n{log_tail()}")
        if os.path.exists(address) and ready():
            return
        if time.monotonic() > deadline:
            raise DaemonError(f"{name} not ready after {timeout}s\n{log_tail()}")
        time.sleep(interval)


class _Daemon:
    """start(): start the daemon and wait until it answers; on failure clean up
    and raise DaemonError. Subclasses provide _start() and stop()."""

    proc: subprocess.Popen[bytes] | None = None

    def start(self):  # type: ignore[no-untyped-def]
        if self.proc is not None:
            return self
        try:
            return self._start()  # type: ignore[attr-defined]
        except BaseException:
            self.stop()  # type: ignore[attr-defined]
            raise


class Containerd(_Daemon):
    """A private containerd 1.6 with its own root, state, socket and runc root."""

    def __init__(
        self,
        tmpdir: Path | str,
        path_prefix: Path | str | None = None,
        *,
        namespace: str = NAMESPACE,
        snapshotter: str = "overlayfs",
        criu: Path | str | None = None,
        start_timeout: float = 30,
        extra_env: Mapping[str, str] | None = None,
        gc: Mapping[str, Any] | None = None,
        binaries: Binaries = PACKAGED,
    ) -> None:
        self.bins = binaries
        self.dir = Path(tmpdir)
        #: settings of containerd's garbage collection scheduler (e.g.
        #: ``pause_threshold``): how long a deleted blob stays in the store
        self.gc = dict(gc or {})
        self.dir.mkdir(parents=True, exist_ok=True)
        self.root = self.dir / "root"
        self.state = self.dir / "state"
        self.temp = self.dir / "temp"
        self.config = self.dir / "containerd.toml"
        self.log = self.dir / "containerd.log"
        self.namespace = namespace
        self.snapshotter = snapshotter
        self.path_prefix = Path(path_prefix) if path_prefix else None
        self.start_timeout = start_timeout
        #: short /tmp/chdXXXX dir for the sockets and the runc root; made by start()
        self.sock_dir: Path | None = None
        criu_path = Path(criu) if criu else find_criu()
        path = DEFAULT_PATH
        if criu_path is not None and str(criu_path.parent) not in path.split(":"):
            path = f"{criu_path.parent}:{path}"
        if binaries.path:
            path = ":".join([*binaries.path, path])
        if self.path_prefix is not None:
            path = f"{self.path_prefix}:{path}"
        self.env = {
            "PATH": path,
            "HOME": "/root",
            "TMPDIR": str(self.temp),
            "LANG": "C.UTF-8",
            **(extra_env or {}),
        }
        self.proc: subprocess.Popen[bytes] | None = None
        self._logfh: Any = None

    @property
    def address(self) -> str:
        """containerd's gRPC socket (``<address>.ttrpc`` is the ttrpc one)."""
        if self.sock_dir is None:
            raise DaemonError("containerd not started")
        return str(self.sock_dir / "c.sock")

    @property
    def runc_root(self) -> Path:
        """runc state dir for containers :meth:`run` starts (``ctr run --runc-root``)."""
        if self.sock_dir is None:
            raise DaemonError("containerd not started")
        return self.sock_dir / "runc"

    # -- lifecycle ----------------------------------------------------------

    def write_config(self) -> Path:
        for d in (self.root, self.state, self.temp):
            d.mkdir(parents=True, exist_ok=True)
        disabled = [
            "io.containerd.grpc.v1.cri",
            "io.containerd.snapshotter.v1.aufs",
            "io.containerd.snapshotter.v1.btrfs",
            "io.containerd.snapshotter.v1.devmapper",
            "io.containerd.snapshotter.v1.zfs",
            "io.containerd.tracing.processor.v1.otlp",
            "io.containerd.internal.v1.tracing",
        ]
        toml = f"""\
version = 2
root = "{self.root}"
state = "{self.state}"
temp = "{self.temp}"
disabled_plugins = {json.dumps(disabled)}

[grpc]
  address = "{self.address}"

[ttrpc]
  address = "{self.address}.ttrpc"

[debug]
  address = ""
  level = "debug"

[metrics]
  address = ""

[plugins]
  [plugins."io.containerd.internal.v1.opt"]
    path = "{self.root}/opt"
"""
        if self.gc:
            toml += '  [plugins."io.containerd.gc.v1.scheduler"]\n'
            toml += "".join(f"    {k} = {json.dumps(v)}\n" for k, v in self.gc.items())
        self.config.write_text(toml)
        return self.config


    def _start(self) -> Containerd:
        if self.sock_dir is None:
            self.sock_dir = _short_dir("chd")
            atexit.register(self.stop)  # a crashed test run still cleans up
        self.write_config()
        self._logfh = self.log.open("ab")
        self.proc = _launch([self.bins.containerd, "--config", str(self.config)], self.env, self._logfh)

        def ready() -> bool:
            res = self.ctr("version", check=False, timeout=5)
            return res.returncode == 0 and "Server:" in res.stdout

        _wait_ready("containerd", self.proc, self.address, ready, self.start_timeout,
                    self.log_tail, 0.1)
        return self

    def __enter__(self) -> Containerd:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    # -- clients ------------------------------------------------------------

    def ctr_cmd(self, *args: str, namespace: str | None = None) -> list[str]:
        return [self.bins.ctr, "--address", self.address, "--namespace", namespace or self.namespace, *args]

    def ctr(
        self,
        *args: str,
        check: bool = True,
        timeout: float = 60,
        namespace: str | None = None,
    ) -> subprocess.CompletedProcess[str]:
        """Run ``ctr`` against this daemon (stdin /dev/null, output captured)."""
        cmd = self.ctr_cmd(*args, namespace=namespace)
        try:
            res = subprocess.run(
                cmd, env=self.env, stdin=subprocess.DEVNULL, capture_output=True, text=True,
                timeout=timeout, check=False,
            )  # fmt: skip
        except subprocess.TimeoutExpired as exc:
            raise DaemonError(f"ctr {' '.join(args)} timed out after {timeout}s\n{self.log_tail()}") from exc
        if check and res.returncode != 0:
            msg = res.stderr.strip() or res.stdout.strip()
            raise DaemonError(f"ctr {' '.join(args)} failed ({res.returncode}): {msg}\n{self.log_tail()}")
        return res

    def log_tail(self, n: int = 30) -> str:
        return f"containerd log {self.log} (tail):\n{tail(self.log, n)}"

    def server_version(self) -> str:
        """The version the running containerd reports (``ctr version``)."""
        out = self.ctr("version").stdout.split("Server:", 1)[-1]
        return next((ln.split(":", 1)[1].strip() for ln in out.splitlines()
                     if ln.strip().startswith("Version:")), "")

    # -- images and containers -----------------------------------------------

    def import_image(self, tarball: Path | str) -> str:
        """``ctr images import`` a docker-save archive; return the stored image name."""
        res = self.ctr("images", "import", "--snapshotter", self.snapshotter, str(tarball), timeout=120)
        names = [ln.split()[1] for ln in res.stdout.splitlines() if ln.startswith("unpacking ")]
        if not names:
            names = self.ctr("images", "ls", "-q").stdout.split()
        if not names:
            raise DaemonError(f"no image after import of {tarball}: {res.stdout}")
        return names[0]

    def run(
        self,
        image: str,
        cid: str,
        *cmd: str,
        mounts: Sequence[tuple[str, str, bool]] = (),
        extra: Sequence[str] = (),
    ) -> int:
        """``ctr run -d --null-io`` a container from ``image``; return its host PID.

        stdio is /dev/null (CRIU refuses host files as stdio). ``mounts`` are
        ``(host, container, readonly)`` bind mounts.
        """
        args = ["run", "-d", "--null-io", "--snapshotter", self.snapshotter]
        args += ["--runc-root", str(self.runc_root)]
        for host, dest, ro in mounts:
            args += ["--mount", f"type=bind,src={host},dst={dest},options=bind:{'ro' if ro else 'rw'}"]
        args += [*extra, image, cid, *cmd]
        self.ctr(*args)
        return self.task_pid(cid)

    def tasks(self) -> dict[str, tuple[int, str]]:
        """``{container id: (pid, status)}`` from ``ctr tasks ls``."""
        out: dict[str, tuple[int, str]] = {}
        res = self.ctr("tasks", "ls", check=False)
        for line in res.stdout.splitlines()[1:]:
            parts = line.split()
            if len(parts) >= 3:
                out[parts[0]] = (int(parts[1]), parts[2])
        return out

    def task_pid(self, cid: str) -> int:
        pid, status = self.tasks().get(cid, (0, "MISSING"))
        if status != "RUNNING" or pid <= 0:
            raise DaemonError(f"task {cid} is {status}\n{self.log_tail()}")
        return pid

    def checkpoint(
        self, cid: str, ref: str, *, rw: bool = False, image: bool = False
    ) -> subprocess.CompletedProcess[str]:
        """``ctr containers checkpoint --task ID REF``: checkpoint image REF, task left running."""
        args = ["containers", "checkpoint", "--task"]
        if rw:
            args.append("--rw")
        if image:
            args.append("--image")
        return self.ctr(*args, cid, ref, timeout=120)

    def task_checkpoint(
        self, cid: str, image_path: Path | str, work_path: Path | str, *, exit: bool = False
    ) -> subprocess.CompletedProcess[str]:
        """``ctr tasks checkpoint --image-path DIR --work-path DIR``: CRIU images and
        ``dump.log`` stay on disk (no checkpoint image in the content store, so
        ``ctr c restore`` cannot use it); the task keeps running unless ``exit``."""
        args = ["tasks", "checkpoint", "--image-path", str(image_path), "--work-path", str(work_path)]
        if exit:
            args.append("--exit")
        return self.ctr(*args, cid, timeout=120)

    def remove(self, cid: str, timeout: float = 15) -> None:
        """Kill the task (SIGKILL), delete it and the container; tolerate absence."""
        if self.tasks().get(cid, (0, ""))[1] == "CREATED":
            # Left by a restore that failed: containerd 1.6's `tasks delete
            # --force` hangs on it, a plain delete removes it.
            self.ctr("tasks", "delete", cid, check=False)
        if cid in self.tasks():
            self.ctr("tasks", "kill", "--all", "--signal", "SIGKILL", cid, check=False)
            deadline = time.monotonic() + timeout
            while self.tasks().get(cid, (0, "STOPPED"))[1] not in ("STOPPED", "UNKNOWN"):
                if time.monotonic() > deadline:
                    break
                time.sleep(0.05)
            self.ctr("tasks", "delete", "--force", cid, check=False)
        self.ctr("containers", "delete", cid, check=False)

    def restore(self, cid: str, ref: str, *, rw: bool = False) -> int:
        """``ctr containers restore --live ID REF`` (ID must not exist); return the new PID."""
        args = ["containers", "restore", "--live"]
        if rw:
            args.append("--rw")
        self.ctr(*args, cid, ref, timeout=120)
        return self.task_pid(cid)

    # -- teardown -------------------------------------------------------------

    def _remove_all(self) -> None:
        """SIGKILL and delete every task, then every container, in every namespace."""
        for ns in self.ctr("namespaces", "ls", "-q", check=False, timeout=10).stdout.split():
            cids = self.ctr("tasks", "ls", "-q", check=False, timeout=10, namespace=ns).stdout.split()
            for cid in cids:
                self.ctr(
                    "tasks", "kill", "--all", "-s", "SIGKILL", cid, check=False, timeout=10, namespace=ns
                )
            for cid in cids:
                for _ in range(40):
                    r = self.ctr("tasks", "delete", "--force", cid, check=False, timeout=10, namespace=ns)
                    if r.returncode == 0 or "not found" in r.stderr:
                        break
                    time.sleep(0.05)
            for cid in self.ctr(
                "containers", "ls", "-q", check=False, timeout=10, namespace=ns
            ).stdout.split():
                self.ctr("containers", "delete", cid, check=False, timeout=10, namespace=ns)

    def _bundle_pids(self, name: str) -> list[int]:
        pids = []
        for f in self.state.glob(f"io.containerd.runtime.v2.task/*/*/{name}"):
            with contextlib.suppress(OSError, ValueError):
                pids.append(int(f.read_text().strip()))
        return pids

    def stop(self) -> None:
        """Kill every task in every namespace, the shims, containerd; unmount leftovers.

        Safe to call more than once, and after a failed start.
        """
        if self.sock_dir is None:
            return
        if self.proc is not None and self.proc.poll() is None:
            with contextlib.suppress(DaemonError):  # hung containerd: kill by PID below
                self._remove_all()
        # Whatever survived (containerd dead, a delete failed): container inits
        # from the bundles' init.pid, shims by their `-address <our socket>`.
        leftovers = [p for p in self._bundle_pids("init.pid") if _pid_alive(p)]
        for pid in leftovers:
            _kill_pid(pid)
        _stop_process(self.proc)
        shims = pids_with_args("-address", self.address)
        for pid in shims:
            _kill_pid(pid)
        _wait_gone(leftovers + shims, 5)
        for state in self.runc_root.glob("*/*/state.json"):  # <runc root>/<namespace>/<id>
            with contextlib.suppress(subprocess.SubprocessError, OSError):
                subprocess.run([RUNC, "--root", str(state.parent.parent), "delete", "-f", state.parent.name],
                               capture_output=True, check=False, timeout=30)  # fmt: skip
        unmount_under([self.root, self.state, self.sock_dir])
        if self._logfh is not None:
            self._logfh.close()
            self._logfh = None
        self.proc = None
        shutil.rmtree(self.sock_dir, ignore_errors=True)
        self.sock_dir = None
        atexit.unregister(self.stop)


# --------------------------------------------------------------------------- dockerd


class Dockerd(_Daemon):
    """A private dockerd 20.10 (experimental) on its own containerd, data root and socket."""

    def __init__(
        self,
        tmpdir: Path | str,
        runtimes: Mapping[str, Path | str] | None = None,
        default_runtime: str | None = None,
        *,
        path_prefix: Path | str | None = None,
        start_timeout: float = 60,
        extra_config: Mapping[str, Any] | None = None,
        gc: Mapping[str, Any] | None = None,
        binaries: Binaries = PACKAGED,
    ) -> None:
        self.bins = binaries
        self.dir = Path(tmpdir)
        self.dir.mkdir(parents=True, exist_ok=True)
        self.data_root = self.dir / "data"
        self.config = self.dir / "daemon.json"
        self.log = self.dir / "dockerd.log"
        self.client_config = self.dir / "client"
        self.runtimes = {k: str(v) for k, v in (runtimes or {}).items()}
        self.default_runtime = default_runtime
        self.extra_config = dict(extra_config or {})
        self.start_timeout = start_timeout
        #: short /tmp/chkXXXX dir: exec-root, pidfile, API socket; made by start()
        self.short: Path | None = None
        self.containerd = Containerd(self.dir / "containerd", path_prefix=path_prefix,
                                     gc=gc, binaries=binaries)
        self.env = {**self.containerd.env, "DOCKER_CONFIG": str(self.client_config)}
        self.env.pop("TMPDIR", None)
        self.proc: subprocess.Popen[bytes] | None = None
        self._logfh: Any = None

    def _short(self) -> Path:
        if self.short is None:
            raise DaemonError("dockerd not started")
        return self.short

    @property
    def exec_root(self) -> Path:
        return self._short() / "x"

    @property
    def pidfile(self) -> Path:
        return self._short() / "docker.pid"

    @property
    def address(self) -> str:
        """dockerd's API socket."""
        return str(self._short() / "d.sock")

    @property
    def host(self) -> str:
        """``-H`` value for the docker client (``unix://...``)."""
        return f"unix://{self.address}"

    def write_config(self) -> Path:
        cfg: dict[str, Any] = {
            "experimental": True,
            "data-root": str(self.data_root),
            "exec-root": str(self.exec_root),
            "pidfile": str(self.pidfile),
            "hosts": [self.host],
            "containerd": self.containerd.address,
            "iptables": False,
            "ip-masq": False,
            "bridge": "none",
            "storage-driver": "overlay2",
            "log-level": "debug",
            "features": {"buildkit": False},
        }
        if self.runtimes:
            cfg["runtimes"] = {name: {"path": path} for name, path in self.runtimes.items()}
        if self.default_runtime:
            cfg["default-runtime"] = self.default_runtime
        cfg.update(self.extra_config)
        self.config.write_text(json.dumps(cfg, indent=2) + "\n")
        return self.config


    def _start(self) -> Dockerd:
        if self.short is None:
            self.short = _short_dir("chk")
            atexit.register(self.stop)
        self.containerd.start()
        for d in (self.data_root, self.exec_root, self.client_config):
            d.mkdir(parents=True, exist_ok=True)
        self.write_config()
        self._logfh = self.log.open("ab")
        self.proc = _launch([self.bins.dockerd, "--config-file", str(self.config)], self.env, self._logfh)

        def ready() -> bool:
            res = self.docker("version", "--format", "{{.Server.Version}}", check=False, timeout=10)
            return res.returncode == 0 and bool(res.stdout.strip())

        _wait_ready("dockerd", self.proc, self.address, ready, self.start_timeout,
                    self.log_tail, 0.2)
        return self

    def __enter__(self) -> Dockerd:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def log_tail(self, n: int = 30) -> str:
        return f"dockerd log {self.log} (tail):\n{tail(self.log, n)}\n{self.containerd.log_tail(15)}"

    def docker(self, *args: str, check: bool = True, timeout: float = 60) -> subprocess.CompletedProcess[str]:
        """Run docker.io's client against this daemon (stdin /dev/null, output captured).
        ``checkpoint create`` and ``start --checkpoint`` go through
        :meth:`_through_content_store`."""
        if _stores_checkpoint(args):
            return self._through_content_store(args, check, timeout)
        return self._docker(args, check, timeout)

    def _docker(self, args: Sequence[str], check: bool, timeout: float
                ) -> subprocess.CompletedProcess[str]:
        cmd = [self.bins.docker, "-H", self.host, *args]
        try:
            res = subprocess.run(
                cmd, env=self.env, stdin=subprocess.DEVNULL, capture_output=True, text=True,
                timeout=timeout, check=False,
            )  # fmt: skip
        except subprocess.TimeoutExpired as exc:
            msg = f"docker {' '.join(args)} timed out after {timeout}s"
            raise DaemonError(f"{msg}\n{self.log_tail()}") from exc
        if check and res.returncode != 0:
            msg = res.stderr.strip() or res.stdout.strip()
            raise DaemonError(f"docker {' '.join(args)} failed ({res.returncode}): {msg}\n{self.log_tail()}")
        return res

    def _through_content_store(self, args: Sequence[str], check: bool, timeout: float
                               ) -> subprocess.CompletedProcess[str]:
        """A command that passes a checkpoint through containerd's content store.

        dockerd 20.10 commits each blob with a bare ``Commit`` (no "already
        there is fine"), and deletes what it committed once done - but a
        deleted blob only leaves the store at containerd's next garbage
        collection, which a loaded machine delays. A checkpoint of the same
        container (its runtime spec is the same blob) or a start from the
        same checkpoint (the same tar) meanwhile fails "commit failed:
        content sha256:...: already exists" (moby/moby#42900).
        ``checkpoint create`` fails so only after CRIU has dumped (and, without
        ``--leave-running``, stopped) the container, so a retry cannot mend
        it: the store is waited for BEFORE each such command, until docker's
        namespace holds no blob and no ingest (it keeps nothing there between
        commands), bounded by CONTENT_SETTLE_S. A start that still meets the
        race is retried once the named blob is gone; a checkpoint only while
        its container still runs (nothing was lost)."""
        for attempt in range(1, CONTENT_ATTEMPTS + 1):
            self.settle_content()
            res = self._docker(args, False, timeout)
            race = CONTENT_RACE.search(res.stderr)
            if res.returncode == 0 or race is None or attempt == CONTENT_ATTEMPTS:
                break
            if args[0] == "checkpoint" and not self._running(_checkpoint_target(args)):
                break  # dumped and stopped: no retry can make this checkpoint again
            self.settle_content(race.group(1))
        if check and res.returncode != 0:
            msg = res.stderr.strip() or res.stdout.strip()
            raise DaemonError(f"docker {' '.join(args)} failed ({res.returncode}): {msg}\n{self.log_tail()}")
        return res

    def content(self) -> list[str]:
        """Digests and active ingest refs in docker's namespace of its containerd."""
        held = self.containerd.ctr("content", "ls", "-q", namespace=DOCKER_NAMESPACE, timeout=15)
        active = self.containerd.ctr("content", "active", namespace=DOCKER_NAMESPACE, timeout=15)
        ingests = [ln.split()[0] for ln in active.stdout.splitlines()[1:] if ln.strip()]
        return held.stdout.split() + ingests

    def settle_content(self, digest: str | None = None, timeout: float | None = None) -> bool:
        """Until docker's namespace of the content store holds nothing (with
        `digest`: not that blob), at most `timeout` (CONTENT_SETTLE_S); whether
        it settled (if not, the command runs anyway and says why it failed)."""
        deadline = time.monotonic() + (CONTENT_SETTLE_S if timeout is None else timeout)
        while True:
            with contextlib.suppress(DaemonError):
                left = self.content()
                if (digest not in left) if digest else not left:
                    return True
            if time.monotonic() >= deadline:
                return False
            time.sleep(0.1)

    def _running(self, cid: str | None) -> bool:
        if cid is None:
            return False
        res = self._docker(["inspect", "--type", "container", "--format", "{{.State.Running}}", cid],
                           False, 30)
        return res.returncode == 0 and res.stdout.strip() == "true"

    def start_checkpoint(self, cid: str, checkpoint: str, timeout: float = 120
                         ) -> subprocess.CompletedProcess[str]:
        """``docker start --checkpoint`` (through the content store: see
        :meth:`_through_content_store`)."""
        return self.docker("start", "--checkpoint", checkpoint, cid, timeout=timeout)

    def load_image(self, tarball: Path | str) -> str:
        """``docker load`` a docker-save archive; return the loaded name."""
        res = self.docker("load", "-i", str(tarball), timeout=120)
        for line in res.stdout.splitlines():
            if line.startswith("Loaded image: "):
                return line.split(": ", 1)[1].strip()
        raise DaemonError(f"docker load printed no image name: {res.stdout!r}")

    def inspect(self, cid: str) -> dict[str, Any]:
        return json.loads(self.docker("inspect", "--type", "container", cid).stdout)[0]

    def pid(self, cid: str) -> int:
        st = self.inspect(cid)["State"]
        if not st.get("Running") or not st.get("Pid"):
            raise DaemonError(f"container {cid} not running: {st}\n{self.log_tail()}")
        return int(st["Pid"])

    def stop(self) -> None:
        """Remove all containers, stop dockerd and its containerd; unmount leftovers.

        Safe to call more than once, and after a failed start.
        """
        if self.short is None:
            return
        if self.proc is not None and self.proc.poll() is None:
            with contextlib.suppress(DaemonError):  # a hung dockerd: kill it below
                ids = self.docker("ps", "-aq", check=False, timeout=20).stdout.split()
                if ids:
                    self.docker("rm", "-f", *ids, check=False, timeout=60)
        _stop_process(self.proc, timeout=20)
        self.proc = None
        self.containerd.stop()
        unmount_under([self.data_root, self.short])
        if self._logfh is not None:
            self._logfh.close()
            self._logfh = None
        shutil.rmtree(self.short, ignore_errors=True)
        self.short = None
        atexit.unregister(self.stop)
