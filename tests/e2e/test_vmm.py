"""The CUDA VMM interposer step, end to end through runc and CRIU."""

from __future__ import annotations

import socket
import threading
import time
from pathlib import Path

import pytest

from cudahook.core import manifest

from .conftest import needs_runc, tree_digest
from .outcomes import assert_nothing_restored, image_hashes

pytestmark = needs_runc

TAGS = ["mp.0", "mp.1", "mp.2"]


def start(env, tmp_path: Path, *, vmm=True, control=True, name="b1", **kw):  # type: ignore[no-untyped-def]
    ctl = tmp_path / f"control-{name}"
    ctl.mkdir(exist_ok=True)
    workloads = kw.pop("workloads", [("mp", {"mib": 1, "procs": 3, "vmm": vmm})])
    bundle = env.box.bundle(name, workloads, snapshot_control=ctl if control else None, **kw)
    cid = env.cid()
    r = env.box.run(cid, bundle)
    assert r.returncode == 0, r.stderr
    tags = [f"{w[0]}.{i}" for w in workloads for i in range(w[1].get("procs", 1))] \
        if any(w[1].get("procs", 1) > 1 for w in workloads) else [w[0] for w in workloads]
    env.wait_running(tags, steps=3)
    return cid, bundle, ctl, tags


def test_all_shims_mappings_survive(make_env, tmp_path) -> None:  # type: ignore[no-untyped-def]
    env = make_env()
    cid, bundle, ctl, tags = start(env, tmp_path)
    assert sorted(p.name for p in ctl.iterdir()) == sorted(
        f"cuda-vmm-{env.lab.status(t)['pid']}.sock" for t in tags)
    image = tmp_path / "img"
    r = env.box.checkpoint(cid, image)
    assert r.returncode == 0, r.stderr
    assert (image / "cuda-vmm.state").is_file()
    assert getattr(manifest.read(image), "vmm", None) is True
    frozen = env.frozen(cid, tags)
    r = env.box.restore(cid, bundle, image)
    assert r.returncode == 0, r.stderr
    env.wait_running(tags, frozen)  # includes the VMM mapping's content check
    calls = env.lab.vmm_calls()
    assert [c["op"] for c in calls] == ["prepare", "restore"]
    assert calls[0]["proc_root"] == "/proc" and calls[1]["proc_root"] == ""
    assert sorted(ns for _, ns in calls[0]["processes"]) == sorted(
        env.lab.status(t)["pid"] for t in tags)


def test_without_the_coordinator_the_mappings_are_lost(make_env, tmp_path) -> None:  # type: ignore[no-untyped-def]
    """What the VMM step is for: cuda-checkpoint alone drops VMM mappings. An
    image whose VMM state went missing is refused before its tasks run."""
    env = make_env()
    cid, bundle, _, tags = start(env, tmp_path)
    image = tmp_path / "img"
    assert env.box.checkpoint(cid, image).returncode == 0
    (image / "cuda-vmm.state").unlink()  # as if the coordinator had saved nothing
    env.frozen(cid, tags)
    digest = tree_digest(image)
    r = env.box.restore(cid, bundle, image)
    assert r.returncode != 0
    assert "no regular cuda-vmm.state" in (tmp_path / "img.rwork" / "restore.log").read_text()
    assert tree_digest(image) == digest
    st = env.box.state(cid)
    assert st is None or st["status"] == "stopped"
    if st is not None:
        env.box.delete(cid)
    # A manifest without the VMM step: the coordinator is not run at restore,
    # and the workload visibly loses its mappings.
    m = manifest.read(image)
    assert m is not None
    # Nor the checksum of a cuda-vmm.state it would not have.
    manifest.write(image, m.replace(vmm=False, files={}))
    assert env.box.restore(cid, bundle, image).returncode == 0
    assert [c["op"] for c in env.lab.vmm_calls()] == ["prepare"]  # not run at restore
    deadline = time.monotonic() + 20
    while not all("no device mapping for 'vmm'" in " ".join(env.lab.status(t)["errors"])
                  for t in tags):
        assert time.monotonic() < deadline, [env.lab.status(t) for t in tags]
        time.sleep(0.1)
    assert not any(env.lab.status(t)["intact"] for t in tags)


def test_a_stale_vmm_state_in_a_reused_image_dir_is_ignored(make_env, tmp_path) -> None:  # type: ignore[no-untyped-def]
    env = make_env()
    cid, bundle, _, tags = start(env, tmp_path, vmm=False)
    image = tmp_path / "img"
    assert env.box.checkpoint(cid, image).returncode == 0
    (image / "cuda-vmm.state").write_text("{}")  # left by an older checkpoint here
    frozen = env.frozen(cid, tags)
    assert env.box.restore(cid, bundle, image).returncode == 0
    env.wait_running(tags, frozen)
    assert env.lab.vmm_calls() == []  # the coordinator was never run on it
    assert any("not from this checkpoint" in e.get("warning", "")
               for e in env.events("post-restore"))


def test_no_sockets_plain_path(make_env, tmp_path) -> None:  # type: ignore[no-untyped-def]
    env = make_env()
    cid, bundle, _, tags = start(env, tmp_path, vmm=False)
    image = tmp_path / "img"
    assert env.box.checkpoint(cid, image).returncode == 0
    assert getattr(manifest.read(image), "vmm", None) is False
    frozen = env.frozen(cid, tags)
    assert env.box.restore(cid, bundle, image).returncode == 0
    env.wait_running(tags, frozen)
    assert env.lab.vmm_calls() == []


def _refused(env, tmp_path, cid, tags, text: str) -> None:  # type: ignore[no-untyped-def]
    before = env.counters(tags)
    r = env.box.checkpoint(cid, tmp_path / "img")
    assert r.returncode != 0
    err = env.wait_event("pre-dump", lambda e: "error" in e)["error"]
    assert text in err
    assert env.events("checkpoint") == []  # nothing was locked
    env.wait_running(tags, before)
    assert env.box.state(cid)["status"] == "running"


def test_one_of_three_without_shim_is_refused(make_env, tmp_path) -> None:  # type: ignore[no-untyped-def]
    env = make_env()
    workloads = [("a", {"mib": 1, "vmm": True}), ("b", {"mib": 1, "vmm": True}),
                 ("c", {"mib": 1})]
    cid, _, _, tags = start(env, tmp_path, workloads=workloads)
    nspid = env.lab.status("c")["pid"]
    _refused(env, tmp_path, cid, tags, f"namespace pid {nspid}")
    assert env.lab.vmm_calls() == []


@pytest.mark.parametrize("decoy", ["symlink", "fifo", "file"])
def test_decoys_count_as_missing_and_are_never_followed(make_env, tmp_path, decoy: str) -> None:  # type: ignore[no-untyped-def]
    env = make_env()
    # A host socket the container's symlink points at: no hook may reach it.
    trap_path = tmp_path / "trap.sock"
    trap = socket.socket(socket.AF_UNIX)
    trap.bind(str(trap_path))
    trap.listen(4)
    trap.settimeout(0.2)
    hits: list[int] = []
    stop = threading.Event()

    def watch() -> None:
        while not stop.is_set():
            try:
                trap.accept()[0].close()
                hits.append(1)
            except OSError:
                continue

    threading.Thread(target=watch, daemon=True).start()
    workloads = [("a", {"mib": 1, "vmm": True}), ("b", {"mib": 1, "vmm": True}),
                 ("c", {"mib": 1, "vmm_decoy": decoy})]
    try:
        if decoy == "symlink":
            env.lab.root.joinpath("trap-target").write_text(str(trap_path))
        cid, _, ctl, tags = start(env, tmp_path, workloads=workloads)
        if decoy == "symlink":  # re-point the decoy at the host trap
            link = ctl / f"cuda-vmm-{env.lab.status('c')['pid']}.sock"
            link.unlink()
            link.symlink_to(trap_path)
        _refused(env, tmp_path, cid, tags, f"namespace pid {env.lab.status('c')['pid']}")
    finally:
        stop.set()
        trap.close()
    assert hits == []
    assert env.lab.vmm_calls() == []


def test_symlinked_control_dir_with_the_interposer_loaded_is_refused(make_env, tmp_path) -> None:  # type: ignore[no-untyped-def]
    """The shims serve through a symlink the hook does not follow: without
    their sockets the VMM state would be lost, and the shims are there."""
    env = make_env()
    cid, _, _, tags = start(env, tmp_path, control=False, control_symlink="/tmp", others=[])
    _refused(env, tmp_path, cid, tags, "interposer loaded")
    assert env.lab.vmm_calls() == []


def test_symlinked_control_dir_without_interposer_is_a_plain_checkpoint(make_env, tmp_path) -> None:  # type: ignore[no-untyped-def]
    env = make_env()
    cid, _, _, _ = start(env, tmp_path, vmm=False, control=False, control_symlink="/tmp",
                         others=[])
    assert env.box.checkpoint(cid, tmp_path / "img").returncode == 0
    assert getattr(manifest.read(tmp_path / "img"), "vmm", None) is False
    assert env.lab.vmm_calls() == []


def test_containers_sharing_a_control_dir_with_colliding_pids(make_env, tmp_path) -> None:  # type: ignore[no-untyped-def]
    """Both containers' shims are cuda-vmm-<same nspid>.sock in one directory:
    the later one took the names. The earlier container's processes have no
    socket of their own and are refused, never saved with the other's state;
    the later one checkpoints with its own."""
    env = make_env()
    shared = tmp_path / "shared"
    shared.mkdir()
    cids, tags = [], []
    for name, base in (("b1", "x"), ("b2", "y")):
        # The namespace PID a workload gets depends on what else the
        # container's init started first, which a loaded machine can reorder:
        # start the second container again until its PID collides with the
        # first's, the case this test is about.
        # Each attempt has a tag of its own, so no status a killed attempt
        # wrote last can be read for the next one.
        for attempt in range(25):
            tag = f"{base}{attempt}"
            bundle = env.box.bundle(name, [(tag, {"mib": 1, "vmm": True})],
                                    snapshot_control=shared, others=[])
            cid = env.cid()
            assert env.box.run(cid, bundle).returncode == 0, name
            env.wait_running([tag], steps=3)
            if not tags or env.lab.status(tag)["pid"] == env.lab.status(tags[0])["pid"]:
                break
            env.box.delete(cid)
        cids.append(cid)
        tags.append(tag)
    nspids = {env.lab.status(t)["pid"] for t in tags}
    assert len(nspids) == 1  # the collision this test is about
    _refused(env, tmp_path, cids[0], tags[:1], "interposer loaded")
    assert env.lab.vmm_calls() == []
    image = tmp_path / "img2"
    assert env.box.checkpoint(cids[1], image).returncode == 0
    assert getattr(manifest.read(image), "vmm", None) is True
    # b1 is untouched by b2's checkpoint and poststop.
    assert (shared / f"cuda-vmm-{nspids.pop()}.sock").exists() is False
    env.wait_running(tags[:1], env.counters(tags[:1]))


def test_coordinator_failure_at_prepare_rolls_back(make_env, tmp_path) -> None:  # type: ignore[no-untyped-def]
    env = make_env()
    cid, _, _, tags = start(env, tmp_path)
    env.lab.fault("vmm-prepare", message="shim did not answer")
    _refused(env, tmp_path, cid, tags, "shim did not answer")


def test_coordinator_failure_at_restore_fails_closed(make_env, tmp_path) -> None:  # type: ignore[no-untyped-def]
    env = make_env()
    cid, bundle, _, tags = start(env, tmp_path)
    image = tmp_path / "img"
    assert env.box.checkpoint(cid, image).returncode == 0
    frozen = env.frozen(cid, tags)
    digest = tree_digest(image)
    env.lab.fault("vmm-restore", message="replay failed")
    before = image_hashes(image)
    env.box.restore(cid, bundle, image)
    assert_nothing_restored(env, cid, image, before)
    err = env.wait_event("restore", lambda e: "error" in e)["error"]
    assert "replay failed" in err and "container killed" in err
    assert tree_digest(image) == digest
    env.lab.clear_faults()
    env.box.delete(cid)
    assert env.box.restore(cid, bundle, image).returncode == 0
    env.wait_running(tags, frozen)


def test_coordinator_before_unlock_option(make_env, tmp_path) -> None:  # type: ignore[no-untyped-def]
    env = make_env()
    cid, bundle, _, tags = start(
        env, tmp_path, annotations={"cudahook.io/vmm-restore-before-unlock": "true"})
    image = tmp_path / "img"
    assert env.box.checkpoint(cid, image).returncode == 0
    frozen = env.frozen(cid, tags)
    assert env.box.restore(cid, bundle, image).returncode == 0
    env.wait_running(tags, frozen)
    assert [c["op"] for c in env.lab.vmm_calls()] == ["prepare", "restore"]


def test_rollback_after_prepare_brings_the_mappings_back(make_env, tmp_path) -> None:  # type: ignore[no-untyped-def]
    """The checkpoint of the second of two VMM workloads fails: both are
    rolled back onto the GPU with their VMM mappings, or it says unsafe."""
    env = make_env()
    workloads = [("a", {"mib": 1, "vmm": True}), ("b", {"mib": 1, "vmm": True})]
    cid, _, _, tags = start(env, tmp_path, workloads=workloads, others=[])
    env.lab.fault("checkpoint", tag="b", code=2)
    r = env.box.checkpoint(cid, tmp_path / "img")
    assert r.returncode != 0
    env.lab.clear_faults()
    # Counted from now: a memory check (VMM mapping included) after the rollback.
    env.wait_running(tags, env.counters(tags))
    assert [c["op"] for c in env.lab.vmm_calls()] == ["prepare", "restore"]
    assert "out of memory" in env.events("checkpoint")[-1]["error"]
    assert env.box.state(cid)["status"] == "running"


def test_leave_running_brings_the_mappings_back(make_env, tmp_path) -> None:  # type: ignore[no-untyped-def]
    env = make_env()
    cid, _, _, tags = start(env, tmp_path, others=[])
    r = env.box.checkpoint(cid, tmp_path / "img", leave_running=True)
    assert r.returncode == 0, r.stderr
    env.wait_event("guardian", lambda e: "resumed" in e.get("outcome", ""))
    env.wait_running(tags, env.counters(tags))
    assert [c["op"] for c in env.lab.vmm_calls()] == ["prepare", "restore"]


def test_failed_dump_brings_the_mappings_back(make_env, tmp_path) -> None:  # type: ignore[no-untyped-def]
    env = make_env()
    holder = ("/usr/bin/python3 -c 'import socket,time; s=socket.socket(socket.AF_UNIX); "
              "s.connect(\"/run/cuda-sim/gpu.sock\"); time.sleep(1e6)'")
    cid, _, _, tags = start(env, tmp_path, others=[holder])
    r = env.box.checkpoint(cid, tmp_path / "img")
    assert r.returncode != 0
    assert "External socket" in (tmp_path / "img.work" / "dump.log").read_text()
    env.wait_event("guardian", lambda e: "resumed" in e.get("outcome", ""))
    env.wait_running(tags, env.counters(tags))
    assert [c["op"] for c in env.lab.vmm_calls()] == ["prepare", "restore"]


def test_mappings_that_cannot_come_back_are_reported_unsafe(make_env, tmp_path) -> None:  # type: ignore[no-untyped-def]
    env = make_env()
    workloads = [("a", {"mib": 1, "vmm": True}), ("b", {"mib": 1, "vmm": True})]
    cid, _, _, _ = start(env, tmp_path, workloads=workloads, others=[])
    env.lab.fault("checkpoint", tag="b", code=2)
    env.lab.fault("vmm-restore", message="replay failed")
    r = env.box.checkpoint(cid, tmp_path / "img")
    assert r.returncode != 0
    ev = env.wait_event("checkpoint", lambda e: "error" in e)
    assert "replay failed" in ev["error"] and ev.get("unsafe") is True
    with open(env.config) as f:
        state_dir = __import__("yaml").safe_load(f)["state_dir"]
    hist = __import__("json").loads((Path(state_dir) / "history" / f"{cid}.json").read_text())
    assert hist["checkpoint"]["ok"] is False and hist["checkpoint"].get("unsafe") is True


def test_poststop_removes_the_restored_containers_own_sockets(make_env, tmp_path) -> None:  # type: ignore[no-untyped-def]
    env = make_env()
    cid, bundle, ctl, tags = start(env, tmp_path, others=[])
    (ctl / "keep").write_text("not ours")
    image = tmp_path / "img"
    assert env.box.checkpoint(cid, image).returncode == 0
    assert sorted(p.name for p in ctl.iterdir()) == ["keep"]  # the dumped container's poststop
    frozen = env.frozen(cid, tags)
    assert env.box.restore(cid, bundle, image).returncode == 0
    env.wait_running(tags, frozen)
    assert len(list(ctl.glob("cuda-vmm-*.sock"))) == len(tags)
    env.box.delete(cid)
    assert sorted(p.name for p in ctl.iterdir()) == ["keep"]


def test_storage_path_mappings_survive(make_env, tmp_path, capsys) -> None:  # type: ignore[no-untyped-def]
    """`gpu_memory: storage`: the GPU memory goes into cudahook-gpu/, the
    interposer's state into cuda-vmm.state, both in the image. After a
    --leave-running dump the guardian restores the memory from the chunks
    and replays the mappings; a restore brings back each process's memory
    and its VMM mappings."""
    from .test_gpu_storage_e2e import configure

    env = make_env()
    env.lab.set(cuda_version=13040)
    configure(env, "storage")
    cid, bundle, _, tags = start(env, tmp_path,
                                 workloads=[("mp", {"mib": 20, "procs": 3, "vmm": True,
                                                    "check_after_restore": True})], others=[])
    r = env.box.checkpoint(cid, tmp_path / "live", leave_running=True)
    assert r.returncode == 0, r.stderr
    env.wait_event("guardian", lambda e: "resumed" in e.get("outcome", ""))
    env.wait_running(tags, env.counters(tags))
    assert [c["op"] for c in env.lab.vmm_calls()] == ["prepare", "restore"]
    image = tmp_path / "img"
    r = env.box.checkpoint(cid, image)
    assert r.returncode == 0, r.stderr
    m = manifest.read(image)
    assert m is not None and m.vmm is True and m.gpu_storage is not None
    assert (image / "cuda-vmm.state").is_file()
    assert len(m.gpu_storage.processes) == len(tags)
    frozen = env.frozen(cid, tags)
    r = env.box.restore(cid, bundle, image)
    assert r.returncode == 0, r.stderr
    env.wait_running(tags, frozen)  # includes the VMM mapping's content check
    assert [c["op"] for c in env.lab.vmm_calls()] == ["prepare", "restore"] * 2
    for t in tags:
        st = env.lab.status(t)
        assert st["intact"] and not st["errors"] and st.get("checked_restores", 0) >= 1, st
