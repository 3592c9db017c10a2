"""The checkpoint manifest: what cudahook adds to a CRIU image directory.

It is written at pre-dump, before CRIU writes anything, and read at restore;
it is the only way the restore side learns which processes were CUDA
processes and on which GPUs, so it is versioned and validated on read.

The image comes from wherever the checkpoint was stored, so the file is
read once (`read`): the bytes read are validated, parsed into a `Manifest`,
and hashed into its `digest` - what was checked is what is used, and no
second open can see another file put in its place in between.
"""

from __future__ import annotations

from pathlib import Path

from cudahook.platform.errors import CudahookError, Exit
from cudahook.platform.record import Record
from cudahook.platform.store import write_json_atomic

# typing costs milliseconds at every hook start: annotations only.
TYPE_CHECKING = False
if TYPE_CHECKING:
    from typing import Any


NAME = "cudahook-manifest.json"
# Version 1 images keep GPU memory in the processes' host memory (CRIU dumps
# it). Version 2 adds `gpu_storage`: GPU memory in chunk files in the image
# (CUDA 13.4+ custom storage). Only such an image is written as 2, so an
# older cudahook refuses the one image it could not restore, and this one
# reads both.
# Version 3 is version 2 whose chunks have blake3 digests or are stored
# compressed (zstd): written only for such an image, so an older cudahook
# refuses it by its version rather than as a chunk that fails its checksum.
VERSION = 1
STORAGE_VERSION = 2
PACKED_VERSION = 3
STORAGE_VERSIONS = (STORAGE_VERSION, PACKED_VERSION)
READS = (VERSION, *STORAGE_VERSIONS)
# The digests a chunk may carry (core/backends/driver_helper.py computes them).
CHUNK_DIGESTS = ("sha256", "blake3")
# Where in the image the chunks of each process go: <STORAGE_DIR>/<nspid>/.
STORAGE_DIR = "cudahook-gpu"
STORAGE_MANIFEST = "manifest.json"  # the driver helper's, per process
# Pre-dump's preallocation in STORAGE_DIR, held until the copy-out writes
# into its space (the driver helper's RESERVE: it imports nothing).
STORAGE_RESERVE = ".reserve"
# A manifest holds a few lines per CUDA process; anything near this is not ours.
MAX_BYTES = 32 << 20


class ManifestError(CudahookError):
    """The checkpoint's manifest is unusable: bad input, nothing was changed."""

    exit_code = Exit.USAGE


# cudahook's own files in an image are checksummed up to this size (the VMM
# state is capped at 1 GiB where it is copied, see vmm/coordinator.py).
MAX_FILE_BYTES = 1 << 30
# Hashing must not hold a hook past this (all files together): 1 GiB takes
# a few seconds from a local disk, more from a network mount.
HASH_TIMEOUT_S = 120.0


class Process(Record, frozen=True):
    """One CUDA process of the checkpoint."""

    nspid: int  # its PID in the container's namespace: what CRIU restores
    pid: int | None = None  # its host PID at checkpoint (changes on restore)
    state: str | None = None  # cuda-checkpoint's state before the lock

    def to_dict(self) -> dict[str, Any]:
        # `pid` may not be null in the format: absent when unknown.
        pid = {} if self.pid is None else {"pid": self.pid}
        return {"nspid": self.nspid, **pid, "state": self.state}


class GpuModel(Record, frozen=True):
    """Model name and memory of a GPU the processes used: a restore
    elsewhere needs the same chip with as much memory."""

    name: str
    memory_mib: int | None = None


class FileSum(Record, frozen=True):
    """sha256 and size of one of cudahook's own files in the image."""

    sha256: str
    size: int


class StorageRange(Record, frozen=True):
    """One GPU's memory of a process: its size and each chunk's digest (every
    chunk `chunk` bytes, the last one the rest), of its raw bytes."""

    size: int
    chunks: tuple[str, ...]
    # Each chunk's size as stored compressed (zstd), 0 where stored raw;
    # empty: every chunk raw.
    zstd: tuple[int, ...] = ()


class StoredFile(Record, frozen=True):
    """One GPU-memory file of an image: its name in the image, its raw size
    and digest (`kind`), and its size as stored compressed (0: raw)."""

    name: str
    size: int
    digest: str
    zstd: int = 0
    kind: str = "sha256"


class StoredProcess(Record, frozen=True):
    """Where one process's GPU memory lies in the image, chunk by chunk."""

    nspid: int
    chunk: int
    manifest_sha256: str  # of <dir>/<nspid>/manifest.json, as the helper wrote it
    manifest_size: int
    ranges: tuple[StorageRange, ...]

    def files(self, kind: str = "sha256") -> list[StoredFile]:
        """Each chunk file, by its name in the process's directory."""
        out = []
        for i, r in enumerate(self.ranges):
            for k, digest in enumerate(r.chunks):
                out.append(StoredFile(name=f"gpu{i}-{k:06d}.chunk",
                                      size=min(self.chunk, r.size - k * self.chunk),
                                      digest=digest, zstd=r.zstd[k] if r.zstd else 0, kind=kind))
        return out

    def to_dict(self) -> dict[str, Any]:
        return {"nspid": self.nspid, "chunk": self.chunk,
                "manifest": {"sha256": self.manifest_sha256, "size": self.manifest_size},
                "ranges": [{"size": r.size, "chunks": list(r.chunks),
                            **({"zstd": list(r.zstd)} if r.zstd else {})}
                           for r in self.ranges]}


class GpuStorage(Record, frozen=True):
    """The image's GPU memory in storage (manifest version 2)."""

    dir: str  # relative to the image directory
    processes: tuple[StoredProcess, ...]
    digest: str = "sha256"

    @property
    def bytes(self) -> int:
        """The GPU memory's raw size. What the image holds may be less (shared
        and compressed chunks), but a restore, and a checkpoint's space
        reservation, must count on the raw size: nothing guarantees the next
        checkpoint dedupes or compresses as well."""
        return sum(r.size for p in self.processes for r in p.ranges)

    @property
    def version(self) -> int:
        """The manifest version this storage needs (see PACKED_VERSION)."""
        packed = self.digest != "sha256" or any(r.zstd for p in self.processes
                                                for r in p.ranges)
        return PACKED_VERSION if packed else STORAGE_VERSION

    def to_dict(self) -> dict[str, Any]:
        return {"dir": self.dir, "digest": self.digest,
                "processes": [p.to_dict() for p in self.processes]}


class Manifest(Record, frozen=True):
    """A parsed manifest (config/manifest.schema.json says each field's rule).

    Optional fields absent from an older manifest read as their defaults;
    top-level keys this version does not know (a newer cudahook's) are
    accepted and kept in `extra`, as they were read.
    """

    processes: tuple[Process, ...]
    container_id: str | None = None
    created: float | None = None  # wall-clock time of the checkpoint
    driver_version: str | None = None
    gpus: tuple[str, ...] = ()
    gpu_models: dict[str, GpuModel] = {}  # by GPU UUID
    vmm: bool = False  # the VMM interposer's state is part of the image
    gpu_memory_bytes: int | None = None
    # The checkpoint's phases per process, as core/timeline.py writes them
    # and admin/chart.py draws them (the same shape as a result's timeline).
    timeline: dict[str, Any] | None = None
    files: dict[str, FileSum] = {}  # by name in the image (none before 0.2)
    # GPU memory in chunk files of the image (version 2), or None: in the
    # processes' host memory, which CRIU dumps.
    gpu_storage: GpuStorage | None = None
    extra: dict[str, Any] = {}
    version: int = VERSION
    # sha256 of the bytes it was parsed from (None: not read from a file).
    digest: str | None = None

    def to_dict(self) -> dict[str, Any]:
        """The manifest as the file holds it (JSON-ready; `digest` is not
        part of it)."""
        out: dict[str, Any] = {
            **self.extra,
            "version": self.version,
            "container_id": self.container_id,
            "driver_version": self.driver_version,
            "gpus": list(self.gpus),
            "gpu_models": {u: m.as_dict() for u, m in self.gpu_models.items()},
            "vmm": self.vmm,
            "gpu_memory_bytes": self.gpu_memory_bytes,
            "processes": [p.to_dict() for p in self.processes],
        }
        # Neither may be null in the format: absent when unknown.
        if self.created is not None:
            out["created"] = self.created
        if self.timeline is not None:
            out["timeline"] = self.timeline
        if self.files:
            out["files"] = {n: f.as_dict() for n, f in self.files.items()}
        if self.gpu_storage is not None:
            out["version"] = self.gpu_storage.version
            out["gpu_storage"] = self.gpu_storage.to_dict()
        return out

    @property
    def nspids(self) -> list[int]:
        return [p.nspid for p in self.processes]

    def gpu_model(self) -> str | None:
        """The first GPU's model name (the metrics' label), if recorded."""
        for u in self.gpus:
            m = self.gpu_models.get(u)
            if m is not None and m.name:
                return m.name
        return None


# The top-level keys of this version's format: the rest go to `extra`.
_KNOWN = frozenset(Manifest._fields) - {"extra", "digest"}


def write(image_dir: Path, data: Manifest | dict[str, Any],
          files: list[str] | tuple[str, ...] = ()) -> Path:
    """Write the manifest; `files`, cudahook's own files already in the
    image, go in with their sha256, which the restore side verifies.

    A plain dict is the older form of `data` (written as given, with the
    version first): kept until hooks/criu_action.py builds a Manifest."""
    from cudahook.platform import safeio

    sums = {}
    for name in files:
        digest, size = safeio.sha256_file(image_dir / name, MAX_FILE_BYTES, HASH_TIMEOUT_S)
        sums[name] = FileSum(sha256=digest, size=size)
    if isinstance(data, Manifest):
        out = (data.replace(files=sums) if sums else data).to_dict()
    else:
        stored = data.get("gpu_storage")
        out = {"version": VERSION, **data}
        if isinstance(stored, GpuStorage):
            out.update(version=stored.version, gpu_storage=stored.to_dict())
        if sums:
            out["files"] = {n: f.as_dict() for n, f in sums.items()}
    path = image_dir / NAME
    write_json_atomic(path, out, mode=0o600)
    return path


def digest(image_dir: Path) -> str:
    """sha256 of the manifest file as it is now. A manifest in hand carries
    the digest of the bytes it was read from (`Manifest.digest`): use that."""
    from cudahook.platform import safeio

    return safeio.sha256_file(image_dir / NAME, MAX_BYTES)[0]


# Hashing GPU memory in storage gets this much more time per byte (a slow
# disk still reads 64 MiB/s), on top of HASH_TIMEOUT_S.
STORAGE_HASH_BYTES_PER_S = 64 << 20
# Files hashed at once by verify_files (at most one per CPU).
HASH_WORKERS = 8
# `quick`: besides each process's manifest, its first and last chunk and
# this many more, picked at random, are verified.
QUICK_SAMPLE = 4


def storage_files(m: Manifest, quick: bool = False) -> list[StoredFile]:
    """Each GPU-memory file of the image, by its name in the image; `quick`:
    each process's manifest and a sample of its chunks."""
    import random

    out: list[StoredFile] = []
    if m.gpu_storage is None:
        return out
    for p in m.gpu_storage.processes:
        base = f"{m.gpu_storage.dir}/{p.nspid}/"
        out.append(StoredFile(name=base + STORAGE_MANIFEST, size=p.manifest_size,
                              digest=p.manifest_sha256))
        chunks = p.files(m.gpu_storage.digest)
        if quick and len(chunks) > QUICK_SAMPLE + 2:
            middle = random.sample(range(1, len(chunks) - 1), QUICK_SAMPLE)
            chunks = [chunks[i] for i in sorted({0, len(chunks) - 1, *middle})]
        out.extend(f.replace(name=base + f.name) for f in chunks)
    return out


def _storage_dirs(image_dir: Path, m: Manifest) -> list[tuple[str, str]]:
    """Problems with the directories the chunks lie in: each must be a real
    directory of the image, never a symlink to somewhere else."""
    import stat

    if m.gpu_storage is None:
        return []
    out = []
    names = [m.gpu_storage.dir] + [f"{m.gpu_storage.dir}/{p.nspid}"
                                   for p in m.gpu_storage.processes]
    for name in names:
        try:
            st = (image_dir / name).lstat()
        except FileNotFoundError:
            out.append((name, "missing"))
            continue
        except OSError as exc:
            out.append((name, f"unreadable ({exc.strerror})"))
            continue
        if not stat.S_ISDIR(st.st_mode):
            out.append((name, "unreadable (not a directory)"))
    return out


def verify_files(image_dir: Path, m: Manifest, quick: bool = False) -> list[tuple[str, str]]:
    """(file, problem) for each file the manifest names that is missing,
    not a regular file, or not the file that was checksummed: cudahook's
    own files, and every chunk of GPU memory in storage (`quick`: a sample
    of them). A manifest written before checksums were recorded names
    none: nothing to verify."""
    import os
    import time

    from cudahook.core.fanout import Raised, fan_out
    from cudahook.platform import safeio

    out = _storage_dirs(image_dir, m)
    if out:  # a chunk read through a swapped directory would prove nothing
        return out
    wanted = [StoredFile(name=name, size=want.size, digest=want.sha256)
              for name, want in sorted(m.files.items())]
    stored = storage_files(m, quick)
    # One budget for all of them: a manifest may name up to 64 files, and
    # gigabytes of GPU memory.
    budget = HASH_TIMEOUT_S + sum(f.size for f in stored) / STORAGE_HASH_BYTES_PER_S
    deadline = time.monotonic() + budget

    def problem(f: StoredFile) -> str | None:
        name, size, sha256 = f.name, f.size, f.digest
        left = deadline - time.monotonic()
        if left <= 0:
            return f"not verified within {budget:g}s"
        if f.zstd or f.kind != "sha256":
            return _verify_chunk(image_dir, f, left)
        try:
            got, got_size = safeio.sha256_file(image_dir / name, MAX_FILE_BYTES, left)
        except FileNotFoundError:
            return "missing"
        except (OSError, safeio.FileRefused) as exc:
            why = exc.strerror if isinstance(exc, OSError) else str(exc)
            return f"unreadable ({why})"
        return "checksum" if got != sha256 or got_size != size else None

    # Side by side: hashlib and the reads let go of the GIL, and gigabytes
    # of chunks would otherwise keep one core busy while the others wait.
    items = wanted + stored
    found = fan_out(problem, items, min(HASH_WORKERS, os.cpu_count() or 1))
    for f, why in zip(items, found, strict=True):
        if isinstance(why, Raised):
            raise why.exc
        if why is not None:
            out.append((f.name, why))
    return out


def _verify_chunk(image_dir: Path, f: StoredFile, timeout_s: float) -> str | None:
    """A chunk whose digest is not sha256 or which is stored compressed,
    verified as the driver helper verifies it at restore (one reader: the
    same caps, links never followed, decompression bounded by its raw size):
    the problem, or None."""
    import os

    from cudahook.core.backends import driver_helper as helper
    from cudahook.platform import safeio

    where, name = os.path.split(f.name)

    def read() -> None:
        fd = os.open(image_dir / where, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW
                     | os.O_CLOEXEC)
        try:
            helper.read_chunk(fd, name, f.size, f.zstd, f.kind, f.digest, None)
        finally:
            os.close(fd)

    try:
        safeio.with_deadline(read, timeout_s, str(image_dir / f.name))
    except helper.Missing:
        return "missing"
    except helper.Mismatch:
        return "checksum"
    except (helper.Refused, safeio.FileRefused) as exc:
        return f"unreadable ({str(exc).removeprefix(name + ': ')})"
    except ImportError as exc:
        return f"unreadable (its digest or compression needs {exc.name or exc})"
    except OSError as exc:
        return f"unreadable ({exc.strerror or exc})"
    return None


def read(image_dir: Path) -> Manifest | None:
    """The manifest, or None when the checkpoint holds no CUDA state.

    The manifest is read like any file someone else controls (no symlink,
    regular file, size cap, deadline), once: the Manifest and its digest
    both come from the bytes of that one read.
    """
    from cudahook.platform import safeio

    path = image_dir / NAME
    try:
        data = safeio.read_bytes(path, MAX_BYTES)
    except FileNotFoundError:
        return None
    except (OSError, safeio.FileRefused) as exc:
        why = exc.strerror if isinstance(exc, OSError) else str(exc).removeprefix(f"{path}: ")
        raise ManifestError(f"{NAME} in the checkpoint is unreadable ({why})") from exc
    return parse(data)


def parse(data: bytes) -> Manifest:
    """A manifest from its bytes (read by `read`, or out of an archive),
    validated against config/manifest.schema.json; ManifestError in one
    line when it is not one this cudahook reads."""
    import hashlib

    from cudahook.platform import safeio

    if len(data) > MAX_BYTES:
        raise ManifestError(f"{NAME} in the checkpoint is unreadable "
                            f"(larger than {MAX_BYTES} bytes)")
    try:
        obj = safeio.parse_json(data, NAME)
    except safeio.FileRefused as exc:
        why = str(exc).removeprefix(f"{NAME}: ")
        raise ManifestError(f"{NAME} in the checkpoint is unreadable ({why})") from exc
    if not isinstance(obj, dict):
        raise ManifestError(f"{NAME} in the checkpoint is unreadable (not a JSON object)")
    version = obj.get("version")
    if type(version) is not int or version not in READS \
            or (version in STORAGE_VERSIONS) != ("gpu_storage" in obj):
        why = " (versions 2 and 3 are an image with gpu_storage, and only it)" \
            if type(version) is int and version in READS else ""
        raise ManifestError(
            f"{NAME} has version {version!r}{why}; this cudahook reads versions "
            f"{', '.join(map(str, READS))}")
    _validate(obj)
    m = from_dict(obj, digest=hashlib.sha256(data).hexdigest())
    _check_storage(m)
    return m


def _check_storage(m: Manifest) -> None:
    """What the schema cannot say about gpu_storage: one entry per CUDA
    process of the image, and as many chunks as each size takes."""
    if m.gpu_storage is None:
        return
    if m.version < m.gpu_storage.version:
        raise ManifestError(f"{NAME}: gpu_storage: blake3 digests or compressed chunks need "
                            f"version {PACKED_VERSION}, not {m.version}")
    nspids = [p.nspid for p in m.gpu_storage.processes]
    if sorted(nspids) != sorted(m.nspids):
        raise ManifestError(f"{NAME}: gpu_storage: its processes {sorted(nspids)} are not "
                            f"the image's {sorted(m.nspids)}")
    for p in m.gpu_storage.processes:
        for r in p.ranges:
            if len(r.chunks) != -(-r.size // p.chunk):
                raise ManifestError(f"{NAME}: gpu_storage: process {p.nspid}: "
                                    f"{len(r.chunks)} chunks for {r.size} bytes of "
                                    f"{p.chunk}-byte chunks")
            # A chunk is stored compressed only when that made it smaller.
            if r.zstd and (len(r.zstd) != len(r.chunks) or any(
                    z >= min(p.chunk, r.size - k * p.chunk) for k, z in enumerate(r.zstd))):
                raise ManifestError(f"{NAME}: gpu_storage: process {p.nspid}: its compressed "
                                    f"sizes are not one per chunk, each smaller than the chunk")


def from_dict(obj: dict[str, Any], digest: str | None = None) -> Manifest:
    """A Manifest from a JSON object that passed the schema (`parse`), or
    that cudahook wrote itself (a CRIU run's progress file)."""
    models = obj.get("gpu_models") or {}
    sums = obj.get("files") or {}
    return Manifest(
        processes=tuple(Process(nspid=int(p["nspid"]), pid=_int(p.get("pid")),
                                state=p.get("state")) for p in obj["processes"]),
        container_id=obj.get("container_id"),
        created=obj.get("created"),
        driver_version=obj.get("driver_version"),
        gpus=tuple(obj.get("gpus") or ()),
        gpu_models={u: GpuModel(name=m["name"], memory_mib=_int(m.get("memory_mib")))
                    for u, m in models.items()},
        vmm=bool(obj.get("vmm", False)),
        gpu_memory_bytes=_int(obj.get("gpu_memory_bytes")),
        timeline=obj.get("timeline"),
        files={n: FileSum(sha256=f["sha256"], size=int(f["size"])) for n, f in sums.items()},
        gpu_storage=_storage(obj.get("gpu_storage")),
        extra={k: v for k, v in obj.items() if k not in _KNOWN},
        version=obj.get("version", VERSION),
        digest=digest,
    )


def _storage(obj: dict[str, Any] | None) -> GpuStorage | None:
    if obj is None:
        return None
    return GpuStorage(dir=obj["dir"], digest=obj.get("digest", "sha256"), processes=tuple(
        StoredProcess(nspid=int(p["nspid"]), chunk=int(p["chunk"]),
                      manifest_sha256=p["manifest"]["sha256"],
                      manifest_size=int(p["manifest"]["size"]),
                      ranges=tuple(StorageRange(size=int(r["size"]), chunks=tuple(r["chunks"]),
                                                zstd=tuple(int(z) for z in r.get("zstd") or ()))
                                   for r in p["ranges"]))
        for p in obj["processes"]))


def _int(value: Any) -> int | None:
    # JSON Schema's integers include 7.0: the field holds it as 7.
    return None if value is None else int(value)


def _validate(data: dict[str, Any]) -> None:
    from cudahook.platform.config import validate
    from cudahook.platform.errors import ConfigError

    try:
        validate(data, "manifest.schema.json", NAME)
    except ConfigError as exc:
        text = str(exc)
        # Name the part a reader looks for first; the schema says the rest.
        for key, what in (("processes", "malformed process list"), ("gpus", "malformed GPU list")):
            if text.startswith(f"{NAME}: {key}"):
                raise ManifestError(f"{NAME}: {what}: {text.removeprefix(NAME + ': ')}") from exc
        raise ManifestError(text) from exc
