"""Framing for the simulator's Unix sockets: a JSON line, then an optional
binary payload whose length the line announces."""

from __future__ import annotations

import contextlib
import json
import os
import socket
from typing import Any, BinaryIO

from .wire import (  # noqa: F401 - re-exported for the service and runtime
    CUDA_ERRORS,
    ILLEGAL_STATE,
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


def send(out: BinaryIO, msg: dict[str, Any], payload: bytes | memoryview = b"") -> None:
    if payload:
        msg = {**msg, "len": len(payload)}
    out.write(json.dumps(msg).encode() + b"\n")
    if payload:
        out.write(payload)
    out.flush()


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
        self.file = sock.makefile("rwb")

    def call(self, msg: dict[str, Any], payload: bytes = b"") -> tuple[dict[str, Any], bytes]:
        send(self.file, msg, payload)
        reply, data = recv(self.file)
        if not reply.get("ok"):
            raise CudaError(int(reply.get("code", UNKNOWN)), reply.get("error"))
        return reply, data

    def close(self) -> None:
        try:
            self.file.close()
        finally:
            self.sock.close()


def pattern(seed: int, size: int) -> bytes:
    """The known content of a workload's device buffer: cheap to make, and any
    change to it (or a zeroed buffer after a lost GPU) changes its digest."""
    import random

    block = random.Random(seed).randbytes(4096)
    whole, rest = divmod(size, 4096)
    return block * whole + block[:rest]
