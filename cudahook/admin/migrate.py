"""`cudahook migrate`: move a GPU container to another node through podman.

    node A:  cudahook migrate checkpoint CONTAINER ARCHIVE
             (podman container checkpoint --export; ARCHIVE.sha256 beside it)
    copy ARCHIVE and ARCHIVE.sha256 to node B
    node B:  cudahook migrate restore ARCHIVE [--name NAME] [--gpus UUID,...]
             (podman container restore --import, the container moved onto B's GPUs)

The restore decides everything before podman starts, so a refusal leaves
nothing behind: the archive must match its checksum and read to the end as
a tar, every member's data included (a copy damaged or cut short in transit
is refused, exit 2); the checkpoint's manifest must pass this node's restore
gate with the GPUs chosen here (`restore_gate.plan_restore`, the decision
post-restore takes: driver branch, GPU count, model and memory, a driver
that can remap; exit 6 when this node can never run it). A copy of the
archive (in $TMPDIR or --work-dir, as large as the archive uncompressed)
then names this node's GPUs in its container spec, and the restore's OCI
hook and post-restore compute the same device map from it. A restore that
podman (or the gate at post-restore) refuses is reported with the reason
cudahook wrote into CRIU's log and its exit code, and the container podman
made is removed.

Archives are read with the standard tarfile module: podman's `--compress`
none or gzip (`migrate checkpoint` writes gzip unless told otherwise).
"""

from __future__ import annotations

import contextlib
import errno
import hashlib
import io
import json
import os
import re
import shlex
import shutil
import tarfile
import tempfile
import time
import zlib
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

from cudahook.platform.atomic import write_atomic
from cudahook.platform.errors import (
    CudahookError,
    EnvironmentProblem,
    Exit,
    NotRestorableHere,
    UsageError,
)

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
        super().__init__(message)
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


def verify_checksum(archive: Path) -> str:
    """The archive's digest, checked against ARCHIVE.sha256 (sha256sum format)."""
    from cudahook.platform import safeio

    side = sidecar(archive)
    try:
        text = safeio.read_bytes(side, 4096).decode(errors="replace")
    except FileNotFoundError:
        raise UsageError(f"{side} is missing: the archive cannot be checked "
                         "(copy it with the archive, or --no-verify)") from None
    except (OSError, safeio.FileRefused) as exc:
        raise UsageError(f"{side}: unreadable ({exc})") from None
    want = text.split()[0].lower() if text.split() else ""
    if not re.fullmatch(r"[0-9a-f]{64}", want):
        raise UsageError(f"{side}: not a sha256 checksum")
    try:
        got = sha256_of(archive)
    except OSError as exc:
        raise UsageError(f"{archive}: unreadable ({exc.strerror})") from None
    if got != want:
        raise UsageError(f"{archive} does not match {side.name} (damaged or cut short in "
                         f"transit): sha256 {got}, expected {want}")
    return got


#: Members read into memory: the container's spec (twice) and the manifest.
SMALL = {*SPEC_FILES, MANIFEST}
SMALL_LIMIT = 64 << 20


def _members(tar: tarfile.TarFile, archive: Path) -> Iterator[tarfile.TarInfo]:
    """The archive's members, refusing anything a podman checkpoint does not
    hold (links, devices, paths leaving the archive)."""
    for member in tar:
        name = member.name.removeprefix("./")
        if name.startswith("/") or ".." in Path(name).parts:
            raise UsageError(f"{archive}: member {member.name!r} leaves the archive")
        if not (member.isreg() or member.isdir()):
            raise UsageError(f"{archive}: member {member.name!r} is not a file or directory")
        yield member


@contextlib.contextmanager
def _reading(archive: Path) -> Iterator[None]:
    """Read errors of a damaged or truncated archive, as one clean refusal."""
    try:
        yield
    except OSError as exc:
        if exc.errno in (errno.ENOSPC, errno.EDQUOT, errno.EROFS, errno.EACCES):
            raise EnvironmentProblem(f"cannot write the restore's copy of {archive.name}: "
                                     f"{exc.strerror}") from None
        raise UsageError(f"{archive}: not a complete checkpoint archive ({exc})") from None
    except (tarfile.TarError, EOFError, zlib.error) as exc:
        # tarfile's "could not be opened" lists every method it tried, a line each.
        why = str(exc) if "\n" not in str(exc) else "not a tar, gzip, bzip2 or xz archive"
        raise UsageError(f"{archive}: not a complete checkpoint archive ({why})") from None


def scan(archive: Path, copy_to: Path | None = None) -> dict[str, bytes]:
    """Read the whole archive (every member's data: a gzip stream's checksum
    is checked at its end), refusing what a checkpoint never holds and any
    read error - a copy damaged or cut short fails here, before anything is
    restored. Returns the small members cudahook reads. With `copy_to`, the
    same pass copies every member but the spec files into that uncompressed
    tar (one read of a large archive, not two); `finish_copy` adds those."""
    small: dict[str, bytes] = {}
    with contextlib.ExitStack() as stack:
        stack.enter_context(_reading(archive))
        tar = stack.enter_context(tarfile.open(archive, "r:*"))
        dst = stack.enter_context(tarfile.open(copy_to, "w")) if copy_to else None
        for member in _members(tar, archive):
            name = member.name.removeprefix("./")
            if not member.isreg():
                if dst is not None:
                    dst.addfile(member)
                continue
            f = tar.extractfile(member)
            assert f is not None
            if name in SMALL:
                if member.size > SMALL_LIMIT:
                    raise UsageError(f"{archive}: {name} is {member.size} bytes, past "
                                     f"{SMALL_LIMIT}")
                small[name] = f.read()
                if dst is not None and name not in SPEC_FILES:
                    dst.addfile(member, io.BytesIO(small[name]))
            elif dst is not None:
                dst.addfile(member, f)
            else:
                while f.read(CHUNK):
                    pass
        # To the end of the stream: gzip checks its CRC only there.
        assert tar.fileobj is not None
        while tar.fileobj.read(CHUNK):
            pass
    return small


def finish_copy(copy: Path, specs: dict[str, bytes]) -> None:
    """Add the container's spec files to the copy `scan` made."""
    with tarfile.open(copy, "a") as dst:
        for name, data in specs.items():
            info = tarfile.TarInfo(name)
            info.size, info.mode, info.mtime = len(data), 0o600, int(time.time())
            dst.addfile(info, io.BytesIO(data))


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


def _json(small: dict[str, bytes], name: str) -> Any:
    """A member's JSON; malformed, not UTF-8 or nested too deeply: exit 2."""
    from cudahook.platform import safeio

    return safeio.parse_json(small[name], f"{name} in the archive")


# podman's rule for a container name (and a cap): the name goes on podman's
# command line and is printed, so anything else from an archive is refused.
_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,252}")


def retarget(small: dict[str, bytes], gpus: Sequence[str]) -> dict[str, bytes]:
    """The container's spec, which podman keeps twice (spec.dump, and inside
    config.dump), naming this node's GPUs: the new contents of both."""
    out = {}
    for name in SPEC_FILES:
        if name not in small:
            raise UsageError(f"{name} in the archive is missing")
        data = _json(small, name)
        spec = data if name == "spec.dump" else data.get("spec") if isinstance(data, dict) else None
        if not isinstance(spec, dict):
            raise UsageError(f"{name} in the archive holds no container spec")
        process = spec.get("process", {})
        env = (process.get("env") or []) if isinstance(process, dict) else None
        if not isinstance(env, list) or not all(isinstance(e, str) for e in env):
            raise UsageError(f"{name} in the archive: process.env is not a list of strings")
        set_visible(spec, gpus)
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


def plan(ctx: Any, data: dict[str, Any], wanted: Sequence[str] | None
         ) -> tuple[list[str], dict[str, str] | None]:
    """This node's GPUs for the checkpoint and the device map the restore
    gate computes for them (or its refusal)."""
    from cudahook.core.gpus import query_gpus
    from cudahook.hooks import annotations as ann
    from cudahook.hooks.restore_gate import plan_restore

    source = [str(u) for u in data.get("gpus") or []]
    node = [g.uuid for g in query_gpus(ctx.host, ctx.settings)]
    targets = choose_gpus(source, node, wanted)
    # The record the OCI hook will write at restore names exactly these.
    mapping = plan_restore(ctx, {"visible": targets}, ann.Options(), data)
    return targets, mapping


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
               timeout: float = DEFAULT_TIMEOUT_S) -> dict[str, Any]:
    """Checkpoint `container` into `archive` (and its checksum beside it)."""
    if archive.exists() or sidecar(archive).exists():
        raise UsageError(f"{archive} (or its {SIDECAR}) exists already: not overwritten")
    partial = archive.with_name(archive.name + ".partial")
    partial.unlink(missing_ok=True)
    args = ["container", "checkpoint", "--export", str(partial), "--compress", compress]
    if leave_running:
        args.append("--leave-running")
    res = _run(ctx, podman, [*args, container], timeout)
    if not res.ok:
        partial.unlink(missing_ok=True)
        reason, code = _podman_reason(res)
        raise MigrateFailed(f"checkpoint of {container} failed: {reason}", code)
    digest = sha256_of(partial)
    os.replace(partial, archive)
    # Written last: an archive with its checksum beside it is complete.
    write_atomic(sidecar(archive), f"{digest}  {archive.name}\n".encode(), 0o644)
    data = _peek_manifest(archive)
    return {"container": container, "archive": str(archive), "sha256": digest,
            "bytes": archive.stat().st_size, "gpus": (data or {}).get("gpus"),
            "leave_running": leave_running}


def _manifest(small: dict[str, bytes]) -> dict[str, Any] | None:
    """The checkpoint's manifest, read and checked as the restore gate reads
    it (None: the checkpoint holds no CUDA state)."""
    from cudahook.core import manifest

    if MANIFEST not in small:
        return None
    with tempfile.TemporaryDirectory(prefix="cudahook-manifest-") as d:
        path = Path(d, MANIFEST)
        path.parent.mkdir()
        path.write_bytes(small[MANIFEST])
        return manifest.read(path.parent)


def _peek_manifest(archive: Path) -> dict[str, Any] | None:
    """The manifest of an archive just written, for the report: read up to it
    only (podman writes members in name order: it comes before the pages)."""
    try:
        with tarfile.open(archive, "r:*") as tar:
            for member in tar:
                if member.name.removeprefix("./") == MANIFEST and member.isreg():
                    f = tar.extractfile(member)
                    return _manifest({MANIFEST: f.read(SMALL_LIMIT)}) if f else None
    except (CudahookError, tarfile.TarError, OSError, EOFError, zlib.error):
        pass
    return None


def _need_image(ctx: Any, podman: Sequence[str], config: dict[str, Any]) -> None:
    """podman restores a checkpoint only onto the image it was taken from
    (by ID), and says so cryptically ("invalid repository name"): name it."""
    image_id = str(config.get("rootfsImageID") or "")
    if not image_id:
        return  # a container made from a rootfs directory: nothing to look for
    if _run(ctx, podman, ["image", "exists", image_id], 60).returncode != 0:
        what = str(config.get("rootfsImageName") or config.get("RawImageName") or "its image")
        raise EnvironmentProblem(f"the checkpoint's image {what} (ID {image_id[:12]}) is not on "
                                 "this node: pull that image (the same ID) first")


def _exists(ctx: Any, podman: Sequence[str], name: str) -> bool:
    return bool(_run(ctx, podman, ["container", "exists", name], 60).returncode == 0)


def restore(ctx: Any, podman: Sequence[str], archive: Path, *, name: str | None = None,
            gpus: Sequence[str] | None = None, verify: bool = True,
            timeout: float = DEFAULT_TIMEOUT_S, work_dir: str | None = None,
            dry_run: bool = False) -> dict[str, Any]:
    """Restore the container in `archive` on this node, onto this node's GPUs
    (`dry_run`: every check, then stop before writing or restoring anything)."""
    if not archive.is_file():
        raise UsageError(f"{archive}: no such archive")
    digest = verify_checksum(archive) if verify else None
    try:
        work = Path(tempfile.mkdtemp(prefix="cudahook-migrate-", dir=work_dir))
    except OSError as exc:
        where = work_dir or tempfile.gettempdir()
        raise EnvironmentProblem(f"cannot make a work directory in {where}: {exc.strerror}"
                                 ) from None
    try:
        copy = work / "restore.tar"
        small = scan(archive, copy_to=None if dry_run else copy)
        for required in SPEC_FILES:
            if required not in small:
                raise UsageError(f"{archive}: not a podman checkpoint archive (no {required})")
        data = _manifest(small)
        targets: list[str] | None = None
        mapping = None
        if data is not None:
            targets, mapping = plan(ctx, data, gpus)
        elif gpus:
            raise UsageError("--gpus: the checkpoint holds no CUDA state")
        config = _json(small, "config.dump")
        if not isinstance(config, dict):
            raise UsageError("config.dump in the archive is unreadable (not a JSON object)")
        final = name or str(config.get("name") or "")
        if final and not _NAME.fullmatch(final):
            raise UsageError(f"container name {final[:300]!r} is not one podman takes "
                             f"({'--name' if name else 'config.dump in the archive'})")
        if final and _exists(ctx, podman, final):
            raise UsageError(f"a container named {final} exists on this node "
                             "(--name gives the restored one another)")
        _need_image(ctx, podman, config)
        if dry_run:
            return {"archive": str(archive), "sha256": digest, "container": final,
                    "gpus": targets, "source_gpus": (data or {}).get("gpus"),
                    "device_map": mapping, "dry_run": True}
        # The copy's spec names this node's GPUs: the archive stays as it came.
        finish_copy(copy, retarget(small, targets) if targets is not None
                    else {k: small[k] for k in SPEC_FILES})
        args = ["container", "restore", "--import", str(copy)]
        if name:
            args += ["--name", name]
        res = _run(ctx, podman, args, timeout)
        if not res.ok:
            reason, code = _podman_reason(res)
            # Nothing half-restored stays: the archive is unchanged, retry freely.
            if final and _exists(ctx, podman, final):
                _run(ctx, podman, ["rm", "-f", "-t", "0", final], 120)
            raise MigrateFailed(f"restore of {archive.name} failed: {reason}", code)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return {"archive": str(archive), "sha256": digest, "container": final or res.stdout.strip(),
            "gpus": targets, "source_gpus": (data or {}).get("gpus"), "device_map": mapping}


def podman_argv(text: str) -> list[str]:
    argv = shlex.split(text)
    if not argv:
        raise UsageError("--podman: empty command")
    return argv
