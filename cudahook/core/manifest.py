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
VERSION = 1
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
        out = {"version": VERSION, **data}
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


def verify_files(image_dir: Path, m: Manifest) -> list[tuple[str, str]]:
    """(file, problem) for each file the manifest names that is missing,
    not a regular file, or not the file that was checksummed. A manifest
    written before checksums were recorded names none: nothing to verify."""
    import time

    from cudahook.platform import safeio

    out = []
    # One budget for all of them: a manifest may name up to 64 files.
    deadline = time.monotonic() + HASH_TIMEOUT_S
    for name, want in sorted(m.files.items()):
        left = deadline - time.monotonic()
        if left <= 0:
            out.append((name, f"not verified within {HASH_TIMEOUT_S:g}s"))
            continue
        try:
            got, size = safeio.sha256_file(image_dir / name, MAX_FILE_BYTES, left)
        except FileNotFoundError:
            out.append((name, "missing"))
            continue
        except (OSError, safeio.FileRefused) as exc:
            why = exc.strerror if isinstance(exc, OSError) else str(exc)
            out.append((name, f"unreadable ({why})"))
            continue
        if got != want.sha256 or size != want.size:
            out.append((name, "checksum"))
    return out


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
    if type(obj.get("version")) is not int or obj["version"] != VERSION:
        raise ManifestError(
            f"{NAME} has version {obj.get('version')!r}; this cudahook reads version {VERSION}"
        )
    _validate(obj)
    return from_dict(obj, digest=hashlib.sha256(data).hexdigest())


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
        extra={k: v for k, v in obj.items() if k not in _KNOWN},
        version=obj.get("version", VERSION),
        digest=digest,
    )


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
