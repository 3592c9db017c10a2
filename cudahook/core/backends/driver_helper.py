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
import json
import os
import sys
import threading

SYMBOLS = ("cuInit", "cuDriverGetVersion", "cuGetErrorName", "cuGetErrorString",
           "cuCheckpointProcessGetState", "cuCheckpointProcessGetRestoreThreadId",
           "cuCheckpointProcessLock", "cuCheckpointProcessCheckpoint",
           "cuCheckpointProcessRestore", "cuCheckpointProcessUnlock")

# CUprocessState (cuda.h; 4 and 5 from CUDA 13.4).
STATES = {0: "running", 1: "locked", 2: "checkpointed", 3: "failed", 4: "checkpointing",
          5: "restoring"}

cuuint64_t = ctypes.c_uint64


# The argument structs exactly as cuda.h (CUDA 13.5) lays them out: 64 bytes
# each (tests/test_cuda_abi.py holds the simulator's C copy to the header).
class CUcheckpointLockArgs(ctypes.Structure):
    _fields_ = [("timeoutMs", ctypes.c_uint), ("reserved0", ctypes.c_uint),
                ("reserved1", cuuint64_t * 7)]


# Custom storage (CUDA 13.4+): the driver maps the target's GPU memory onto
# the caller's GPUs, one range per GPU, and waits for the caller's copies.
class CUcheckpointCustomStoragePerDeviceData(ctypes.Structure):
    _fields_ = [("devPtr", ctypes.c_ulonglong), ("size", ctypes.c_size_t),
                ("stream", ctypes.c_void_p)]


class CUcheckpointCustomStorageInfo(ctypes.Structure):
    _fields_ = [("handle", ctypes.c_void_p),
                ("perDeviceData", ctypes.POINTER(CUcheckpointCustomStoragePerDeviceData)),
                ("deviceCount", ctypes.c_uint)]


class CUcheckpointCheckpointArgs(ctypes.Structure):
    # NULL customStorageInfo_out: GPU memory goes to the target's host memory.
    _fields_ = [("customStorageInfo_out",
                 ctypes.POINTER(ctypes.POINTER(CUcheckpointCustomStorageInfo))),
                ("reserved", ctypes.c_char * 56)]


class CUuuid(ctypes.Structure):
    _fields_ = [("bytes", ctypes.c_char * 16)]


class CUcheckpointGpuPair(ctypes.Structure):
    _fields_ = [("oldUuid", CUuuid), ("newUuid", CUuuid)]


class CUcheckpointRestoreArgs(ctypes.Structure):
    # cuda.h's 40 reserved bytes at the end, here as 32 and 8.
    _fields_ = [("gpuPairs", ctypes.POINTER(CUcheckpointGpuPair)),
                ("gpuPairsCount", ctypes.c_uint),
                ("padding0", ctypes.c_uint),
                ("customStorageInfo_out",
                 ctypes.POINTER(ctypes.POINTER(CUcheckpointCustomStorageInfo))),
                ("reserved", ctypes.c_char * 32),
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


# cuCheckpointOperationComplete first shipped with CUDA 13.4: asking
# cuGetProcAddress for it at that version tells whether the driver has custom
# storage (an older driver refuses a version newer than itself).
CUSTOM_STORAGE_VERSION = 13040
INVALID_VALUE = 1
PROC_ADDRESS = {1: "the driver does not know cuCheckpointOperationComplete",
                2: "the driver has cuCheckpointOperationComplete only for a newer CUDA version"}


def custom_storage(lib: ctypes.CDLL, cuda_version: int) -> tuple[bool, str]:
    """Whether the driver offers CUDA 13.4's custom storage; and why (not)."""
    get = getattr(lib, "cuGetProcAddress_v2", None)
    if get is None:
        return False, "libcuda exports no cuGetProcAddress_v2 (a driver before CUDA 12.0)"
    get.argtypes = [ctypes.c_char_p, ctypes.POINTER(ctypes.c_void_p), ctypes.c_int, cuuint64_t,
                    ctypes.POINTER(ctypes.c_int)]
    get.restype = ctypes.c_int
    fn, status = ctypes.c_void_p(), ctypes.c_int(-1)
    code = get(b"cuCheckpointOperationComplete", ctypes.byref(fn), CUSTOM_STORAGE_VERSION, 0,
               ctypes.byref(status))
    if code == INVALID_VALUE and cuda_version < CUSTOM_STORAGE_VERSION:
        return False, f"the driver supports CUDA {_dotted(cuda_version)}; custom storage " \
                      f"needs {_dotted(CUSTOM_STORAGE_VERSION)}"
    if code != 0:
        return False, f"cuGetProcAddress(cuCheckpointOperationComplete) failed (CUresult {code})"
    if status.value != 0 or not fn.value:
        return False, PROC_ADDRESS.get(status.value, f"cuGetProcAddress status {status.value}")
    return True, f"cuCheckpointOperationComplete found for CUDA {_dotted(CUSTOM_STORAGE_VERSION)}"


def _dotted(version: int) -> str:
    return f"{version // 1000}.{version % 1000 // 10}"


class CallFailed(Exception):
    def __init__(self, code: int):
        self.code = code


def _check(code: int) -> None:
    if code != 0:
        raise CallFailed(code)


def main(argv: list[str]) -> int:
    out_lock = threading.Lock()
    out = sys.stdout

    def say(msg: dict) -> None:
        line = json.dumps(msg) + "\n"
        with out_lock:
            out.write(line)
            out.flush()

    try:
        driver = Driver(argv[0])
    except OSError as exc:
        say({"ready": False, "stage": "load", "error": str(exc)})
        return 1
    except LookupError as exc:
        say({"ready": False, "stage": "symbols", "error": f"missing {exc}"})
        return 1
    code = driver.lib.cuInit(0)
    if code != 0:
        name, text = driver.describe(code)
        say({"ready": False, "stage": "init", "code": code, "name": name, "error": text})
        return 1
    version = ctypes.c_int(0)
    driver.lib.cuDriverGetVersion(ctypes.byref(version))
    storage, why = custom_storage(driver.lib, version.value)
    say({"ready": True, "cuda_version": version.value, "pid": os.getpid(),
         "custom_storage": storage, "custom_storage_why": why})

    def serve(req: dict) -> None:
        try:
            say({"id": req["id"], "ok": True, "value": driver.call(req)})
        except CallFailed as exc:
            name, text = driver.describe(exc.code)
            say({"id": req["id"], "ok": False, "code": exc.code, "name": name, "error": text})
        except (KeyError, TypeError, ValueError) as exc:
            say({"id": req.get("id"), "ok": False, "code": 1, "name": "bad request",
                 "error": str(exc)})

    for line in sys.stdin:
        try:
            req = json.loads(line)
        except ValueError:
            continue
        threading.Thread(target=serve, args=(req,), daemon=True).start()
    # The hook closed our stdin: it is done (or gone). Calls still inside the
    # driver are abandoned with the process.
    os._exit(0)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
