"""`cudahook migrate`: move a GPU container to another node through podman.

    node A:  cudahook migrate checkpoint CONTAINER ARCHIVE
             (podman container checkpoint --export; ARCHIVE.sha256 beside it)
    copy ARCHIVE and ARCHIVE.sha256 to node B
    node B:  cudahook migrate restore ARCHIVE [--name NAME] [--gpus UUID,...]
             (podman container restore --import, the container moved onto B's GPUs)

The restore decides everything before podman starts, so a refusal leaves
nothing behind. The archive is outside input: one bounded pass of
archive.py's reader checks its checksum (against ARCHIVE.sha256), its gzip
CRC, its structure and bounds (exit 2: damaged, cut short, or holding what
a podman checkpoint never holds), and with a trusted key its signature
(signing.py); the checkpoint's manifest must pass this node's restore gate
with the GPUs chosen here (`restore_gate.plan_restore`, the decision
post-restore takes; exit codes as `cudahook check --image` gives them: 6
when this node can never run it). The same pass writes a copy (in $TMPDIR
or --work-dir, as large as the archive uncompressed) whose container spec
names this node's GPUs, without the CRIU configuration the source node
chose; the restore's OCI hook and post-restore compute the same device map
from it. A restore that podman (or the gate at post-restore) refuses is
reported with the reason cudahook wrote into CRIU's log and its exit code,
and the container this restore made (and only that one) is removed.
"""

from __future__ import annotations

import contextlib
import errno
import hashlib
import json
import os
import re
import shlex
import shutil
import stat
import tempfile
import uuid
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from cudahook.platform.atomic import write_atomic
from cudahook.platform.errors import (
    CudahookError,
    EnvironmentProblem,
    Exit,
    NotRestorableHere,
    UsageError,
    one_line,
)

from . import archive as ar

if TYPE_CHECKING:
    from cudahook.core.manifest import Manifest, StoredFile

MANIFEST = "checkpoint/cudahook-manifest.json"
SPEC_FILES = ("spec.dump", "config.dump")
SIDECAR = ".sha256"
CHUNK = 1 << 20
#: podman's own work on a large checkpoint (GPU memory copied to the host,
#: written out, packed) takes minutes: the default deadline is generous.
DEFAULT_TIMEOUT_S = 3600.0


class MigrateFailed(CudahookError):
    """podman failed the checkpoint or restore; the reason it or cudahook gave."""

    def __init__(self, message: str, code: int = Exit.FAILED):
        super().__init__(one_line(message))
        self.exit_code = Exit(code)  # type: ignore[misc]


# -- the archive ---------------------------------------------------------------


def sha256_of(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(CHUNK):
            h.update(chunk)
    return h.hexdigest()


def sidecar(archive: Path) -> Path:
    return archive.with_name(archive.name + SIDECAR)


def expected_checksum(archive: Path) -> str:
    """The digest ARCHIVE.sha256 (sha256sum format) says the archive has."""
    from cudahook.platform import safeio

    side = sidecar(archive)
    try:
        text = safeio.read_bytes(side, 4096).decode(errors="replace")
    except FileNotFoundError:
        raise UsageError(f"{one_line(str(side))} is missing: the archive cannot be checked "
                         "(copy it with the archive, or --no-verify)") from None
    except (OSError, safeio.FileRefused) as exc:
        raise UsageError(one_line(f"{side}: unreadable ({exc})")) from exc
    want = text.split()[0].lower() if text.split() else ""
    if not re.fullmatch(r"[0-9a-f]{64}", want):
        raise UsageError(f"{one_line(str(side))}: not a sha256 checksum")
    return want


def mismatch(archive: Path, got: str | None, want: str) -> UsageError:
    return UsageError(f"{one_line(str(archive))} does not match "
                      f"{one_line(sidecar(archive).name)} (damaged or cut short "
                      f"in transit): sha256 {got or 'unreadable'}, expected {want}")


def verify_checksum(archive: Path) -> str:
    """The archive's digest, checked against ARCHIVE.sha256."""
    want = expected_checksum(archive)
    try:
        got = sha256_of(archive)
    except OSError as exc:
        raise UsageError(f"{one_line(str(archive))}: unreadable ({exc.strerror})") from exc
    if got != want:
        raise mismatch(archive, got, want)
    return got


#: Members read into memory: the container's spec (twice) and the manifest.
SMALL = frozenset({*SPEC_FILES, MANIFEST})


def scan(archive: Path, copy_to: Path | None = None, *,
         max_bytes: int = ar.DEFAULT_MAX_BYTES, timeout_s: float = DEFAULT_TIMEOUT_S,
         room: int | None = None) -> ar.Scan:
    """Read the whole archive once (archive.py: bounded, strict, the gzip
    CRC checked at its end), refusing what a checkpoint never holds - a copy
    damaged or cut short fails here, before anything is restored. With
    `copy_to`, the same pass copies every member but the spec files into
    that new uncompressed tar; `finish_copy` adds those. Without one (a dry
    run) it takes the GPU-memory chunks' digests instead, for `verify_files`."""
    if copy_to is None:
        return ar.scan(archive, small=SMALL, max_bytes=max_bytes, timeout_s=timeout_s,
                       chunk_digests=True)
    fd = os.open(copy_to, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC,
                 0o600)
    try:
        with open(fd, "wb", buffering=CHUNK) as copy:
            return ar.scan(archive, small=SMALL, skip_in_copy=frozenset(SPEC_FILES), copy=copy,
                           room=room, max_bytes=max_bytes, timeout_s=timeout_s)
    except OSError as exc:
        if exc.errno in (errno.ENOSPC, errno.EDQUOT, errno.EROFS, errno.EACCES):
            raise EnvironmentProblem(f"cannot write the restore's copy of {ar.show(archive.name)}: "
                                     f"{exc.strerror}") from exc
        raise


def finish_copy(copy: Path, specs: dict[str, bytes]) -> None:
    """Add the container's spec files to the copy `scan` made, and its end."""
    with open(copy, "ab") as dst:
        for name, data in specs.items():
            ar.add_file(dst, name, data)
        ar.end_copy(dst)


def set_visible(spec: dict[str, Any], gpus: Sequence[str]) -> None:
    """An OCI spec names `gpus` as its GPUs: NVIDIA_VISIBLE_DEVICES (which the
    OCI hook reads first), the nvidia.com/gpu devices of its CDI annotations,
    and no `cudahook.io/device-map` (a map between the old node's GPUs: the
    restore gate computes this node's from the GPUs named here)."""
    process = spec.setdefault("process", {})
    env = [e for e in process.get("env") or [] if not e.startswith("NVIDIA_VISIBLE_DEVICES=")]
    process["env"] = [*env, f"NVIDIA_VISIBLE_DEVICES={','.join(gpus)}"]
    notes = spec.get("annotations")
    if not isinstance(notes, dict):
        return
    notes.pop("cudahook.io/device-map", None)
    ours = [f"nvidia.com/gpu={u}" for u in gpus]
    for key in sorted(k for k in notes if k.startswith("cdi.k8s.io/")):
        kept, nvidia, kind = [], False, ""
        for item in (x.strip() for x in str(notes[key]).split(",")):
            if "=" in item:
                kind = item.partition("=")[0].strip()
            if kind == "nvidia.com/gpu":
                nvidia = True
            elif item:
                kept.append(item)
        if nvidia:
            kept, ours = kept + ours, []  # this node's GPUs, once
            if kept:
                notes[key] = ",".join(kept)
            else:
                del notes[key]


#: Annotations that choose CRIU's configuration (and with it which action
#: scripts run): the operator's on each node, never carried in an archive.
CRIU_CONFIG_ANNOTATIONS = ("org.criu.config", "cudahook.io/criu-config")
#: The restore's own mark on the container podman creates: removed after a
#: failure only when it carries this run's token. Not under cudahook.io/,
#: whose keys the OCI hook reads as options.
TOKEN_ANNOTATION = "cudahook-migrate/restore-token"


def _json(small: dict[str, bytes], name: str) -> Any:
    """A JSON member of the archive (strict UTF-8, nesting bounded): exit 2
    when it is missing or malformed."""
    from cudahook.platform import safeio

    if name not in small:
        raise UsageError(f"{name} is not in the archive")
    try:
        return safeio.parse_json(small[name], f"{name} in the archive")
    except safeio.FileRefused as exc:
        raise UsageError(one_line(str(exc))) from exc


def _specs(small: dict[str, bytes]) -> Iterator[tuple[str, Any, dict[str, Any]]]:
    """(file, its JSON, the OCI spec in it) for spec.dump and config.dump."""
    for name in SPEC_FILES:
        data = _json(small, name)
        spec = data if name == "spec.dump" else data.get("spec") if isinstance(data, dict) else None
        if not isinstance(spec, dict):
            raise UsageError(f"{name} in the archive holds no container spec")
        process = spec.get("process", {})
        if not isinstance(process, dict) or not isinstance(process.get("env", []), list) \
                or not all(isinstance(e, str) for e in process.get("env") or []):
            raise UsageError(f"{name} in the archive: the spec's process environment is not a "
                             "list of strings")
        yield name, data, spec


def carried_criu_config(small: dict[str, bytes]) -> list[str]:
    """The CRIU-configuration annotations the archive's spec carries (dropped)."""
    found: set[str] = set()
    for _, _, spec in _specs(small):
        notes = spec.get("annotations")
        if isinstance(notes, dict):
            found |= {k for k in CRIU_CONFIG_ANNOTATIONS if k in notes}
    return sorted(found)


def retarget(small: dict[str, bytes], gpus: Sequence[str] | None,
             token: str | None = None) -> dict[str, bytes]:
    """The container's spec, which podman keeps twice (spec.dump, and inside
    config.dump): naming this node's GPUs (`gpus`; None: as it is), without
    the CRIU-configuration annotations of the node it came from, marked with
    this restore's `token`. The new contents of both."""
    out = {}
    for name, data, spec in _specs(small):
        if gpus is not None:
            set_visible(spec, gpus)
        notes = spec.get("annotations")
        if notes is not None and not isinstance(notes, dict):
            raise UsageError(f"{name} in the archive: annotations are not a map")
        for key in CRIU_CONFIG_ANNOTATIONS:
            (notes or {}).pop(key, None)
        if token:
            spec.setdefault("annotations", {})[TOKEN_ANNOTATION] = token
        out[name] = json.dumps(data).encode()
    return out


# -- this node -----------------------------------------------------------------


def choose_gpus(source: Sequence[str], node: Sequence[str], wanted: Sequence[str] | None
                ) -> list[str]:
    """The GPUs to restore onto: `wanted`; else the same ones where all are
    here (a restore on the same node); else the first of this node's."""
    if wanted:
        if len(wanted) != len(source):
            raise UsageError(f"--gpus names {len(wanted)} GPU(s); the checkpoint's processes "
                             f"used {len(source)}")
        missing = [u for u in wanted if u not in node]
        if missing:
            raise UsageError(f"--gpus: this node has no GPU {', '.join(missing)}")
        return list(wanted)
    if all(u in node for u in source):
        return list(source)
    if len(node) < len(source):
        raise NotRestorableHere(
            f"the checkpoint's processes used {len(source)} GPU(s); this node has {len(node)}")
    return list(node[: len(source)])


def plan(ctx: Any, m: Manifest, wanted: Sequence[str] | None
         ) -> tuple[list[str], dict[str, str] | None]:
    """This node's GPUs for the checkpoint and the device map the restore
    gate computes for them (or its refusal)."""
    from cudahook.core.gpus import query_gpus
    from cudahook.flow import annotations as ann
    from cudahook.flow.restore_gate import plan_restore

    source = list(m.gpus)
    try:
        node = [g.uuid for g in query_gpus(ctx.host, ctx.settings)]
        targets = choose_gpus(source, node, wanted)
        # The record the OCI hook will write at restore names exactly these.
        mapping = plan_restore(ctx, {"visible": targets}, ann.Options(), m)
    except CudahookError as exc:
        if exc.reason is None:
            raise
        raise as_check(exc) from exc
    return targets, mapping


def as_check(exc: CudahookError) -> CudahookError:
    """A refusal of the restore gate with the exit code `cudahook check
    --image` gives for the same reason: 6 when no retry on this node can
    change it, else 1 (the hooks' own codes, e.g. 5, stay the hooks')."""
    from cudahook.platform.reasons import REASONS

    reason = REASONS.get(exc.reason or "")
    code = Exit.NOT_HERE if reason is not None and reason.never_here else Exit.FAILED
    out = MigrateFailed(str(exc), code)
    out.reason = exc.reason
    return out


# -- podman --------------------------------------------------------------------


def _podman_reason(res: Any) -> tuple[str, int]:
    """What failed, in one line: cudahook's own line from the CRIU log podman
    names (at post-restore: why the gate refused), else podman's last line."""
    from cudahook.platform import safeio

    said = (res.stderr or "") + (res.stdout or "")
    code = Exit.FAILED
    lines: list[str] = []
    m = re.search(r"log file: (\S+\.log)", said)
    if m:
        try:
            log = safeio.read_bytes(m.group(1), 8 << 20).decode(errors="replace")
        except (OSError, safeio.FileRefused):
            log = ""
        for line in log.splitlines():
            if "cudahook: " not in line:
                continue
            # CRIU runs each action twice; the second call repeats the exit code.
            earlier = re.search(r"failed earlier in this CRIU run \(exit (\d+)\)", line)
            if earlier:
                code = int(earlier.group(1)) or Exit.FAILED
                continue
            text = line[line.index("cudahook: ") + len("cudahook: "):].strip()
            if text not in lines:
                lines.append(text)
    if res.timed_out:
        return f"podman did not finish in time ({' '.join(res.argv[:3])} ...)", Exit.FAILED
    podman = [x.strip() for x in said.splitlines() if x.strip()]
    reason = "; ".join(lines) or (podman[0] if podman else f"podman exited {res.returncode}")
    return reason, code


def _run(ctx: Any, podman: Sequence[str], args: Sequence[str], timeout: float) -> Any:
    if not podman or shutil.which(podman[0]) is None:
        raise EnvironmentProblem(f"podman not found ({podman[0] if podman else ''!r})")
    return ctx.host.run([*podman, *args], timeout)


def checkpoint(ctx: Any, podman: Sequence[str], container: str, archive: Path, *,
               leave_running: bool = False, compress: str = "gzip",
               timeout: float = DEFAULT_TIMEOUT_S, sign_key: Path | None = None
               ) -> dict[str, Any]:
    """Checkpoint `container` into `archive` (its checksum beside it, and
    with `sign_key` its signature)."""
    from . import signing

    existing = [p for p in (archive, sidecar(archive), signing.signature_path(archive))
                if os.path.lexists(p)]
    if existing:
        raise UsageError(f"{existing[0]} exists already: not overwritten")
    # Before podman stops anything: a key that cannot sign refuses now.
    key = signing.load_private(sign_key) if sign_key is not None else None
    partial = archive.with_name(archive.name + ".partial")
    partial.unlink(missing_ok=True)
    args = ["container", "checkpoint", f"--export={partial}", "--compress", compress]
    if leave_running:
        args.append("--leave-running")
    with _interruptible() as deferred:
        try:
            # A signal now waits for podman: the container may be stopped
            # already, and its only copy is the archive podman is writing.
            deferred.hold = True
            try:
                res = _run(ctx, podman, [*args, "--", container], timeout)
            finally:
                deferred.hold = False
            if not res.ok:
                reason, code = _podman_reason(res)
                raise MigrateFailed(f"checkpoint of {ar.show(container)} failed: {reason}", code)
            try:
                st = partial.lstat()
            except FileNotFoundError:
                st = None
            if st is None or not stat.S_ISREG(st.st_mode):
                raise MigrateFailed(f"podman reported the checkpoint of {ar.show(container)} "
                                    f"done but wrote no archive ({partial.name})")
            digest = sha256_of(partial)
            size = st.st_size
            os.replace(partial, archive)
        finally:
            partial.unlink(missing_ok=True)
    signed = None
    if key is not None:
        signed = str(signing.sign(archive, digest, size, container, key))
    # Written last: an archive with its checksum beside it is complete.
    write_atomic(sidecar(archive), f"{digest}  {archive.name}\n".encode(), 0o644)
    m = _peek_manifest(archive)
    return {"container": container, "archive": str(archive), "sha256": digest,
            "bytes": size, "gpus": list(m.gpus) if m else None,
            "leave_running": leave_running, "signature": signed}


def _manifest(small: dict[str, bytes]) -> Manifest | None:
    """The checkpoint's manifest, checked as the restore gate checks it
    (None: the checkpoint holds no CUDA state). Unreadable: exit 6, as
    `cudahook check --image` says (MANIFEST_UNREADABLE)."""
    from cudahook.core import manifest

    if MANIFEST not in small:
        return None
    try:
        return manifest.parse(small[MANIFEST])
    except manifest.ManifestError as exc:
        raise NotRestorableHere(one_line(str(exc)), reason="MANIFEST_UNREADABLE") from exc


def verify_files(m: Manifest, hashed: dict[str, tuple[str, int]],
                 at: dict[str, tuple[int, int]] | None = None, copy: Path | None = None,
                 chunks: dict[str, ar.ChunkDigests] | None = None) -> int:
    """cudahook's own files the manifest names, as the archive holds them,
    and every chunk of GPU memory in storage with its per-process manifest
    (a hard link as the file it names): exit 6 when one is missing or
    changed (IMAGE_FILE_MISSING, IMAGE_CHECKSUM), as `cudahook check
    --image` says - before podman creates anything, rather than at
    post-restore. The scan's sha256 proves a raw sha256 chunk; a blake3 or
    compressed one is read back from `copy` (where `at` says) and checked
    as the driver helper checks it, or, without a copy (a dry run), checked
    by the same rule against the digests the scan took (`chunks`). How many
    chunks neither could prove (a dry run's compressed chunks of sha256
    digests, or all where blake3 or zstandard is missing: post-restore
    checks them)."""
    from cudahook.core import manifest

    def differs(name: str, what: str) -> NotRestorableHere:
        return NotRestorableHere(f"{ar.show(name)}: {what} or size differs from the "
                                 "manifest's", reason="IMAGE_CHECKSUM")

    wanted = [manifest.StoredFile(name=name, size=want.size, digest=want.sha256)
              for name, want in sorted(m.files.items())]
    unread: list[manifest.StoredFile] = []
    for f in wanted + manifest.storage_files(m):
        got = hashed.get(f"checkpoint/{f.name}")
        if got is None:
            raise NotRestorableHere(f"{ar.show(f.name)}: missing from the archive's image",
                                    reason="IMAGE_FILE_MISSING")
        if f.kind == "sha256" and not f.zstd:
            if got != (f.digest, f.size):
                raise differs(f.name, "sha256")
        elif got[1] != (f.zstd or f.size):
            raise differs(f.name, f.kind)
        elif copy is not None or not _check_digests(
                f, (chunks or {}).get(f"checkpoint/{f.name}"), differs):
            unread.append(f)  # with a copy: read back from it below
    if copy is None or at is None:
        return len(unread)
    _check_in_copy(copy, at, unread, differs)
    return 0


def _check_digests(f: StoredFile, got: ar.ChunkDigests | None,
                   differs: Callable[[str, str], NotRestorableHere]) -> bool:
    """A chunk of blake3 digest, of the size its manifest says as stored,
    checked by the driver helper's rule (`read_chunk`) against the digests
    the scan took: the blake3 of its raw bytes, or of what its zstd frame
    decompresses to, which must be exactly its raw size - a frame that is
    damaged, makes more or less, or is no frame fails, as it would there.
    False where the scan took none to check it by (sha256 of decompressed
    bytes is not taken: post-restore checks it)."""
    if got is None or f.kind != "blake3":
        return False
    if (got.unpacked == (f.digest, f.size)) if f.zstd else (got.raw == f.digest):
        return True
    raise differs(f.name, f.kind)


def chunks_verified(m: Manifest) -> str | None:
    """What `verify_files` proved of the GPU-memory chunks, for the report
    (None: the image keeps none)."""
    from cudahook.core import manifest

    if m.gpu_storage is None:
        return None
    chunks = [f for f in manifest.storage_files(m) if f.name.endswith(".chunk")]
    packed = sum(1 for f in chunks if f.zstd)
    return (f"GPU-memory chunks ({len(chunks)}, {m.gpu_storage.digest}"
            + (f"; {packed} zstd-decompressed" if packed else "") + ")")


def _check_in_copy(copy: Path, at: dict[str, tuple[int, int]], files: list[StoredFile],
                   differs: Callable[[str, str], NotRestorableHere]) -> None:
    """Each of `files` read back from the copy this run wrote, and checked by
    the driver helper's own rule (digest of the raw bytes, decompression
    never past the raw size)."""
    from cudahook.core.backends import driver_helper as helper

    if not files:
        return
    fd = os.open(copy, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
    try:
        for f in files:
            offset, size = at[f"checkpoint/{f.name}"]
            data = os.pread(fd, size, offset)
            try:
                helper.check_stored(f.name, memoryview(data), f.size, f.zstd, f.kind, f.digest)
            except (helper.Mismatch, helper.Refused) as exc:
                raise differs(f.name, f.kind) from exc
            except ImportError as exc:
                raise EnvironmentProblem(f"{ar.show(f.name)}: its digest or compression needs "
                                         f"{exc.name or exc}") from exc
    finally:
        os.close(fd)


def _peek_manifest(archive: Path) -> Manifest | None:
    """The manifest of an archive just written, for the report: read up to it
    only (podman writes members in name order: it comes before the pages)."""
    try:
        data = ar.read_member(archive, MANIFEST, ar.SMALL_LIMIT)
        return _manifest({MANIFEST: data}) if data is not None else None
    except CudahookError:
        return None


def _need_image(ctx: Any, podman: Sequence[str], config: dict[str, Any]) -> None:
    """podman restores a checkpoint only onto the image it was taken from
    (by ID), and says so cryptically ("invalid repository name"): name it."""
    image_id = str(config.get("rootfsImageID") or "")
    if not image_id:
        return  # a container made from a rootfs directory: nothing to look for
    if not re.fullmatch(r"[0-9a-f]{64}", image_id):
        raise UsageError(f"config.dump in the archive: image ID {ar.show(image_id)} is not one")
    if _run(ctx, podman, ["image", "exists", "--", image_id], 60).returncode != 0:
        what = str(config.get("rootfsImageName") or config.get("RawImageName") or "its image")
        raise EnvironmentProblem(f"the checkpoint's image {ar.show(what)[1:-1]} (ID "
                                 f"{image_id[:12]}) is not on this node: pull that image (the "
                                 "same ID) first")


#: podman's rule for a container name.
NAME_RE = re.compile(r"[a-zA-Z0-9][a-zA-Z0-9_.-]{0,252}")


def _exists(ctx: Any, podman: Sequence[str], name: str) -> bool:
    return bool(_run(ctx, podman, ["container", "exists", "--", name], 60).returncode == 0)


def _remove_own(ctx: Any, podman: Sequence[str], name: str, token: str) -> str | None:
    """Remove the container named `name` only if it is the one this restore
    made (it carries `token`): a container someone else created meanwhile
    under that name (why podman failed, maybe) stays. Its ID, if removed."""
    fmt = f'{{{{.Id}}}} {{{{index .Config.Annotations "{TOKEN_ANNOTATION}"}}}}'
    res = _run(ctx, podman, ["container", "inspect", "--format", fmt, "--", name], 60)
    words = (res.stdout or "").split() if res.ok else []
    if len(words) != 2 or words[1] != token or not re.fullmatch(r"[0-9a-f]{64}", words[0]):
        return None
    _run(ctx, podman, ["rm", "-f", "-t", "0", "--", words[0]], 120)
    return words[0]


# -- work directories ----------------------------------------------------------

WORK_PREFIX = "cudahook-migrate-"
#: cudahook-migrate-<owner pid>-<its start time>-<random>
WORK_RE = re.compile(r"cudahook-migrate-([0-9]+)-([0-9]+)-[A-Za-z0-9_]+")


def make_work(ctx: Any, parent: Path) -> Path:
    """A private work directory whose name says which process owns it."""
    pid = os.getpid()
    try:
        return Path(tempfile.mkdtemp(prefix=f"{WORK_PREFIX}{pid}-{ctx.host.start_time(pid)}-",
                                     dir=parent))
    except OSError as exc:
        raise EnvironmentProblem(f"cannot make a work directory in {one_line(str(parent))}: "
                                 f"{exc.strerror}") from exc


def sweep_stale(ctx: Any, parent: Path) -> list[str]:
    """Remove the work directories of migrate runs that died (killed before
    they could clean up): named as `make_work` names them, directories (not
    links), this user's, their owner process gone. Nothing else is touched."""
    removed = []
    try:
        entries = list(os.scandir(parent))
    except OSError:
        return removed
    for e in entries:
        m = WORK_RE.fullmatch(e.name)
        if not m:
            continue
        try:
            st = e.stat(follow_symlinks=False)
        except OSError:
            continue
        if not stat.S_ISDIR(st.st_mode) or st.st_uid != os.geteuid():
            continue
        if ctx.host.alive(int(m.group(1)), int(m.group(2))):
            continue
        shutil.rmtree(e.path, ignore_errors=True)
        removed.append(e.path)
    return removed


class _Deferred:
    """Signals that came while podman worked (see `_interruptible`)."""

    def __init__(self) -> None:
        self.signals: list[int] = []
        self.hold = False

    def __bool__(self) -> bool:
        return bool(self.signals)


@contextlib.contextmanager
def _interruptible() -> Iterator[_Deferred]:
    """SIGTERM and SIGINT end the run through its `finally` blocks (work
    directory and partial files removed), as Ctrl-C does. Python's default
    for SIGTERM would end it without them. While `hold` is set (podman is
    restoring: stopping the wait would leave its container to chance), a
    signal is only noted; the caller acts on it once podman returned."""
    import signal
    import threading

    deferred = _Deferred()
    if threading.current_thread() is not threading.main_thread():
        yield deferred
        return

    def handler(signum: int, _frame: Any) -> None:
        if deferred.hold:
            deferred.signals.append(signum)
            return
        raise KeyboardInterrupt

    old = {s: signal.signal(s, handler) for s in (signal.SIGTERM, signal.SIGINT)}
    try:
        yield deferred
    finally:
        for s, h in old.items():
            signal.signal(s, h)


# -- restore -------------------------------------------------------------------


def _limits(ctx: Any) -> tuple[int, bool, str | None]:
    s = ctx.settings
    return (int(getattr(s, "migrate_max_unpacked_bytes", None) or ar.DEFAULT_MAX_BYTES),
            bool(getattr(s, "migrate_require_signature", False)),
            getattr(s, "migrate_trusted_keys_dir", None))


def restore(ctx: Any, podman: Sequence[str], archive: Path, *, name: str | None = None,
            gpus: Sequence[str] | None = None, verify: bool = True,
            timeout: float = DEFAULT_TIMEOUT_S, work_dir: str | None = None,
            dry_run: bool = False, verify_keys: Sequence[Path] = ()) -> dict[str, Any]:
    """Restore the container in `archive` on this node, onto this node's GPUs
    (`dry_run`: every check, then stop before writing or restoring anything)."""
    from cudahook.platform import eventlog

    from . import signing

    if not archive.is_file():
        raise UsageError(f"{one_line(str(archive))}: no such archive")
    if name is not None and not NAME_RE.fullmatch(name):
        raise UsageError(f"--name {ar.show(name)}: not a container name")
    max_bytes, require, keys_dir = _limits(ctx)
    want = expected_checksum(archive) if verify else None
    keys = signing.trusted_keys(list(verify_keys), keys_dir)
    has_sig = os.path.lexists(signing.signature_path(archive))
    if (require or verify_keys) and not has_sig:
        raise signing.SignatureRefused(
            f"{archive.name}{signing.SIG} is missing: the archive's origin cannot be proven"
            + (" (migrate_require_signature)" if require else ""))
    if require and not keys:
        raise signing.SignatureRefused("migrate_require_signature is set but no trusted key "
                                       "(--verify-key, migrate_trusted_keys_dir)")
    parent = Path(work_dir or tempfile.gettempdir())
    if not parent.is_dir():
        raise EnvironmentProblem(f"cannot make a work directory in {one_line(str(parent))}: "
                                 "no such directory")
    sweep_stale(ctx, parent)
    token = uuid.uuid4().hex
    with _interruptible() as deferred:
        work = None if dry_run else make_work(ctx, parent)
        try:
            copy = work / "restore.tar" if work else None
            room = ar.free_bytes(work) - ar.RESERVE if work else None
            try:
                found = scan(archive, copy, max_bytes=max_bytes, timeout_s=timeout, room=room)
            except ar.ArchiveRefused as exc:
                # A copy damaged in transit fails its checksum: say that.
                if want is not None and not isinstance(exc, ar.ReadTimedOut):
                    got = ar.rest_sha256(archive, timeout)
                    if got is not None and got != want:
                        raise mismatch(archive, got, want) from exc
                raise
            if want is not None and found.sha256 != want:
                raise mismatch(archive, found.sha256, want)
            verified = (["sha256 (" + sidecar(archive).name + ")"] if want else []) + \
                ["tar structure and bounds"] + \
                (["gzip CRC"] if archive_is_gzip(archive) else [])
            origin = None
            if has_sig and keys:
                origin = signing.verify(archive, keys, found.sha256, found.raw_bytes)
                verified.append(f"origin (signed by {origin['key_id']})")
            for required in SPEC_FILES:
                if required not in found.small:
                    raise UsageError(f"{one_line(str(archive))}: not a podman checkpoint archive "
                                     f"(no {required})")
            m = _manifest(found.small)
            targets: list[str] | None = None
            mapping = None
            unread = 0
            if m is not None:
                unread = verify_files(m, found.hashed, found.at, copy, found.chunks)
                proved = chunks_verified(m) if not unread else None
                if proved:
                    verified.append(proved)
                targets, mapping = plan(ctx, m, gpus)
                verified.append("restore gate")
            elif gpus:
                raise UsageError("--gpus: the checkpoint holds no CUDA state")
            config = _json(found.small, "config.dump")
            if not isinstance(config, dict):
                raise UsageError("config.dump in the archive is not a JSON object")
            final = name or str(config.get("name") or "")
            if final and not NAME_RE.fullmatch(final):
                raise UsageError(f"config.dump in the archive names the container "
                                 f"{ar.show(final)}: not a container name (--name gives the "
                                 "restored one another)")
            if final and _exists(ctx, podman, final):
                raise UsageError(f"a container named {final} exists on this node "
                                 "(--name gives the restored one another)")
            _need_image(ctx, podman, config)
            dropped = carried_criu_config(found.small)
            not_verified = [] if origin else [
                "origin (" + ("signature present, no trusted key: --verify-key" if has_sig
                              else "unsigned") + ")"]
            if unread:
                not_verified.append(f"the digests of {unread} GPU-memory chunk(s) (compressed, "
                                    "of sha256 digests, or blake3 or zstandard missing here: "
                                    "a dry run writes no copy to read them back from; "
                                    "post-restore checks them)")
            result = {"archive": str(archive), "sha256": found.sha256, "container": final,
                      "gpus": targets, "source_gpus": list(m.gpus) if m else None,
                      "device_map": mapping, "verified": verified,
                      "not_verified": not_verified, "signature": origin,
                      "dropped_annotations": dropped}
            if dry_run:
                return {**result, "dry_run": True}
            assert copy is not None
            # The copy's spec names this node's GPUs: the archive stays as it came.
            finish_copy(copy, retarget(found.small, targets, token))
            if dropped:
                eventlog.log(ctx.settings.log_file, "migrate_restore", archive=str(archive),
                             dropped_annotations=dropped,
                             note="CRIU configuration comes from this node's operator")
            args = ["container", "restore", f"--import={copy}"]
            if name:
                args.append(f"--name={name}")
            deferred.hold = True
            try:
                res = _run(ctx, podman, args, timeout)
            finally:
                deferred.hold = False
            if not res.ok:
                reason, code = _podman_reason(res)
                # Nothing half-restored stays: the archive is unchanged, retry
                # freely. Only the container this restore made goes.
                if final:
                    _remove_own(ctx, podman, final, token)
                raise MigrateFailed(f"restore of {archive.name} failed: {reason}", code)
        finally:
            if work is not None:
                shutil.rmtree(work, ignore_errors=True)
    return {**result, "container": final or res.stdout.strip()}


def archive_is_gzip(archive: Path) -> bool:
    try:
        with open(archive, "rb") as f:
            return f.read(2) == ar.GZIP_MAGIC
    except OSError:
        return False


def podman_argv(text: str) -> list[str]:
    argv = shlex.split(text)
    if not argv:
        raise UsageError("--podman: empty command")
    return argv
