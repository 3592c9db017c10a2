"""A custom-storage caller (CUDA 13.4+) the edge probes drive step by step.

Run as `python storage_caller.py LIBCUDA` with the repository on PYTHONPATH.
It loads libcuda, calls cuInit, says hello (its PID and the driver's CUDA
version) and then answers one JSON command per stdin line with one JSON line:
the CUresult of each driver call with its name and text, never an exception.
Being its own process is the point: the probes kill it between two commands
(after the driver mapped a target's memory, before cuCheckpointOperationComplete)
and watch what the driver does with the operation it leaves open.

Commands ({"do": ...}):
  retain                     retain every GPU's primary context (and make the first current)
  checkpoint  pid            cuCheckpointProcessCheckpoint with customStorageInfo_out
  restore     pid            cuCheckpointProcessRestore with customStorageInfo_out
  copy-out    op [limit]     the op's ranges into this process's host memory (limit: bytes per range)
  copy-in     op [limit] [zeros]  that host memory (the same target's) or zeros into the ranges
  complete    op | handle    cuCheckpointOperationComplete (handle: a raw value, 0 for NULL)
  state       pid            cuCheckpointProcessGetState

The argument structs are the driver-API helper's own (one definition).
"""

from __future__ import annotations

import ctypes
import json
import mmap
import os
import sys
from typing import Any

from cudahook.core.backends import driver_helper as dh


class Caller:
    def __init__(self, library: str):
        self.driver = dh.Driver(library)
        lib = self.lib = self.driver.lib
        ptr, size = ctypes.c_void_p, ctypes.c_size_t
        for name, args in (
            ("cuDeviceGetCount", [ctypes.POINTER(ctypes.c_int)]),
            ("cuDevicePrimaryCtxRetain", [ctypes.POINTER(ptr), ctypes.c_int]),
            ("cuCtxSetCurrent", [ptr]),
            ("cuStreamSynchronize", [ptr]),
            ("cuMemcpyDtoHAsync_v2", [ptr, ctypes.c_ulonglong, size, ptr]),
            ("cuMemcpyHtoDAsync_v2", [ctypes.c_ulonglong, ptr, size, ptr]),
            ("cuCheckpointOperationComplete", [ptr]),
        ):
            fn = getattr(lib, name, None)
            if fn is not None:
                fn.argtypes, fn.restype = args, ctypes.c_int
        self.ops: list[dict[str, Any]] = []
        self.saved: dict[int, list[mmap.mmap]] = {}  # target PID: its ranges' bytes

    def result(self, code: int, **more: Any) -> dict[str, Any]:
        name, text = self.driver.describe(code) if code else ("CUDA_SUCCESS", "no error")
        return {"rc": code, "name": name, "text": text, **more}

    def retain(self) -> dict[str, Any]:
        count = ctypes.c_int()
        rc = self.lib.cuDeviceGetCount(ctypes.byref(count))
        for dev in range(count.value if rc == 0 else 0):
            ctx = ctypes.c_void_p()
            rc = self.lib.cuDevicePrimaryCtxRetain(ctypes.byref(ctx), dev)
            if rc:
                break
            if dev == 0:
                rc = self.lib.cuCtxSetCurrent(ctx)
        return self.result(rc, devices=count.value)

    def begin(self, pid: int, restore: bool) -> dict[str, Any]:
        info = ctypes.POINTER(dh.CUcheckpointCustomStorageInfo)()
        if restore:
            args: Any = dh.CUcheckpointRestoreArgs()
            args.customStorageInfo_out = ctypes.pointer(info)
            rc = self.lib.cuCheckpointProcessRestore(pid, ctypes.byref(args))
        else:
            args = dh.CUcheckpointCheckpointArgs()
            args.customStorageInfo_out = ctypes.pointer(info)
            rc = self.lib.cuCheckpointProcessCheckpoint(pid, ctypes.byref(args))
        if rc:
            return self.result(rc)
        ranges = [info.contents.perDeviceData[i] for i in range(info.contents.deviceCount)]
        op = {"pid": pid, "handle": info.contents.handle or 0, "ranges": ranges, "info": info}
        self.ops.append(op)
        return self.result(rc, op=len(self.ops) - 1, handle=op["handle"],
                           sizes=[r.size for r in ranges])

    def copy(self, index: int, to_device: bool, limit: int | None, zeros: bool) -> dict[str, Any]:
        op = self.ops[index]
        held = self.saved.setdefault(op["pid"], [])
        moved = 0
        for i, r in enumerate(op["ranges"]):
            n = r.size if limit is None else min(limit, r.size)
            if not n:
                continue
            if zeros or i >= len(held):
                buf = mmap.mmap(-1, n)
                if not to_device:
                    held.append(buf)
            else:
                buf = held[i]
                n = min(n, len(buf))
            addr = ctypes.addressof(ctypes.c_char.from_buffer(buf))
            if to_device:
                rc = self.lib.cuMemcpyHtoDAsync_v2(r.devPtr, addr, n, r.stream)
            else:
                rc = self.lib.cuMemcpyDtoHAsync_v2(addr, r.devPtr, n, r.stream)
            rc = rc or self.lib.cuStreamSynchronize(r.stream)
            if rc:
                return self.result(rc, bytes=moved)
            moved += n
        return self.result(0, bytes=moved)

    def complete(self, cmd: dict[str, Any]) -> dict[str, Any]:
        handle = self.ops[int(cmd["op"])]["handle"] if "op" in cmd else int(cmd["handle"])
        return self.result(self.lib.cuCheckpointOperationComplete(handle or None))

    def state(self, pid: int) -> dict[str, Any]:
        out = ctypes.c_int(-1)
        rc = self.lib.cuCheckpointProcessGetState(pid, ctypes.byref(out))
        return self.result(rc, state=dh.STATES.get(out.value, "unknown") if rc == 0 else None)

    def handle(self, cmd: dict[str, Any]) -> dict[str, Any]:
        do = cmd.get("do")
        if do == "retain":
            return self.retain()
        if do in ("checkpoint", "restore"):
            return self.begin(int(cmd["pid"]), do == "restore")
        if do in ("copy-out", "copy-in"):
            limit = cmd.get("limit")
            return self.copy(int(cmd["op"]), do == "copy-in", None if limit is None else int(limit),
                             bool(cmd.get("zeros")))
        if do == "complete":
            return self.complete(cmd)
        if do == "state":
            return self.state(int(cmd["pid"]))
        raise ValueError(f"unknown command {do!r}")


def main(argv: list[str]) -> int:
    def say(msg: dict[str, Any]) -> None:
        sys.stdout.write(json.dumps(msg) + "\n")
        sys.stdout.flush()

    try:
        caller = Caller(argv[0])
    except (OSError, LookupError) as exc:
        say({"ready": False, "error": str(exc)})
        return 1
    rc = caller.lib.cuInit(0)
    version = ctypes.c_int(0)
    caller.lib.cuDriverGetVersion(ctypes.byref(version))
    say({"ready": rc == 0, "pid": os.getpid(), "cuda_version": version.value, **caller.result(rc)})
    for line in sys.stdin:
        try:
            say(caller.handle(json.loads(line)))
        except (ValueError, KeyError, IndexError, TypeError) as exc:
            say({"rc": None, "error": f"{type(exc).__name__}: {exc}"})
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
