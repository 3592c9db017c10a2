"""Framing for the simulator's Unix sockets: a JSON line, then an optional
binary payload whose length the line announces, or a file descriptor
passed with the line (SCM_RIGHTS): a memfd holding a device-memory image,
copied in the kernel instead of through either process (see gpu.py)."""

from __future__ import annotations

import contextlib
import json
import os
import socket
from typing import Any, BinaryIO

from .wire import (  # noqa: F401 - re-exported for the service and runtime
    CUDA_ERRORS,
    ILLEGAL_STATE,
    INVALID_CONTEXT,
    INVALID_DEVICE,
    INVALID_VALUE,
    NO_DEVICE,
    NOT_INITIALIZED,
    NOT_SUPPORTED,
    OUT_OF_MEMORY,
    TIMEOUT,
    UNKNOWN,
    CudaError,
    at_path,
)


def send(out: BinaryIO, msg: dict[str, Any], payload: bytes | memoryview = b"",
         fd: int | None = None) -> None:
    if payload:
        msg = {**msg, "len": len(payload)}
    line = json.dumps(msg).encode() + b"\n"
    if fd is not None:
        socket.send_fds(out.sock, [line], [fd])  # type: ignore[attr-defined]
    else:
        out.write(line)
    if payload:
        out.write(payload)
    out.flush()


class FdStream:
    """A connected Unix socket read as a stream, keeping the descriptors that
    arrive with the bytes (a buffered socket file drops them)."""

    MAX_FDS = 4

    def __init__(self, sock: socket.socket):
        self.sock = sock
        self.buf = bytearray()
        self.fds: list[int] = []

    def _fill(self) -> bool:
        data, fds, _flags, _addr = socket.recv_fds(self.sock, 65536, self.MAX_FDS)
        for fd in fds:
            os.set_inheritable(fd, False)
        self.fds += fds
        self.buf += data
        return bool(data)

    def readline(self) -> bytes:
        while True:
            end = self.buf.find(b"\n")
            if end >= 0:
                line = bytes(self.buf[:end + 1])
                del self.buf[:end + 1]
                return line
            if not self._fill():
                return b""

    def readinto(self, view: memoryview) -> int:
        if self.buf:
            n = min(len(view), len(self.buf))
            view[:n] = self.buf[:n]
            del self.buf[:n]
            return n
        return self.sock.recv_into(view)

    def take_fd(self) -> int:
        """The descriptor that came with the last message (ValueError: none)."""
        if not self.fds:
            raise ValueError("no file descriptor came with the message")
        return self.fds.pop(0)

    def write(self, data: bytes | memoryview) -> None:
        self.sock.sendall(data)

    def flush(self) -> None:
        pass

    def close(self) -> None:
        for fd in self.fds:
            with contextlib.suppress(OSError):
                os.close(fd)
        self.fds = []


def recv(inp: BinaryIO) -> tuple[dict[str, Any], bytes]:
    line = inp.readline()
    if not line:
        raise EOFError("peer closed the connection")
    msg = json.loads(line)
    return msg, read_payload(inp, int(msg.get("len", 0)))


def read_payload(inp: BinaryIO, size: int) -> bytes:
    """`size` bytes read straight into one buffer: device-memory images are
    hundreds of MiB, and every extra copy costs the simulated GPU's time."""
    if not size:
        return b""
    buf = bytearray(size)
    view = memoryview(buf)
    got = 0
    while got < size:
        n = inp.readinto(view[got:])  # type: ignore[attr-defined]
        if not n:
            raise EOFError("peer closed the connection mid-payload")
        got += n
    return buf  # type: ignore[return-value]  # a bytearray: the receiver may keep it


def connect_unix(path: str, timeout: float | None = None) -> socket.socket:
    """Connect to a Unix socket at any path length."""
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.settimeout(timeout)
    try:
        at_path(sock.connect, path)
    except BaseException:
        sock.close()
        raise
    return sock



def bind_unix(path: str) -> socket.socket:
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    with contextlib.suppress(FileNotFoundError):
        os.unlink(path)
    at_path(sock.bind, path)
    sock.listen(64)
    return sock


class Channel:
    """One request/response connection."""

    def __init__(self, sock: socket.socket):
        self.sock = sock
        self.file = FdStream(sock)

    def call(self, msg: dict[str, Any], payload: bytes = b"", fd: int | None = None
             ) -> tuple[dict[str, Any], bytes]:
        send(self.file, msg, payload, fd)  # type: ignore[arg-type]
        reply, data = recv(self.file)  # type: ignore[arg-type]
        if not reply.get("ok"):
            raise CudaError(int(reply.get("code", UNKNOWN)), reply.get("error"))
        return reply, data

    def call_fd(self, msg: dict[str, Any], fd: int | None = None) -> tuple[dict[str, Any], int]:
        """A call whose reply carries a descriptor: (reply, the descriptor)."""
        reply, _ = self.call(msg, fd=fd)
        return reply, self.file.take_fd()

    def close(self) -> None:
        try:
            self.file.close()
        finally:
            self.sock.close()


# What a workload's device buffer holds: "pattern", one random 4 KiB block
# repeated (compresses well, and its chunks are identical), or "random":
# random bytes throughout (nothing to compress or dedupe; model weights are
# closer to this).
CONTENTS = ("pattern", "random")


def pattern(seed: int, size: int, content: str = "pattern") -> bytes:
    """The known content of a workload's device buffer: cheap to make, and any
    change to it (or a zeroed buffer after a lost GPU) changes its digest."""
    import random

    if content == "random":
        return random.Random(seed).randbytes(size)
    block = random.Random(seed).randbytes(4096)
    whole, rest = divmod(size, 4096)
    return block * whole + block[:rest]
