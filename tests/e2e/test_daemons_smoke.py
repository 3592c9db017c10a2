"""End-to-end smoke tests: CRIU checkpoint/restore through a private containerd
(``ctr``) and a private dockerd (experimental), each with a ``runc`` wrapper in
front of the real runc (see :mod:`tests.e2e.daemons`), for each version the
suite drives: Debian 12's containerd 1.6 and docker 20.10, and the containerd
1.7 and docker 26 unpacked beside them.

A version is skipped unless its containerd, ctr, dockerd and docker client
are there (``scripts/provision-runtimes.sh``); all of them unless root with
runc and a CRIU >= 4.0 (``scripts/provision-criu.sh``).

The workload is busybox ``sh`` incrementing a counter every 50 ms and writing
it atomically to ``/data/counter`` (a bind-mounted host dir). The image is a
busybox-static rootfs packed by :func:`tests.e2e.daemons.image_tar` and
imported without a registry.
"""

from __future__ import annotations

import os
import shutil
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from cudahook.sim.bundle import find_criu
from tests.e2e.daemons import (
    PACKAGED,
    Binaries,
    Containerd,
    Dockerd,
    image_tar,
    private_binaries,
    runc_wrapper,
)
from tests.e2e.outcomes import process_tree, still_alive

CRIU = find_criu()
VERSIONS = [PACKAGED, private_binaries("1.7", "26")]

pytestmark = [
    pytest.mark.e2e,
    pytest.mark.skipif(os.geteuid() != 0, reason="needs root"),
    pytest.mark.skipif(CRIU is None, reason="criu >= 4.0 not found (scripts/provision-criu.sh)"),
    pytest.mark.skipif(
        shutil.which("busybox") is None and not os.path.exists("/bin/busybox"),
        reason="busybox-static not installed",
    ),
]

COUNTER = (
    "i=0; while :; do i=$((i+1)); echo $i > /data/counter.tmp; "
    "mv /data/counter.tmp /data/counter; sleep 0.05; done"
)


def wait_for(pred, timeout: float = 10.0, interval: float = 0.05, what: str = "condition"):
    deadline = time.monotonic() + timeout
    while True:
        value = pred()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout}s waiting for {what}")
        time.sleep(interval)


def counter(data_dir: Path) -> int:
    try:
        return int((data_dir / "counter").read_text())
    except (OSError, ValueError):
        return 0


def moves(data_dir: Path, since: int, what: str, timeout: float = 5) -> int:
    return wait_for(lambda: (c := counter(data_dir)) > since and c, timeout=timeout, what=what)


def watch(data_dir: Path, seconds: float = 1.0) -> list[int]:
    seen = []
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        seen.append(counter(data_dir))
        time.sleep(0.02)
    return seen


def wrapper_calls(log: Path) -> list[list[str]]:
    """argv lines the runc wrapper logged (global flags included)."""
    if not log.exists():
        return []
    return [line.split() for line in log.read_text().splitlines() if line.strip()]


def subcommands(log: Path, cid: str | None = None) -> list[str]:
    """The runc subcommand of each logged call (optionally only those naming ``cid``)."""
    verbs = {"create", "start", "run", "checkpoint", "restore", "pause", "resume", "kill", "delete", "exec"}
    out = []
    for argv in wrapper_calls(log):
        if cid is not None and cid not in argv:
            continue
        verb = next((a for a in argv if a in verbs), None)
        if verb:
            out.append(verb)
    return out


@pytest.fixture(scope="module")
def image(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return image_tar(tmp_path_factory.mktemp("image") / "busybox.tar")


@pytest.fixture
def data_dir(tmp_path: Path) -> Path:
    d = tmp_path / "data"
    d.mkdir()
    return d


@pytest.fixture
def wrapper(tmp_path: Path) -> tuple[Path, Path]:
    """(``runc`` wrapper path, its argv log)."""
    log = tmp_path / "runc-wrapper.log"
    return runc_wrapper(tmp_path / "wrap" / "runc", log), log


@pytest.fixture(params=VERSIONS, ids=lambda b: b.name.replace(", ", "+").replace(" ", "-"))
def binaries(request: pytest.FixtureRequest) -> Binaries:
    missing = request.param.missing()
    if missing:
        pytest.skip(f"missing {', '.join(missing)} (scripts/provision-runtimes.sh)")
    return request.param


@pytest.fixture
def containerd(tmp_path: Path, wrapper: tuple[Path, Path], binaries: Binaries) -> Iterator[Containerd]:
    with Containerd(tmp_path / "containerd", path_prefix=wrapper[0].parent, binaries=binaries) as c:
        yield c


@pytest.fixture
def dockerd(tmp_path: Path, wrapper: tuple[Path, Path], binaries: Binaries) -> Iterator[Dockerd]:
    with Dockerd(tmp_path / "dockerd", runtimes={"cudahook-runc": wrapper[0]},
                 binaries=binaries) as d:
        yield d


def test_containerd_checkpoint_restore_via_path_wrapper(
    containerd: Containerd, image: Path, data_dir: Path, wrapper: tuple[Path, Path]
) -> None:
    c = containerd
    _, wlog = wrapper
    assert c.server_version().startswith(c.bins.containerd_version + "."), c.server_version()
    name = c.import_image(image)
    assert name == "docker.io/cudahook/busybox:test"
    pid = c.run(name, "counter", "sh", "-c", COUNTER, mounts=[(str(data_dir), "/data", False)])
    wait_for(lambda: counter(data_dir) >= 10, what="counter >= 10")

    # ctr 1.6: `containers checkpoint --task` writes a checkpoint image and
    # leaves the task running (it is paused only while CRIU dumps it).
    before = counter(data_dir)
    c.checkpoint("counter", "cudahook/checkpoint:1")
    after = counter(data_dir)
    assert "cudahook/checkpoint:1" in c.ctr("images", "ls", "-q").stdout.split()
    assert c.task_pid("counter") == pid
    moves(data_dir, after, "counter to move after checkpoint (task left running)")

    # Let the original run on, then replace it with the checkpoint.
    last = wait_for(lambda: (v := counter(data_dir)) >= after + 20 and v, what="original to run on")
    c.remove("counter")
    last = max(last, counter(data_dir))
    assert "counter" not in c.tasks()

    new_pid = c.restore("counter", "cudahook/checkpoint:1")
    assert new_pid != pid
    first = wait_for(lambda: (v := counter(data_dir)) != last and v, timeout=5, what="restored write")
    # Resumed from the checkpointed value (taken while the file showed before..after).
    assert before <= first <= after + 1, f"restored at {first}, expected {before}..{after + 1} (last={last})"
    seen = watch(data_dir, 0.6)
    assert seen == sorted(seen) and max(seen) > first, seen

    # The shim ran OUR runc (first on containerd's PATH) for every step,
    # with the runc root this helper chose.
    verbs = subcommands(wlog, "counter")
    for verb in ("create", "start", "checkpoint", "restore"):
        assert verb in verbs, f"{verb} not seen by the wrapper: {verbs}"
    assert verbs.index("create") < verbs.index("checkpoint") < verbs.index("restore")
    ckpt = next(a for a in wrapper_calls(wlog) if "checkpoint" in a)
    assert "--leave-running" in ckpt and "--image-path" in ckpt, ckpt
    assert ckpt[ckpt.index("--root") + 1].startswith(str(c.runc_root)), ckpt
    # containerd pauses the task around the dump (cgroup freezer): pause,
    # checkpoint, resume - the container is FROZEN when CRIU's pre-dump runs.
    i = verbs.index("checkpoint")
    assert verbs[i - 1] == "pause" and verbs[i + 1] == "resume", verbs

    c.remove("counter")
    assert c.tasks() == {}


def test_docker_checkpoint_restore_via_runtime(
    dockerd: Dockerd, image: Path, data_dir: Path, wrapper: tuple[Path, Path], tmp_path: Path
) -> None:
    d = dockerd
    _, wlog = wrapper
    server = d.docker("version", "--format", "{{.Server.Version}}").stdout.strip()
    assert server.startswith(d.bins.docker_version + "."), server
    assert d.containerd.server_version().startswith(d.bins.containerd_version + ".")
    name = d.load_image(image)
    assert name == "cudahook/busybox:test"
    assert d.docker("info", "--format", "{{.ExperimentalBuild}}").stdout.strip() == "true"
    runtimes = d.docker("info", "--format", "{{json .Runtimes}}").stdout
    assert "cudahook-runc" in runtimes, runtimes

    cid = d.docker(
        "run", "-d", "--runtime", "cudahook-runc", "--name", "counter",
        "-v", f"{data_dir}:/data", name, "sh", "-c", COUNTER,
    ).stdout.strip()  # fmt: skip
    pid = d.pid(cid)
    wait_for(lambda: counter(data_dir) >= 10, what="counter >= 10")
    assert "create" in subcommands(wlog, cid), wrapper_calls(wlog)

    # 1. --leave-running: same process keeps counting.
    before1 = counter(data_dir)
    d.docker("checkpoint", "create", "--leave-running", cid, "cp-live", timeout=120)
    after1 = counter(data_dir)
    assert d.pid(cid) == pid
    moves(data_dir, after1, "counter to move after --leave-running checkpoint")

    # 2. plain checkpoint: the container stops, the counter freezes.
    wait_for(lambda: counter(data_dir) >= after1 + 10, what="counter to run on")
    tree = process_tree(pid)
    d.docker("checkpoint", "create", cid, "cp-stop", timeout=120)
    state = d.inspect(cid)["State"]
    assert not state["Running"], state
    # Nothing counts on from the checkpoint: every process of it is gone.
    assert not still_alive(tree), f"still running after checkpoint: {still_alive(tree)}"
    frozen = counter(data_dir)
    listed = d.docker("checkpoint", "ls", cid).stdout.split()
    assert {"cp-live", "cp-stop"} <= set(listed), listed
    images = d.data_root / "containers" / cid / "checkpoints"
    assert (images / "cp-stop" / "inventory.img").is_file()

    # 3. restore the stopped checkpoint: continues from `frozen`.
    d.start_checkpoint(cid, "cp-stop")
    new_pid = d.pid(cid)
    assert new_pid != pid
    first = moves(data_dir, frozen, "restored counter to move")
    # The restored shell goes on from i == frozen: its next write is frozen + 1.
    assert first <= frozen + 5, f"frozen={frozen}, first value after restore {first}"
    seen = watch(data_dir, 0.6)
    assert min(seen) >= first and seen == sorted(seen), f"frozen={frozen} first={first} seen={seen}"

    # 4. restore the --leave-running checkpoint: back to its older value.
    d.docker("kill", cid)
    wait_for(lambda: not d.inspect(cid)["State"]["Running"], what="container to stop")
    last = counter(data_dir)
    d.start_checkpoint(cid, "cp-live")
    first = wait_for(lambda: (v := counter(data_dir)) != last and v, timeout=5, what="restored write")
    assert before1 <= first <= after1 + 1, f"restored at {first}, expected {before1}..{after1 + 1}"
    moves(data_dir, first, "counter to move after the second restore")

    # The registered runtime (the wrapper) did create, both checkpoints and both restores.
    verbs = subcommands(wlog, cid)
    assert verbs.count("checkpoint") == 2 and verbs.count("restore") == 2, verbs
    ckpts = [a for a in wrapper_calls(wlog) if "checkpoint" in a and cid in a]
    assert ["--leave-running" in a for a in ckpts] == [True, False], ckpts
    restores = [a for a in wrapper_calls(wlog) if "restore" in a and cid in a]
    assert all("--image-path" in a for a in restores), restores

    # A container without --runtime uses plain runc: the wrapper never sees it.
    other = d.docker("run", "-d", "--name", "plain", name, "sleep", "60").stdout.strip()
    assert d.pid(other) > 0
    assert subcommands(wlog, other) == []
    d.docker("rm", "-f", other, cid)
