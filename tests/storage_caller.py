"""A bare custom-storage caller of the simulated libcuda, for the tests: the
calls as cuda.h documents them, in their own process (the driver refuses a
process that checkpoints itself, and each node's library keeps its cuInit).

    python storage_caller.py LIBCUDA PID checkpoint FILE [--no-retain] [--self] [--pause]
    python storage_caller.py LIBCUDA PID restore FILE [--flip OFFSET] [--map OLD=NEW]
                             [--pause] [--no-unlock]

`checkpoint` locks PID, checkpoints it to custom storage, copies its range
into FILE in chunks through a pinned buffer, and completes. `restore` maps
it back, copies FILE in (with --flip, one byte at OFFSET changed on the way
in), completes and unlocks. Each step prints one JSON line; --pause waits
for a line on stdin before completing. Any failing call prints
{"failed": NAME, "code": N} and exits 1.
"""

from __future__ import annotations

import ctypes
import json
import sys

from cudahook.core.backends.driver_api import uuid_hex
from cudahook.core.backends.driver_helper import (
    STATES,
    CUcheckpointCheckpointArgs,
    CUcheckpointCustomStorageInfo,
    CUcheckpointGpuPair,
    CUcheckpointLockArgs,
    CUcheckpointRestoreArgs,
    CUcheckpointUnlockArgs,
)

CHUNK = 1 << 20


def say(**fields: object) -> None:
    print(json.dumps(fields), flush=True)


def main(argv: list[str]) -> int:
    lib = ctypes.CDLL(argv[0])
    pid, action, path, opts = int(argv[1]), argv[2], argv[3], argv[4:]
    if "--self" in opts:
        import os

        pid = os.getpid()
    lib.cuMemcpyDtoHAsync_v2.argtypes = [ctypes.c_void_p, ctypes.c_ulonglong, ctypes.c_size_t,
                                         ctypes.c_void_p]
    lib.cuMemcpyHtoDAsync_v2.argtypes = [ctypes.c_ulonglong, ctypes.c_void_p, ctypes.c_size_t,
                                         ctypes.c_void_p]
    lib.cuStreamSynchronize.argtypes = [ctypes.c_void_p]
    lib.cuCheckpointOperationComplete.argtypes = [ctypes.c_void_p]
    lib.cuMemFreeHost.argtypes = [ctypes.c_void_p]
    lib.cuCtxSetCurrent.argtypes = [ctypes.c_void_p]

    def check(name: str, code: int) -> None:
        if code != 0:
            say(failed=name, code=code)
            sys.exit(1)

    def state() -> str:
        out = ctypes.c_int(-1)
        check("cuCheckpointProcessGetState", lib.cuCheckpointProcessGetState(pid, ctypes.byref(out)))
        return STATES.get(out.value, "unknown")

    check("cuInit", lib.cuInit(0))
    count = ctypes.c_int()
    check("cuDeviceGetCount", lib.cuDeviceGetCount(ctypes.byref(count)))
    if "--no-retain" not in opts:
        for dev in range(count.value):
            ctx = ctypes.c_void_p()
            check("cuDevicePrimaryCtxRetain", lib.cuDevicePrimaryCtxRetain(ctypes.byref(ctx), dev))
            check("cuCtxSetCurrent", lib.cuCtxSetCurrent(ctx))
    info = ctypes.POINTER(CUcheckpointCustomStorageInfo)()
    if action == "checkpoint":
        check("cuCheckpointProcessLock",
              lib.cuCheckpointProcessLock(pid, ctypes.byref(CUcheckpointLockArgs())))
        args = CUcheckpointCheckpointArgs()
        args.customStorageInfo_out = ctypes.pointer(info)
        check("cuCheckpointProcessCheckpoint",
              lib.cuCheckpointProcessCheckpoint(pid, ctypes.byref(args)))
    else:
        restore = CUcheckpointRestoreArgs()
        restore.customStorageInfo_out = ctypes.pointer(info)
        maps = [o.split("=", 1) for o in opts[opts.index("--map") + 1:][:1]] if "--map" in opts \
            else []
        if maps:
            pairs = (CUcheckpointGpuPair * len(maps))()
            for i, (old, new) in enumerate(maps):
                pairs[i].oldUuid.bytes = bytes.fromhex(uuid_hex(old))
                pairs[i].newUuid.bytes = bytes.fromhex(uuid_hex(new))
            restore.gpuPairs = ctypes.cast(pairs, type(restore.gpuPairs))
            restore.gpuPairsCount = len(maps)
        check("cuCheckpointProcessRestore", lib.cuCheckpointProcessRestore(pid, ctypes.byref(restore)))
    ranges = [info.contents.perDeviceData[i] for i in range(info.contents.deviceCount)]
    say(step="mapped", state=state(), sizes=[r.size for r in ranges])
    pinned = ctypes.c_void_p()
    check("cuMemHostAlloc", lib.cuMemHostAlloc(ctypes.byref(pinned), CHUNK, 0))
    flip = int(opts[opts.index("--flip") + 1]) if "--flip" in opts else -1
    with open(path, "rb" if action == "restore" else "wb") as f:
        for r in ranges:
            for offset in range(0, r.size, CHUNK):
                n = min(CHUNK, r.size - offset)
                if action == "checkpoint":
                    check("cuMemcpyDtoHAsync", lib.cuMemcpyDtoHAsync_v2(
                        pinned, r.devPtr + offset, n, r.stream))
                    check("cuStreamSynchronize", lib.cuStreamSynchronize(r.stream))
                    f.write(ctypes.string_at(pinned, n))
                else:
                    data = bytearray(f.read(n))
                    if offset <= flip < offset + n:
                        data[flip - offset] ^= 0x01  # the byte changes on its way in
                    ctypes.memmove(pinned, bytes(data), n)
                    check("cuMemcpyHtoDAsync", lib.cuMemcpyHtoDAsync_v2(
                        r.devPtr + offset, pinned, n, r.stream))
                    check("cuStreamSynchronize", lib.cuStreamSynchronize(r.stream))
    check("cuMemFreeHost", lib.cuMemFreeHost(pinned))
    if "--pause" in opts:
        say(step="copied", state=state())
        sys.stdin.readline()
    check("cuCheckpointOperationComplete",
          lib.cuCheckpointOperationComplete(info.contents.handle))
    say(step="complete", state=state())
    if action == "restore" and "--no-unlock" not in opts:
        check("cuCheckpointProcessUnlock",
              lib.cuCheckpointProcessUnlock(pid, ctypes.byref(CUcheckpointUnlockArgs())))
        say(step="unlocked", state=state())
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
