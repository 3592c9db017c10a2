"""The driver-API backend's helper process: one driver attach, many calls.

Started once per phase by `driver_api.DriverAPI` as
`python -I -S driver_helper.py LIBCUDA`. It loads libcuda, checks that the
checkpoint entry points are exported, calls cuInit once (the attach), then
answers one JSON request per stdin line with one JSON reply per stdout line,
each request on its own thread: the engine drives processes in parallel.
The backend kills this process's group when a call outlives its deadline,
so a driver call that hangs costs this helper, never the hook.

Standard library only, run as a file (no package import): it starts on the
hook's critical path.
"""

from __future__ import annotations

import ctypes
import io
import json
import os
import sys
import threading

# Annotations only: this file starts on the hook's critical path.
TYPE_CHECKING = False
if TYPE_CHECKING:
    from collections.abc import Callable, Iterable

SYMBOLS = ("cuInit", "cuDriverGetVersion", "cuGetErrorName", "cuGetErrorString",
           "cuCheckpointProcessGetState", "cuCheckpointProcessGetRestoreThreadId",
           "cuCheckpointProcessLock", "cuCheckpointProcessCheckpoint",
           "cuCheckpointProcessRestore", "cuCheckpointProcessUnlock")

# CUprocessState (cuda.h; 4 and 5 from CUDA 13.4).
STATES = {0: "running", 1: "locked", 2: "checkpointed", 3: "failed", 4: "checkpointing",
          5: "restoring"}

cuuint64_t = ctypes.c_uint64


# The argument structs exactly as cuda.h (CUDA 13.0) lays them out: 64 bytes each.
class CUcheckpointLockArgs(ctypes.Structure):
    _fields_ = [("timeoutMs", ctypes.c_uint), ("reserved0", ctypes.c_uint),
                ("reserved1", cuuint64_t * 7)]


class CUcheckpointCheckpointArgs(ctypes.Structure):
    _fields_ = [("reserved", cuuint64_t * 8)]


class CUuuid(ctypes.Structure):
    _fields_ = [("bytes", ctypes.c_char * 16)]


class CUcheckpointGpuPair(ctypes.Structure):
    _fields_ = [("oldUuid", CUuuid), ("newUuid", CUuuid)]


class CUcheckpointRestoreArgs(ctypes.Structure):
    _fields_ = [("gpuPairs", ctypes.POINTER(CUcheckpointGpuPair)),
                ("gpuPairsCount", ctypes.c_uint),
                ("reserved", ctypes.c_char * (64 - 8 - 4 - 8)),
                ("reserved1", cuuint64_t)]


class CUcheckpointUnlockArgs(ctypes.Structure):
    _fields_ = [("reserved", cuuint64_t * 8)]


class Driver:
    def __init__(self, path: str):
        self.lib = ctypes.CDLL(path)
        missing = [s for s in SYMBOLS if not hasattr(self.lib, s)]
        if missing:
            raise LookupError(", ".join(missing))
        lib = self.lib
        cu = ctypes.c_int  # CUresult
        for name, args in (
            ("cuInit", [ctypes.c_uint]),
            ("cuDriverGetVersion", [ctypes.POINTER(ctypes.c_int)]),
            ("cuGetErrorName", [cu, ctypes.POINTER(ctypes.c_char_p)]),
            ("cuGetErrorString", [cu, ctypes.POINTER(ctypes.c_char_p)]),
            ("cuCheckpointProcessGetState", [ctypes.c_int, ctypes.POINTER(ctypes.c_int)]),
            ("cuCheckpointProcessGetRestoreThreadId", [ctypes.c_int, ctypes.POINTER(ctypes.c_int)]),
            ("cuCheckpointProcessLock", [ctypes.c_int, ctypes.POINTER(CUcheckpointLockArgs)]),
            ("cuCheckpointProcessCheckpoint",
             [ctypes.c_int, ctypes.POINTER(CUcheckpointCheckpointArgs)]),
            ("cuCheckpointProcessRestore", [ctypes.c_int, ctypes.POINTER(CUcheckpointRestoreArgs)]),
            ("cuCheckpointProcessUnlock", [ctypes.c_int, ctypes.POINTER(CUcheckpointUnlockArgs)]),
        ):
            fn = getattr(lib, name)
            fn.argtypes = args
            fn.restype = cu

    def describe(self, code: int) -> tuple[str, str]:
        """cuGetErrorName and cuGetErrorString for a CUresult."""
        name, text = ctypes.c_char_p(), ctypes.c_char_p()
        if self.lib.cuGetErrorName(code, ctypes.byref(name)) != 0 or not name.value:
            return f"CUresult {code}", "unrecognized error code"
        if self.lib.cuGetErrorString(code, ctypes.byref(text)) != 0 or not text.value:
            return name.value.decode(), "unrecognized error code"
        return name.value.decode(), text.value.decode()

    def call(self, req: dict) -> object:
        """One request; its value, or raises CallFailed with the CUresult."""
        op, pid = req["op"], int(req["pid"])
        lib = self.lib
        if op == "get-state":
            out = ctypes.c_int(-1)
            _check(lib.cuCheckpointProcessGetState(pid, ctypes.byref(out)))
            # A value this cuda.h does not name: cuda-checkpoint prints "unknown".
            return STATES.get(out.value, "unknown")
        if op == "get-restore-tid":
            out = ctypes.c_int(0)
            _check(lib.cuCheckpointProcessGetRestoreThreadId(pid, ctypes.byref(out)))
            return out.value
        if op == "lock":
            lock = CUcheckpointLockArgs(timeoutMs=int(req.get("timeout_ms", 0)))
            _check(lib.cuCheckpointProcessLock(pid, ctypes.byref(lock)))
        elif op == "checkpoint":
            ckpt = CUcheckpointCheckpointArgs()
            _check(lib.cuCheckpointProcessCheckpoint(pid, ctypes.byref(ckpt)))
        elif op == "restore":
            pairs = req.get("pairs") or []
            restore = CUcheckpointRestoreArgs()
            if pairs:
                array = (CUcheckpointGpuPair * len(pairs))()
                for i, (old, new) in enumerate(pairs):
                    array[i].oldUuid.bytes = bytes.fromhex(old)
                    array[i].newUuid.bytes = bytes.fromhex(new)
                restore.gpuPairs = ctypes.cast(array, ctypes.POINTER(CUcheckpointGpuPair))
                restore.gpuPairsCount = len(pairs)
            _check(lib.cuCheckpointProcessRestore(pid, ctypes.byref(restore)))
        elif op == "unlock":
            unlock = CUcheckpointUnlockArgs()
            _check(lib.cuCheckpointProcessUnlock(pid, ctypes.byref(unlock)))
        else:
            raise ValueError(f"unknown request {op!r}")
        return None


class CallFailed(Exception):
    def __init__(self, code: int):
        self.code = code


def _check(code: int) -> None:
    if code != 0:
        raise CallFailed(code)


def answer(driver: Driver, req: dict) -> dict:
    """The reply to one request: the value, or the CUresult with the
    driver's own name and message."""
    try:
        return {"id": req["id"], "ok": True, "value": driver.call(req)}
    except CallFailed as exc:
        name, text = driver.describe(exc.code)
        return {"id": req["id"], "ok": False, "code": exc.code, "name": name, "error": text}
    except (KeyError, TypeError, ValueError) as exc:
        return {"id": req.get("id"), "ok": False, "code": 1, "name": "bad request",
                "error": str(exc)}


def replier(out) -> Callable[[dict], None]:  # type: ignore[no-untyped-def]
    """One JSON line per message on `out` (a binary or text file), whole
    lines only: replies come from many threads."""
    lock = threading.Lock()

    def say(msg: dict) -> None:
        line = json.dumps(msg) + "\n"
        data = line if isinstance(out, io.TextIOBase) else line.encode()
        with lock:
            out.write(data)
            out.flush()

    return say


def serve_lines(lines: Iterable, handle: Callable[[dict], dict | None],
                say: Callable[[dict], None]) -> None:
    """The protocol's serving loop, shared by this helper (stdin/stdout) and
    the node agent (a Unix socket): one JSON request per line, each handled
    on its own thread (the engine drives processes in parallel), its reply
    said as one line when `handle` returns one. Returns at end of input."""

    def one(req: dict) -> None:
        reply = handle(req)
        if reply is not None:
            say(reply)

    for line in lines:
        try:
            req = json.loads(line)
        except ValueError:
            continue
        if isinstance(req, dict):
            threading.Thread(target=one, args=(req,), daemon=True).start()


def attach(path: str) -> tuple[Driver | None, dict]:
    """Load libcuda and call cuInit once (the attach): the driver, and the
    hello line that says whether it is ready."""
    try:
        driver = Driver(path)
    except OSError as exc:
        return None, {"ready": False, "stage": "load", "error": str(exc)}
    except LookupError as exc:
        return None, {"ready": False, "stage": "symbols", "error": f"missing {exc}"}
    code = driver.lib.cuInit(0)
    if code != 0:
        name, text = driver.describe(code)
        return None, {"ready": False, "stage": "init", "code": code, "name": name,
                      "error": text}
    version = ctypes.c_int(0)
    driver.lib.cuDriverGetVersion(ctypes.byref(version))
    return driver, {"ready": True, "cuda_version": version.value, "pid": os.getpid()}


def main(argv: list[str]) -> int:
    say = replier(sys.stdout)
    driver, hello = attach(argv[0])
    say(hello)
    if driver is None:
        return 1
    serve_lines(sys.stdin, lambda req: answer(driver, req), say)
    # The hook closed our stdin: it is done (or gone). Calls still inside the
    # driver are abandoned with the process.
    os._exit(0)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
