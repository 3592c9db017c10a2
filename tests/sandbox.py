"""Keep the test suite off the node: a private view of the node's paths, and
a guard that proves nothing outside it changed.

Two layers:

- `CUDAHOOK_ROOT` points at a session directory, so everything cudahook reads
  or writes by default (configuration, state, marks, log, install paths)
  lands there - as root or not.
- As root, the whole session runs in a private mount namespace in which the
  node directories that runc, CRIU, install.sh and the runtimes use at fixed
  paths (`/etc`, `/opt`, `/usr/local`, `/var/lib`, `/var/log`, `/run`,
  the containers hooks.d) are overlays: the node's files are readable below,
  every write lands in a private upper layer, and cudahook's own node files
  (an install of the user's, its registrations and state) are hidden, so the
  suite sees a node without cudahook. Child processes (runc, CRIU, private
  containerd and dockerd) inherit the namespace.

`snapshot` digests the watched node paths; the session compares a digest
taken in the node's own mount namespace before and after the suite. It
watches what only an install or a registration changes (cudahook's
installation, configuration, journal, the registrations in runc.conf,
hooks.d, docker and containerd): the node's own cudahook changes its live
state (`/run/cudahook`, the marks, its log) whenever a container on the node
is checkpointed, suite or no suite (another session's suite, whose
sandbox failed it, included). There the guard looks for this session's
traces instead (`traces`): a file that names this session's own temporary
directories (its sandbox, pytest's base directory) was written by it.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import hashlib
import json
import os
import shutil
import stat
import subprocess
import sys
import tempfile
from pathlib import Path

# Directories overlaid (writes go private), when they exist on the node.
OVERLAID = ("/etc", "/opt", "/usr/local", "/usr/share/containers", "/var/lib", "/var/log",
            "/var/cache/cudahook", "/run")

# cudahook's own node files and the registrations pointing at them: hidden in
# the sandbox (the suite starts from a node without cudahook) and watched.
HIDDEN = (
    "/etc/cudahook", "/opt/cudahook", "/var/lib/cudahook", "/run/cudahook",
    "/run/cudahook-marks", "/etc/criu", "/etc/logrotate.d/cudahook",
    "/etc/systemd/system/containerd.service.d/50-cudahook.conf",
    "/usr/share/containers/oci/hooks.d/50-cudahook-create.json",
    "/usr/share/containers/oci/hooks.d/50-cudahook-poststop.json",
    "/etc/docker/daemon.json", "/usr/local/sbin/criu",
)
HIDDEN_GLOBS = (("/usr/local/bin", "cudahook*"), ("/var/log", "cudahook.log*"))

# The node's cudahook's live state: it changes whenever a container on the
# node is checkpointed or restored, so no change of it is the suite's by
# itself; `traces` tells the suite's writes there apart.
LIVE = ("/run/cudahook", "/run/cudahook-marks")
LIVE_GLOBS = (("/var/log", "cudahook.log*"),)
# Watched for any change: cudahook's installation and registrations;
# storage directories only by their entries' names (their contents are the
# node's daemons' business and may change by themselves).
WATCHED = tuple(p for p in HIDDEN if p not in LIVE)
WATCHED_GLOBS = tuple(g for g in HIDDEN_GLOBS if g not in LIVE_GLOBS)
# Live-state files read for traces at most this large.
TRACE_READ_MAX = 1 << 20
STORAGE = ("/var/lib/docker", "/var/lib/containerd", "/var/lib/containers",
           "/run/containerd", "/run/docker", "/run/containers")

CLONE_NEWNS = 0x00020000
MS_REC = 0x4000
MS_PRIVATE = 1 << 18


def _entry(path: Path) -> list[object]:
    st = os.lstat(path)
    kind = stat.S_IFMT(st.st_mode)
    out: list[object] = [kind, stat.S_IMODE(st.st_mode), st.st_uid]
    if stat.S_ISLNK(st.st_mode):
        out.append(os.readlink(path))
    elif stat.S_ISREG(st.st_mode):
        out.append(st.st_size)
        if st.st_size <= 1 << 20:
            out.append(hashlib.sha256(path.read_bytes()).hexdigest())
        else:
            out.append(st.st_mtime_ns)
    return out


def _walk(path: Path, out: dict[str, object], limit: int = 20000) -> None:
    if not os.path.lexists(path):
        return
    out[str(path)] = _entry(path)
    if path.is_dir() and not path.is_symlink():
        for dirpath, dirnames, filenames in os.walk(path):
            for name in dirnames + filenames:
                if len(out) > limit:
                    out["(truncated)"] = True
                    return
                p = Path(dirpath, name)
                out[str(p)] = _entry(p)


def snapshot(base: str = "/") -> dict[str, object]:
    """A digest of the watched node paths under `base` (the node: "/")."""
    root = Path(base)
    out: dict[str, object] = {}
    for p in WATCHED:
        _walk(root / p.lstrip("/"), out)
    for d, pattern in WATCHED_GLOBS:
        for p in sorted((root / d.lstrip("/")).glob(pattern)):
            _walk(p, out)
    for d in STORAGE:
        p = root / d.lstrip("/")
        if p.is_dir():
            out[f"{p}/*"] = sorted(os.listdir(p))
    return out


def traces(base: str, needles: list[str]) -> list[str]:
    """The node's live-state files under `base` that name one of `needles`
    (a session's own temporary directories): written by that session, not by
    the node's own cudahook, whose state names the node's containers."""
    root = Path(base)
    paths: list[Path] = [root / p.lstrip("/") for p in LIVE]
    for d, pattern in LIVE_GLOBS:
        paths += sorted((root / d.lstrip("/")).glob(pattern))
    found = []
    wanted = [n.encode() for n in needles]
    for top in paths:
        if not os.path.lexists(top):
            continue
        files = [top] if not top.is_dir() or top.is_symlink() else [
            Path(d, f) for d, _, names in os.walk(top) for f in names]
        for f in files:
            try:
                st = os.lstat(f)
                if stat.S_ISLNK(st.st_mode):
                    data = os.readlink(f).encode()
                elif stat.S_ISREG(st.st_mode):
                    with open(f, "rb") as fh:
                        data = fh.read(TRACE_READ_MAX)
                else:
                    continue
            except OSError:
                continue
            if any(n in data for n in wanted):
                found.append(f"the suite wrote {f}")
    return found


def diff(before: dict[str, object], after: dict[str, object]) -> list[str]:
    lines = []
    for k in sorted(set(before) | set(after)):
        if k not in after:
            lines.append(f"removed {k}")
        elif k not in before:
            lines.append(f"created {k}")
        elif before[k] != after[k]:
            lines.append(f"changed {k}")
    return lines


def _libc() -> ctypes.CDLL:
    return ctypes.CDLL(ctypes.util.find_library("c"), use_errno=True)


def _mount(src: str, target: str, fstype: str | None, flags: int, data: str | None) -> None:
    libc = _libc()
    if libc.mount(src.encode() if src else None, target.encode(),
                  fstype.encode() if fstype else None, ctypes.c_ulong(flags),
                  data.encode() if data else None) != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"mount {fstype or ''} {src} on {target}: {os.strerror(err)}")


class Sandbox:
    """The session's private view of the node (see the module docstring)."""

    def __init__(self, node: str = "/") -> None:
        #: the node's root: "/" for the real node (a directory in the
        #: guard's own tests)
        self.node = node
        self.dir = Path(tempfile.mkdtemp(prefix="cudahook-suite-"))
        self.root = self.dir / "root"
        self.root.mkdir()
        self.private = False
        self._ns_fd: int | None = None
        self.before: dict[str, object] | None = None

    # -- the guard -------------------------------------------------------------

    def _node_snapshot(self) -> dict[str, object]:
        """The snapshot as the node sees it, from outside our namespace."""
        return self._in_node("snapshot", self.node)  # type: ignore[no-any-return]

    def _in_node(self, name: str, *args: object) -> object:
        """tests.sandbox.`name`(*args), run where the node's own mounts are seen."""
        if self._ns_fd is None:
            return globals()[name](*args)
        code = ("import json, sys; sys.path.insert(0, sys.argv[1]); import tests.sandbox as s; "
                "print(json.dumps(getattr(s, sys.argv[2])(*json.loads(sys.argv[3]))))")
        r = subprocess.run(
            ["nsenter", f"--mount=/proc/{os.getpid()}/fd/{self._ns_fd}",
             sys.executable, "-I", "-c", code, str(Path(__file__).resolve().parents[1]),
             name, json.dumps(args)],
            capture_output=True, text=True, timeout=120, pass_fds=(self._ns_fd,))
        if r.returncode != 0:
            raise RuntimeError(f"node {name} failed: {r.stderr.strip()}")
        return json.loads(r.stdout)

    def watch(self) -> None:
        """Take the node's snapshot the session's changes are measured from."""
        self.before = self._node_snapshot()

    def changes(self, own: tuple[str, ...] = ()) -> list[str]:
        """What changed in the node's installation and registrations since
        `watch`, and this session's traces in its live state: files naming
        its sandbox directory or one of `own` (more directories only it
        uses, such as pytest's base directory of this run)."""
        assert self.before is not None
        needles = [os.path.join(d, "") for d in (str(self.dir), *own)]
        return (diff(self.before, self._node_snapshot())
                + self._in_node("traces", self.node, needles))  # type: ignore[operator]

    # -- the private view -------------------------------------------------------

    def enter(self) -> None:
        os.environ["CUDAHOOK_ROOT"] = str(self.root)
        if os.geteuid() == 0 and shutil.which("nsenter") and self._overlay_works():
            self._ns_fd = os.open("/proc/self/ns/mnt", os.O_RDONLY)
            self.watch()
            self._unshare()
            self.private = True
        else:
            self.watch()

    @staticmethod
    def _overlay_works() -> bool:
        try:
            with open("/proc/filesystems") as f:
                return any(line.split()[-1] == "overlay" for line in f if line.strip())
        except OSError:
            return False

    def _unshare(self) -> None:
        libc = _libc()
        if libc.unshare(CLONE_NEWNS) != 0:
            err = ctypes.get_errno()
            raise OSError(err, f"unshare(CLONE_NEWNS): {os.strerror(err)}")
        _mount("", "/", None, MS_REC | MS_PRIVATE, None)
        layers = self.dir / "layers"
        layers.mkdir()
        # Upper layers on a tmpfs of our own: whiteouts need xattrs, and
        # nothing of the suite's private writes ever reaches the node's disk.
        _mount("tmpfs", str(layers), "tmpfs", 0, "mode=0700")
        for i, d in enumerate(OVERLAID):
            if not os.path.isdir(d) or os.path.islink(d):
                continue
            upper, work = layers / f"{i}-upper", layers / f"{i}-work"
            upper.mkdir()
            work.mkdir()
            _mount("overlay", d, "overlay", 0,
                   f"lowerdir={d},upperdir={upper},workdir={work}")
        # The suite starts from a node without cudahook (whiteouts, private).
        for p in HIDDEN:
            _remove(Path(p))
        for d, pattern in HIDDEN_GLOBS:
            for p in Path(d).glob(pattern):
                _remove(p)

    def close(self) -> None:
        if self._ns_fd is not None:
            os.close(self._ns_fd)
        if not self.private:
            shutil.rmtree(self.dir, ignore_errors=True)
        # In the namespace the directory holds the overlay mounts' layers;
        # it goes with the namespace (a tmpfs), its skeleton with the tmp dir.


def _remove(p: Path) -> None:
    if p.is_dir() and not p.is_symlink():
        shutil.rmtree(p, ignore_errors=True)
    elif os.path.lexists(p):
        p.unlink()
