"""Simulated CUDA workloads through the real runtimes, with cudahook installed by
install.sh into a fresh prefix: containerd 1.6 (``ctr``, the wrapper first on
the shim's PATH) and docker 20.10 (experimental, ``--runtime cudahook``).

Both runtimes pause the container before ``runc checkpoint``; cudahook's
action script thaws it for the CUDA phase and its guardian puts the workloads
back on the GPU after a ``--leave-running`` dump. The workloads' status files
(written through the lab root bound into the container) tell whether they
went on, restored from the right point, with their GPU memory intact.

Skipped unless root with runc, CRIU >= 4.0, containerd/ctr/dockerd/docker.io
(scripts/provision-criu.sh, scripts/provision-runtimes.sh), and unless no
cudahook installation is journaled on this machine (uninstalling ours would
revert it too).
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import shlex
import shutil
import stat
import subprocess
import threading
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import yaml

from cudahook.admin.journal import Journal
from cudahook.platform.store import Store, container_key
from cudahook.sim.lab import SimLab, workload_argv
from cudahook.sim.runcbox import guest_binds, guest_env

from .conftest import needs_runc, private_node, real_node_env
from .daemons import (
    CONTAINERD,
    CTR,
    DOCKER,
    DOCKERD,
    RUNC,
    SHIM,
    Containerd,
    Dockerd,
    image_tar,
)
from .outcomes import process_tree, still_alive

REPO = Path(__file__).resolve().parents[2]
JOURNAL = Path("/var/lib/cudahook/journal.json")
CONFIG = Path("/etc/cudahook/config.yaml")
DAEMON_JSON = Path("/etc/docker/daemon.json")
_MISSING = [b for b in (CONTAINERD, CTR, SHIM, DOCKERD, DOCKER, RUNC) if not os.access(b, os.X_OK)]

pytestmark = [
    *needs_runc,
    private_node,
    pytest.mark.skipif(
        bool(_MISSING), reason=f"missing {', '.join(_MISSING)} (scripts/provision-runtimes.sh)"
    ),
    pytest.mark.skipif(bool(Journal.all("/")), reason="cudahook is installed here"),
]

# The files install.sh (and its configure steps) may touch outside the prefix.
WATCHED = [
    "/etc/criu/runc.conf", str(DAEMON_JSON), str(CONFIG),
    "/etc/systemd/system/containerd.service.d/50-cudahook.conf",
    "/usr/share/containers/oci/hooks.d/50-cudahook-create.json",
    "/usr/share/containers/oci/hooks.d/50-cudahook-poststop.json",
    "/usr/local/bin/cudahook", "/usr/local/bin/cudahook-sim", "/usr/local/bin/cudahook-runtime",
    str(JOURNAL), "/etc/logrotate.d/cudahook",
]

WORKLOADS = [("solo", {"mib": 4}), ("mp", {"mib": 2, "procs": 2})]
OTHERS = ["sleep 100000"]  # not a CUDA process, beside the workloads
RATE = 50  # steps per second a workload can at most make (20 ms sleep per step)
IMAGE = "cudahook/python-host:test"


# -- the machine's /etc, as test_install.py keeps it ----------------------------


Snapshot = dict[str, tuple[str, bytes, int] | None]


def snapshot() -> Snapshot:
    out: Snapshot = {}
    for p in WATCHED:
        path = Path(p)
        if path.is_symlink():
            out[p] = ("link", os.readlink(path).encode(), 0)
        elif path.exists():
            out[p] = ("file", path.read_bytes(), stat.S_IMODE(path.stat().st_mode))
        else:
            out[p] = None
    return out


def put_back(snap: Snapshot, absent_dirs: list[Path]) -> None:
    """Leave every watched file (and directory) as the test found it."""
    for p, v in snap.items():
        path = Path(p)
        if path.is_symlink() or path.exists():
            path.unlink()
        if v is None:
            continue
        path.parent.mkdir(parents=True, exist_ok=True)
        kind, data, mode = v
        if kind == "link":
            path.symlink_to(data.decode())
        else:
            path.write_bytes(data)
            os.chmod(path, mode)
    for d in sorted(absent_dirs, key=lambda d: -len(d.parts)):  # deepest first
        if d.is_dir():
            with contextlib.suppress(OSError):  # not empty: someone else's now
                d.rmdir()


def missing_dirs() -> list[Path]:
    """Parents of the watched files that do not exist now (to remove again)."""
    out: set[Path] = set()
    for p in WATCHED:
        d = Path(p).parent
        while not d.exists():
            out.add(d)
            d = d.parent
    return sorted(out)


def sh(*args: str, timeout: float = 300) -> subprocess.CompletedProcess[str]:
    return subprocess.run(list(args), capture_output=True, text=True, timeout=timeout,
                          env=real_node_env(),
                          stdin=subprocess.DEVNULL)


@dataclass
class Node:
    prefix: Path
    lab: SimLab
    tmp: Path

    @property
    def libexec(self) -> Path:
        return self.prefix / "libexec"

    @property
    def state_dir(self) -> Path:
        return Path(self.lab.settings().state_dir)

    @property
    def log_file(self) -> Path:
        return Path(self.lab.settings().log_file)

    # -- cudahook's log ------------------------------------------------------

    def events(self, cid: str | None, name: str | None = None) -> list[dict[str, Any]]:
        """The log's events of container `cid` (None: those that name no container)."""
        if not self.log_file.exists():
            return []
        lines = [json.loads(x) for x in self.log_file.read_text().splitlines() if x.strip()]
        return [e for e in lines if e.get("container") == cid and name in (None, e["event"])]

    def wait_event(self, cid: str, name: str, pred: Any = lambda e: True,
                   count: int = 1, timeout: float = 20) -> list[dict[str, Any]]:
        deadline = time.monotonic() + timeout
        while True:
            hits = [e for e in self.events(cid, name) if pred(e)]
            if len(hits) >= count:
                return hits
            assert time.monotonic() < deadline, f"no {count} {name} event(s): {self.events(cid)}"
            time.sleep(0.05)

    def assert_no_errors(self, cid: str) -> None:
        events = self.events(cid) + self.events(None)
        bad = [e for e in events if e.get("error") or e.get("warning")]
        assert not bad, bad

    # -- the workloads ---------------------------------------------------------

    def counters(self, tags: list[str]) -> dict[str, int]:
        return {t: self.lab.status(t).get("counter", 0) for t in tags}

    def wait_running(self, tags: list[str], since: dict[str, int] | None = None,
                     steps: int = 11, timeout: float = 20) -> dict[str, int]:
        """Each workload advanced `steps` past `since`, memory intact, no errors."""
        for t in tags:
            st = self.lab.wait_counter(t, (since or {}).get(t, 0) + steps, timeout=timeout)
            assert st["intact"] and st["errors"] == [] and st["state"] == "running", st
        return self.counters(tags)

    def frozen(self, tags: list[str], tree: dict[int, int]) -> dict[str, int]:
        """After a dump (not --leave-running): every process of the
        container (`tree`, taken before the dump) is gone, so nothing runs
        on from the checkpoint. The counters the workloads last reported."""
        alive = still_alive(tree)
        assert not alive, f"processes still alive after the dump: {alive}"
        return self.counters(tags)

    def resumed(self, tags: list[str]) -> FirstReports:
        """Watch, from now on, for each workload's first report (of a restore)."""
        return FirstReports(self.lab, tags)


class FirstReports:
    """Polls the workloads' status files in a thread, from before a restore on,
    for each one's first report written after the restore began, and how far
    apart its polls were at most (`gap`). A workload makes at most RATE steps
    a second, so the value first seen is at most 1 + RATE * gap steps past
    the first one the restored workload reported."""

    def __init__(self, lab: SimLab, tags: list[str]):
        self.lab, self.tags = lab, tags
        self.t0 = time.time()
        self.first: dict[str, int] = {}
        self.gap = 0.0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._poll, daemon=True)
        self._thread.start()

    def _poll(self) -> None:
        last = time.monotonic()
        while not self._stop.is_set() and len(self.first) < len(self.tags):
            for t in self.tags:
                st = self.lab.status(t)
                if t not in self.first and st.get("time", 0) > self.t0:
                    self.first[t] = st["counter"]
            now = time.monotonic()
            self.gap, last = max(self.gap, now - last), now
            time.sleep(0.002)

    def __enter__(self) -> FirstReports:
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(5)

    def assert_from(self, low: dict[str, int], high: dict[str, int], timeout: float = 20) -> dict[str, int]:
        """Restored from a checkpoint taken while the reports showed [low, high]:
        the first value reported is above `low` and at most a step past `high`,
        plus what the polling may have missed. Returns the first values."""
        self._thread.join(timeout)
        assert len(self.first) == len(self.tags), f"no report after the restore: {self.first}"
        slack = 2 + math.ceil(RATE * self.gap)
        for t, v in self.first.items():
            assert low[t] < v <= high[t] + slack, (t, v, low[t], high[t], slack)
        return self.first


@contextlib.contextmanager
def installed_node(tmp: Path, *runtimes: str) -> Iterator[Node]:
    """cudahook installed by install.sh with `runtimes` registered, its
    configuration pointing at a simulated GPU node in `tmp`; all undone
    afterwards (uninstalled, and the node's files put back as they were)."""
    if Journal.all("/"):  # installed since collection (another test run?)
        pytest.skip("cudahook is installed here")
    snap, absent = snapshot(), missing_dirs()
    prefix = tmp / "opt"
    lab: SimLab | None = None
    installed: bytes | None = None
    try:
        r = sh(str(REPO / "install.sh"), "--prefix", str(prefix),
               *(a for rt in runtimes for a in ("--runtime", rt)))
        assert r.returncode == 0, r.stdout + r.stderr
        installed = CONFIG.read_bytes()
        lab = SimLab(tmp / "node")
        lab.start()
        CONFIG.write_text(yaml.safe_dump(dict(lab.settings().__dict__)))
        yield Node(prefix, lab, tmp)
    finally:
        try:
            if lab is not None:
                lab.stop()
            if installed is not None:
                CONFIG.write_bytes(installed)  # the journal's after_sha must match
            if prefix.exists() or JOURNAL.exists():
                sh(str(REPO / "install.sh"), "--prefix", str(prefix), "--uninstall")
        finally:
            put_back(snap, absent)
            shutil.rmtree(prefix, ignore_errors=True)


@contextlib.contextmanager
def gpu_memory(node: Node, path: str) -> Iterator[None]:
    """The installed node's configuration with `gpu_memory: path` (the
    driver-API backend, on a CUDA 13.4 driver: the one with custom storage)
    while it lasts; the configuration and driver as they were afterwards."""
    before, cuda = CONFIG.read_bytes(), node.lab.config.get("cuda_version", 0)
    node.lab.set(cuda_version=13040)
    settings = node.lab.settings(backend="driver-api", gpu_memory=path)
    CONFIG.write_text(yaml.safe_dump(dict(settings.__dict__)))
    try:
        yield
    finally:
        CONFIG.write_bytes(before)
        node.lab.set(cuda_version=cuda)


@pytest.fixture(scope="module")
def node(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Node]:
    """containerd and docker registered."""
    with installed_node(tmp_path_factory.mktemp("runtimes"), "containerd", "docker") as n:
        yield n


# -- a GPU container's image, mounts and environment -----------------------------


def python_rootfs(dest: Path) -> Path:
    """A rootfs that runs the host's python once /usr and /etc are bound in."""
    for name in ("usr", "etc", "dev", "proc", "sys", "tmp", "root", "run", "opt"):
        (dest / name).mkdir(parents=True, exist_ok=True)
    (dest / "tmp").chmod(0o1777)
    for name in ("bin", "sbin", "lib", "lib64"):
        (dest / name).symlink_to(f"usr/{name}")
    return dest


@pytest.fixture(scope="module")
def image(tmp_path_factory: pytest.TempPathFactory) -> Path:
    d = tmp_path_factory.mktemp("image")
    return image_tar(d / "python-host.tar", python_rootfs(d / "rootfs"), name=IMAGE,
                     cmd=("/bin/sh",))


def workload_script(prefix: str, workloads: list[tuple[str, dict[str, Any]]] = WORKLOADS
                    ) -> tuple[list[str], list[str]]:
    """A GPU container's command, as RuncBox's bundles have it: each workload
    (tagged <prefix>-<name>) and OTHERS in the background of one shell that
    waits for them. With the workloads' tags (a workload of N processes
    reports as tag.0 .. tag.N-1)."""
    cmds, tags = [], []
    for name, opts in workloads:
        tag = f"{prefix}-{name}"
        cmds.append(shlex.join(workload_argv("/usr/bin/python3", tag, **opts)))
        procs = int(opts.get("procs", 1))
        tags += [tag] if procs == 1 else [f"{tag}.{i}" for i in range(procs)]
    script = " ".join(f"{c} &" for c in [*cmds, *OTHERS]) + " wait"
    return ["/bin/sh", "-c", script], tags


@dataclass
class GpuSpec:
    cmd: list[str]
    env: list[str]
    binds: list[tuple[str, str, bool]]
    tags: list[str]

    def env_on(self, gpu: str) -> list[str]:
        """The environment, naming GPU `gpu` instead."""
        return [f"NVIDIA_VISIBLE_DEVICES={gpu}" if e.startswith("NVIDIA_VISIBLE") else e
                for e in self.env]

    def docker_args(self, env: list[str] | None = None) -> list[str]:
        """`docker run` / `docker create` options: cudahook's runtime, the
        binds (not recursive, as RuncBox's) and the environment (`env`
        instead, given one)."""
        args = ["--runtime", "cudahook", "--network", "none"]
        for host, dest, ro in self.binds:
            args += ["--mount", f"type=bind,source={host},target={dest},bind-nonrecursive=true"
                     + (",readonly" if ro else "")]
        return args + [x for e in (self.env if env is None else env) for x in ("-e", e)]


def gpu_spec(lab: SimLab, prefix: str,
             workloads: list[tuple[str, dict[str, Any]]] = WORKLOADS) -> GpuSpec:
    """What RuncBox puts in a GPU container, for a runtime's command line."""
    cmd, tags = workload_script(prefix, workloads)
    binds = [("/usr", "/usr", True), ("/etc", "/etc", True), *guest_binds(lab)]
    return GpuSpec(cmd, guest_env(lab.uuids[:1]), binds, tags)


def comms_in_pidns(init_pid: int) -> list[str]:
    """Command names of the processes in the PID namespace of `init_pid`."""
    ns = os.readlink(f"/proc/{init_pid}/ns/pid")
    out = []
    for entry in os.scandir("/proc"):
        if not entry.name.isdigit():
            continue
        try:
            if os.readlink(f"{entry.path}/ns/pid") == ns:
                out.append(Path(entry.path, "comm").read_text().strip())
        except OSError:
            continue
    return out


def assert_hooked(node: Node, cid: str, bundle: Path, pid: int) -> None:
    """The wrapper added the OCI hooks, and the hook recorded the container."""
    hooks = json.loads((bundle / "config.json").read_text()).get("hooks", {})
    want = str(node.libexec / "cudahook-oci-hook")
    for stage in ("createRuntime", "poststop"):
        assert [h["path"] for h in hooks.get(stage, [])] == [want], hooks
    record = Store(node.state_dir).load(container_key(cid, str(bundle)))
    assert record is not None and record["pid"] == pid and record["visible"] == node.lab.uuids[:1], record
    assert "sleep" in comms_in_pidns(pid)


# -- containerd 1.6 + ctr ----------------------------------------------------------


def run_gpu_task(node: Node, c: Containerd, image: Path, spec: GpuSpec, cid: str) -> tuple[int, Path]:
    """Import the image, run `spec` as task `cid` through the wrapper, wait
    for its workloads and check it was hooked: the task's PID and bundle."""
    name = c.import_image(image)
    extra = [a for e in spec.env for a in ("--env", e)]
    pid = c.run(name, cid, *spec.cmd, mounts=spec.binds, extra=extra)
    node.wait_running(spec.tags, steps=3)
    bundle = c.state / "io.containerd.runtime.v2.task" / c.namespace / cid
    assert_hooked(node, cid, bundle, pid)
    return pid, bundle


def test_containerd_ctr_checkpoint_and_restore(node: Node, image: Path, tmp_path: Path) -> None:
    shim_path = node.libexec / "runc-path"
    assert os.readlink(shim_path / "runc") == str(node.libexec / "cudahook-runtime")
    spec = gpu_spec(node.lab, "ctr")
    tags, cid, ref = spec.tags, f"gpu-{uuid.uuid4().hex[:8]}", "cudahook/gpu-checkpoint:1"
    with Containerd(tmp_path / "containerd", path_prefix=shim_path) as c:
        pid, bundle = run_gpu_task(node, c, image, spec, cid)

        # Checkpoint, leaving the task running: the guardian puts the
        # workloads back on the GPU once containerd resumes the task.
        before = node.counters(tags)
        c.checkpoint(cid, ref)
        after = node.counters(tags)
        assert ref in c.ctr("images", "ls", "-q").stdout.split()
        assert c.task_pid(cid) == pid
        node.wait_event(cid, "guardian", lambda e: "resumed" in e.get("outcome", ""))
        node.wait_running(tags, after, steps=25)
        (ckpt,) = node.events(cid, "checkpoint")
        assert sorted(ckpt["nspids"]) == sorted(node.lab.status(t)["pid"] for t in tags)

        # Replace the task with the checkpoint: counters go back to its values.
        c.remove(cid)
        assert cid not in c.tasks()
        last = node.counters(tags)
        with node.resumed(tags) as reports:
            new_pid = c.restore(cid, ref)
            first = reports.assert_from(before, after)
        assert new_pid != pid
        assert all(first[t] < last[t] for t in tags), (first, last)
        node.wait_running(tags, first)
        (restore,) = node.wait_event(cid, "restore")
        assert len(restore["pids"]) == len(tags)
        node.wait_event(cid, "post-restore")
        assert_hooked(node, cid, bundle, new_pid)
        node.assert_no_errors(cid)
        c.remove(cid)


def test_containerd_with_gpu_only_criu_registration(node: Node, image: Path,
                                                    tmp_path: Path) -> None:
    """gpu-only through containerd's shim: the wrapper gives the GPU container
    its own CRIU configuration (runc.conf names no script), and its
    checkpoint and restore run the action script from there."""
    cudahook = str(node.prefix / "venv" / "bin" / "cudahook")
    conf = Path("/etc/criu/runc.conf")
    before = conf.read_bytes()
    script = str(node.libexec / "cudahook-criu-action")
    r = sh(cudahook, "configure", "--runtime", "containerd", "--criu-registration", "gpu-only")
    assert r.returncode == 0, r.stdout + r.stderr
    try:
        assert f"action-script {script}" not in conf.read_text().splitlines()
        shim_path = node.libexec / "runc-path"
        spec = gpu_spec(node.lab, "go")
        tags, cid, ref = spec.tags, f"gpu-{uuid.uuid4().hex[:8]}", "cudahook/gpu-only:1"
        with Containerd(tmp_path / "containerd", path_prefix=shim_path) as c:
            _, bundle = run_gpu_task(node, c, image, spec, cid)
            copy = node.state_dir / "criu" / f"{container_key(cid, str(bundle))}.conf"
            notes = json.loads((bundle / "config.json").read_text())["annotations"]
            assert notes["org.criu.config"] == str(copy)
            assert f"action-script {script}" in copy.read_text().splitlines()

            before_ckpt = node.counters(tags)
            c.checkpoint(cid, ref)
            after = node.counters(tags)
            node.wait_event(cid, "guardian", lambda e: "resumed" in e.get("outcome", ""))
            node.wait_running(tags, after, steps=25)
            (ckpt,) = node.events(cid, "checkpoint")
            assert sorted(ckpt["nspids"]) == sorted(node.lab.status(t)["pid"] for t in tags)

            c.remove(cid)
            assert not copy.exists()  # poststop removed it with the task
            with node.resumed(tags) as reports:
                new_pid = c.restore(cid, ref)
                first = reports.assert_from(before_ckpt, after)
            node.wait_running(tags, first)
            (restore,) = node.wait_event(cid, "restore")
            assert len(restore["pids"]) == len(tags)
            assert copy.exists()  # the wrapper wrote it again for the restored task
            assert_hooked(node, cid, bundle, new_pid)
            node.assert_no_errors(cid)
            c.remove(cid)
    finally:
        r = sh(cudahook, "configure", "--runtime", "containerd", "--criu-registration", "global")
        assert r.returncode == 0, r.stdout + r.stderr
    assert conf.read_bytes() == before


# -- docker 20.10 (experimental) ------------------------------------------------------


def docker_gpu_task(node: Node, d: Dockerd, cid: str, tags: list[str]) -> tuple[int, Path]:
    """Wait for the workloads of docker container `cid` and check the
    wrapper hooked it: its PID and bundle."""
    pid = d.pid(cid)
    node.wait_running(tags, steps=3)
    bundle = d.containerd.state / "io.containerd.runtime.v2.task" / "moby" / cid
    assert_hooked(node, cid, bundle, pid)
    return pid, bundle


def docker_restore_moved(node: Node, d: Dockerd, cid: str, checkpoint: str, tags: list[str],
                         frozen: dict[str, int], device_map: dict[str, str]) -> None:
    """`docker start --checkpoint` of a container naming other GPUs: the
    workloads go on from `frozen`, each on the GPU `device_map` moves it to."""
    with node.resumed(tags) as reports:
        d.start_checkpoint(cid, checkpoint)
        first = reports.assert_from(frozen, frozen)
    node.wait_running(tags, first)
    assert {node.lab.status(t)["gpu"] for t in tags} == set(device_map.values())
    (restore,) = node.wait_event(cid, "restore")
    assert restore["device_map"] == device_map


def ctr_leave_running(node: Node, c: Containerd, cid: str, ref: str, pid: int,
                      tags: list[str]) -> tuple[dict[str, int], dict[str, int]]:
    """`ctr c checkpoint --task` (runc `--leave-running`): the same task goes
    on, back on its GPU once the guardian resumed it. The counters before
    and right after the checkpoint, for a later restore to continue from."""
    before = node.counters(tags)
    c.checkpoint(cid, ref)
    after = node.counters(tags)
    assert c.task_pid(cid) == pid
    node.wait_event(cid, "guardian", lambda e: "resumed" in e.get("outcome", ""))
    node.wait_running(tags, after, steps=15)
    return before, after


def docker_leave_running(node: Node, d: Dockerd, cid: str, pid: int, tags: list[str],
                         checkpoint: str) -> None:
    """`docker checkpoint create --leave-running`: the same processes go on,
    back on their GPU once the guardian resumed them."""
    d.docker("checkpoint", "create", "--leave-running", cid, checkpoint, timeout=120)
    after = node.counters(tags)
    node.wait_event(cid, "guardian", lambda e: "resumed" in e.get("outcome", ""))
    assert d.pid(cid) == pid
    node.wait_running(tags, after)


def test_docker_checkpoint_and_restore(node: Node, image: Path, tmp_path: Path) -> None:
    runtimes = json.loads(DAEMON_JSON.read_text())["runtimes"]
    assert runtimes["cudahook"] == {"path": str(node.libexec / "cudahook-runtime")}
    spec = gpu_spec(node.lab, "dk")
    tags = spec.tags
    with Dockerd(tmp_path / "dockerd", extra_config={"runtimes": runtimes}) as d:
        name = d.load_image(image)
        cid = d.docker("run", "-d", *spec.docker_args(), name, *spec.cmd).stdout.strip()
        pid, bundle = docker_gpu_task(node, d, cid, tags)

        # 1. --leave-running: the same processes go on, back on their GPU.
        docker_leave_running(node, d, cid, pid, tags, "cp1")

        # 2. a plain checkpoint stops the container where its counters stand.
        tree = process_tree(pid)
        d.docker("checkpoint", "create", cid, "cp2", timeout=120)
        assert not d.inspect(cid)["State"]["Running"]
        frozen = node.frozen(tags, tree)
        images = d.data_root / "containers" / cid / "checkpoints" / "cp2"
        assert (images / "cudahook-manifest.json").is_file()
        node.wait_event(cid, "checkpoint", count=2)
        node.wait_event(cid, "guardian", lambda e: "nothing to resume" in e.get("outcome", ""))

        # 3. start from cp2: the counters continue from the frozen values.
        with node.resumed(tags) as reports:
            d.start_checkpoint(cid, "cp2")
            first = reports.assert_from(frozen, frozen)
        new_pid = d.pid(cid)
        assert new_pid != pid
        node.wait_running(tags, first)
        (restore,) = node.wait_event(cid, "restore")
        assert len(restore["pids"]) == len(tags)
        assert_hooked(node, cid, bundle, new_pid)
        node.assert_no_errors(cid)
        d.docker("rm", "-f", cid)


def test_docker_recipe_moves_a_checkpoint_onto_other_gpus(node: Node, image: Path,
                                                          tmp_path: Path) -> None:
    """README's docker recipe: `docker checkpoint create --checkpoint-dir`, the
    directory copied into a new container's checkpoints directory (docker
    20.10 refuses `start --checkpoint-dir`: "custom checkpointdir is not
    supported"), the new container naming other GPUs started from it with
    `docker start --checkpoint`. (Both ends on this node's simulated GPUs;
    tests/e2e/test_migrate.py moves podman and runc checkpoints between nodes.)"""
    runtimes = json.loads(DAEMON_JSON.read_text())["runtimes"]
    a, b = node.lab.uuids[:2]
    spec = gpu_spec(node.lab, "mv")
    tags = spec.tags

    with Dockerd(tmp_path / "dockerd", extra_config={"runtimes": runtimes}) as d:
        name = d.load_image(image)
        src = d.docker("run", "-d", *spec.docker_args(), name, *spec.cmd).stdout.strip()
        node.wait_running(tags, steps=3)
        ckdir = tmp_path / "checkpoints"
        tree = process_tree(d.pid(src))
        d.docker("checkpoint", "create", "--checkpoint-dir", str(ckdir), src, "move", timeout=120)
        frozen = node.frozen(tags, tree)
        assert (ckdir / "move" / "cudahook-manifest.json").is_file()
        copied = tmp_path / "transit"
        shutil.copytree(ckdir, copied)
        dst = d.docker("create", *spec.docker_args(spec.env_on(b)), name, *spec.cmd).stdout.strip()
        shutil.copytree(copied / "move", d.data_root / "containers" / dst / "checkpoints" / "move")
        docker_restore_moved(node, d, dst, "move", tags, frozen, {a: b})
        d.docker("rm", "-f", src, dst)
