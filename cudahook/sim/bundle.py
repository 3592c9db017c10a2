"""Build OCI bundles (``config.json`` + ``rootfs``) that runc can run, checkpoint
and restore with CRIU, for the end-to-end tests and the demo.

Two rootfs flavours:

* ``host_usr=True`` (default): the host's ``/usr`` and ``/etc`` are bind-mounted
  read-only and ``bin``, ``sbin``, ``lib``, ``lib64`` are symlinks into ``usr/``
  in the rootfs, so ``/usr/bin/python3`` and ``/usr/bin/busybox`` (Debian's
  busybox-static) both work inside the container. The host's ``/lib`` symlink
  itself must NOT be bind-mounted: CRIU's restore then fails with
  ``mnt-v2: Failed to move_mount ... Invalid argument``.
* ``host_usr=False``: a self-contained busybox-static rootfs (``/bin/busybox``
  plus a symlink per applet); no Python.

Container stdio must be ``/dev/null`` (or a pipe / a file inside the
container): a host file as stdio makes ``runc checkpoint`` fail. Run
``runc run -d`` with stdin/stdout/stderr = ``/dev/null`` and read runc's own
errors from ``runc --log FILE``.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from cudahook.platform import criu as criu_node

__all__ = [
    "CRIU_LINK_DIR",
    "CRIU_PREFIX_BIN",
    "DEFAULT_PATH",
    "Bind",
    "criu_version",
    "find_busybox",
    "find_criu",
    "make_bundle",
    "make_config",
    "runc_env",
]

DEFAULT_PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"
#: Wrapper written by ``scripts/provision-criu.sh`` (CRIU 4.1.1 from trixie).
CRIU_PREFIX_BIN = Path("/opt/cudahook/criu/bin/criu")
#: Where provision-criu.sh links ``criu`` so runc finds it on PATH.
CRIU_LINK_DIR = Path("/usr/local/sbin")

#: (host_path, container_path, readonly)
Bind = tuple[str, str, bool]

_CAPS = ["CAP_AUDIT_WRITE", "CAP_KILL", "CAP_NET_BIND_SERVICE"]
_USR_LINKS = ("bin", "sbin", "lib", "lib64")

_BASE_MOUNTS: list[dict[str, Any]] = [
    {"destination": "/proc", "type": "proc", "source": "proc"},
    {
        "destination": "/dev",
        "type": "tmpfs",
        "source": "tmpfs",
        "options": ["nosuid", "strictatime", "mode=755", "size=65536k"],
    },
    {
        "destination": "/dev/pts",
        "type": "devpts",
        "source": "devpts",
        "options": ["nosuid", "noexec", "newinstance", "ptmxmode=0666", "mode=0620", "gid=5"],
    },
    {
        "destination": "/dev/shm",
        "type": "tmpfs",
        "source": "shm",
        "options": ["nosuid", "noexec", "nodev", "mode=1777", "size=65536k"],
    },
    {
        "destination": "/dev/mqueue",
        "type": "mqueue",
        "source": "mqueue",
        "options": ["nosuid", "noexec", "nodev"],
    },
    {
        "destination": "/sys",
        "type": "sysfs",
        "source": "sysfs",
        "options": ["nosuid", "noexec", "nodev", "ro"],
    },
    {
        "destination": "/sys/fs/cgroup",
        "type": "cgroup",
        "source": "cgroup",
        "options": ["nosuid", "noexec", "nodev", "relatime", "ro"],
    },
]

_TMP_MOUNT: dict[str, Any] = {
    "destination": "/tmp",
    "type": "tmpfs",
    "source": "tmpfs",
    "options": ["nosuid", "nodev", "mode=1777", "size=65536k"],
}


def _bind_mount(host: str, dest: str, readonly: bool, recursive: bool = True) -> dict[str, Any]:
    return {
        "destination": dest,
        "type": "bind",
        "source": host,
        "options": ["rbind" if recursive else "bind", "ro" if readonly else "rw"],
    }


def make_config(
    args: Sequence[str],
    *,
    env: Sequence[str] | None = None,
    binds: Sequence[Bind] = (),
    cwd: str = "/",
    terminal: bool = False,
    hostname: str = "cudahook-test",
    annotations: Mapping[str, str] | None = None,
    own_netns: bool = True,
    host_usr: bool = True,
    readonly_root: bool = True,
    hooks: Mapping[str, Sequence[Mapping[str, Any]]] | None = None,
    devices: Sequence[Mapping[str, Any]] = (),
) -> dict[str, Any]:
    """Return a runtime-spec 1.0.2 ``config.json`` dict (shaped like ``runc spec``).

    ``devices``: ``linux.devices`` entries (``path``, ``type``, ``major``,
    ``minor``); the runtime creates each node and the device cgroup allows it.
    """
    if not args:
        raise ValueError("args must not be empty")
    mounts = [dict(m) for m in _BASE_MOUNTS]
    if host_usr:
        # Not recursive: whatever is mounted below the host's /usr or /etc
        # (an overlay, another tool's private view) is not the container's
        # business, and CRIU would have to dump and re-create it on restore.
        mounts.append(_bind_mount("/usr", "/usr", True, recursive=False))
        mounts.append(_bind_mount("/etc", "/etc", True, recursive=False))
    mounts.append(dict(_TMP_MOUNT))
    for host, dest, readonly in binds:
        if not os.path.isabs(host) or not os.path.isabs(dest):
            raise ValueError(f"bind paths must be absolute: {host!r} -> {dest!r}")
        mounts.append(_bind_mount(host, os.path.normpath(dest), readonly))

    namespaces = [{"type": t} for t in ("pid", "ipc", "uts", "mount")]
    if own_netns:
        namespaces.insert(1, {"type": "network"})

    config: dict[str, Any] = {
        "ociVersion": "1.0.2-dev",
        "process": {
            "terminal": terminal,
            "user": {"uid": 0, "gid": 0},
            "args": list(args),
            "env": list(env) if env is not None else [f"PATH={DEFAULT_PATH}", "HOME=/root"],
            "cwd": cwd,
            "capabilities": {k: list(_CAPS) for k in ("bounding", "effective", "permitted", "ambient")},
            "rlimits": [{"type": "RLIMIT_NOFILE", "hard": 1024, "soft": 1024}],
            "noNewPrivileges": True,
        },
        "root": {"path": "rootfs", "readonly": readonly_root},
        "hostname": hostname,
        "mounts": mounts,
        "linux": {
            "resources": {"devices": [{"allow": False, "access": "rwm"}]},
            "namespaces": namespaces,
            "maskedPaths": [
                "/proc/acpi",
                "/proc/asound",
                "/proc/kcore",
                "/proc/keys",
                "/proc/latency_stats",
                "/proc/timer_list",
                "/proc/timer_stats",
                "/proc/sched_debug",
                "/sys/firmware",
                "/proc/scsi",
            ],
            "readonlyPaths": ["/proc/bus", "/proc/fs", "/proc/irq", "/proc/sys", "/proc/sysrq-trigger"],
        },
    }
    if devices:
        config["linux"]["devices"] = [dict(d) for d in devices]
        config["linux"]["resources"]["devices"] += [
            {"allow": True, "type": d.get("type", "c"), "major": d["major"], "minor": d["minor"],
             "access": "rwm"} for d in devices]
    if annotations:
        config["annotations"] = dict(annotations)
    if hooks:
        config["hooks"] = {stage: [dict(h) for h in hs] for stage, hs in hooks.items()}
    return config


def find_busybox() -> Path:
    """Path of a static busybox on the host (Debian: busybox-static)."""
    for cand in (shutil.which("busybox"), "/usr/bin/busybox", "/bin/busybox"):
        if cand and os.access(cand, os.X_OK):
            return Path(cand)
    raise FileNotFoundError("busybox not found (apt-get install busybox-static)")


def _install_busybox(rootfs: Path) -> None:
    busybox = find_busybox()
    (rootfs / "bin").mkdir(parents=True, exist_ok=True)
    target = rootfs / "bin" / "busybox"
    if not target.exists():
        try:
            os.link(busybox, target)
        except OSError:
            shutil.copy2(busybox, target)
    listing = subprocess.run([str(busybox), "--list-full"], check=True, capture_output=True, text=True).stdout
    for rel in listing.split():
        link = rootfs / rel
        if rel == "bin/busybox" or link.exists() or link.is_symlink():
            continue
        link.parent.mkdir(parents=True, exist_ok=True)
        link.symlink_to("/bin/busybox")


def _under(path: str, parent: str) -> bool:
    return parent != "/" and (path == parent or path.startswith(parent.rstrip("/") + "/"))


def _make_mountpoints(rootfs: Path, config: Mapping[str, Any]) -> None:
    """Create each mount's target in the rootfs; an empty file for a file bind.

    Targets that lie under another mount (e.g. below /usr, /etc, /tmp) are left
    to runc: they live in that mount, not in the rootfs directory.
    """
    mounts = config["mounts"]
    for i, m in enumerate(mounts):
        dest = m["destination"]
        if any(_under(dest, o["destination"]) and dest != o["destination"] for o in mounts[:i]):
            continue
        target = rootfs / dest.lstrip("/")
        if target.is_symlink():
            raise ValueError(f"mount destination {dest} is a symlink in the rootfs")
        is_file = m.get("type") == "bind" and os.path.isfile(m["source"])
        if is_file:
            target.parent.mkdir(parents=True, exist_ok=True)
            target.touch(exist_ok=True)
        else:
            target.mkdir(parents=True, exist_ok=True)


def make_bundle(
    bundle_dir: Path | str,
    args: Sequence[str],
    *,
    binds: Sequence[Bind] = (),
    cwd: str = "/",
    host_usr: bool = True,
    **config: Any,
) -> Path:
    """Write ``bundle_dir/config.json`` and ``bundle_dir/rootfs``; return ``bundle_dir``.

    ``binds`` are ``(host_path, container_path, readonly)``; host paths must
    exist. With ``host_usr`` the container sees the host's /usr and /etc
    read-only (so ``/usr/bin/python3`` runs); otherwise the rootfs is busybox
    only. The other keywords are :func:`make_config`'s (``terminal=True``
    needs ``runc run --console-socket``).
    """
    bundle = Path(bundle_dir)
    for host, _dest, _ro in binds:
        if not os.path.exists(host):
            raise FileNotFoundError(f"bind source does not exist: {host}")
    config = make_config(args, binds=binds, cwd=cwd, host_usr=host_usr, **config)
    rootfs = bundle / "rootfs"
    rootfs.mkdir(parents=True, exist_ok=True)
    if host_usr:
        (rootfs / "usr").mkdir(exist_ok=True)
        (rootfs / "etc").mkdir(exist_ok=True)
        for name in _USR_LINKS:
            link = rootfs / name
            if not link.is_symlink():
                link.symlink_to(f"usr/{name}")
    else:
        _install_busybox(rootfs)
        (rootfs / "etc").mkdir(exist_ok=True)
    for name in ("proc", "sys", "dev", "tmp", "root", "run"):
        (rootfs / name).mkdir(exist_ok=True)
    if cwd != "/" and not any(_under(cwd, m["destination"]) for m in config["mounts"]):
        (rootfs / cwd.lstrip("/")).mkdir(parents=True, exist_ok=True)
    _make_mountpoints(rootfs, config)
    tmp = bundle / "config.json.tmp"
    tmp.write_text(json.dumps(config, indent=2) + "\n")
    tmp.replace(bundle / "config.json")
    return bundle


def criu_version(criu: Path | str) -> tuple[int, ...] | None:
    """``(major, minor[, sub])`` from ``criu --version``; None if it does not run."""
    try:
        out = subprocess.run(
            [str(criu), "--version"], check=False, capture_output=True, text=True, timeout=10
        ).stdout
    except (OSError, subprocess.SubprocessError):
        return None
    return criu_node.parse_version(out) or None


def find_criu(min_version: tuple[int, ...] = criu_node.MIN_VERSION) -> Path | None:
    """First ``criu`` at least ``min_version``: $CUDAHOOK_CRIU, then PATH, then
    the prefix install.sh --with-criu provides."""
    seen: set[str] = set()
    for cand in (os.environ.get("CUDAHOOK_CRIU"), shutil.which("criu"),
                 str(CRIU_LINK_DIR / "criu"), str(CRIU_PREFIX_BIN)):
        if not cand or cand in seen or not os.access(cand, os.X_OK):
            continue
        seen.add(cand)
        version = criu_version(cand)
        if version is not None and version >= min_version:
            return Path(cand)
    return None


def runc_env(criu: Path | str | None = None, base: Mapping[str, str] | None = None) -> dict[str, str]:
    """Environment for running runc so that it finds ``criu`` on PATH.

    ``criu`` defaults to :func:`find_criu`; its directory is put first on PATH.
    (Alternatively pass ``runc --criu PATH``.)
    """
    env = dict(os.environ if base is None else base)
    path = env.get("PATH") or DEFAULT_PATH
    if criu is None:
        criu = find_criu()
    if criu is not None:
        path = f"{Path(criu).parent}:{path}"
    env["PATH"] = path
    return env
