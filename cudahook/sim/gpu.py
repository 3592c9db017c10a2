"""The simulated GPU: a daemon that owns device memory, per client connection.

A CUDA process's live connection here plays the part of its open GPU
context: CRIU refuses to dump a connected Unix socket whose peer is outside
the container, exactly as it refuses a live /dev/nvidia* mapping, and when a
client disconnects or dies its memory is freed, as the driver frees a dead
process's allocations. Whatever was not copied out first is gone.

Copies between device and host memory (a checkpoint's download, a
restore's upload) go over the GPU's link at the configured bandwidth
(`bandwidth_mib_s`, per GPU or for the node): processes on different GPUs
copy in parallel, processes on one GPU take turns on its link, so a phase
takes at least its largest per-GPU byte count over the link's bandwidth.

Device memory is a memfd per allocation (mapped here for kernels and
digests). A checkpoint's copy to the host (`download_fd`) hands the CUDA
process that memfd (SCM_RIGHTS) within the copy's turn on the link, and the
process copies it into a memfd of its own (`copy_memfd`, in the kernel):
its host copy, which CRIU dumps with the process and restores. A restore
(`upload_fd`) hands that back and the service adopts it as device memory,
then copies it into memory of its own before the process's next GPU work
(`_recharge`), off the restore's own time, as the real copy in is the
GPU's DMA. Shared memory is charged to the memory cgroup that first
touches it, so each copy made by its new owner puts the host copy in the
container's cgroup and device memory in the service's, where a real node
has them. The kernel copy at checkpoint runs within the link's time; what
a restored process reads is exactly what went through the host (the
image, under CRIU), and its memory check catches any page that changed on
the way.
"""

from __future__ import annotations

import contextlib
import errno
import hashlib
import json
import mmap
import os
import secrets
import signal
import socket
import struct
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from .protocol import (
    CUDA_ERRORS,
    INVALID_CONTEXT,
    INVALID_DEVICE,
    INVALID_VALUE,
    OUT_OF_MEMORY,
    CudaError,
    FdStream,
    bind_unix,
    pattern,
    read_payload,
    send,
)


@dataclass
class Device:
    index: int
    uuid: str
    name: str
    total: int  # bytes
    used: int = 0
    users: dict[int, int] = field(default_factory=dict)  # client pid -> bytes
    bandwidth: float = 0.0  # MiB/s over the link; 0: unlimited
    link_free_at: float = 0.0  # monotonic time the link's queued copies end


@dataclass
class Client:
    pid: int
    device: Device | None = None
    kind: str = "cuda"
    buffers: dict[int, Any] = field(default_factory=dict)  # handle -> mmap of its memfd
    fds: dict[int, int] = field(default_factory=dict)  # handle -> the memfd
    # Buffers adopted from a restore's host copy, still charged to the
    # process's memory cgroup: made the service's own before its next work.
    recharge: set[int] = field(default_factory=set)


@dataclass
class Mapping:
    """A process's device memory mapped onto a checkpointer's GPU (CUDA 13.4+
    custom storage): one range, the process's allocations end to end."""

    fd: int
    size: int
    device: Device
    owner: Client  # the process whose memory it is
    sizes: list[int]
    charged: int = 0  # device memory charged for it (a restore's range)
    mapper: Client | None = None  # the checkpointer's context that mapped it
    # A checkpoint's range is its first allocation's own memfd, extended
    # past it (`_gather`): that allocation's size, to cut it back to if the
    # checkpoint is cancelled; None for a range of its own.
    extends: int | None = None


# A digest of a buffer this large lets go of the pages it mapped (see "digest").
DROP_VIEW_BYTES = 1 << 20


def _end_orphaned(pid: int, token: str) -> None:
    """A custom-storage operation whose checkpointer went away (its context's
    connection closed: the process exited, or was killed) before completing
    it. The API has no abort, and what a driver does then is not documented;
    the simulator models the driver tearing the caller's context down: the
    operation ends as one that failed inside its call does (`storage-cancel`,
    the target back to locked with its memory, or to checkpointed), never
    left open. A target already past the operation refuses: nothing changes."""
    from .tool import _ask

    with contextlib.suppress(Exception):
        _ask(pid, {"op": "storage-cancel", "token": token})


def memfd(size: int, name: str = "cudahook-sim-device-memory") -> int:
    fd = os.memfd_create(name, os.MFD_CLOEXEC)
    try:
        os.ftruncate(fd, size)
    except OSError:
        os.close(fd)
        raise
    return fd


def copy_memfd(src: int, size: int) -> int:
    """A new device-memory memfd holding `src`'s first `size` bytes, its
    pages allocated by the calling process. Shared memory stays charged to
    the memory cgroup that first touched it: a host copy made here counts
    where the real driver's does (the copying process's own memory), not in
    the cgroup of whoever made the source."""
    fd = memfd(size)
    try:
        done = 0
        while done < size:
            n = os.copy_file_range(src, fd, size - done, done, done)
            if n <= 0:
                raise OSError(errno.EIO, f"memfd copy stopped at {done} of {size} bytes")
            done += n
    except BaseException:
        os.close(fd)
        raise
    return fd


def _mapping(fd: int, size: int) -> Any:
    return mmap.mmap(fd, size) if size else bytearray()


class GpuService:
    def __init__(self, config: dict[str, Any]):
        self.config = config
        node_bandwidth = float(config.get("bandwidth_mib_s") or 0)
        self.devices = [
            Device(i, g["uuid"], g.get("name", "NVIDIA Simulated GPU"), g["memory_mib"] << 20,
                   bandwidth=float(g.get("bandwidth_mib_s", node_bandwidth) or 0))
            for i, g in enumerate(config["gpus"])
        ]
        self.by_uuid = {d.uuid: d for d in self.devices}
        self.lock = threading.Lock()
        self.clients: dict[int, Client] = {}
        self.mappings: dict[str, Mapping] = {}
        self.next_handle = 1

    # -- per-connection ----------------------------------------------------

    def serve_connection(self, conn: socket.socket) -> None:
        # SIGTERM for the main thread only: delivered to a thread blocked in
        # recvmsg here, it would wait for the main thread's next accept.
        signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGTERM})
        creds = conn.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i"))
        pid = struct.unpack("3i", creds)[0]
        client = Client(pid)
        key = id(client)
        with self.lock:
            self.clients[key] = client
        stream = FdStream(conn)
        try:
            while True:
                try:
                    msg, payload, arrived = _recv_timed(stream)
                except (EOFError, OSError, ValueError):
                    return
                msg["_arrived"] = arrived
                if stream.fds:
                    msg["_fd"] = stream.take_fd()
                try:
                    reply, data = self.handle(client, msg, payload)
                    reply["ok"] = True
                except CudaError as exc:
                    reply, data = {"ok": False, "code": exc.code, "error": str(exc)}, b""
                finally:
                    if "_fd" in msg:
                        os.close(msg["_fd"])
                fd = reply.pop("_fd", None)
                try:
                    send(stream, reply, data, fd)  # type: ignore[arg-type]
                except OSError:
                    return
                finally:
                    if fd is not None:
                        os.close(fd)  # the client has its own now
        finally:
            self._release(key)
            stream.close()
            conn.close()

    def _release(self, key: int) -> None:
        with self.lock:
            client = self.clients.pop(key, None)
            if client is None:
                return
            if client.device:
                dev = client.device
                freed = sum(len(b) for b in client.buffers.values())
                dev.used -= freed
                dev.users.pop(client.pid, None)
            # A range this client mapped out of another process: its
            # operation is ended below, never left open.
            orphaned = [(t, m.owner.pid) for t, m in self.mappings.items()
                        if m.mapper is client and m.owner is not client]
            ranges = [self._unmap(t) for t in [t for t, m in self.mappings.items()
                                                if m.owner is client]]
        # Outside the lock: unmapping and freeing a process's device memory
        # takes the kernel a while per GiB, and every other GPU's copies need
        # the lock for their turn on the link - they must not wait for it.
        for handle in list(client.buffers):
            self._drop(client, handle)
        for fd in ranges:
            os.close(fd)
        for token, pid in orphaned:
            threading.Thread(target=_end_orphaned, args=(pid, token), daemon=True).start()

    def _unmap(self, token: str) -> int:
        """Forget a custom-storage range (self.lock held); its memfd, for the
        caller to close once it lets go of the lock. A checkpointer that
        still maps it keeps only its own view."""
        m = self.mappings.pop(token)
        m.device.used -= m.charged
        if m.owner.pid in m.device.users:
            m.device.users[m.owner.pid] -= m.charged
        return m.fd

    @staticmethod
    def _drop(client: Client, handle: int) -> Any:
        """Forget a buffer, unmapping it and closing its memfd; the buffer."""
        buf = client.buffers.pop(handle, None)
        fd = client.fds.pop(handle, None)
        if isinstance(buf, mmap.mmap):
            with contextlib.suppress(BufferError):  # a view still out: the GC unmaps it
                buf.close()
        if fd is not None:
            os.close(fd)
        return buf

    def _store(self, client: Client, size: int, fill: Any = None, src: int | None = None) -> int:
        """A new device buffer of `size` bytes (zeroed, `fill`ed, or the memfd
        `src` adopted); its handle."""
        fd = os.dup(src) if src is not None else memfd(size)
        try:
            if fill and src is None:
                view, done = memoryview(fill), 0
                while done < size:
                    done += os.pwrite(fd, view[done:], done)
            buf = _mapping(fd, size)
        except BaseException:
            os.close(fd)
            raise
        with self.lock:
            handle = self.next_handle
            self.next_handle += 1
        client.buffers[handle], client.fds[handle] = buf, fd
        return handle

    def _charge(self, client: Client, size: int) -> None:
        dev = self._device(client)
        if dev.used + size > dev.total:
            raise CudaError(OUT_OF_MEMORY)
        dev.used += size
        dev.users[client.pid] = dev.users.get(client.pid, 0) + size

    def _uncharge(self, client: Client, size: int) -> None:
        dev = self._device(client)
        dev.used -= size
        dev.users[client.pid] = dev.users.get(client.pid, 0) - size

    def _device(self, client: Client) -> Device:
        if client.device is None:
            raise CudaError(INVALID_VALUE, "no device selected")
        return client.device

    def _buffer(self, client: Client, msg: dict[str, Any]) -> bytearray:
        try:
            return client.buffers[int(msg["handle"])]
        except (KeyError, ValueError) as exc:
            raise CudaError(INVALID_VALUE) from exc

    def _recharge(self, client: Client) -> None:
        """Make adopted buffers device memory of the service's own: copied
        here, their pages are charged to the service's memory cgroup, and the
        process's host copy goes once the process closes it (at restore)."""
        for handle in sorted(client.recharge):
            fd = client.fds.get(handle)
            if fd is None:
                continue
            size = len(client.buffers[handle])
            new = copy_memfd(fd, size)
            try:
                buf = _mapping(new, size)
            except BaseException:
                os.close(new)
                raise
            self._drop(client, handle)
            client.buffers[handle], client.fds[handle] = buf, new
        client.recharge.clear()

    def handle(self, client: Client, msg: dict[str, Any], payload: bytes) -> tuple[dict, bytes]:
        op = msg.get("op")
        if client.recharge and op not in ("info", "hello", "alloc", "upload", "upload_fd"):
            # The restore is over (its uploads are done): before any GPU
            # work reads or writes the buffers.
            try:
                self._recharge(client)
            except OSError as exc:
                raise CudaError(OUT_OF_MEMORY, f"device memory: {exc}") from exc
        if op == "info":
            return self.info(), b""
        if op == "hello":
            dev = self.by_uuid.get(msg.get("uuid", ""))
            if dev is None:
                raise CudaError(INVALID_DEVICE)
            with self.lock:
                client.device, client.kind = dev, msg.get("kind", "cuda")
                dev.users.setdefault(client.pid, 0)
            return {"index": dev.index, "uuid": dev.uuid, "bandwidth_mib_s": dev.bandwidth}, b""
        if op in ("alloc", "upload", "upload_fd"):
            src = msg.get("_fd")
            if op == "upload_fd":
                if src is None or not os.readlink(f"/proc/self/fd/{src}").startswith(
                        "/memfd:cudahook-sim-device-memory"):
                    raise CudaError(INVALID_VALUE, "upload_fd without device memory's memfd")
                size = os.fstat(src).st_size
            else:
                size = len(payload) if op == "upload" else int(msg["size"])
            with self.lock:
                self._charge(client, size)
            try:
                if op == "alloc":
                    fill = pattern(int(msg["seed"]), size, str(msg.get("content", "pattern"))
                                   ) if "seed" in msg else None
                    return {"handle": self._store(client, size, fill)}, b""
                # The copy runs within its turn on the link (for an upload,
                # the payload crossed the socket while the turn ran).
                until = self._reserve(self._device(client), size, msg.get("_arrived", 0.0))
                handle = (self._store(client, size, payload) if op == "upload"
                          else self._store(client, size, src=src))
                if op == "upload_fd":
                    client.recharge.add(handle)
                self._wait(until)
                return {"handle": handle}, b""
            except OSError as exc:
                with self.lock:
                    self._uncharge(client, size)
                raise CudaError(OUT_OF_MEMORY, f"device memory: {exc}") from exc
        if op in ("download", "download_fd"):
            buf = self._buffer(client, msg)
            dev = self._device(client)
            until = self._reserve(dev, len(buf))
            if until:
                self._wait(until - len(buf) / (dev.bandwidth * (1 << 20)))  # our turn
            # The bytes cross inside the copy's time on the link; the client
            # waits out the rest, `link_left` seconds from this reply. (Not
            # until `link_until` by its own clock: a process CRIU restored
            # runs in a time namespace whose CLOCK_MONOTONIC lags this one
            # by every checkpoint's downtime, and would wait that out too.)
            left = max(0.0, until - time.monotonic()) if until else 0.0
            if op == "download":  # small images (VMM mappings): through the socket
                return {"link_until": until, "link_left": left}, bytes(buf)
            # The process locked, nothing writes the pages while both hold them.
            return {"link_until": until, "link_left": left, "size": len(buf),
                    "_fd": os.dup(client.fds[int(msg["handle"])])}, b""
        if op in ("map_out", "map_in", "map", "link", "adopt", "unmap"):
            return self._storage(client, op, msg), b""
        if op == "digest":
            buf = self._buffer(client, msg)
            digest = hashlib.sha256(buf).hexdigest()
            if isinstance(buf, mmap.mmap) and len(buf) >= DROP_VIEW_BYTES:
                # Reading it mapped every page into this service's view of
                # the memfd; letting go of that view now (the pages stay)
                # keeps its cost here, in the check, rather than charged to
                # whatever phase next unmaps the buffer: a driver keeps no
                # host page tables over device memory.
                buf.madvise(mmap.MADV_DONTNEED)
            return {"sha256": digest}, b""
        if op == "incr":
            # A "kernel": add one to the 64-bit counter at the buffer's start.
            buf = self._buffer(client, msg)
            duration = float(msg.get("duration", 0))
            if duration:
                time.sleep(duration)
            value = int.from_bytes(buf[:8], "little") + 1
            buf[:8] = value.to_bytes(8, "little")
            return {"value": value}, b""
        if op == "free":
            buf = self._drop(client, int(msg["handle"]))
            if buf is not None and client.device:
                with self.lock:
                    self._uncharge(client, len(buf))
            return {}, b""
        raise CudaError(INVALID_VALUE, f"unknown op {op!r}")

    def _storage(self, client: Client, op: str, msg: dict[str, Any]) -> dict[str, Any]:
        """Custom storage (CUDA 13.4+). The checkpointed process gathers its
        allocations into one range (`map_out`) or has an empty one made on
        its new GPU (`map_in`, charged as its device memory); the
        checkpointer's context maps it (`map`: the memfd, on that GPU only)
        and pays each copy's time on the link (`link`); a restore's process
        then takes its allocations back out of the range (`adopt`)."""
        if op == "link":
            return {"link_until": self._reserve(self._device(client), int(msg["size"]))}
        if op in ("map_out", "map_in"):
            dev = self._device(client)
            if op == "map_out":
                bufs = [self._buffer(client, {"handle": h}) for h in msg["handles"]]
                sizes = [len(b) for b in bufs]
            else:
                sizes = [int(n) for n in msg["sizes"]]
            total = sum(sizes)
            if op == "map_in":
                with self.lock:
                    self._charge(client, total)
            extends = None
            try:
                if op == "map_out":
                    fd, extends = self._gather(client, [int(h) for h in msg["handles"]], bufs)
                else:
                    fd = memfd(total)
                if op == "map_in" and total:
                    # Device memory is the service's: its pages are made
                    # here, so the checkpointer's copy in fills them without
                    # charging its own memory cgroup (on a restore through
                    # runc, the container's) for the GPU's memory.
                    try:
                        os.posix_fallocate(fd, 0, total)
                    except OSError:
                        os.close(fd)
                        raise
            except OSError as exc:
                if op == "map_in":
                    with self.lock:
                        self._uncharge(client, total)
                raise CudaError(OUT_OF_MEMORY, f"device memory: {exc}") from exc
            token = secrets.token_hex(8)
            with self.lock:
                self.mappings[token] = Mapping(fd, total, dev, client, sizes,
                                               total if op == "map_in" else 0,
                                               extends=extends)
            return {"token": token, "size": total, "sizes": sizes}
        with self.lock:
            m = self.mappings.get(str(msg.get("token")))
        if m is None:
            raise CudaError(INVALID_VALUE, "no such mapping")
        if op == "map":
            if client.device is not m.device:
                raise CudaError(INVALID_CONTEXT, "the range is on another GPU")
            m.mapper = client
            return {"size": m.size, "_fd": os.dup(m.fd)}
        if m.owner is not client:
            raise CudaError(INVALID_VALUE, "not this process's mapping")
        if op == "adopt":
            handles = self._scatter(client, m)
            with self.lock:
                m.charged = 0  # now the allocations' own
        elif m.extends is not None:
            # A cancelled checkpoint (no checkpointer maps the range any
            # more): the allocation gets its own size back.
            os.ftruncate(m.fd, m.extends)
        with self.lock:
            fd = self._unmap(str(msg["token"]))
        os.close(fd)
        return {"handles": handles} if op == "adopt" else {}

    @staticmethod
    def _gather(client: Client, handles: list[int], bufs: list[Any]) -> tuple[int, int | None]:
        """A checkpoint's range, the allocations end to end: (its memfd, the
        size of the allocation it extends, or None). The driver maps device
        memory where it is; so does this, for the first allocation: the
        range is that allocation's own memfd, extended, with the others
        written after it. (A copy of it all here would cost the phase what
        no driver spends, on top of the link's modelled time.)"""
        first = len(bufs[0]) if bufs else 0
        fd = os.dup(client.fds[handles[0]]) if first else memfd(sum(len(b) for b in bufs))
        try:
            offset = 0
            if first:
                os.ftruncate(fd, sum(len(b) for b in bufs))
                offset = first
            for buf in bufs[1:] if first else bufs:
                view, done = memoryview(buf), 0
                while done < len(view):
                    done += os.pwrite(fd, view[done:], offset + done)
                offset += len(view)
        except OSError:
            if first:
                with contextlib.suppress(OSError):
                    os.ftruncate(fd, first)
            os.close(fd)
            raise
        return fd, first or None

    def _scatter(self, client: Client, m: Mapping) -> list[int]:
        """A restore's range back into allocations (`adopt`): the first one
        takes the range's memfd itself, cut to its size, once the others
        have been copied out of the rest; their handles. The checkpointer
        has unmapped the range by now (the operation is complete)."""
        handles, offset = [], m.sizes[0] if m.sizes and m.sizes[0] else 0
        whole = _mapping(m.fd, m.size)
        try:
            for size in m.sizes[1:] if offset else m.sizes:
                handles.append(self._store(client, size, memoryview(whole)[offset:offset + size]))
                offset += size
        finally:
            if isinstance(whole, mmap.mmap):
                with contextlib.suppress(BufferError):
                    whole.close()
        if m.sizes and m.sizes[0]:
            os.ftruncate(m.fd, m.sizes[0])
            handles.insert(0, self._store(client, m.sizes[0], src=m.fd))
        return handles

    def _reserve(self, dev: Device, size: int, since: float = 0.0) -> float:
        """Queue a copy of `size` bytes on the GPU's link, starting no earlier
        than `since` (default: now); when it ends (0: the link is unlimited)."""
        if dev.bandwidth <= 0 or size <= 0:
            return 0.0
        cost = size / (dev.bandwidth * (1 << 20))
        with self.lock:
            start = max(since or time.monotonic(), dev.link_free_at)
            dev.link_free_at = start + cost
        return start + cost

    @staticmethod
    def _wait(until: float) -> None:
        left = until - time.monotonic()
        if left > 0:
            time.sleep(left)

    def info(self) -> dict[str, Any]:
        with self.lock:
            return {
                "driver_version": self.config["driver_version"],
                "gpus": [
                    {
                        "index": d.index,
                        "uuid": d.uuid,
                        "name": d.name,
                        "memory_total_mib": d.total >> 20,
                        "memory_used_mib": d.used >> 20,
                        "processes": [
                            {"pid": pid, "used_bytes": used, "kind": kind}
                            for pid, used, kind in self._users(d)
                        ],
                    }
                    for d in self.devices
                ],
            }

    def _users(self, dev: Device) -> list[tuple[int, int, str]]:
        kinds = {c.pid: c.kind for c in self.clients.values() if c.device is dev}
        return [(pid, used, kinds.get(pid, "cuda")) for pid, used in sorted(dev.users.items())
                if pid in kinds]


def _recv_timed(inp: Any) -> tuple[dict[str, Any], bytes, float]:
    """protocol.recv, plus when the request's line arrived (before its payload)."""
    line = inp.readline()
    if not line:
        raise EOFError("peer closed the connection")
    arrived = time.monotonic()
    msg = json.loads(line)
    return msg, read_payload(inp, int(msg.get("len", 0))), arrived


def serve(sim_dir: Path) -> None:
    config = json.loads((sim_dir / "sim.json").read_text())
    service = GpuService(config)
    listener = bind_unix(str(sim_dir / "gpu.sock"))
    os.chmod(sim_dir / "gpu.sock", 0o666)
    (sim_dir / "gpu.pid").write_text(f"{os.getpid()}\n")
    signal.signal(signal.SIGTERM, lambda *_: os._exit(0))
    while True:
        conn, _ = listener.accept()
        threading.Thread(target=service.serve_connection, args=(conn,), daemon=True).start()


__all__ = ["CUDA_ERRORS", "GpuService", "serve"]
