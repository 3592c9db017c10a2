"""`cudahook check` against a simulated node: every reason code, triggered
by the real cause (a process stopped, locked, checkpointed, in the driver's
failed state, an NVML monitor, a memory limit, a full file system, an image
from another driver...), and the same decisions in the hooks."""

from __future__ import annotations

import contextlib
import itertools
import json
import os
import re
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

from cudahook.core import manifest
from cudahook.platform import reasons
from cudahook.platform.store import Store

from .conftest import Node, count_opens, requires_root

HERE = Path(__file__)
_configs = itertools.count()


def config(node: Node, **over: Any) -> Path:
    path = node.lab.root / f"config-{next(_configs)}.yaml"
    over.setdefault("criu", os.environ.get("CUDAHOOK_CRIU", "criu"))
    settings = node.settings(**over)
    path.write_text(yaml.safe_dump(dict(settings.__dict__)))
    return path


def check(cfg: Path, *args: str, env: dict[str, str] | None = None
          ) -> tuple[int, dict[str, Any], str]:
    r = subprocess.run([sys.executable, "-m", "cudahook", "--config", str(cfg), "--json",
                        "check", *args], capture_output=True, text=True, timeout=120,
                       env={**os.environ, **(env or {})})
    assert r.returncode in (0, 1, 2, 6), r.stderr
    return r.returncode, (json.loads(r.stdout) if r.stdout.strip() else {}), r.stderr


def expect(cfg: Path, args: list[str], code: str, rc: int = 1,
           env: dict[str, str] | None = None) -> dict[str, Any]:
    """`cudahook check ARGS` reports `code` and exits `rc`."""
    got, verdict, err = check(cfg, *args, env=env)
    codes = [p["code"] for p in verdict.get("problems", [])]
    assert code in codes and got == rc, (got, verdict.get("problems"), err)
    p = next(p for p in verdict["problems"] if p["code"] == code)
    assert p["hint"] == reasons.get(code).hint and p["explanation"]
    return verdict


def ok(cfg: Path, *args: str) -> dict[str, Any]:
    got, verdict, err = check(cfg, *args)
    assert got == 0 and verdict["ok"], (verdict, err)
    return verdict


def test_every_reason_code_is_triggered_by_a_test() -> None:
    """Each code of platform/reasons.py is named in an `expect` or a hook
    test below (a code no test can trigger is one no node will show)."""
    text = HERE.read_text() + (HERE.parent / "e2e" / "test_check_e2e.py").read_text()
    tested = set(re.findall(r'"([A-Z][A-Z_]+[A-Z])"', text))
    assert set(reasons.REASONS) - tested == set()


def test_reason_codes_are_defined_once_with_text_and_hint() -> None:
    for code, r in reasons.REASONS.items():
        assert re.fullmatch(r"[A-Z][A-Z_]+", code) and r.code == code
        assert r.text and r.hint and "\n" not in r.text + r.hint
        assert r.side in ("checkpoint", "restore", "both")


# -- checkpoint side ---------------------------------------------------------------------


def test_a_healthy_container_can_be_checkpointed(node: Node, tmp_path: Path) -> None:
    init = node.spawn_tree(("a", {"mib": 8}), ("b", {"mib": 4}))
    pids = sorted(node.lab.wait_counter(t)["pid"] for t in ("a", "b"))
    cfg = config(node)
    before = {t: node.lab.status(t)["counter"] for t in ("a", "b")}
    v = ok(cfg, "--init-pid", str(init.pid), "--image-dir", str(tmp_path))
    assert v["facts"]["cuda_processes"] == pids
    assert v["facts"]["states"] == {str(p): "running" for p in pids}
    assert v["facts"]["gpu_memory_bytes"] == 12 << 20
    assert v["facts"]["image_expected_bytes"] > 12 << 20
    assert "host memory" in v["checked"] and "image space" in v["checked"]
    # Never touched: both keep computing, memory intact.
    for t in ("a", "b"):
        st = node.lab.wait_counter(t, before[t] + 3)
        assert st["intact"] and not st["errors"]
    r = subprocess.run([sys.executable, "-m", "cudahook", "--config", str(cfg), "check",
                        "--init-pid", str(init.pid)], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0 and "the checkpoint can go ahead" in r.stdout, r.stdout + r.stderr


def test_process_states_that_refuse(node: Node) -> None:
    init = node.spawn_tree(("a", {"mib": 1}), ("b", {"mib": 1}), ("c", {"mib": 1}))
    a, b, c = (node.lab.wait_counter(t)["pid"] for t in ("a", "b", "c"))
    cfg = config(node)
    engine = node.engine()
    engine.backend.lock(a, 1000)  # as an abandoned checkpoint leaves it
    engine.checkpoint([b])
    node.lab.force_state(c, "failed")
    v = expect(cfg, ["--init-pid", str(init.pid)], "PROCESS_LOCKED")
    codes = {p["code"]: p["detail"] for p in v["problems"]}
    assert codes["PROCESS_LOCKED"] == f"pid {a} is locked"
    # Found although it holds no device file any more: a dump would take it off its GPU.
    assert codes["PROCESS_CHECKPOINTED"] == f"pid {b} is checkpointed"
    assert codes["PROCESS_FAILED"] == f"pid {c} is failed"
    expect(cfg, ["--pid", str(b)], "PROCESS_CHECKPOINTED")
    node.lab.force_state(c, "checkpointing")
    expect(cfg, ["--pid", str(c)], "PROCESS_BUSY")
    # Nothing moved: the states are what they were.
    assert [engine.read_state(p) for p in (a, b)] == ["locked", "checkpointed"]
    engine.backend.unlock(a)
    engine.restore([b])
    node.lab.force_state(c, "running")
    ok(cfg, "--init-pid", str(init.pid))


def test_stopped_unreadable_and_nvml(node: Node) -> None:
    init = node.spawn_tree(("a", {"mib": 1}), ("n", {"nvml_only": True}))
    a = node.lab.wait_counter("a")["pid"]
    mon = node.lab.wait_counter("n")["pid"]
    cfg = config(node)
    v = expect(cfg, ["--init-pid", str(init.pid)], "NVML_FDS")
    assert f"pid {mon} (not a CUDA process, e.g. NVML) holds" in v["problems"][0]["detail"]
    os.kill(a, signal.SIGSTOP)
    try:
        expect(cfg, ["--pid", str(a)], "PROCESS_STOPPED")  # answered, no probe hung on it
    finally:
        os.kill(a, signal.SIGCONT)
    # A CUDA process that also uses NVML (as NCCL does): its NVML handles can
    # only be told from CUDA's own device files after the CUDA checkpoint
    # (pre-dump then puts it back and refuses, NVML_FDS): a warning here.
    node.spawn_tree(("b", {"mib": 1, "nvml": True}))
    st = node.lab.wait_counter("b")
    assert st["nvml_mapped"] and st["nvml_fds"] == 2
    got, v, _ = check(cfg, "--pid", str(st["pid"]))
    assert got == 0 and any("NVML_FDS" in w and "libnvidia-ml" in w for w in v["warnings"]), v
    plain = subprocess.Popen(["sleep", "60"])
    try:
        v = expect(cfg, ["--pid", str(plain.pid)], "PROCESS_UNREADABLE")
        assert "initialization error" in v["problems"][0]["detail"]
    finally:
        plain.kill()
        plain.wait()


def test_driver_tool_and_gpu_query(make_node) -> None:  # type: ignore[no-untyped-def]
    node = make_node(gpu_specs=[{"persistence_mode": "Disabled"}])
    init = node.spawn_tree(("a", {"mib": 1}),)
    a = node.lab.wait_counter("a")["pid"]
    v = expect(config(node), ["--init-pid", str(init.pid)], "PERSISTENCE_OFF")
    assert v["problems"][0]["detail"] == "disabled on GPU 0"
    expect(config(node, backend="cli", cuda_checkpoint="/nonexistent/cuda-checkpoint"),
           ["--pid", str(a)], "CHECKPOINT_TOOL_MISSING")
    expect(config(node, nvidia_smi="/bin/false"), ["--pid", str(a)], "GPU_QUERY_FAILED")
    # A --launch-job job on a driver that cannot drive one.
    job = node.lab.root / "job"
    job.write_text("")
    env = {**node.lab.workload_env(), "CUDA_CHECKPOINT_JOB_FILE": str(job)}
    p = subprocess.Popen(node.lab.workload_argv("j", mib=1), env=env, start_new_session=True)
    node.procs.append(p)
    j = node.lab.wait_counter("j")["pid"]
    v = expect(config(node), ["--pid", str(j)], "DRIVER_TOO_OLD")
    assert "R590+" in v["problems"][0]["detail"]
    node.lab.set(driver=545)  # no checkpoint support at all
    expect(config(node, backend="cli"), ["--pid", str(a)], "DRIVER_TOO_OLD")
    node.lab.driver_version_file.unlink()
    node.lab.stop()
    expect(config(node), ["--pid", str(a)], "DRIVER_UNKNOWN")


def test_criu_and_its_cuda_plugin(node: Node, tmp_path: Path) -> None:
    init = node.spawn_tree(("a", {"mib": 1}),)
    node.lab.wait_counter("a")
    args = ["--init-pid", str(init.pid)]
    expect(config(node, criu="/nonexistent/criu"), args, "CRIU_MISSING")
    old = tmp_path / "criu"
    old.write_text("#!/bin/sh\necho 'Version: 3.17.1'\n")
    old.chmod(0o755)
    v = expect(config(node, criu=str(old)), args, "CRIU_TOO_OLD")
    assert v["facts"]["criu_version"] == "3.17"
    libs = tmp_path / "libs"
    libs.mkdir()
    (libs / "cuda_plugin.so").write_bytes(b"\x7fELF")
    v = expect(config(node), args, "CRIU_CUDA_PLUGIN", env={"CRIU_LIBS_DIR": str(libs)})
    assert "would checkpoint the same processes" in v["problems"][0]["detail"]


@contextlib.contextmanager
def memory_cgroup(pids: list[int], limit: int) -> Iterator[Path]:
    """A memory cgroup (v2, else v1) limited to `limit` bytes, holding `pids`."""
    name = f"cudahook-test-{os.getpid()}-{time.monotonic_ns()}"
    v2 = Path("/sys/fs/cgroup/cgroup.controllers")
    if v2.exists() and "memory" in v2.read_text().split():
        where, limit_file = Path("/sys/fs/cgroup") / name, "memory.max"
        with contextlib.suppress(OSError):
            Path("/sys/fs/cgroup/cgroup.subtree_control").write_text("+memory")
    elif Path("/sys/fs/cgroup/memory/cgroup.procs").exists():
        where, limit_file = Path("/sys/fs/cgroup/memory") / name, "memory.limit_in_bytes"
    else:
        pytest.skip("no memory cgroup controller")
    try:
        where.mkdir()
    except OSError as exc:
        pytest.skip(f"cannot create a memory cgroup: {exc}")
    try:
        for pid in pids:
            (where / "cgroup.procs").write_text(str(pid))
        (where / limit_file).write_text(str(limit))
        yield where
    finally:
        for pid in pids:
            with contextlib.suppress(OSError):
                os.kill(pid, signal.SIGKILL)
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            try:
                where.rmdir()
                break
            except OSError:
                time.sleep(0.05)


def shmem(cgroup: Path) -> int:
    """Shared-memory bytes charged to a memory cgroup (v1 and v2 alike)."""
    for line in (cgroup / "memory.stat").read_text().splitlines():
        key, _, value = line.partition(" ")
        if key == "shmem":
            return int(value)
    raise AssertionError(f"no shmem in {cgroup}/memory.stat")


@requires_root
def test_the_simulated_host_copy_is_charged_to_the_process_cgroup(node: Node) -> None:
    """On a real node a checkpoint's host copy is the process's own memory,
    counted in the container's memory cgroup: that is what the host-memory
    rule and P8's cgroup peak measure. The simulator's copy must count
    there too, not in the GPU service's cgroup, and leave it at restore."""
    p = node.spawn("c", mib=64, check_every=1)
    node.lab.wait_counter("c")
    tool = str(node.lab.cuda_checkpoint)

    def cc(*actions: str) -> None:
        for action in actions:
            r = subprocess.run([tool, "--action", action, "--pid", str(p.pid)],
                               capture_output=True, text=True, timeout=60)
            assert r.returncode == 0, r.stderr

    with memory_cgroup([p.pid], 4 << 30) as cg:
        before = shmem(cg)
        cc("lock", "checkpoint")
        held = shmem(cg)
        assert held - before >= 64 << 20, f"host copy charged elsewhere: shmem {before} -> {held}"
        cc("restore", "unlock")
        # Once it computes again its device memory is the GPU's, not its own.
        counter = node.lab.status("c")["counter"]
        st = node.lab.wait_counter("c", counter + 2)
        assert st["intact"] and st["restores"] == 1, st
        after = shmem(cg)
        assert held - after >= 64 << 20, f"device memory still charged here: {held} -> {after}"


@requires_root
def test_host_memory_against_the_memory_limit(node: Node) -> None:
    """A checkpoint copies GPU memory into the process: a container whose
    memory limit cannot take it would be OOM-killed mid-checkpoint."""
    p = node.spawn("m", mib=96)
    st = node.lab.wait_counter("m")
    rss = int(Path(f"/proc/{st['pid']}/statm").read_text().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    cfg = config(node)
    with memory_cgroup([p.pid], rss + (24 << 20)):
        v = expect(cfg, ["--pid", str(st["pid"])], "HOST_MEMORY")
        assert "96 MiB" in v["problems"][0]["detail"] and "memory limit" in v["problems"][0]["detail"]
        assert node.lab.status("m")["counter"] > 0


@requires_root
def test_the_storage_path_checks_the_image_disk_not_host_memory(make_node: Any,
                                                                tmp_path: Path) -> None:
    """On the storage path the GPU memory never enters host memory: neither
    MemAvailable nor the memory cgroup's headroom refuses it, the image
    directory's file system must take all of it instead (no dedupe or
    compression counted on), and the verdict says which path and why."""
    node = make_node(driver=590)
    node.lab.set(cuda_version=13040)
    p = node.spawn("m", mib=96)
    st = node.lab.wait_counter("m")
    rss = int(Path(f"/proc/{st['pid']}/statm").read_text().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    host = config(node, backend="driver-api", gpu_memory="host")
    storage = config(node, backend="driver-api", gpu_memory="storage")
    pid = ["--pid", str(st["pid"])]
    small = tmp_path / "small"
    small.mkdir()
    if subprocess.run(["mount", "-t", "tmpfs", "-o", "size=64m", "tmpfs", str(small)]).returncode:
        pytest.skip("cannot mount a tmpfs")
    try:
        with memory_cgroup([p.pid], rss + (24 << 20)):
            v = expect(host, pid, "HOST_MEMORY")
            assert v["facts"]["gpu_memory_path"] == "host"
            # Storage: the cgroup's limit does not matter, the disk does.
            _, v, _ = check(storage, *pid)
            assert v["ok"] and v["facts"]["gpu_memory_path"] == "storage", v
            assert "custom storage" in v["facts"]["gpu_memory_path_why"]
            assert "host memory" not in v["checked"]
            assert any("not checked (give --image-dir)" in w for w in v["warnings"]), v
            v = expect(storage, [*pid, "--image-dir", str(small)], "IMAGE_SPACE")
            detail = v["problems"][0]["detail"]
            assert "storage path" in detail
            assert "dedupe and compression not counted on" in detail and str(small) in detail
            assert v["facts"]["image_gpu_bytes"] >= 96 << 20 > v["facts"]["image_free_bytes"]
            v = ok(storage, *pid, "--image-dir", str(tmp_path))
            assert "image space for GPU memory" in v["checked"]
            assert node.lab.status("m")["counter"] > 0
    finally:
        subprocess.run(["umount", str(small)])


@requires_root
def test_image_space(node: Node, tmp_path: Path) -> None:
    init = node.spawn_tree(("a", {"mib": 16}),)
    node.lab.wait_counter("a")
    small = tmp_path / "small"
    small.mkdir()
    if subprocess.run(["mount", "-t", "tmpfs", "-o", "size=4m", "tmpfs", str(small)]).returncode:
        pytest.skip("cannot mount a tmpfs")
    try:
        v = expect(config(node), ["--init-pid", str(init.pid), "--image-dir", str(small)],
                   "IMAGE_SPACE")
        assert v["facts"]["image_free_bytes"] <= 4 << 20 < v["facts"]["image_expected_bytes"]
        ok(config(node), "--init-pid", str(init.pid), "--image-dir", str(tmp_path))
    finally:
        subprocess.run(["umount", str(small)])


def test_bad_targets_are_usage_errors(node: Node, tmp_path: Path) -> None:
    cfg = config(node)
    for args, text in ((["--container", "nope"], "not a running GPU container"),
                       (["--pid", "999999999"], "no process"),
                       (["--image", str(tmp_path / "none")], "not a directory"),
                       (["--pid", "1", "--bundle", str(tmp_path)], "go with --image"),
                       (["--image", str(tmp_path), "--image-dir", str(tmp_path)], "--image-dir")):
        got, _, err = check(cfg, *args)
        assert got == 2 and err.count("\n") == 1 and text in err, (args, err)


def test_container_check_is_remembered_for_status(node: Node) -> None:
    init = node.spawn_tree(("a", {"mib": 1}),)
    a = node.lab.wait_counter("a")["pid"]
    settings = node.settings()
    Store(settings.state_dir).update("job-1", pid=init.pid, pid_start=None,
                                     visible=[node.lab.uuids[0]])
    cfg = config(node)
    ok(cfg, "--container", "job-1")
    os.kill(a, signal.SIGSTOP)
    try:
        expect(cfg, ["--container", "job-1"], "PROCESS_STOPPED")
    finally:
        os.kill(a, signal.SIGCONT)
    r = subprocess.run([sys.executable, "-m", "cudahook", "--config", str(cfg), "status",
                        "job-1", "--no-live"], capture_output=True, text=True, timeout=60)
    assert "last check (checkpoint):" in r.stdout and "REFUSED PROCESS_STOPPED" in r.stdout
    data = json.loads(subprocess.run(
        [sys.executable, "-m", "cudahook", "--config", str(cfg), "--json", "status", "--no-live"],
        capture_output=True, text=True, timeout=60).stdout)
    job = next(c for c in data["containers"] if c["id"] == "job-1")
    assert job["last"]["check"]["codes"] == ["PROCESS_STOPPED"]
    assert job["metrics"]["series"]["cudahook_last_check_ok{side=checkpoint}"] == 0


# -- restore side ------------------------------------------------------------------------


def image(tmp: Path, node: Node, name: str = "img", **data: Any) -> Path:
    d = tmp / name
    d.mkdir(exist_ok=True)
    base = {"container_id": "c", "driver_version": node.lab.config["driver_version"],
            "gpus": node.lab.uuids[:1], "processes": [{"nspid": 7, "pid": 7}],
            "gpu_models": {u: {"name": "NVIDIA H100 80GB HBM3 (simulated)", "memory_mib": 81559}
                           for u in node.lab.uuids}}
    manifest.write(d, {**base, **data})
    return d


def test_restore_checks_and_exit_codes(node: Node, tmp_path: Path) -> None:
    cfg = config(node)
    img = image(tmp_path, node)
    v = ok(cfg, "--image", str(img))
    assert v["facts"]["device_map"] is None and v["facts"]["manifest"] is True
    v = ok(cfg, "--image", str(img), "--visible-gpus", node.lab.uuids[1])
    assert v["facts"]["device_map"] == {node.lab.uuids[0]: node.lab.uuids[1]}
    empty = tmp_path / "empty"
    empty.mkdir()
    assert "no cudahook manifest" in subprocess.run(
        [sys.executable, "-m", "cudahook", "--config", str(cfg), "check", "--image", str(empty)],
        capture_output=True, text=True, timeout=60).stdout
    expect(cfg, ["--image", str(img), "--visible-gpus", "GPU-00000000-0000-0000-0000-00000000dead"],
           "GPU_MISSING", rc=6)
    two = image(tmp_path, node, "two", gpus=node.lab.uuids)
    expect(cfg, ["--image", str(two), "--visible-gpus", node.lab.uuids[0]], "GPU_MISMATCH", rc=6)
    expect(cfg, ["--image", str(image(tmp_path, node, "nodrv", driver_version=""))],
           "MANIFEST_NO_DRIVER", rc=1)
    bad = tmp_path / "bad"
    bad.mkdir()
    (bad / manifest.NAME).write_text('{"version": 99, "processes": []}')
    v = expect(cfg, ["--image", str(bad)], "MANIFEST_UNREADABLE", rc=6)
    assert "version 99" in v["problems"][0]["detail"]
    # The device map of the bundle's annotation must name every GPU.
    bundle = tmp_path / "bundle"
    bundle.mkdir()
    (bundle / "config.json").write_text(json.dumps({
        "ociVersion": "1.0.2", "process": {"env": ["NVIDIA_VISIBLE_DEVICES=all"]},
        "annotations": {"cudahook.io/device-map": f"{node.lab.uuids[1]}={node.lab.uuids[0]}"}}))
    expect(cfg, ["--image", str(img), "--bundle", str(bundle)], "DEVICE_MAP_INVALID", rc=1)


def test_restore_side_driver_and_gpus(make_node, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    node = make_node(driver=570, gpu_specs=[{}, {"name": "NVIDIA A100 (simulated)",
                                                 "persistence_mode": "Disabled"}])
    cfg = config(node)
    img = image(tmp_path, node)
    expect(cfg, ["--image", str(img), "--visible-gpus", node.lab.uuids[1]],
           "DEVICE_MAP_UNSUPPORTED", rc=6)
    on1 = image(tmp_path, node, "on1", gpus=node.lab.uuids[1:])
    expect(cfg, ["--image", str(on1)], "PERSISTENCE_OFF", rc=1)
    node.lab.set(driver=580)
    v = expect(config(node), ["--image", str(img)], "DRIVER_BRANCH", rc=6)
    assert "570" in v["problems"][0]["detail"]
    new = image(tmp_path, node, "new")
    v = expect(config(node), ["--image", str(new), "--visible-gpus", node.lab.uuids[1]],
               "GPU_MISMATCH", rc=6)
    assert "A100" in v["problems"][0]["detail"]
    node.lab.set(driver=545)
    expect(config(node, backend="cli"), ["--image", str(image(tmp_path, node, "old"))],
           "DRIVER_TOO_OLD", rc=1)


def test_restore_side_image_integrity_and_vmm(node: Node, tmp_path: Path) -> None:
    from cudahook.vmm.coordinator import STATE_FILE

    d = tmp_path / "vimg"
    d.mkdir()
    (d / STATE_FILE).write_bytes(b"vmm state " * 100)
    manifest.write(d, {"container_id": "c", "driver_version": node.lab.config["driver_version"],
                       "gpus": node.lab.uuids[:1], "vmm": True,
                       "processes": [{"nspid": 7, "pid": 7}]}, files=[STATE_FILE])
    m = manifest.read(d)
    assert m is not None and len(m.files[STATE_FILE].sha256) == 64
    cfg = config(node)
    ok(cfg, "--image", str(d))
    expect(config(node, vmm_coordinator="/nonexistent/coordinator"), ["--image", str(d)],
           "VMM_COORDINATOR_MISSING", rc=1)
    (d / STATE_FILE).write_bytes(b"VMM state " * 100)  # same size, other bytes
    expect(cfg, ["--image", str(d)], "IMAGE_CHECKSUM", rc=6)
    (d / STATE_FILE).unlink()
    v = expect(cfg, ["--image", str(d)], "IMAGE_FILE_MISSING", rc=6)
    assert f"{STATE_FILE}: missing" in v["problems"][0]["detail"]
    # A manifest of before checksums (no "files") is still read and checked.
    old = image(tmp_path, node, "old")
    m = manifest.read(old)
    assert m is not None and m.files == {}
    ok(cfg, "--image", str(old))


def test_outside_files_read_safely__restore_checks_judge_the_manifest_read_once(
        node: Node, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The restore checks, their remembered verdicts and the kept verdict
    all go by the one manifest read: the file is opened once when the
    checks read it, never when the caller hands them what it read, and a
    file put in its place afterwards changes nothing they decided."""
    import hashlib

    from cudahook.flow import annotations as ann
    from cudahook.flow import checks
    from cudahook.flow.context import Context

    ctx = Context(node.settings())
    img = image(tmp_path, node)
    path = str(img / manifest.NAME)
    first = Path(path).read_bytes()
    opened = count_opens(monkeypatch, path)
    v = checks.restore_checks(ctx, img, None, ann.Options())
    assert v.ok and len(opened) == 1, (v.message(), opened)
    assert v.manifest is not None and v.manifest.digest == hashlib.sha256(first).hexdigest()
    m = manifest.read(img)
    opened.clear()
    v = checks.restore_checks(ctx, img, None, ann.Options(), found=m)
    assert v.ok and v.manifest is m and opened == []
    # Another manifest in its place: the kept verdict is still the judged one's.
    image(tmp_path, node, "img", container_id="someone-else")
    assert Path(path).read_bytes() != first
    kept = checks.write_verdict(ctx, img, v)
    assert kept is not None and kept.name == f"image-{m.digest[:32]}.json" and opened == []
    # What the caller could not read is the checks' MANIFEST_UNREADABLE.
    v = checks.restore_checks(ctx, img, None, ann.Options(),
                              found=manifest.ManifestError("cudahook-manifest.json: bad"))
    assert [p.code for p in v.problems] == ["MANIFEST_UNREADABLE"] and opened == []
    assert checks.restore_checks(ctx, img, None, ann.Options(), found=None).facts == {
        "manifest": False}


def test_never_here_verdict_is_remembered_and_answered_without_asking_the_driver(
        node: Node, tmp_path: Path) -> None:
    calls = node.lab.root / "smi-calls.log"
    smi = node.lab.root / "logged-nvidia-smi"
    smi.write_text(f'#!/bin/sh\necho "$*" >> {calls}\nexec {node.lab.nvidia_smi} "$@"\n')
    smi.chmod(0o755)
    cfg = config(node, nvidia_smi=str(smi))
    img = image(tmp_path, node)
    gone = "GPU-00000000-0000-0000-0000-00000000dead"
    v = expect(cfg, ["--image", str(img), "--visible-gpus", gone], "GPU_MISSING", rc=6)
    assert v["cached"] is False and calls.exists()
    before = calls.read_text()
    v = expect(cfg, ["--image", str(img), "--visible-gpus", gone], "GPU_MISSING", rc=6)
    assert v["cached"] is True and calls.read_text() == before  # no nvidia-smi call
    # Another target, another image or --fresh: checked again.
    v = expect(cfg, ["--image", str(img), "--visible-gpus", gone, "--fresh"], "GPU_MISSING", rc=6)
    assert v["cached"] is False and calls.read_text() != before
    ok(cfg, "--image", str(img), "--visible-gpus", node.lab.uuids[1])
    # A refusal that can change (a fixable cause) is never remembered.
    nodrv = image(tmp_path, node, "nodrv", driver_version="")
    for _ in range(2):
        assert expect(cfg, ["--image", str(nodrv)], "MANIFEST_NO_DRIVER")["cached"] is False


def storage_image(d: Path, node: Node) -> Path:
    """An image whose GPU memory is in storage: one process, one 4 KiB range
    in one chunk (the smallest chunk size); the chunk's path."""
    import hashlib

    proc = d / manifest.STORAGE_DIR / "7"
    proc.mkdir(parents=True)
    chunk = bytes(range(256)) * 16
    (proc / "gpu0-000000.chunk").write_bytes(chunk)
    digest = hashlib.sha256(chunk).hexdigest()
    raw = json.dumps({"format": 1, "digest": "sha256", "chunk": 4096,
                      "ranges": [{"size": 4096, "chunks": [digest]}]}).encode()
    (proc / manifest.STORAGE_MANIFEST).write_bytes(raw)
    stored = manifest.GpuStorage(dir=manifest.STORAGE_DIR, processes=(manifest.StoredProcess(
        nspid=7, chunk=4096, manifest_sha256=hashlib.sha256(raw).hexdigest(),
        manifest_size=len(raw), ranges=(manifest.StorageRange(size=4096, chunks=(digest,)),)),))
    manifest.write(d, {"container_id": "c", "driver_version": node.lab.config["driver_version"],
                       "gpus": node.lab.uuids[:1], "processes": [{"nspid": 7, "pid": 7}],
                       "gpu_storage": stored})
    return proc / "gpu0-000000.chunk"


def test_restore_side_gpu_memory_in_storage(node: Node, tmp_path: Path) -> None:
    d = tmp_path / "simg"
    d.mkdir()
    chunk = storage_image(d, node)
    m = manifest.read(d)
    assert m is not None and m.version == manifest.STORAGE_VERSION
    # This node's driver (R580: CUDA 13.0) has no custom storage.
    v = expect(config(node, backend="driver-api"), ["--image", str(d)],
               "GPU_STORAGE_UNAVAILABLE", rc=1)
    assert "custom storage needs 13.4" in v["problems"][0]["detail"]
    node.lab.set(cuda_version=13040)
    cfg = config(node, backend="driver-api")
    ok(cfg, "--image", str(d))
    data = bytearray(chunk.read_bytes())
    data[100] ^= 0x04  # one flipped bit in one chunk
    chunk.write_bytes(bytes(data))
    v = expect(cfg, ["--image", str(d)], "IMAGE_CHECKSUM", rc=6)
    assert "cudahook-gpu/7/gpu0-000000.chunk" in v["problems"][0]["detail"]
    chunk.unlink()
    chunk.symlink_to(tmp_path / "elsewhere")  # a link is never followed
    expect(cfg, ["--image", str(d)], "IMAGE_FILE_MISSING", rc=6)


def packed_image(d: Path, node: Node, chunks: list[bytes], frames: list[bytes | None], *,
                 chunk: int = 4096, damage: dict[int, bytes] | None = None) -> Path:
    """An image of version 3 naming `node`'s driver and first GPU: process
    7's chunks of `chunk` bytes with blake3 digests, stored as the given zstd
    frames (None: raw), identical chunks hard links to one file, as the
    storage path writes them. `damage`: bytes written in place of chunk k's
    file, the manifests unchanged. The process's directory."""
    import hashlib
    import os

    import blake3

    proc = d / manifest.STORAGE_DIR / "7"
    proc.mkdir(parents=True)
    seen: dict[bytes, str] = {}
    for k, (data, frame) in enumerate(zip(chunks, frames, strict=True)):
        name = f"gpu0-{k:06d}.chunk"
        if data in seen:
            os.link(proc / seen[data], proc / name)
        else:
            (proc / name).write_bytes((damage or {}).get(k, data if frame is None else frame))
            seen[data] = name
    size = sum(map(len, chunks))
    rng = {"size": size, "chunks": [blake3.blake3(c).hexdigest() for c in chunks],
           "zstd": [0 if f is None else len(f) for f in frames]}
    raw = json.dumps({"format": 2, "digest": "blake3", "chunk": chunk, "ranges": [rng]}).encode()
    (proc / manifest.STORAGE_MANIFEST).write_bytes(raw)
    stored = manifest.GpuStorage(dir=manifest.STORAGE_DIR, digest="blake3", processes=(
        manifest.StoredProcess(nspid=7, chunk=chunk, manifest_sha256=hashlib.sha256(raw).hexdigest(),
                               manifest_size=len(raw), ranges=(manifest.StorageRange(
                                   size=size, chunks=tuple(rng["chunks"]),
                                   zstd=tuple(rng["zstd"])),)),))
    manifest.write(d, {"container_id": "c", "driver_version": node.lab.config["driver_version"],
                       "gpus": node.lab.uuids[:1], "processes": [{"nspid": 7, "pid": 7}],
                       "gpu_storage": stored})
    return proc


def test_restore_side_verifies_compressed_and_shared_chunks(node: Node, tmp_path: Path) -> None:
    """check --image decompresses each compressed chunk (never past its raw
    size) and checks the blake3 digest of its raw bytes; a shared chunk is
    verified under each of its names."""
    import zstandard

    d = tmp_path / "pimg"
    d.mkdir()
    chunks = [bytes(4096), bytes(4096), bytes(range(256)) * 16]
    z = zstandard.ZstdCompressor(level=3)
    frames: list[bytes | None] = [z.compress(chunks[0]), z.compress(chunks[0]), None]
    proc = packed_image(d, node, chunks, frames)
    m = manifest.read(d)
    assert m is not None and m.version == manifest.PACKED_VERSION
    assert (proc / "gpu0-000000.chunk").stat().st_nlink == 2  # stored once
    node.lab.set(cuda_version=13040)
    cfg = config(node, backend="driver-api")
    ok(cfg, "--image", str(d))
    # A frame of the same length that makes more than the chunk (a bomb), or
    # other bytes: refused as a checksum problem, nothing allocated past it.
    bomb = z.compress(bytes(1 << 24))
    for frame in (bomb[:len(frames[0])].ljust(len(frames[0]), b"\0"),
                  z.compress(b"\1" * 4096)[:len(frames[0])].ljust(len(frames[0]), b"\0")):
        (proc / "gpu0-000000.chunk").write_bytes(frame)
        v = expect(cfg, ["--image", str(d)], "IMAGE_CHECKSUM", rc=6)
        assert "cudahook-gpu/7/gpu0-000000.chunk" in v["problems"][0]["detail"]
    (proc / "gpu0-000000.chunk").write_bytes(frames[0])  # type: ignore[arg-type]
    ok(cfg, "--image", str(d))


def test_quick_image_check_samples_the_chunks(node: Node, tmp_path: Path) -> None:
    """--quick reads each process's first and last chunk and a sample of the
    rest; without it, every chunk."""
    import hashlib

    d = tmp_path / "qimg"
    d.mkdir()
    proc = d / manifest.STORAGE_DIR / "7"
    proc.mkdir(parents=True)
    digests = []
    for k in range(40):
        data = bytes([k]) * 4096
        (proc / f"gpu0-{k:06d}.chunk").write_bytes(data)
        digests.append(hashlib.sha256(data).hexdigest())
    raw = json.dumps({"format": 1, "digest": "sha256", "chunk": 4096,
                      "ranges": [{"size": 40 * 4096, "chunks": digests}]}).encode()
    (proc / manifest.STORAGE_MANIFEST).write_bytes(raw)
    stored = manifest.GpuStorage(dir=manifest.STORAGE_DIR, processes=(manifest.StoredProcess(
        nspid=7, chunk=4096, manifest_sha256=hashlib.sha256(raw).hexdigest(),
        manifest_size=len(raw), ranges=(manifest.StorageRange(size=40 * 4096,
                                                              chunks=tuple(digests)),)),))
    manifest.write(d, {"container_id": "c", "driver_version": node.lab.config["driver_version"],
                       "gpus": node.lab.uuids[:1], "processes": [{"nspid": 7, "pid": 7}],
                       "gpu_storage": stored})
    m = manifest.read(d)
    assert m is not None
    quick = manifest.storage_files(m, quick=True)
    names = [f.name.rsplit("/", 1)[1] for f in quick]
    assert len(quick) == 1 + 6 and names[0] == manifest.STORAGE_MANIFEST
    assert {"gpu0-000000.chunk", "gpu0-000039.chunk"} <= set(names)
    assert len(manifest.storage_files(m)) == 41
    node.lab.set(cuda_version=13040)
    cfg = config(node, backend="driver-api")
    (proc / "gpu0-000000.chunk").write_bytes(b"\xff" * 4096)  # always in the sample
    expect(cfg, ["--image", str(d), "--quick"], "IMAGE_CHECKSUM", rc=6)
    (proc / "gpu0-000000.chunk").write_bytes(bytes([0]) * 4096)
    ok(cfg, "--image", str(d), "--quick")
    unsampled = next(f"gpu0-{k:06d}.chunk" for k in range(1, 39)
                     if f"gpu0-{k:06d}.chunk" not in names)
    (proc / unsampled).write_bytes(b"\xff" * 4096)
    expect(cfg, ["--image", str(d)], "IMAGE_CHECKSUM", rc=6)  # the full check finds it
