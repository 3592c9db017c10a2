"""runc checkpoint/restore of GPU containers through cudahook's hooks, with
real runc and CRIU and the simulated GPU."""

from __future__ import annotations

import re
import time

import pytest
import yaml

from cudahook.core import manifest
from cudahook.platform.store import Store, container_key

from .conftest import needs_runc, tree_digest
from .outcomes import assert_nothing_restored, container_pids, image_hashes

pytestmark = needs_runc

WORKLOADS = [("solo", {"mib": 8}), ("mp", {"mib": 2, "procs": 3})]
TAGS = ["solo", "mp.0", "mp.1", "mp.2"]
OTHERS = ["sleep 100000"]  # a process that is not a CUDA process, beside them


def start(env, name="b1", workloads=WORKLOADS, others=OTHERS, **kw):  # type: ignore[no-untyped-def]
    bundle = env.box.bundle(name, workloads, others=others, **kw)
    cid = env.cid()
    r = env.box.run(cid, bundle)
    assert r.returncode == 0, r.stderr
    tags = [t for t in TAGS if t.split(".")[0] in {w[0] for w in workloads}]
    env.wait_running(tags, steps=3)
    return cid, bundle, tags


def test_round_trip(make_env, tmp_path) -> None:  # type: ignore[no-untyped-def]
    env = make_env()
    cid, bundle, tags = start(env)
    image = tmp_path / "img"
    r = env.box.checkpoint(cid, image)
    assert r.returncode == 0, r.stderr
    assert env.box.state(cid) is None  # the dump ended the container
    m = manifest.read(image)
    assert m is not None and m.container_id == cid
    assert sorted(m.nspids) == sorted(
        env.lab.status(t)["pid"] for t in tags)
    assert list(m.gpus) == env.lab.uuids[:1] and str(m.driver_version).startswith("580.")
    frozen = env.frozen(cid, tags)
    assert len(env.events("checkpoint")) == 1  # CRIU ran pre-dump twice; one checkpoint

    r = env.box.restore(cid, bundle, image)
    assert r.returncode == 0, r.stderr
    env.wait_running(tags, frozen)
    assert env.box.state(cid)["status"] == "running"
    restores = env.events("restore")
    assert len(restores) == 1 and not restores[0].get("error")
    assert sorted(restores[0]["pids"]) != []
    record = Store(env.state_dir).load(container_key(cid, str(bundle)))
    assert record is not None and record["pid"] == env.box.state(cid)["pid"]  # updated by the hook on restore


def test_leave_running_goes_on_intact(make_env, tmp_path) -> None:  # type: ignore[no-untyped-def]
    env = make_env()
    cid, _, tags = start(env)
    before = env.counters(tags)
    r = env.box.checkpoint(cid, tmp_path / "img", leave_running=True)
    assert r.returncode == 0, r.stderr
    env.wait_running(tags, before)  # the guardian put them back on the GPU
    env.wait_event("guardian", lambda e: "resumed" in e.get("outcome", ""))
    assert env.box.state(cid)["status"] == "running"


def test_hook_not_registered_the_dump_is_refused(make_env, tmp_path) -> None:  # type: ignore[no-untyped-def]
    env = make_env()
    cid, _, tags = start(env, oci_hooks=False, action_script=False)
    before = env.counters(tags)
    r = env.box.checkpoint(cid, tmp_path / "img")
    assert r.returncode != 0
    dump_log = (tmp_path / "img.work" / "dump.log").read_text()
    # The live GPU: an open /dev/nvidia* node (a character device CRIU cannot
    # dump), or the connection to the GPU service, whichever CRIU meets first.
    assert ("External socket is used" in dump_log
            or re.search(r"Can't dump file \d+ of that type \[\d+\] \(chr ", dump_log)), dump_log[-2000:]
    env.wait_running(tags, before)


def test_action_script_alone_works_by_discovery(make_env, tmp_path) -> None:  # type: ignore[no-untyped-def]
    env = make_env()
    cid, bundle, tags = start(env, oci_hooks=False)
    r = env.box.checkpoint(cid, tmp_path / "img")
    assert r.returncode == 0, r.stderr
    frozen = env.frozen(cid, tags)
    m = manifest.read(tmp_path / "img")
    assert m is not None and m.container_id is None
    r = env.box.restore(cid, bundle, tmp_path / "img")
    assert r.returncode == 0, r.stderr
    env.wait_running(tags, frozen)


def test_remap_onto_other_gpus_on_r580(make_env, tmp_path) -> None:  # type: ignore[no-untyped-def]
    env = make_env(driver=580, gpus=2)
    a, b = env.lab.uuids
    cid, _, tags = start(env, visible=[a])
    image = tmp_path / "img"
    assert env.box.checkpoint(cid, image).returncode == 0
    frozen = env.frozen(cid, tags)
    moved = env.box.bundle("b2", WORKLOADS, others=OTHERS, visible=[b])
    r = env.box.restore(cid, moved, image)
    assert r.returncode == 0, r.stderr
    env.wait_running(tags, frozen)
    assert {env.lab.status(t)["gpu"] for t in tags} == {b}
    used = [g["memory_used_mib"] for g in env.lab.info()["gpus"]]
    assert used[0] == 0 and used[1] > 0
    assert env.events("restore")[-1]["device_map"] == {a: b}


def test_remap_refused_on_r570_before_tasks_run(make_env, tmp_path) -> None:  # type: ignore[no-untyped-def]
    env = make_env(driver=570, gpus=2)
    a, b = env.lab.uuids
    cid, _, tags = start(env, visible=[a])
    image = tmp_path / "img"
    assert env.box.checkpoint(cid, image).returncode == 0
    digest = tree_digest(image)
    frozen = env.frozen(cid, tags)
    moved = env.box.bundle("b2", WORKLOADS, others=OTHERS, visible=[b])
    r = env.box.restore(cid, moved, image)
    assert r.returncode != 0
    assert "--device-map" in (tmp_path / "img.rwork" / "restore.log").read_text()
    st = env.box.state(cid)
    assert st is None or st["status"] == "stopped"
    assert container_pids(cid) == {}  # nothing ran, nothing is left
    assert tree_digest(image) == digest
    # Same GPUs: the image restores fine.
    env.box.delete(cid)
    same = env.box.bundle("b3", WORKLOADS, others=OTHERS, visible=[a])
    r = env.box.restore(cid, same, image)
    assert r.returncode == 0, r.stderr
    env.wait_running(tags, frozen)


def test_a_device_map_annotation_that_misses_a_gpu_is_refused_before_tasks_run(make_env, tmp_path) -> None:  # type: ignore[no-untyped-def]
    env = make_env(driver=580, gpus=4)
    a, b, c, d = env.lab.uuids
    cid, _, tags = start(env, visible=[a, b])
    image = tmp_path / "img"
    assert env.box.checkpoint(cid, image).returncode == 0
    digest = tree_digest(image)
    frozen = env.frozen(cid, tags)
    partial = env.box.bundle("b2", WORKLOADS, others=OTHERS, visible=[c, d],
                             annotations={"cudahook.io/device-map": f"{a}={c}"})
    r = env.box.restore(cid, partial, image)
    assert r.returncode != 0
    log = (tmp_path / "img.rwork" / "restore.log").read_text()
    assert f"does not name GPU(s) {b}" in log
    st = env.box.state(cid)
    assert st is None or st["status"] == "stopped"
    assert env.events("restore") == []  # post-resume never ran: nothing to kill
    assert tree_digest(image) == digest
    # The whole map restores.
    if st is not None:
        env.box.delete(cid)
    whole = env.box.bundle("b3", WORKLOADS, others=OTHERS, visible=[c, d],
                           annotations={"cudahook.io/device-map": f"{a}={c},{b}={d}"})
    r = env.box.restore(cid, whole, image)
    assert r.returncode == 0, r.stderr
    env.wait_running(tags, frozen)


def test_checkpoint_fault_on_one_of_three(make_env, tmp_path) -> None:  # type: ignore[no-untyped-def]
    env = make_env()
    cid, _, _ = start(env, workloads=[("mp", {"mib": 2, "procs": 3})])
    tags = ["mp.0", "mp.1", "mp.2"]
    env.lab.fault("checkpoint", tag="mp.1", code=2)
    before = env.counters(tags)
    r = env.box.checkpoint(cid, tmp_path / "img")
    assert r.returncode != 0
    env.wait_running(tags, before)
    assert env.box.state(cid)["status"] == "running"
    err = env.events("checkpoint")[-1]["error"]
    assert "out of memory" in err


def test_dump_failing_after_pre_dump_resumes_on_gpu(make_env, tmp_path) -> None:  # type: ignore[no-untyped-def]
    env = make_env()
    # A process holding a connection to a host socket: CRIU cannot dump it,
    # and fails after pre-dump has checkpointed the CUDA processes.
    holder = ("/usr/bin/python3 -c 'import socket,time; s=socket.socket(socket.AF_UNIX); "
              "s.connect(\"/run/cuda-sim/gpu.sock\"); time.sleep(1e6)'")
    cid, _, tags = start(env, others=[holder])
    before = env.counters(tags)
    r = env.box.checkpoint(cid, tmp_path / "img")
    assert r.returncode != 0
    assert "External socket" in (tmp_path / "img.work" / "dump.log").read_text()
    assert env.events("checkpoint") and not env.events("checkpoint")[-1].get("error")
    env.wait_running(tags, before)
    env.wait_event("guardian", lambda e: "resumed" in e.get("outcome", ""))


def test_restore_fault_fails_closed_then_retry_succeeds(make_env, tmp_path) -> None:  # type: ignore[no-untyped-def]
    env = make_env()
    cid, bundle, tags = start(env)
    image = tmp_path / "img"
    assert env.box.checkpoint(cid, image).returncode == 0
    frozen = env.frozen(cid, tags)
    digest = tree_digest(image)
    env.lab.fault("restore", tag="mp.2", code=2)
    before = image_hashes(image)
    env.box.restore(cid, bundle, image)
    assert_nothing_restored(env, cid, image, before)
    err = env.events("restore")[-1]["error"]
    assert "container killed" in err and "out of memory" in err
    assert tree_digest(image) == digest
    env.lab.clear_faults()
    env.box.delete(cid)
    r = env.box.restore(cid, bundle, image)
    assert r.returncode == 0, r.stderr
    env.wait_running(tags, frozen)


@pytest.mark.parametrize("driver", [550, 570])
def test_round_trip_on_older_drivers(make_env, tmp_path, driver: int) -> None:  # type: ignore[no-untyped-def]
    env = make_env(driver=driver)
    cid, bundle, tags = start(env)
    assert env.box.checkpoint(cid, tmp_path / "img").returncode == 0
    frozen = env.frozen(cid, tags)
    r = env.box.restore(cid, bundle, tmp_path / "img")
    assert r.returncode == 0, r.stderr
    env.wait_running(tags, frozen)


@pytest.mark.parametrize("leave_running", [True, False])
def test_paused_first_as_containerd_and_docker_do(make_env, tmp_path, leave_running: bool) -> None:  # type: ignore[no-untyped-def]
    """containerd and docker freeze the container, then call runc checkpoint:
    a frozen CUDA process cannot answer cuda-checkpoint, so the hook thaws it
    for the CUDA phase and refreezes it for CRIU."""
    env = make_env()
    cid, bundle, tags = start(env)
    assert env.box.pause(cid).returncode == 0
    paused = env.paused(cid, tags)
    image = tmp_path / "img"
    r = env.box.checkpoint(cid, image, leave_running=leave_running)
    assert r.returncode == 0, r.stderr
    if leave_running:
        assert env.box.state(cid)["status"] == "paused"  # as the runtime left it
        assert env.box.resume(cid).returncode == 0
        env.wait_running(tags, paused)  # the guardian waited for the thaw, then restored
        env.wait_event("guardian", lambda e: "resumed" in e.get("outcome", ""))
    else:
        frozen = env.frozen(cid, tags)
        r = env.box.restore(cid, bundle, image)
        assert r.returncode == 0, r.stderr
        env.wait_running(tags, frozen)


def test_containers_without_gpu_never_start_python(make_env, tmp_path) -> None:  # type: ignore[no-untyped-def]
    """The shell fast paths: no record, no pre-dump/restore work for a plain
    container; a container holding GPU device nodes (an NVML monitor) does
    start Python, which finds no CUDA process but the device files CRIU
    cannot dump, and refuses, naming them, before CRIU fails on them."""
    env = make_env()
    # The shell's device test covers the default device_pattern only (see
    # hooks/cudahook-lib.sh); containers see /dev/nvidia*, so the lab's
    # wider pattern is not needed here.
    cfg = yaml.safe_load(env.config.read_text())
    del cfg["device_pattern"]
    env.config.write_text(yaml.safe_dump(cfg))
    plain = env.box.bundle("plain", [], others=["sleep 100000"], visible=[])
    cid = env.cid()
    assert env.box.run(cid, plain).returncode == 0
    assert env.box.checkpoint(cid, tmp_path / "img").returncode == 0
    assert env.box.restore(cid, plain, tmp_path / "img").returncode == 0
    assert env.box.state(cid)["status"] == "running"
    assert env.events() == []  # not one Python hook ran

    nvml = env.box.bundle("nvml", [("mon", {"nvml_only": True})])
    cid2 = env.cid()
    assert env.box.run(cid2, nvml).returncode == 0
    env.lab.wait_counter("mon", 2)
    r = env.box.checkpoint(cid2, tmp_path / "img2")
    assert r.returncode != 0
    pre = env.wait_event("pre-dump")
    assert pre["cuda_processes"] == 0 and pre["container"] == cid2
    assert "holds /dev/nvidia0, /dev/nvidiactl" in pre["error"] and "nothing was locked" in pre["error"]
    assert env.box.state(cid2)["status"] == "running"
    env.lab.wait_counter("mon", env.lab.status("mon")["counter"] + 2)

    # A configured device_pattern is Python's to apply: then even a plain
    # container's pre-dump starts Python, which finds nothing to do.
    env.config.write_text(yaml.safe_dump({**cfg, "device_pattern": r"^/dev/nvidia[0-9]+$"}))
    cid3 = env.cid()
    assert env.box.run(cid3, plain).returncode == 0
    assert env.box.checkpoint(cid3, tmp_path / "img3").returncode == 0
    pres = env.events("pre-dump")
    assert len(pres) == 2 and pres[-1]["container"] is None and pres[-1]["cuda_processes"] == 0



def test_simulated_device_nodes_fail_the_dump_like_real_ones(make_env, tmp_path) -> None:  # type: ignore[no-untyped-def]
    """Without cudahook, an fd left open on /dev/nvidia* stops CRIU, as on a
    GPU node: the simulated nodes are character devices CRIU cannot dump."""
    env = make_env()
    nvml = env.box.bundle("nvml-bare", [("mon", {"nvml_only": True})], action_script=False,
                          oci_hooks=False)
    cid = env.cid()
    assert env.box.run(cid, nvml).returncode == 0
    env.lab.wait_counter("mon", 2)
    r = env.box.checkpoint(cid, tmp_path / "img")
    assert r.returncode != 0
    assert env.box.state(cid)["status"] == "running"


def test_status_on_a_paused_container_answers_at_once(make_env) -> None:  # type: ignore[no-untyped-def]
    """A frozen CUDA process cannot answer cuda-checkpoint: status says so
    instead of waiting for it."""
    import subprocess
    import sys

    env = make_env()
    cid, _bundle, tags = start(env, workloads=[("solo", {"mib": 1})], others=[])
    assert env.box.pause(cid).returncode == 0
    try:
        t = time.monotonic()
        r = subprocess.run([sys.executable, "-m", "cudahook", "--config", str(env.config),
                            "status", cid], capture_output=True, text=True, timeout=60)
        assert r.returncode == 0, r.stderr
        assert time.monotonic() - t < 8
        assert "container paused: processes not probed" in r.stdout, r.stdout
    finally:
        assert env.box.resume(cid).returncode == 0
    env.wait_running(tags, env.counters(tags))
    r = subprocess.run([sys.executable, "-m", "cudahook", "--config", str(env.config), "status",
                        cid], capture_output=True, text=True, timeout=60)
    assert "running" in r.stdout and "nspid" in r.stdout, r.stdout


def test_a_failed_checkpoint_of_a_paused_container_does_not_hold_up_the_next(make_env, tmp_path) -> None:  # type: ignore[no-untyped-def]
    """pre-dump rolled a failed checkpoint back itself, and the container
    stays paused: its guardian, armed before the lock, has nothing to do and
    says so at once, instead of waiting for a thaw that may never come -
    so the next checkpoint (which thaws for the CUDA phase) is not refused
    for a guardian still alive."""
    env = make_env()
    cfg = yaml.safe_load(env.config.read_text())
    env.config.write_text(yaml.safe_dump({**cfg, "guardian_wait_s": 1}))
    cid, bundle, tags = start(env)
    assert env.box.pause(cid).returncode == 0
    env.lab.fault("checkpoint", tag="mp.1", code=2)
    r = env.box.checkpoint(cid, tmp_path / "img")
    assert r.returncode != 0
    assert env.box.state(cid)["status"] == "paused"
    env.wait_event("guardian", lambda e: "nothing to resume" in e.get("outcome", ""))
    env.lab.clear_faults()
    r = env.box.checkpoint(cid, tmp_path / "img2")
    assert r.returncode == 0, r.stderr
    frozen = env.frozen(cid, tags)
    r = env.box.restore(cid, bundle, tmp_path / "img2")
    assert r.returncode == 0, r.stderr
    env.wait_running(tags, frozen)
