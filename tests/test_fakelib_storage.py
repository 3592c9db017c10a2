"""Custom storage (CUDA 13.4+) in the simulated libcuda: the caller maps the
target's device memory, copies it out and in at the link's pace, and
completes; the driver's rules hold; a workload's memory check catches any
byte that comes back wrong."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

from .conftest import requires_root

CALLER = Path(__file__).with_name("storage_caller.py")


class Caller:
    """tests/storage_caller.py on a node's libcuda, one JSON line per step."""

    def __init__(self, node, pid: int, action: str, path: Path, *opts: str):  # type: ignore[no-untyped-def]
        self.proc = subprocess.Popen(
            [sys.executable, str(CALLER), str(node.lab.libcuda), str(pid), action, str(path),
             *opts], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
            env={**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[1])})

    def step(self) -> dict:
        assert self.proc.stdout is not None
        line = self.proc.stdout.readline()
        assert line, f"the caller ended early (exit {self.proc.wait(10)})"
        return json.loads(line)

    def go_on(self) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.write("\n")
        self.proc.stdin.flush()

    def finish(self, timeout: float = 60) -> list[dict]:
        out, _ = self.proc.communicate(timeout=timeout)
        return [json.loads(line) for line in out.splitlines()]


def run(node, pid: int, action: str, path: Path, *opts: str) -> list[dict]:  # type: ignore[no-untyped-def]
    return Caller(node, pid, action, path, *opts).finish()


def used_by(node, pid: int) -> int | None:  # type: ignore[no-untyped-def]
    """Device memory the service charges to pid, None when it is on no GPU."""
    for gpu in node.lab.info()["gpus"]:
        for p in gpu["processes"]:
            if p["pid"] == pid:
                return int(p["used_bytes"])
    return None


def storage_node(make_node, **kw):  # type: ignore[no-untyped-def]
    node = make_node(**kw)
    node.lab.set(cuda_version=13040)  # a CUDA 13.4+ driver
    return node


def healthy_after(node, tag: str, restores: int) -> dict:  # type: ignore[no-untyped-def]
    """The workload's report once it has run on and checked its memory since
    its restore: its counter advanced and it checked its memory."""
    before = node.lab.status(tag)["counter"]
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline:
        st = node.lab.status(tag)
        if st.get("checked_restores", 0) >= restores and st["counter"] > before + 2:
            return st
        time.sleep(0.05)
    raise AssertionError(f"no check after the restore: {node.lab.status(tag)}")


def test_custom_storage_round_trip_keeps_the_workload_intact(make_node, tmp_path) -> None:  # type: ignore[no-untyped-def]
    node = storage_node(make_node, bandwidth_mib_s=200)
    node.spawn("w", mib=8, check_after_restore=True)
    pid = node.lab.wait_counter("w", 2)["pid"]
    image = tmp_path / "gpu-memory"
    t = time.monotonic()
    out = Caller(node, pid, "checkpoint", image, "--pause")
    mapped = out.step()
    # CHECKPOINTING: the range is mapped, the process still holds its memory.
    assert mapped["state"] == "checkpointing" and mapped["sizes"] == [(8 << 20) + 8]
    assert out.step()["state"] == "checkpointing"
    assert used_by(node, pid) == (8 << 20) + 8
    out.go_on()
    assert out.finish()[-1] == {"step": "complete", "state": "checkpointed"}
    took = time.monotonic() - t
    assert used_by(node, pid) is None  # released at completion
    assert took >= 8 / 200  # the copy out went at the link's pace
    assert image.stat().st_size == (8 << 20) + 8
    steps = run(node, pid, "restore", image)
    assert [s["state"] for s in steps] == ["restoring", "locked", "running"]
    st = healthy_after(node, "w", 1)
    assert st["intact"] and not st["errors"]


def test_a_byte_changed_during_the_copy_in_fails_the_memory_check(make_node, tmp_path) -> None:  # type: ignore[no-untyped-def]
    node = storage_node(make_node)
    node.spawn("w", mib=4, check_after_restore=True)
    pid = node.lab.wait_counter("w", 2)["pid"]
    image = tmp_path / "gpu-memory"
    assert run(node, pid, "checkpoint", image)[-1]["state"] == "checkpointed"
    # Chunk 2 of the range (1 MiB chunks): inside the data buffer.
    steps = run(node, pid, "restore", image, "--flip", str((2 << 20) + 12345))
    assert steps[-1]["state"] == "running"
    deadline = time.monotonic() + 20
    while node.lab.status("w").get("intact", True) and time.monotonic() < deadline:
        time.sleep(0.05)
    st = node.lab.status("w")
    assert not st["intact"] and "device memory content changed" in st["errors"]


def test_custom_storage_needs_retained_contexts_and_another_process(make_node, tmp_path) -> None:  # type: ignore[no-untyped-def]
    node = storage_node(make_node)
    node.spawn("w", mib=2)
    pid = node.lab.wait_counter("w", 2)["pid"]
    image = tmp_path / "gpu-memory"
    out = run(node, pid, "checkpoint", image, "--no-retain")
    assert out == [{"failed": "cuCheckpointProcessCheckpoint", "code": 201}]  # INVALID_CONTEXT
    state = subprocess.run([str(node.lab.cuda_checkpoint), "--get-state", "--pid", str(pid)],
                           capture_output=True, text=True)
    assert state.stdout == "locked\n"  # refused before anything moved
    out = run(node, pid, "checkpoint", image, "--self")
    assert out[-1] in ({"failed": "cuCheckpointProcessLock", "code": 3},
                       {"failed": "cuCheckpointProcessCheckpoint", "code": 801})


def test_custom_storage_is_refused_before_cuda_13_4(make_node, tmp_path) -> None:  # type: ignore[no-untyped-def]
    node = make_node(driver=590)  # CUDA 13.1: the pointer is still reserved space
    node.spawn("w", mib=2)
    pid = node.lab.wait_counter("w", 2)["pid"]
    out = run(node, pid, "checkpoint", tmp_path / "gpu-memory")
    assert out == [{"failed": "cuCheckpointProcessCheckpoint", "code": 1}]


def test_a_storage_checkpoint_is_not_restored_from_host_memory(make_node, tmp_path) -> None:  # type: ignore[no-untyped-def]
    node = storage_node(make_node)
    node.spawn("w", mib=2)
    pid = node.lab.wait_counter("w", 2)["pid"]
    run(node, pid, "checkpoint", tmp_path / "gpu-memory")
    tool = str(node.lab.cuda_checkpoint)
    r = subprocess.run([tool, "--action", "restore", "--pid", str(pid)], capture_output=True,
                       text=True)
    assert r.returncode == 1 and "invalid argument" in r.stderr
    got = subprocess.run([tool, "--get-state", "--pid", str(pid)], capture_output=True, text=True)
    assert got.stdout == "checkpointed\n"


PROBE = """
import ctypes, sys
lib = ctypes.CDLL(sys.argv[1])
get = lib.cuGetProcAddress_v2
get.argtypes = [ctypes.c_char_p, ctypes.POINTER(ctypes.c_void_p), ctypes.c_int, ctypes.c_uint64,
                ctypes.POINTER(ctypes.c_int)]
for version in (13000, 13040):
    fn, status = ctypes.c_void_p(), ctypes.c_int(-1)
    rc = get(b"cuCheckpointOperationComplete", ctypes.byref(fn), version, 0, ctypes.byref(status))
    print(version, rc, status.value, bool(fn.value))
"""


def test_cu_get_proc_address_gives_operation_complete_from_cuda_13_4_only(make_node) -> None:  # type: ignore[no-untyped-def]
    def probe(node) -> list[str]:  # type: ignore[no-untyped-def]
        return subprocess.run([sys.executable, "-c", PROBE, str(node.lab.libcuda)],
                              capture_output=True, text=True, check=True).stdout.splitlines()

    old = make_node("old", driver=590)
    # CUDA 13.1: not known at 13.0; asking for 13.4 is newer than the driver.
    assert probe(old) == ["13000 0 1 False", "13040 1 -1 False"]
    new = storage_node(make_node, name="new")
    # CUDA 13.4: found at 13.4; asked for at 13.0, the version is not enough.
    assert probe(new) == ["13000 0 2 False", "13040 0 0 True"]


def test_the_service_maps_device_memory_in_place_and_gives_it_back_whole() -> None:
    """The GPU service's range of a custom-storage checkpoint is the
    process's device memory itself, not a copy (a change shows through);
    a cancelled one leaves each allocation its own size; a restore's range
    becomes the allocations, byte for byte."""
    from cudahook.sim.gpu import Client, GpuService

    svc = GpuService({"driver_version": "590.1", "gpus": [{"uuid": "GPU-a", "memory_mib": 64}]})
    owner, other = Client(os.getpid()), Client(os.getpid())
    for c in (owner, other):
        svc.handle(c, {"op": "hello", "uuid": "GPU-a"}, b"")
    data = svc.handle(owner, {"op": "alloc", "size": 1 << 20, "seed": 7}, b"")[0]["handle"]
    counter = svc.handle(owner, {"op": "alloc", "size": 8}, b"")[0]["handle"]
    out = svc.handle(owner, {"op": "map_out", "handles": [data, counter]}, b"")[0]
    assert out["sizes"] == [1 << 20, 8]
    fd = svc.mappings[out["token"]].fd
    assert os.fstat(fd).st_size == (1 << 20) + 8
    owner.buffers[data][:4] = b"abcd"
    owner.buffers[counter][:4] = b"wxyz"
    assert os.pread(fd, 4, 0) == b"abcd"  # in place
    assert os.pread(fd, 4, 1 << 20) == b"\0" * 4  # the small ones gathered at the map
    svc.handle(owner, {"op": "unmap", "token": out["token"]}, b"")
    assert os.fstat(owner.fds[data]).st_size == 1 << 20
    image = bytes(owner.buffers[data]) + bytes(owner.buffers[counter])
    back = svc.handle(other, {"op": "map_in", "sizes": [1 << 20, 8]}, b"")[0]
    os.pwrite(svc.mappings[back["token"]].fd, image, 0)
    handles = svc.handle(other, {"op": "adopt", "token": back["token"]}, b"")[0]["handles"]
    assert [bytes(other.buffers[h]) for h in handles] == [image[:1 << 20], image[1 << 20:]]
    assert os.fstat(other.fds[handles[0]]).st_size == 1 << 20
    assert not svc.mappings


def test_the_gpu_kits_storage_probe_on_the_simulator(tmp_path) -> None:  # type: ignore[no-untyped-def]
    """tests/gpu's custom-storage probe, its logic run on the simulator so
    that one run on a real GPU settles the question: before CUDA 13.4 it
    answers no, with the reason; with it, one process goes through storage
    and back, measured per GPU, and computes on intact."""
    from tests.gpu.gpulib import Rig, custom_storage_probe

    rig = Rig.simulated(tmp_path / "rig", driver=590)
    try:
        wl = rig.spawn("small", "memory", gib=0.25)
        wl.wait_ready(60)
        no = custom_storage_probe(rig, lambda: wl, tmp_path / "no")
        assert no["supported"] is False and "13.4" in no["why"], no
        assert no["driver"] and no["cuda_version"] and no["cuda_version"] < 13040, no
        assert not (tmp_path / "no").exists()
        rig.lab.set(cuda_version=13040)
        got = custom_storage_probe(rig, lambda: wl, tmp_path / "yes")
        assert got["supported"] and got["cuda_version"] == 13040, got
        assert (got["state_after_checkpoint"], got["state_after_restore"]) == (
            "checkpointed", "locked"), got
        ((gpu, m),) = got["per_gpu"].items()
        assert gpu == rig.gpu_of(wl) and m["bytes"] >= 4 << 20 and got["chunks"] >= 1, got
        assert m["checkpoint_gb_s"] > 0 and m["restore_gb_s"] > 0, m
        assert got["intact"] and got["put_back"] == [], got
        assert got["status_after"]["restores"] == 1, got
    finally:
        rig.close()


@requires_root
def test_a_restores_copy_in_charges_the_gpu_not_the_callers_cgroup(make_node, tmp_path) -> None:  # type: ignore[no-untyped-def]
    """The range a custom-storage restore copies into is device memory: on a
    real node it takes none of the checkpointer's host memory. A checkpointer
    run by CRIU's action script sits in the restored container's memory
    cgroup, so the simulated range must not be charged there either."""
    from .test_check import memory_cgroup, shmem

    node = storage_node(make_node)
    node.spawn("w", mib=32, check_after_restore=True)
    pid = node.lab.wait_counter("w", 2)["pid"]
    image = tmp_path / "gpu-memory"
    assert run(node, pid, "checkpoint", image)[-1]["state"] == "checkpointed"
    with memory_cgroup([], 4 << 30) as cg:
        procs = cg / "cgroup.procs"
        caller = subprocess.Popen(
            [sys.executable, str(CALLER), str(node.lab.libcuda), str(pid), "restore", str(image),
             "--pause"], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
            env={**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[1])},
            preexec_fn=lambda: procs.write_text(str(os.getpid())))
        assert caller.stdout is not None and caller.stdin is not None
        steps = [json.loads(caller.stdout.readline()) for _ in range(2)]
        assert [s["step"] for s in steps] == ["mapped", "copied"], steps
        charged = shmem(cg)
        caller.stdin.write("\n")
        caller.stdin.flush()
        out, _ = caller.communicate(timeout=60)
        assert charged < 4 << 20, f"{charged} bytes of the GPU's range charged to the caller"
    assert json.loads(out.splitlines()[-1])["state"] == "running"
    st = healthy_after(node, "w", 1)
    assert st["intact"] and not st["errors"]
