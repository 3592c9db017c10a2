"""The cheapest possible client side of the simulator's wire: what the fake
cuda-checkpoint needs, with no import it can avoid (json alone pulls in re
and enum). Benchmarks start dozens of fake tools at once on two cores.

Messages are one JSON object per line, and this module writes and reads
that JSON itself; tests check it against the json module. The GPU service and the workload
runtime use the json module (protocol.py) on the same bytes.
"""

from __future__ import annotations

import _socket
import os

# CUDA driver error codes and the strings cuGetErrorString gives for them.
CUDA_ERRORS = {
    1: "invalid argument",
    2: "out of memory",
    3: "initialization error",
    100: "no CUDA-capable device is detected",
    101: "invalid device ordinal",
    201: "invalid device context",
    401: "the operation cannot be performed in the present state",
    801: "operation not supported",
    909: "the operation timed out",
    999: "unknown error",
}
INVALID_VALUE, OUT_OF_MEMORY, NOT_INITIALIZED = 1, 2, 3
NO_DEVICE, INVALID_DEVICE, ILLEGAL_STATE = 100, 101, 401
INVALID_CONTEXT = 201
NOT_SUPPORTED, TIMEOUT, UNKNOWN = 801, 909, 999


class CudaError(Exception):
    def __init__(self, code: int, text: str | None = None):
        self.code = code
        super().__init__(text or CUDA_ERRORS.get(code, "unknown error"))


def at_path(op, path: str) -> None:  # type: ignore[no-untyped-def]
    """op(address) - a socket's connect or bind - for a path of any length.

    sun_path holds 108 bytes; paths through /proc/PID/root or pytest's tmp
    dirs are often longer, so go through an O_PATH fd of the directory.
    """
    if len(path.encode()) < 100:
        op(path)
        return
    parent, name = os.path.split(path)
    dfd = os.open(parent, os.O_PATH | os.O_DIRECTORY)
    try:
        op(f"/proc/self/fd/{dfd}/{name}")
    finally:
        os.close(dfd)


def request(path: str, line: bytes, timeout: float | None = None) -> bytes:
    """Send one line to the Unix socket at `path`; its one-line reply.

    The C socket module directly: `socket` costs selectors and enum at
    start-up. OSError when nothing listens there.
    """
    sock = _socket.socket(_socket.AF_UNIX, _socket.SOCK_STREAM)
    try:
        sock.settimeout(timeout)
        at_path(sock.connect, path)
        sock.sendall(line)
        chunks = []
        while True:
            chunk = sock.recv(65536)
            if not chunk:
                break
            chunks.append(chunk)
            if chunk.endswith(b"\n"):
                break
        return b"".join(chunks)
    finally:
        sock.close()


_ESC = {'"': '"', "\\": "\\", "/": "/", "b": "\b", "f": "\f", "n": "\n", "r": "\r",
        "t": "\t"}


def _str(text: str) -> str:
    out = text.replace("\\", "\\\\").replace('"', '\\"')
    out = "".join(c if c >= " " else f"\\u{ord(c):04x}" for c in out)
    return f'"{out}"'


def dumps(value: object) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if value is None:
        return "null"
    if isinstance(value, int | float):
        return repr(value)
    if isinstance(value, str):
        return _str(value)
    if isinstance(value, list | tuple):
        return "[" + ", ".join(dumps(v) for v in value) + "]"
    if isinstance(value, dict):
        return "{" + ", ".join(f"{_str(str(k))}: {dumps(v)}" for k, v in value.items()) + "}"
    raise TypeError(f"cannot encode {type(value).__name__}")


def loads(text: str) -> object:
    value, end = _value(text, _ws(text, 0))
    if _ws(text, end) != len(text):
        raise ValueError("trailing data")
    return value


def _ws(t: str, i: int) -> int:
    while i < len(t) and t[i] in " \t\r\n":
        i += 1
    return i


def _value(t: str, i: int) -> tuple[object, int]:
    if i >= len(t):
        raise ValueError("unexpected end")
    c = t[i]
    if c == "{":
        obj: dict[str, object] = {}
        i = _ws(t, i + 1)
        if t[i:i + 1] == "}":
            return obj, i + 1
        while True:
            key, i = _value(t, _ws(t, i))
            if not isinstance(key, str):
                raise ValueError("object key is not a string")
            i = _ws(t, i)
            if t[i:i + 1] != ":":
                raise ValueError("expected ':'")
            obj[key], i = _value(t, _ws(t, i + 1))
            i = _ws(t, i)
            if t[i:i + 1] == "}":
                return obj, i + 1
            if t[i:i + 1] != ",":
                raise ValueError("expected ','")
            i += 1
    if c == "[":
        arr: list[object] = []
        i = _ws(t, i + 1)
        if t[i:i + 1] == "]":
            return arr, i + 1
        while True:
            item, i = _value(t, _ws(t, i))
            arr.append(item)
            i = _ws(t, i)
            if t[i:i + 1] == "]":
                return arr, i + 1
            if t[i:i + 1] != ",":
                raise ValueError("expected ','")
            i += 1
    if c == '"':
        out, i = [], i + 1
        while True:
            j = i
            while j < len(t) and t[j] not in '"\\':
                j += 1
            out.append(t[i:j])
            if j >= len(t):
                raise ValueError("unterminated string")
            if t[j] == '"':
                return "".join(out), j + 1
            e = t[j + 1:j + 2]
            if e == "u":
                code = int(t[j + 2:j + 6], 16)
                i = j + 6
                if 0xD800 <= code < 0xDC00 and t[i:i + 2] == "\\u":
                    low = int(t[i + 2:i + 6], 16)
                    if 0xDC00 <= low < 0xE000:
                        code = 0x10000 + ((code - 0xD800) << 10) + (low - 0xDC00)
                        i += 6
                out.append(chr(code))
            elif e in _ESC:
                out.append(_ESC[e])
                i = j + 2
            else:
                raise ValueError("bad escape")
    for word, val in (("true", True), ("false", False), ("null", None)):
        if t.startswith(word, i):
            return val, i + len(word)
    j = i
    while j < len(t) and t[j] in "+-0123456789.eE":
        j += 1
    if j == i:
        raise ValueError(f"unexpected {c!r}")
    num = t[i:j]
    return (float(num) if any(x in num for x in ".eE") else int(num)), j
