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
import errno
import fcntl
import io
import json
import os
import stat
import sys
import threading

# Annotations only: this file starts on the hook's critical path.
TYPE_CHECKING = False
if TYPE_CHECKING:
    from collections.abc import Callable, Iterable
    from typing import Any

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
        self._storage: Storage | None = None
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

    def storage(self) -> Storage:
        """The custom-storage side (CUDA 13.4+), set up at its first use."""
        with _storage_lock:
            if self._storage is None:
                self._storage = Storage(self)
            return self._storage

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
            array = _gpu_pairs(restore, pairs)  # noqa: F841 - must outlive the call
            _check(lib.cuCheckpointProcessRestore(pid, ctypes.byref(restore)))
        elif op == "unlock":
            unlock = CUcheckpointUnlockArgs()
            _check(lib.cuCheckpointProcessUnlock(pid, ctypes.byref(unlock)))
        elif op == "storage-checkpoint":
            return self.storage().checkpoint(pid, str(req["dir"]), int(req["chunk"]),
                                             _level(req.get("zstd", 0)),
                                             bool(req.get("dedupe", False)))
        elif op == "storage-restore":
            self.storage().restore(pid, str(req["dir"]), req.get("pairs") or [],
                                   checked=req.get("checked") is True)
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


_storage_lock = threading.Lock()
# The chunk digests this helper reads. A new image gets blake3 (several
# times sha256's speed, docs/performance.md) when the installed package can
# be loaded (see _extension), else sha256; the manifest names which.
DIGESTS = ("blake3", "sha256")
HEX = frozenset("0123456789abcdef")
MANIFEST = "manifest.json"
RESERVE = ".reserve"  # core/manifest.py STORAGE_RESERVE, in the storage directory
RESERVE_DIRECTORY = 1 << 16  # given back for a process directory and its manifest's blocks
MANIFEST_MAX = 16 << 20
CHUNK_MIN, CHUNK_MAX = 4096, 1 << 30
MAX_RANGES = 64


class Refused(Exception):
    """A custom-storage image that is not what its manifest says."""


class Missing(Refused):
    """A file of the image is not there."""


class Mismatch(Refused):
    """A chunk's content does not match its digest."""


class Storage:
    """CUDA 13.4 custom storage: a process's GPU memory straight into files.

    The driver maps the target's memory onto this process's GPUs, one range
    per GPU; each range is copied out in fixed-size chunks through two pinned
    staging buffers per GPU (one fills while the other is written), each
    chunk to its own file with its digest in the manifest; the files, the
    manifest and the directory are fsynced before cuCheckpointOperationComplete
    lets the driver release the memory. A restore verifies every chunk
    against the manifest as it copies each one in, and before the process is
    touched too unless the caller has just verified them all (`checked`).
    The image directory comes from outside: opened without following links,
    regular files only, sizes exact, manifest capped.
    """

    def __init__(self, driver: Driver):
        self.driver = driver
        lib = self.lib = driver.lib
        cu, ptr, size = ctypes.c_int, ctypes.c_void_p, ctypes.c_size_t
        for name, args in (
            ("cuDeviceGetCount", [ctypes.POINTER(ctypes.c_int)]),
            ("cuDevicePrimaryCtxRetain", [ctypes.POINTER(ptr), ctypes.c_int]),
            ("cuCtxSetCurrent", [ptr]),
            ("cuStreamSynchronize", [ptr]),
            ("cuMemHostAlloc", [ctypes.POINTER(ptr), size, ctypes.c_uint]),
            ("cuMemFreeHost", [ptr]),
            ("cuMemcpyDtoHAsync_v2", [ptr, ctypes.c_ulonglong, size, ptr]),
            ("cuMemcpyHtoDAsync_v2", [ctypes.c_ulonglong, ptr, size, ptr]),
            ("cuCheckpointOperationComplete", [ptr]),
        ):
            fn = getattr(lib, name)
            fn.argtypes, fn.restype = args, cu
        # The driver requires the primary context of every GPU involved:
        # retained once, for the helper's life (one phase).
        count = ctypes.c_int()
        _check(lib.cuDeviceGetCount(ctypes.byref(count)))
        self.contexts = []
        for dev in range(count.value):
            ctx = ctypes.c_void_p()
            _check(lib.cuDevicePrimaryCtxRetain(ctypes.byref(ctx), dev))
            self.contexts.append(ctx)

    def _current(self) -> None:
        """Pinned allocations need a current context on this thread."""
        if self.contexts:
            _check(self.lib.cuCtxSetCurrent(self.contexts[0]))

    def _pinned(self, size: int) -> ctypes.c_void_p:
        p = ctypes.c_void_p()
        _check(self.lib.cuMemHostAlloc(ctypes.byref(p), size, 0))
        return p

    def checkpoint(self, pid: int, directory: str, chunk: int, zstd: int = 0,
                   dedupe: bool = False) -> dict:
        self._current()
        reserve = _open_reserve(directory)
        try:
            _give_back(reserve, RESERVE_DIRECTORY)
            os.mkdir(directory, 0o700)  # a new directory: never into someone else's
            return self._checkpoint(pid, directory, chunk, reserve, zstd, dedupe)
        finally:
            if reserve is not None:
                os.close(reserve)

    def _checkpoint(self, pid: int, directory: str, chunk: int, reserve: int | None,
                    zstd: int, dedupe: bool) -> dict:
        dirfd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
        out = _Out(dirfd, _new_digest(), zstd)
        try:
            if dedupe:
                out.open_index(directory)
            if zstd:  # loaded now: past the driver's call, a failure costs a put-back
                _needs("zstandard", "compression")
            info = ctypes.POINTER(CUcheckpointCustomStorageInfo)()
            args = CUcheckpointCheckpointArgs()
            args.customStorageInfo_out = ctypes.pointer(info)
            _check(self.lib.cuCheckpointProcessCheckpoint(pid, ctypes.byref(args)))
            ranges = [info.contents.perDeviceData[i] for i in range(info.contents.deviceCount)]
            try:
                manifest = {"format": 2, "digest": out.digest, "chunk": chunk, "ranges": [
                    self._copy_out(r, out, i, chunk, reserve) for i, r in enumerate(ranges)]}
                # Durable before the driver may release the memory: the chunks
                # (those not fsynced as they were written, fsynced once all
                # are, so the disk writes them back while the link copies),
                # the manifest, the directory.
                for name in out.unsynced:
                    _fsync(dirfd, name)
                raw = json.dumps(manifest).encode()
                _give_back(reserve, len(raw) + RESERVE_DIRECTORY)
                _write(dirfd, MANIFEST, raw)
                os.fsync(dirfd)
                _check(self.lib.cuCheckpointOperationComplete(info.contents.handle))
            except (CallFailed, OSError, Refused) as exc:
                # The process is CHECKPOINTING and the API has no abort: its
                # memory is put back through host memory (see _put_back).
                raise PutBack(f"{_what(self, exc)}; {self._put_back(pid, info.contents, ranges)}"
                              ) from exc
        except BaseException:
            _remove_own(dirfd, directory, out.index)
            raise
        finally:
            os.close(dirfd)
            if out.index is not None:
                os.close(out.index)
        return {"ranges": len(ranges), "bytes": sum(r.size for r in ranges),
                "stored": out.stored, "linked": out.linked, "digest": out.digest}

    def _put_back(self, pid: int, info: CUcheckpointCustomStorageInfo,
                  ranges: list[CUcheckpointCustomStoragePerDeviceData]) -> str:
        """Undo a custom-storage checkpoint that failed before completion,
        with the API's own calls: each range into anonymous host memory of
        this helper, complete (memory released), a custom-storage restore from
        that memory, complete. The process ends LOCKED with its memory as it
        was (the rollback unlocks it); what happened, in words."""
        import mmap

        lib = self.lib
        held = []
        try:
            for r in ranges:
                m = mmap.mmap(-1, max(r.size, 1))
                held.append(m)
                addr = ctypes.addressof(ctypes.c_char.from_buffer(m))
                _check(lib.cuMemcpyDtoHAsync_v2(addr, r.devPtr, r.size, r.stream))
                _check(lib.cuStreamSynchronize(r.stream))
            _check(lib.cuCheckpointOperationComplete(info.handle))
        except (CallFailed, OSError) as exc:
            return f"putting its GPU memory back failed ({_what(self, exc)}): left checkpointing"
        try:
            back = ctypes.POINTER(CUcheckpointCustomStorageInfo)()
            args = CUcheckpointRestoreArgs()
            args.customStorageInfo_out = ctypes.pointer(back)
            _check(lib.cuCheckpointProcessRestore(pid, ctypes.byref(args)))
            mapped = [back.contents.perDeviceData[i] for i in range(back.contents.deviceCount)]
            if [r.size for r in mapped] == [r.size for r in ranges]:
                for r, m in zip(mapped, held, strict=True):
                    addr = ctypes.addressof(ctypes.c_char.from_buffer(m))
                    _check(lib.cuMemcpyHtoDAsync_v2(r.devPtr, addr, r.size, r.stream))
                    _check(lib.cuStreamSynchronize(r.stream))
            _check(lib.cuCheckpointOperationComplete(back.contents.handle))
            if [r.size for r in mapped] != [r.size for r in ranges]:
                return "the driver mapped other ranges to put it back: left locked, memory lost"
        except (CallFailed, OSError) as exc:
            return f"putting its GPU memory back failed ({_what(self, exc)}): left checkpointed"
        finally:
            for m in held:
                m.close()
        return "its GPU memory was put back: left locked"

    def _copy_out(self, r: CUcheckpointCustomStoragePerDeviceData, out: _Out, index: int,
                  chunk: int, reserve: int | None = None) -> dict:
        lib, count = self.lib, -(-r.size // chunk)
        bufs = [self._pinned(chunk) for _ in range(2 if count > 1 else 1)]
        digests: list[str] = []
        stored: list[int] = []
        try:
            def enqueue(k: int) -> None:
                n = min(chunk, r.size - k * chunk)
                _check(lib.cuMemcpyDtoHAsync_v2(bufs[k % len(bufs)], r.devPtr + k * chunk, n,
                                                r.stream))

            if count:
                enqueue(0)
            for k in range(count):
                _check(lib.cuStreamSynchronize(r.stream))  # chunk k has landed
                if k + 1 < count:
                    enqueue(k + 1)  # into the other buffer, while this one is written
                n = min(chunk, r.size - k * chunk)
                data = memoryview((ctypes.c_char * n).from_address(bufs[k % len(bufs)].value)
                                  ).cast("B")
                digest = _hash(out.digest, data)
                digests.append(digest)
                _give_back(reserve, n)  # at most n is written: dedupe and zstd only shrink it
                stored.append(out.put(_chunk_name(index, k), data, digest))
        finally:
            for b in bufs:
                lib.cuMemFreeHost(b)
        # `zstd`: each chunk's size as stored compressed, 0 where stored raw.
        return {"size": r.size, "chunks": digests, **({"zstd": stored} if any(stored) else {})}

    def restore(self, pid: int, directory: str, pairs: list, checked: bool = False) -> None:
        self._current()
        try:
            dirfd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
        except OSError as exc:
            raise Refused(f"no custom-storage image at {directory}: {exc.strerror}") from exc
        try:
            manifest = _manifest(dirfd)
            chunk, kind = manifest["chunk"], manifest["digest"]
            _needs_digest(kind)
            if any(rng.get("zstd") for rng in manifest["ranges"]):
                _needs("zstandard", "an image of compressed chunks")
            # Every chunk verified before the process is touched: a bad image
            # leaves it checkpointed, exactly as it was. A caller that has just
            # verified them all (post-restore) spares this second read: a chunk
            # changed since is still refused on its way in, below, and the
            # process is then left locked, never released.
            for i, rng in enumerate(manifest["ranges"]):
                for k, digest in enumerate(rng["chunks"]):
                    if not checked:
                        read_chunk(dirfd, _chunk_name(i, k), _chunk_size(rng["size"], chunk, k),
                                   _zstd(rng, k), kind, digest, None)
            info = ctypes.POINTER(CUcheckpointCustomStorageInfo)()
            args = CUcheckpointRestoreArgs()
            args.customStorageInfo_out = ctypes.pointer(info)
            keep = _gpu_pairs(args, pairs)  # noqa: F841 - the array lives through the call
            _check(self.lib.cuCheckpointProcessRestore(pid, ctypes.byref(args)))
            # RESTORING now. No abort: whatever goes wrong, the operation is
            # completed and the process stays LOCKED - never unlocked here.
            failure: Exception | None = None
            try:
                ranges = [info.contents.perDeviceData[i] for i in range(info.contents.deviceCount)]
                sizes = [r.size for r in ranges]
                if sizes != [rng["size"] for rng in manifest["ranges"]]:
                    raise Refused(f"the driver mapped ranges of {sizes} bytes; the image holds "
                                  f"{[rng['size'] for rng in manifest['ranges']]}")
                for i, (r, rng) in enumerate(zip(ranges, manifest["ranges"], strict=True)):
                    self._copy_in(r, dirfd, i, chunk, kind, rng)
            except (Refused, CallFailed, OSError) as exc:
                failure = exc
            _check(self.lib.cuCheckpointOperationComplete(info.contents.handle))
            if failure is not None:
                raise failure
        finally:
            os.close(dirfd)

    def _copy_in(self, r: CUcheckpointCustomStoragePerDeviceData, dirfd: int, index: int,
                 chunk: int, kind: str, rng: dict) -> None:
        lib, digests = self.lib, rng["chunks"]
        bufs = [self._pinned(chunk) for _ in range(2 if len(digests) > 1 else 1)]
        try:
            for k, digest in enumerate(digests):
                n = _chunk_size(r.size, chunk, k)
                buf = bufs[k % len(bufs)]
                # Read while the previous chunk crosses the link: this buffer's
                # last copy finished at the synchronisation before it.
                read_chunk(dirfd, _chunk_name(index, k), n, _zstd(rng, k), kind, digest,
                           memoryview((ctypes.c_char * n).from_address(buf.value)).cast("B"))
                _check(lib.cuStreamSynchronize(r.stream))
                _check(lib.cuMemcpyHtoDAsync_v2(r.devPtr + k * chunk, buf, n, r.stream))
            _check(lib.cuStreamSynchronize(r.stream))
        finally:
            for b in bufs:
                lib.cuMemFreeHost(b)


class PutBack(Exception):
    """A custom-storage checkpoint failed after the driver's call; the text
    says whether the process's memory was put back."""


def _what(storage: Storage, exc: BaseException) -> str:
    if isinstance(exc, CallFailed):
        name, text = storage.driver.describe(exc.code)
        return f"{text} ({name})"
    return str(exc)


def _remove_own(dirfd: int, directory: str, index: int | None = None) -> None:
    """Remove what a failed checkpoint wrote: the directory it created, and
    the chunk files and manifest in it (nothing else is there to remove).
    A chunk file is a link; one another process of the checkpoint shares
    keeps its data through that process's own link, so removing ours never
    takes a chunk from anyone. Index entries left with no process's link are
    dropped (see _Out)."""
    import contextlib

    for name in os.listdir(dirfd):
        if name == MANIFEST or name.endswith(".chunk"):
            os.unlink(name, dir_fd=dirfd)
    with contextlib.suppress(OSError):  # something else appeared in it: its owner's
        os.rmdir(directory)
    if index is not None:
        prune_index(index)


# Dedupe: identical chunks of one checkpoint are stored once. Each process's
# chunk files stay where they always were (<dir>/<nspid>/gpu<i>-<k>.chunk),
# but a chunk already written by any process of this checkpoint becomes a
# hard link to that file, found through an index of links by digest in the
# storage directory. Links keep the layout, the reading code and the export
# of every runtime (tar keeps hard links; a copy that does not just stores
# them again) as they were, and a file's data lives as long as any process's
# link does: removing one process's files never removes another's chunk.
INDEX = "by-digest"
ZSTD = ".zst"  # an index entry of a chunk stored compressed
# Chunks being written now, by (index device, inode, digest): set when done.
_claims: dict[tuple[int, int, str], threading.Event] = {}
_claims_lock = threading.Lock()


class _Out:
    """Where one process's chunks go: its directory, the digest, the zstd
    level (0: off) and the checkpoint's index (None: no dedupe)."""

    def __init__(self, dirfd: int, digest: str, zstd: int):
        self.dirfd, self.digest, self.zstd = dirfd, digest, zstd
        self.index: int | None = None
        self.index_id = (0, 0)  # the index's device and inode: whose claims
        self.stored = self.linked = 0  # bytes written, chunks linked
        # Chunks written without an fsync, for the checkpoint to fsync in
        # one pass once all are written (see Storage._checkpoint).
        self.unsynced: list[str] = []

    def open_index(self, directory: str) -> None:
        self.index = _index(directory)
        st = os.fstat(self.index)
        self.index_id = (st.st_dev, st.st_ino)

    def put(self, name: str, data: memoryview, digest: str) -> int:
        """Store one chunk as `name`: a link to an identical one stored
        already, or a new file, compressed when that makes it smaller, then
        published in the index. Its size as stored when compressed, else 0."""
        if self.index is None:
            return self._write(name, data, digest)
        key = (*self.index_id, digest)
        # Replicas are checkpointed in parallel and reach the same chunk
        # together: the look in the index is made holding the chunk's claim,
        # so one thread writes it and the others, waiting, then link it (a
        # look made before claiming could miss a chunk published and let go
        # of just after, and store it twice).
        while True:
            with _claims_lock:
                other = _claims.get(key)
                if other is None:
                    mine = _claims[key] = threading.Event()
                    break
            other.wait()  # then link it, or (its writer failed) write it
        try:
            size = self._link(name, digest)
            if size is not None:
                self.linked += 1
                return size
            return self._write(name, data, digest)
        finally:
            with _claims_lock:
                del _claims[key]
            mine.set()

    def _write(self, name: str, data: memoryview, digest: str) -> int:
        frame = _compress(self.zstd, data) if self.zstd else None
        # A chunk published in the index must be complete on disk first (see
        # _link); one of this process's own is fsynced with the others, later.
        # A raw chunk goes from the pinned buffer with O_DIRECT where it can.
        sync = self.index is not None
        _write(self.dirfd, name, data if frame is None else frame, sync=sync)
        if not sync:
            self.unsynced.append(name)
        self.stored += len(data) if frame is None else len(frame)
        if self.index is not None:
            import contextlib

            # First come, first published; an identical file is as good.
            with contextlib.suppress(FileExistsError):
                os.link(name, digest + ("" if frame is None else ZSTD), src_dir_fd=self.dirfd,
                        dst_dir_fd=self.index, follow_symlinks=False)
        return 0 if frame is None else len(frame)

    def _link(self, name: str, digest: str) -> int | None:
        """Link `name` to the index's file of this digest; its compressed size
        (0: raw), or None when the index has none. Only complete files are in
        the index: each is fsynced before it is published."""
        for suffix in (ZSTD, ""):
            try:
                os.link(digest + suffix, name, src_dir_fd=self.index, dst_dir_fd=self.dirfd,
                        follow_symlinks=False)
            except FileNotFoundError:  # none yet, or pruned just now: write it
                continue
            st = os.stat(name, dir_fd=self.dirfd, follow_symlinks=False)
            if not stat.S_ISREG(st.st_mode):  # never ours: write our own
                os.unlink(name, dir_fd=self.dirfd)
                return None
            return st.st_size if suffix else 0
        return None


def _index(directory: str) -> int:
    """The checkpoint's index, next to the process directories: made by the
    first process that needs it, opened without following a link."""
    import contextlib

    path = os.path.join(os.path.dirname(directory), INDEX)
    with contextlib.suppress(FileExistsError):
        os.mkdir(path, 0o700)
    return os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)


def prune_index(index: int) -> None:
    """Drop the index entries no process's file links to any more. Racing a
    process that links one just now is harmless: its link keeps the data,
    and one that finds the entry gone writes the chunk itself."""
    for name in os.listdir(index):
        try:
            if os.stat(name, dir_fd=index, follow_symlinks=False).st_nlink <= 1:
                os.unlink(name, dir_fd=index)
        except OSError:
            continue


# Where the installed blake3 and zstandard packages live, as the parent
# found them (the helper's second argument, os.pathsep-separated).
LIBS: list[str] = []
_import_lock = threading.Lock()


def _extension(name: str) -> Any:
    """blake3 or zstandard, imported at first use: only the storage path
    gets here, never a hook's fast path. Started with -I -S, this helper sees
    the standard library alone; the parent names the directories the
    packages are installed in, and each is used only if it and every
    directory above it belong to root (or to this user) and nobody else may
    write there: no container's or image's path ever gets onto sys.path."""
    import importlib

    with _import_lock:
        try:
            return importlib.import_module(name)
        except ImportError:
            if not LIBS:
                raise
        for path in LIBS:
            if path not in sys.path and _trusted_dir(path):
                sys.path.append(path)  # after the standard library: never shadows it
        return importlib.import_module(name)


def _trusted_dir(path: str) -> bool:
    """Whether only root (or this user) can change what `path` holds: it is
    theirs and writable by no one else, and so is every directory above it
    (one above may be sticky, as /tmp is: others cannot rename our entries)."""
    if not os.path.isabs(path):
        return False
    leaf = True
    while True:
        try:
            st = os.stat(path)
        except OSError:
            return False
        shared = st.st_mode & 0o022 and (leaf or not st.st_mode & stat.S_ISVTX)
        if st.st_uid not in (0, os.geteuid()) or not stat.S_ISDIR(st.st_mode) or shared:
            return False
        parent = os.path.dirname(path)
        if parent == path:
            return True
        path, leaf = parent, False


def _needs(name: str, what: str) -> None:
    try:
        _extension(name)
    except ImportError as exc:
        raise Refused(f"{what} needs the {name} package, which this helper cannot load "
                      f"({exc})") from exc


def _new_digest() -> str:
    """The digest of a new image: blake3 when it loads, else sha256."""
    try:
        _extension("blake3")
    except ImportError:
        return "sha256"
    return "blake3"


def _hash(kind: str, data: memoryview) -> str:
    """A chunk's digest, in hex (hashlib costs milliseconds to import: only
    on this path). blake3 hashes a chunk on several threads where there are
    cores for it."""
    if kind == "blake3":
        b3 = _extension("blake3")
        return b3.blake3(data, max_threads=b3.blake3.AUTO).hexdigest()  # type: ignore[no-any-return]
    if kind == "sha256":
        import hashlib

        return hashlib.sha256(data).hexdigest()
    raise Refused(f"chunk digest {kind!r} is not one this version reads")


def _needs_digest(kind: str) -> None:
    if kind == "blake3":
        _needs("blake3", "an image of blake3 digests")


def _level(value: object) -> int:
    """A zstd level from a request: 0 (off) or 1..19."""
    if type(value) is not int or not 0 <= value <= ZSTD_MAX_LEVEL:
        raise ValueError(f"zstd level {value!r}: not 0 (off) to {ZSTD_MAX_LEVEL}")
    return value


ZSTD_MAX_LEVEL = 19


def _compress(level: int, data: memoryview) -> bytes | None:
    """A chunk as one zstd frame that declares its size, or None when that
    is not smaller than the chunk: such a chunk is stored raw."""
    zstd = _extension("zstandard")
    try:
        # Random-looking data (most of a model's weights can be) costs a whole
        # compression for nothing: a fast look at a sample first.
        if len(data) > 4 * ZSTD_PROBE:
            probe = zstd.ZstdCompressor(level=1).compress(data[:ZSTD_PROBE])
            if len(probe) > ZSTD_PROBE * 0.97:
                return None
        frame = zstd.ZstdCompressor(level=level, write_content_size=True).compress(data)
    except zstd.ZstdError as exc:
        raise Refused(f"zstd: {exc}") from exc
    return frame if len(frame) < len(data) else None


ZSTD_PROBE = 128 << 10


def _decompress(frame: memoryview, into: memoryview) -> None:
    """Fill `into` from one zstd frame, never producing more than it holds:
    a frame that makes more (a bomb), less, or is not zstd is refused."""
    zstd = _extension("zstandard")
    n, done = len(into), 0
    try:
        reader = zstd.ZstdDecompressor().stream_reader(frame, read_across_frames=False)
        while done < n:
            got = reader.readinto(into[done:])
            if not got:
                break
            done += got
        more = reader.read(1)
    except zstd.ZstdError as exc:  # a damaged chunk, as a flipped bit in a raw one is
        raise Mismatch(f"not a zstd frame of {n} bytes ({exc})") from exc
    if done != n or more:
        raise Mismatch(f"its zstd frame does not hold {n} bytes "
                       f"({'more' if more else done})")


def _zstd(rng: dict, k: int) -> int:
    """Chunk k's size as stored compressed, or 0: stored raw."""
    sizes = rng.get("zstd")
    return sizes[k] if sizes else 0


def _chunk_name(index: int, k: int) -> str:
    return f"gpu{index}-{k:06d}.chunk"


def _chunk_size(size: int, chunk: int, k: int) -> int:
    return min(chunk, size - k * chunk)


def _open_reserve(directory: str) -> int | None:
    """Pre-dump's preallocation of the GPU memory's space, beside the process
    directories (core/manifest.py STORAGE_RESERVE), or None without one."""
    try:
        fd = os.open(os.path.join(os.path.dirname(directory), RESERVE),
                     os.O_RDWR | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError:
        return None
    if not stat.S_ISREG(os.fstat(fd).st_mode):
        os.close(fd)
        return None
    return fd


def _give_back(reserve: int | None, n: int) -> None:
    """Shrink the reservation by `n` bytes just before writing as many: the
    space stays held for the copy-out until it is written, so a disk filled
    by someone else meanwhile cannot fail it. Processes copied out in
    parallel share the file: one shrink at a time."""
    if reserve is None:
        return
    fcntl.flock(reserve, fcntl.LOCK_EX)
    try:
        os.ftruncate(reserve, max(0, os.fstat(reserve).st_size - n))
    finally:
        fcntl.flock(reserve, fcntl.LOCK_UN)


# O_DIRECT moves a chunk from the pinned buffer to the disk without passing
# through the page cache; it needs the buffer, the length and the offset
# aligned to the device's block (4096 covers them all).
DIRECT_ALIGN = 4096


def _write(dirfd: int, name: str, data: object, sync: bool = True) -> None:
    """A new file, written whole; fsynced unless `sync` is False (the caller
    fsyncs it later: `_fsync`). With O_DIRECT where the filesystem takes it
    and the buffer is aligned (tmpfs refuses it: written through the cache)."""
    view = memoryview(data).cast("B")  # type: ignore[arg-type]
    flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC
    direct = getattr(os, "O_DIRECT", 0) if _aligned(view) else 0
    try:
        fd = os.open(name, flags | direct, 0o600, dir_fd=dirfd)
    except OSError as exc:
        if not direct or exc.errno != errno.EINVAL:
            raise
        fd, direct = os.open(name, flags, 0o600, dir_fd=dirfd), 0
    try:
        done = 0
        while done < len(view):
            try:
                done += os.write(fd, view[done:])
            except OSError as exc:
                if not direct or exc.errno != errno.EINVAL:
                    raise
                # Opened, yet refused at the write (some filesystems): the
                # rest through the page cache.
                fcntl.fcntl(fd, fcntl.F_SETFL, fcntl.fcntl(fd, fcntl.F_GETFL) & ~direct)
                direct = 0
        if sync:
            os.fsync(fd)
    finally:
        os.close(fd)


def _aligned(view: memoryview) -> bool:
    """Whether `view` can go to the disk with O_DIRECT as it is."""
    if not view.nbytes or view.nbytes % DIRECT_ALIGN:
        return False
    if view.readonly:
        return False
    return ctypes.addressof(ctypes.c_char.from_buffer(view)) % DIRECT_ALIGN == 0


def _fsync(dirfd: int, name: str) -> None:
    """fsync a file this helper wrote with `_write(sync=False)`."""
    fd = os.open(name, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=dirfd)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _open_regular(dirfd: int, name: str, size: int | None, cap: int) -> int:
    """A file of the image: no link followed, no FIFO or device waited on,
    regular, of the expected size (or at most cap)."""
    try:
        fd = os.open(name, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC,
                     dir_fd=dirfd)
    except FileNotFoundError as exc:
        raise Missing(f"{name}: {exc.strerror}") from exc
    except OSError as exc:
        raise Refused(f"{name}: {exc.strerror}") from exc
    st = os.fstat(fd)
    if not stat.S_ISREG(st.st_mode) or (size is not None and st.st_size != size) \
            or st.st_size > cap:
        os.close(fd)
        raise Refused(f"{name}: not a regular file of {size if size is not None else cap} "
                      f"bytes{' at most' if size is None else ''}")
    return fd


def read_chunk(dirfd: int, name: str, size: int, zstd: int, kind: str, digest: str,
               into: memoryview | None) -> None:
    """Read one chunk (into `into`, or a buffer of its own), decompressing
    it when `zstd` (its stored size) says so, and check the digest of its
    raw bytes. The file is the image's: no link followed, regular, exactly
    its stored size."""
    fd = _open_regular(dirfd, name, zstd or size, zstd or size)
    out = into if into is not None else memoryview(bytearray(size))
    try:
        raw = out if not zstd else memoryview(bytearray(zstd))
        done = 0
        while done < len(raw):
            got = os.readv(fd, [raw[done:]])
            if got <= 0:
                raise Refused(f"{name}: shorter than {len(raw)} bytes")
            done += got
    finally:
        os.close(fd)
    _check_raw(name, raw, out, zstd, kind, digest)


def check_stored(name: str, stored: memoryview, size: int, zstd: int, kind: str,
                 digest: str) -> None:
    """A chunk's bytes as stored (`zstd`: its compressed size, else raw),
    read by the caller, checked as `read_chunk` checks them."""
    if len(stored) != (zstd or size):
        raise Mismatch(f"{name}: {len(stored)} bytes, not {zstd or size}")
    _check_raw(name, stored, memoryview(bytearray(size)) if zstd else stored, zstd, kind,
               digest)


def _check_raw(name: str, raw: memoryview, out: memoryview, zstd: int, kind: str,
               digest: str) -> None:
    if zstd:
        try:
            _decompress(raw, out)
        except Refused as exc:
            raise type(exc)(f"{name}: {exc}") from exc
    if _hash(kind, out) != digest:
        raise Mismatch(f"{name}: content does not match its digest in the manifest")


def _manifest(dirfd: int) -> dict:
    """The image's manifest, checked field by field. Format 1: sha256, every
    chunk raw; format 2 names its digest and may store chunks compressed."""
    fd = _open_regular(dirfd, MANIFEST, None, MANIFEST_MAX)
    try:
        raw = os.read(fd, MANIFEST_MAX + 1)
    finally:
        os.close(fd)
    try:
        m = json.loads(raw)
        ok = manifest_ok(m)
    except (ValueError, RecursionError):
        ok = False
    if not ok:
        raise Refused(f"{MANIFEST}: not a custom-storage manifest this version reads")
    return m


def manifest_ok(m: object) -> bool:
    """Whether a parsed per-process manifest is one this version reads."""
    ok = (isinstance(m, dict) and m.get("format") in (1, 2) and m.get("digest") in DIGESTS
          and (m["format"] == 2 or m["digest"] == "sha256")
          and type(m.get("chunk")) is int and CHUNK_MIN <= m["chunk"] <= CHUNK_MAX
          and isinstance(m.get("ranges"), list) and len(m["ranges"]) <= MAX_RANGES)
    for rng in m["ranges"] if ok else ():  # type: ignore[index]
        ok = ok and isinstance(rng, dict) and type(rng.get("size")) is int \
            and 0 <= rng["size"] < 1 << 48 and isinstance(rng.get("chunks"), list) \
            and len(rng["chunks"]) == -(-rng["size"] // m["chunk"]) \
            and all(isinstance(d, str) and len(d) == 64 and HEX.issuperset(d)
                    for d in rng["chunks"]) \
            and _sizes_ok(rng, m["chunk"], m["format"])  # type: ignore[index]
    return ok


def _sizes_ok(rng: dict, chunk: int, fmt: int) -> bool:
    """A range's compressed sizes: absent, or one per chunk, each 0 (raw) or
    smaller than the chunk it holds (a chunk that does not shrink is raw)."""
    sizes = rng.get("zstd")
    if sizes is None:
        return True
    return fmt == 2 and isinstance(sizes, list) and len(sizes) == len(rng["chunks"]) \
        and all(type(z) is int and 0 <= z < _chunk_size(rng["size"], chunk, k)
                for k, z in enumerate(sizes))


def _gpu_pairs(args: CUcheckpointRestoreArgs, pairs: list) -> object:
    """Fill the restore's GPU pairs; the array, which must outlive the call."""
    if not pairs:
        return None
    array = (CUcheckpointGpuPair * len(pairs))()
    for i, (old, new) in enumerate(pairs):
        array[i].oldUuid.bytes = bytes.fromhex(old)
        array[i].newUuid.bytes = bytes.fromhex(new)
    args.gpuPairs = ctypes.cast(array, ctypes.POINTER(CUcheckpointGpuPair))
    args.gpuPairsCount = len(pairs)
    return array


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
    except (Refused, PutBack, OSError) as exc:  # custom storage: the image, or a put-back
        return {"id": req["id"], "ok": False, "code": 1, "name": "custom storage",
                "error": str(exc)}
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
    storage, why = custom_storage(driver.lib, version.value)
    return driver, {"ready": True, "cuda_version": version.value, "pid": os.getpid(),
                    "custom_storage": storage, "custom_storage_why": why}


def main(argv: list[str]) -> int:
    LIBS[:] = [p for p in argv[1].split(os.pathsep) if p] if len(argv) > 1 else []
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
