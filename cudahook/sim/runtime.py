"""The CUDA runtime inside a simulated workload.

It behaves like the real driver's checkpoint support as seen from outside:
- a restore thread named `cuda` + 11 hex digits serves checkpoint requests on
  a control socket inside the process's own filesystem view; when the process
  is frozen, stopped or traced that thread cannot run, and a request hangs;
- lock blocks new GPU work and waits (up to a timeout) for work in flight;
  a lock that times out leaves the process running;
- checkpoint copies device memory into the process's own memory, then drops
  the GPU connection and every device node, so CRIU can dump it;
- restore re-acquires a GPU (possibly another one, by device map), copies the
  memory back and leaves the process locked; unlock lets GPU work go on;
- with custom storage (CUDA 13.4+) a checkpoint hands its device memory to
  the checkpointer's GPU as one range and stays `checkpointing` until the
  checkpointer completes it (memory released, `checkpointed`); a restore
  gets an empty range on its GPU, stays `restoring` while the checkpointer
  copies in, and takes its allocations from the range at completion
  (`locked`). Its host memory then never holds the device memory.
A GPU connection that breaks while the process is not checkpointed means the
device memory is gone: the runtime reports it lost, as a real process would
see CUDA_ERROR_... on its next call.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import secrets
import socket
import threading
import time
from collections.abc import Callable
from typing import Any

from .gpu import copy_memfd
from .protocol import (
    ILLEGAL_STATE,
    INVALID_VALUE,
    OUT_OF_MEMORY,
    TIMEOUT,
    UNKNOWN,
    Channel,
    CudaError,
    bind_unix,
    connect_unix,
    recv,
    send,
)

RUNNING, LOCKED, CHECKPOINTED = "running", "locked", "checkpointed"
# CUDA 13.4+ reports a checkpoint or restore in progress.
CHECKPOINTING, RESTORING = "checkpointing", "restoring"
# States the driver reports for a process in trouble; tests put a process
# there with the "sim-force-state" request (never sent by the fake tool).
FORCEABLE = ("failed", "unknown", "checkpointing", "restoring", RUNNING, LOCKED, CHECKPOINTED)
PR_SET_NAME = 15


class GpuLost(Exception):
    """The GPU connection broke while device memory lived on it."""


def ctl_path(ctl_dir: str, pid: int) -> str:
    return os.path.join(ctl_dir, f"cuda-sim-{pid}.sock")


def _name_thread(name: str) -> None:
    libc = ctypes.CDLL(None, use_errno=True)
    libc.prctl(PR_SET_NAME, name.encode(), 0, 0, 0)


class SimCuda:
    def __init__(self, gpu_socket: str, gpu: str, dev_dir: str = "/dev",
                 ctl_dir: str = "/dev/shm", tag: str = ""):
        self.tag = tag
        self.gpu_socket = gpu_socket
        self.gpu_uuid = gpu
        self.dev_dir = dev_dir
        self.ctl_dir = ctl_dir
        self.state = RUNNING
        self.cond = threading.Condition()
        self.inflight = 0
        self.io = threading.Lock()  # one request at a time on the GPU connection
        self.chan: Channel | None = None
        self.fds: list[int] = []
        self.index = -1
        self.bandwidth = 0.0
        self.buffers: dict[str, int] = {}  # name -> device handle
        self.vmm: set[str] = set()  # VMM mappings: cuda-checkpoint does not save these
        self.vmm_pending: set[str] = set()  # dropped by a checkpoint, not yet replayed
        self.vmm_wait_s = 5.0
        # name -> a memfd with the buffer's content while checkpointed: host
        # memory of this process (CRIU dumps and restores it with us)
        self.host_copy: dict[str, int] = {}
        # Checkpointed to custom storage: the allocations' names and sizes
        # (the content is the checkpointer's); None after a host checkpoint.
        self.layout: list[tuple[str, int]] | None = None
        self.storage: dict[str, Any] | None = None  # the custom-storage operation open
        self.lost: str | None = None
        self.restore_tid = 0
        self.restores = 0  # restores done: a workload may check its memory after each
        self.visible: list[str] = []  # every GPU CUDA sees in this process
        # A --launch-job member (R590+): the driver cannot drive two members
        # of one job at once.
        self.job_file = os.environ.get("CUDA_CHECKPOINT_JOB_FILE", "")
        self._ready = threading.Event()

    # -- setup ---------------------------------------------------------------

    def init(self) -> None:
        """cuInit + context creation: GPU connection, device nodes, restore thread."""
        self._acquire(self.gpu_uuid)
        assert self.chan is not None
        gpus = self.chan.call({"op": "info"})[0]["gpus"]
        # As nvidia-container-toolkit sets it up: NVIDIA_VISIBLE_DEVICES names
        # the container's GPUs; a process outside one sees them all.
        env = [u.strip() for u in os.environ.get("NVIDIA_VISIBLE_DEVICES", "").split(",")]
        named = [u for u in env if u.startswith(("GPU-", "MIG-"))]
        self.visible = named or [g["uuid"] for g in gpus]
        if self.gpu_uuid not in self.visible:
            self.visible.append(self.gpu_uuid)
        thread = threading.Thread(target=self._serve, name="cuda-restore", daemon=True)
        thread.start()
        self._ready.wait()

    def _acquire(self, uuid: str) -> None:
        chan = Channel(connect_unix(self.gpu_socket))
        try:
            reply, _ = chan.call({"op": "hello", "uuid": uuid, "kind": "cuda"})
        except BaseException:
            chan.close()
            raise
        self.chan, self.gpu_uuid = chan, uuid
        self.index = int(reply["index"])
        self.bandwidth = float(reply.get("bandwidth_mib_s") or 0)
        for node in ("nvidiactl", f"nvidia{self.index}", "nvidia-uvm"):
            path = os.path.join(self.dev_dir, node)
            if os.path.exists(path):
                self.fds.append(os.open(path, os.O_RDWR | os.O_CLOEXEC))

    def _release(self) -> None:
        for fd in self.fds:
            os.close(fd)
        self.fds = []
        if self.chan:
            self.chan.close()
            self.chan = None

    # -- GPU work (application threads) --------------------------------------

    def _call(self, msg: dict[str, Any], payload: bytes = b"", *, fd: int | None = None,
              take_fd: bool = False) -> tuple[dict[str, Any], Any]:
        """The reply, and its payload (or with take_fd, the descriptor it carried)."""
        if self.chan is None:
            raise GpuLost(self.lost or "no GPU context")
        try:
            with self.io:
                if take_fd:
                    return self.chan.call_fd(msg, fd)
                return self.chan.call(msg, payload, fd)
        except (EOFError, OSError, ValueError) as exc:
            self.lost = f"GPU connection lost: {exc}"
            raise GpuLost(self.lost) from exc

    @contextlib.contextmanager
    def _work(self):  # type: ignore[no-untyped-def]
        """Every CUDA call goes through here: blocked while locked or checkpointed."""
        with self.cond:
            while self.state != RUNNING:
                self.cond.wait()
            self.inflight += 1
        try:
            yield
        finally:
            with self.cond:
                self.inflight -= 1
                self.cond.notify_all()

    def alloc(self, name: str, size: int, seed: int | None = None, *, vmm: bool = False,
              content: str = "pattern") -> None:
        msg: dict[str, Any] = {"op": "alloc", "size": size}
        if seed is not None:
            msg["seed"] = seed
            msg["content"] = content
        with self._work():
            reply, _ = self._call(msg)
        self.buffers[name] = int(reply["handle"])
        if vmm:
            self.vmm.add(name)

    def _handle(self, name: str) -> int:
        if name in self.vmm_pending:
            # The shim holds the application's access to a VMM mapping until
            # the coordinator has replayed it; if it never does, it is lost.
            with self.cond:
                self.cond.wait_for(lambda: name not in self.vmm_pending, self.vmm_wait_s)
        try:
            return self.buffers[name]
        except KeyError:
            raise CudaError(INVALID_VALUE, f"no device mapping for {name!r}") from None

    def incr(self, name: str, duration: float = 0.0) -> int:
        with self._work():
            reply, _ = self._call({"op": "incr", "handle": self._handle(name),
                                   "duration": duration})
        return int(reply["value"])

    def digest(self, name: str) -> str:
        self._handle(name)
        with self._work():
            reply, _ = self._call({"op": "digest", "handle": self._handle(name)})
        return str(reply["sha256"])

    # -- the VMM interposer shim's side ----------------------------------------

    def export_vmm(self) -> list[dict[str, Any]]:
        out = []
        for name in sorted(self.vmm & set(self.buffers)):
            _, data = self._call({"op": "download", "handle": self.buffers[name]})
            out.append({"name": name, "content": data.hex()})
        return out

    def import_vmm(self, mappings: list[dict[str, Any]]) -> None:
        # The coordinator replays the allocations through the driver itself,
        # whether or not the application's own CUDA calls are unlocked yet.
        for m in mappings:
            reply, _ = self._call({"op": "upload"}, bytes.fromhex(m["content"]))
            with self.cond:
                self.buffers[m["name"]] = int(reply["handle"])
                self.vmm.add(m["name"])
                self.vmm_pending.discard(m["name"])
                self.cond.notify_all()

    def serve_vmm(self, path: str) -> None:
        listener = bind_unix(path)
        threading.Thread(target=serve_forever, args=(listener, self.handle_vmm),
                         name="vmm-shim", daemon=True).start()

    def handle_vmm(self, msg: dict[str, Any]) -> dict[str, Any]:
        if msg.get("op") == "export":
            return {"mappings": self.export_vmm()}
        if msg.get("op") == "import":
            self.import_vmm(msg.get("mappings", []))
            return {}
        raise CudaError(INVALID_VALUE, f"unknown request {msg.get('op')!r}")

    # -- the restore thread --------------------------------------------------

    def _serve(self) -> None:
        _name_thread("cuda" + secrets.token_hex(6)[:11])
        self.restore_tid = threading.get_native_id()
        listener = bind_unix(ctl_path(self.ctl_dir, os.getpid()))
        self._ready.set()
        serve_forever(listener, self.handle)

    def handle(self, msg: dict[str, Any]) -> dict[str, Any]:
        op = msg.get("op")
        if op == "get-state":
            return {"state": self.state}
        if op == "get-restore-tid":
            return {"tid": self.restore_tid}
        if op in ("lock", "checkpoint", "restore", "unlock", "storage-complete", "storage-cancel"):
            with self._job_turn():
                if op == "lock":
                    self.lock(int(msg.get("timeout_ms", 0)))
                elif op in ("checkpoint", "restore") and msg.get("storage"):
                    return self.begin_storage(op, msg.get("device_map") or {})
                elif op == "storage-complete":
                    self.complete_storage(str(msg.get("token")))
                elif op == "storage-cancel":
                    self.cancel_storage(str(msg.get("token")))
                elif op == "checkpoint":
                    self.checkpoint(bool(msg.get("transient")))
                elif op == "restore":
                    self.restore(msg.get("device_map") or {}, bool(msg.get("transient")))
                else:
                    self.unlock()
        elif op == "status":
            return {"state": self.state, "gpu": self.gpu_uuid, "lost": self.lost, "tag": self.tag,
                    "visible": self.visible}
        elif op == "sim-force-state" and msg.get("state") in FORCEABLE:
            with self.cond:
                self.state = str(msg["state"])
                self.cond.notify_all()
        else:
            raise CudaError(INVALID_VALUE, f"unknown request {op!r}")
        return {}

    @contextlib.contextmanager
    def _job_turn(self):  # type: ignore[no-untyped-def]
        """Hold the job's turn for one operation; another member already
        holding it makes this one fail, as the driver does."""
        if not self.job_file:
            yield
            return
        import fcntl

        fd = os.open(self.job_file + ".busy", os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o666)
        try:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                raise CudaError(ILLEGAL_STATE) from None
            yield
        finally:
            os.close(fd)  # nothing of the job left open for CRIU

    def lock(self, timeout_ms: int) -> None:
        with self.cond:
            if self.state != RUNNING:
                raise CudaError(ILLEGAL_STATE)
            self.state = LOCKED  # new work now blocks in _work()
            deadline = time.monotonic() + timeout_ms / 1000 if timeout_ms else None
            while self.inflight:
                left = None if deadline is None else deadline - time.monotonic()
                if left is not None and left <= 0:
                    self.state = RUNNING
                    self.cond.notify_all()
                    raise CudaError(TIMEOUT)
                self.cond.wait(left)

    def _begin(self, need: str, during: str | None) -> None:
        """Check the state an operation needs; with `during` (CUDA 13.4+),
        report that state while the operation runs."""
        with self.cond:
            if self.state != need:
                raise CudaError(ILLEGAL_STATE)
            if during:
                self.state = during

    def _undo(self, back: str, during: str | None) -> None:
        if during:
            with self.cond:
                self.state = back

    def checkpoint(self, transient: bool = False) -> None:
        during = CHECKPOINTING if transient else None
        self._begin(LOCKED, during)
        if self.chan is None:
            self._undo(LOCKED, during)
            raise CudaError(UNKNOWN, self.lost or "no GPU context")
        copy: dict[str, int] = {}
        try:
            for name, handle in self.buffers.items():
                if name in self.vmm:
                    continue  # VMM mappings are the interposer's to save
                # The GPU service paces the copy over the GPU's link: the copy
                # is made within its time, the rest is waited out here.
                reply, fd = self._call({"op": "download_fd", "handle": handle}, take_fd=True)
                # The link's time is counted from this reply (see the GPU
                # service): the copy below runs within it, not on top of it.
                ends = time.monotonic() + float(reply.get("link_left") or 0)
                try:
                    size = int(reply.get("size", -1))
                    if os.fstat(fd).st_size != size:
                        raise CudaError(UNKNOWN, f"host copy of {name!r} is incomplete")
                    # The host copy is this process's own memory, charged to
                    # its memory cgroup as the real driver's copy is: made
                    # here, from the device memory the service handed over.
                    copy[name] = copy_memfd(fd, size)
                except OSError as exc:
                    raise CudaError(OUT_OF_MEMORY, f"host copy of {name!r}: {exc}") from exc
                finally:
                    os.close(fd)
                left = ends - time.monotonic()
                if left > 0:
                    time.sleep(left)
        except (GpuLost, CudaError) as exc:
            for fd in copy.values():
                os.close(fd)
            self._undo(LOCKED, during)
            if isinstance(exc, CudaError):
                raise
            raise CudaError(UNKNOWN, str(exc)) from exc
        self.host_copy = copy
        self.vmm_pending |= self.vmm & set(self.buffers)
        self.buffers = {}
        self._release()  # the service frees our device memory with the connection
        with self.cond:
            self.state = CHECKPOINTED

    def restore(self, device_map: dict[str, str], transient: bool = False) -> None:
        during = RESTORING if transient else None
        self._begin(CHECKPOINTED, during)
        try:
            if self.layout is not None:
                raise CudaError(INVALID_VALUE)  # checkpointed to custom storage: restore from it
            target = self._target(device_map)
        except CudaError:
            self._undo(CHECKPOINTED, during)
            raise
        old_uuid = self.gpu_uuid
        try:
            self._acquire(target)
            handles = {}
            for name, fd in self.host_copy.items():
                reply, _ = self._call({"op": "upload_fd"}, fd=fd)
                handles[name] = int(reply["handle"])
        except (CudaError, GpuLost, OSError) as exc:
            # A failed restore leaves the process checkpointed (cuda-checkpoint #44).
            self._release()
            self.gpu_uuid = old_uuid
            self._undo(CHECKPOINTED, during)
            if isinstance(exc, CudaError):
                raise
            raise CudaError(UNKNOWN, str(exc)) from exc
        self.buffers.update(handles)
        self.restores += 1
        for fd in self.host_copy.values():
            os.close(fd)  # the host copy is freed once on the GPU again
        self.host_copy = {}
        if device_map:
            self.visible = [device_map.get(u, u) for u in self.visible]
        with self.cond:
            self.state = LOCKED

    def _target(self, device_map: dict[str, str]) -> str:
        """The GPU a restore puts the process on."""
        if not device_map:
            return self.gpu_uuid
        self._check_map(device_map)
        return device_map[self.gpu_uuid]

    # -- custom storage (CUDA 13.4+) --------------------------------------------

    def begin_storage(self, op: str, device_map: dict[str, str]) -> dict[str, Any]:
        """A checkpoint or restore through the checkpointer's custom storage:
        the range's token and size, for the checkpointer to map."""
        need, during = (LOCKED, CHECKPOINTING) if op == "checkpoint" else (CHECKPOINTED, RESTORING)
        self._begin(need, during)
        old_uuid = self.gpu_uuid
        try:
            if op == "checkpoint":
                if self.chan is None:
                    raise GpuLost(self.lost or "no GPU context")
                names = [n for n in self.buffers if n not in self.vmm]  # VMM: the shim's
                reply, _ = self._call({"op": "map_out",
                                       "handles": [self.buffers[n] for n in names]})
                layout = list(zip(names, reply["sizes"], strict=True))
            else:
                if self.layout is None:
                    raise CudaError(INVALID_VALUE)  # checkpointed to host memory: restore from it
                self._acquire(self._target(device_map))
                layout = self.layout
                reply, _ = self._call({"op": "map_in", "sizes": [n for _, n in layout]})
        except (GpuLost, CudaError, OSError) as exc:
            if op == "restore":
                self._release()
                self.gpu_uuid = old_uuid
            self._undo(need, during)
            if isinstance(exc, CudaError):
                raise
            raise CudaError(UNKNOWN, str(exc)) from exc
        self.storage = {"op": op, "token": str(reply["token"]), "layout": layout,
                        "old_uuid": old_uuid, "device_map": device_map}
        return {"token": reply["token"], "size": reply["size"]}

    def _open_storage(self, token: str) -> dict[str, Any]:
        if self.storage is None or self.storage["token"] != token:
            raise CudaError(INVALID_VALUE)  # no such custom-storage operation
        op, self.storage = self.storage, None
        return op

    def complete_storage(self, token: str) -> None:
        """cuCheckpointOperationComplete, once the checkpointer's copies are done."""
        op = self._open_storage(token)
        if op["op"] == "checkpoint":
            self.layout = op["layout"]
            self.vmm_pending |= self.vmm & set(self.buffers)
            self.buffers = {}
            self._release()  # the service frees our device memory and the range
            with self.cond:
                self.state = CHECKPOINTED
            return
        try:
            reply, _ = self._call({"op": "adopt", "token": token})
        except (GpuLost, CudaError) as exc:
            # What was copied in is gone with the GPU connection; the
            # checkpointer still has it and may restore again.
            self._release()
            self.gpu_uuid = op["old_uuid"]
            self._undo(CHECKPOINTED, RESTORING)
            if isinstance(exc, CudaError):
                raise
            raise CudaError(UNKNOWN, str(exc)) from exc
        names = [name for name, _ in op["layout"]]
        self.buffers.update(zip(names, (int(h) for h in reply["handles"]), strict=True))
        self.layout = None
        self.restores += 1
        if op["device_map"]:
            self.visible = [op["device_map"].get(u, u) for u in self.visible]
        with self.cond:
            self.state = LOCKED

    def cancel_storage(self, token: str) -> None:
        """The driver's own undo when a custom-storage call fails before it
        returns (the API has no abort): back to the state before it."""
        op = self._open_storage(token)
        if op["op"] == "checkpoint":
            with contextlib.suppress(GpuLost, CudaError):
                self._call({"op": "unmap", "token": token})
            self._undo(LOCKED, CHECKPOINTING)
        else:
            self._release()
            self.gpu_uuid = op["old_uuid"]
            self._undo(CHECKPOINTED, RESTORING)

    def _check_map(self, device_map: dict[str, str]) -> None:
        """The driver's rules for --device-map: every GPU CUDA sees in the
        process is listed (cuda-checkpoint #35), and each target is the same
        chip with at least as much memory. Any breach: "invalid argument"."""
        if any(u not in device_map for u in self.visible):
            raise CudaError(INVALID_VALUE)
        chan = Channel(connect_unix(self.gpu_socket))
        try:
            gpus = {g["uuid"]: g for g in chan.call({"op": "info"})[0]["gpus"]}
        finally:
            chan.close()
        for old in self.visible:
            src, dst = gpus.get(old), gpus.get(device_map[old])
            if dst is None or (src is not None and (
                    src["name"] != dst["name"]
                    or src["memory_total_mib"] > dst["memory_total_mib"])):
                raise CudaError(INVALID_VALUE)

    def unlock(self) -> None:
        with self.cond:
            if self.state != LOCKED:
                raise CudaError(ILLEGAL_STATE)
            self.state = RUNNING
            self.cond.notify_all()


def serve_forever(listener: socket.socket,
                  handle: Callable[[dict[str, Any]], dict[str, Any]]) -> None:
    """One request per connection, answered in order: the driver serialises a
    process's checkpoint operations the same way. A checkpoint or restore
    that reports its progress (CUDA 13.4+) runs beside the loop, so that
    --get-state can say "checkpointing" or "restoring" meanwhile."""
    while True:
        try:
            conn, _ = listener.accept()
        except OSError:
            time.sleep(0.01)
            continue
        stream = conn.makefile("rwb")
        try:
            msg, _ = recv(stream)
        except (EOFError, OSError, ValueError):
            _close(conn, stream)
            continue
        if msg.get("transient") and msg.get("op") in ("checkpoint", "restore"):
            threading.Thread(target=_answer, args=(conn, stream, msg, handle),
                             name="cuda-restore-op", daemon=True).start()
        else:
            _answer(conn, stream, msg, handle)


def _answer(conn: socket.socket, stream: Any, msg: dict[str, Any],
            handle: Callable[[dict[str, Any]], dict[str, Any]]) -> None:
    try:
        try:
            reply = handle(msg)
            reply["ok"] = True
        except CudaError as exc:
            reply = {"ok": False, "code": exc.code, "error": str(exc)}
        except GpuLost as exc:
            reply = {"ok": False, "code": UNKNOWN, "error": str(exc)}
        send(stream, reply)
    except (EOFError, OSError, ValueError):
        pass
    finally:
        _close(conn, stream)


def _close(conn: socket.socket, stream: Any) -> None:
    # The socket's fd stays open while its file object does; a leftover peer
    # would make CRIU refuse the dump.
    with contextlib.suppress(OSError):
        stream.close()
    with contextlib.suppress(OSError):
        conn.close()
