"""`cudahook migrate`'s decisions that need no GPU: the archive's checksum
and its tar read to the end, the members it may hold, the GPUs chosen on the
target node, and the spec rewritten to name them; hostile archives (built
here byte by byte), signatures, and what a failed restore may remove, with a
stand-in podman (a script that records its calls). The end-to-end moves,
with the real podman, are in tests/e2e/test_migrate.py."""

from __future__ import annotations

import gzip
import hashlib
import io
import json
import os
import signal
import subprocess
import sys
import tarfile
import time
import zlib
from collections.abc import Callable
from pathlib import Path

import pytest

from cudahook.admin import migrate
from cudahook.admin.cli import main
from cudahook.core.manifest import (
    FileSum,
    GpuStorage,
    Manifest,
    StorageRange,
    StoredProcess,
)
from cudahook.platform.errors import Exit, NotRestorableHere, UsageError

from .conftest import Node as SimNode
from .test_check import packed_image


def archive(tmp_path: Path, members: dict[str, bytes], *, gz: bool = True) -> Path:
    path = tmp_path / ("ckpt.tar.gz" if gz else "ckpt.tar")
    with tarfile.open(path, "w:gz" if gz else "w") as tar:
        for name, data in members.items():
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    digest = hashlib.sha256(path.read_bytes()).hexdigest()
    path.with_name(path.name + ".sha256").write_text(f"{digest}  {path.name}\n")
    return path


SPEC = {"process": {"env": ["PATH=/bin", "NVIDIA_VISIBLE_DEVICES=GPU-a"]}}
MEMBERS = {"spec.dump": json.dumps(SPEC).encode(),
           "config.dump": json.dumps({"name": "c", "spec": SPEC}).encode(),
           "checkpoint/pages-1.img": b"x" * 100_000}


def test_checksum_matches(tmp_path: Path) -> None:
    a = archive(tmp_path, MEMBERS)
    assert migrate.verify_checksum(a) == hashlib.sha256(a.read_bytes()).hexdigest()


def test_a_changed_byte_or_a_cut_is_refused(tmp_path: Path) -> None:
    a = archive(tmp_path, MEMBERS)
    data = bytearray(a.read_bytes())
    a.write_bytes(bytes(data[: len(data) // 2]))
    with pytest.raises(UsageError, match=r"does not match ckpt\.tar\.gz\.sha256"):
        migrate.verify_checksum(a)


def test_a_missing_or_bogus_checksum_is_refused(tmp_path: Path) -> None:
    a = archive(tmp_path, MEMBERS)
    side = a.with_name(a.name + ".sha256")
    side.write_text("not a digest\n")
    with pytest.raises(UsageError, match="not a sha256 checksum"):
        migrate.verify_checksum(a)
    side.unlink()
    with pytest.raises(UsageError, match="is missing"):
        migrate.verify_checksum(a)


def test_a_truncated_or_damaged_tar_fails_while_scanning(tmp_path: Path) -> None:
    for gz in (True, False):
        a = archive(tmp_path, MEMBERS, gz=gz)
        assert set(migrate.scan(a).small) == {"spec.dump", "config.dump"}
        data = a.read_bytes()
        a.write_bytes(data[: len(data) // 2])
        with pytest.raises(UsageError, match="not a complete checkpoint archive"):
            migrate.scan(a)
    # A changed byte inside a gzip stream: its checksum, read at the end.
    a = archive(tmp_path, MEMBERS)
    data = bytearray(a.read_bytes())
    data[len(data) // 2] ^= 0x01
    a.write_bytes(bytes(data))
    with pytest.raises(UsageError, match="not a complete checkpoint archive"):
        migrate.scan(a)


@pytest.mark.parametrize("kind", ["abs", "dotdot", "dot-dotdot", "root"])
def test_archive_names_canonical__absolute_and_escaping_names_refused(tmp_path: Path,
                                                                     kind: str) -> None:
    path = tmp_path / "bad.tar"
    with tarfile.open(path, "w") as tar:
        info = tarfile.TarInfo({"abs": "/etc/x", "dotdot": "checkpoint/../../x",
                                "dot-dotdot": "./checkpoint/./../../x", "root": "/"}[kind])
        info.type = tarfile.DIRTYPE if kind == "root" else tarfile.REGTYPE
        tar.addfile(info, io.BytesIO(b""))
    with pytest.raises(UsageError, match=r"leaves the archive|absolute name"):
        migrate.scan(path)
    with pytest.raises(UsageError, match=r"leaves the archive|absolute name"):
        migrate.scan(path, copy_to=tmp_path / "copy.tar")
    assert not (tmp_path / "copy.tar").exists() or (tmp_path / "copy.tar").stat().st_size == 0


@pytest.mark.parametrize("kind", ["symlink", "hardlink", "fifo", "chardev", "blockdev"])
def test_archive_bounded__links_and_devices_refused(tmp_path: Path, kind: str) -> None:
    path = tmp_path / "bad.tar"
    with tarfile.open(path, "w") as tar:
        info = tarfile.TarInfo("checkpoint/x")
        info.type = {"symlink": tarfile.SYMTYPE, "hardlink": tarfile.LNKTYPE,
                     "fifo": tarfile.FIFOTYPE, "chardev": tarfile.CHRTYPE,
                     "blockdev": tarfile.BLKTYPE}[kind]
        info.linkname = "/etc/shadow" if "link" in kind else ""
        tar.addfile(info, io.BytesIO(b""))
    with pytest.raises(UsageError, match=r"holds only files and directories"):
        migrate.scan(path)


def test_choose_gpus() -> None:
    a, b, c = "GPU-a", "GPU-b", "GPU-c"
    assert migrate.choose_gpus([a], [a, b], None) == [a]  # the same node: the same GPUs
    assert migrate.choose_gpus([a], [b, c], None) == [b]  # another node: its first
    assert migrate.choose_gpus([a], [b, c], [c]) == [c]
    with pytest.raises(NotRestorableHere, match=r"used 2 GPU\(s\); this node has 1"):
        migrate.choose_gpus([a, b], [c], None)
    with pytest.raises(UsageError, match="names 2 GPU"):
        migrate.choose_gpus([a], [b, c], [b, c])
    with pytest.raises(UsageError, match="this node has no GPU GPU-z"):
        migrate.choose_gpus([a], [b, c], ["GPU-z"])


def test_the_copy_names_the_new_gpus_and_keeps_the_rest(tmp_path: Path) -> None:
    a = archive(tmp_path, MEMBERS)
    raw = bytearray(gzip.decompress(a.read_bytes()))
    at = raw.index(b"checkpoint/pages-1.img")  # its header: the pages setuid
    raw[at + 100:at + 108] = tarfile.itn(0o4755, 8, tarfile.USTAR_FORMAT)
    raw[at + 148:at + 156] = b" " * 8
    raw[at + 148:at + 156] = b"%06o\0 " % sum(raw[at:at + 512])
    a.write_bytes(gzip.compress(bytes(raw)))
    copy = tmp_path / "copy.tar"
    small = migrate.scan(a, copy_to=copy).small
    migrate.finish_copy(copy, migrate.retarget(small, ["GPU-x", "GPU-y"]))
    with tarfile.open(copy) as tar:
        got = {m.name: tar.extractfile(m).read() for m in tar}  # type: ignore[union-attr]
        assert tar.getmember("checkpoint/pages-1.img").mode == 0o755  # no setuid bit
    assert got["checkpoint/pages-1.img"] == MEMBERS["checkpoint/pages-1.img"]
    spec, config = json.loads(got["spec.dump"]), json.loads(got["config.dump"])
    for s in (spec, config["spec"]):
        env = s["process"]["env"]
        assert env == ["PATH=/bin", "NVIDIA_VISIBLE_DEVICES=GPU-x,GPU-y"]
    assert config["name"] == "c"


def test_cli_refuses_a_damaged_archive_in_one_line(tmp_path: Path,
                                                   capsys: pytest.CaptureFixture[str]) -> None:
    a = archive(tmp_path, MEMBERS)
    a.write_bytes(a.read_bytes()[:-100])
    rc = main(["migrate", "restore", str(a), "--podman", "/bin/false"])
    err = capsys.readouterr().err
    assert rc == Exit.USAGE
    assert err.count("\n") == 1 and err.startswith("cudahook: ") and "does not match" in err


def test_cli_refuses_to_overwrite_an_archive(tmp_path: Path,
                                             capsys: pytest.CaptureFixture[str]) -> None:
    a = archive(tmp_path, MEMBERS)
    rc = main(["migrate", "checkpoint", "c", str(a), "--podman", "/bin/false"])
    assert rc == Exit.USAGE and "exists already" in capsys.readouterr().err


def test_podmans_failure_is_told_with_cudahooks_reason_and_code(tmp_path: Path) -> None:
    from cudahook.platform.tools import RunResult

    log = tmp_path / "restore.log"
    log.write_text(
        "(00.1) Running post-restore scripts\n"
        "cudahook: post-restore: GPU(s) not present on this node: GPU-x\n"
        "(00.2) Error (criu/action-scripts.c:135): One of more action scripts failed\n"
        "cudahook: post-restore: failed earlier in this CRIU run (exit 6); see /var/log/x\n")
    res = RunResult(("podman",), 125, "", "Error: OCI runtime error: runc: criu failed: "
                    f"type NOTIFY errno 0\nlog file: {log}\n", 0.1)
    assert migrate._podman_reason(res) == (
        "post-restore: GPU(s) not present on this node: GPU-x", Exit.NOT_HERE)
    # No log, or none of cudahook's lines in it: podman's own first line.
    res = RunResult(("podman",), 125, "", "Error: no such container c\n", 0.1)
    assert migrate._podman_reason(res) == ("Error: no such container c", Exit.FAILED)


def test_a_gzip_stream_whose_data_changed_fails_its_crc(tmp_path: Path) -> None:
    """Changed bytes that still inflate: only gzip's CRC, at the stream's end, tells."""
    import gzip

    a = archive(tmp_path, MEMBERS, gz=False)
    raw = bytearray(a.read_bytes())
    i = raw.index(b"x" * 100)
    raw[i] = ord("y")
    good = gzip.compress(a.read_bytes(), mtime=0)
    bad = bytearray(gzip.compress(bytes(raw), mtime=0))
    bad[-8:-4] = good[-8:-4]  # the intact stream's CRC: the data no longer matches it
    path = tmp_path / "bad.tar.gz"
    path.write_bytes(bytes(bad))
    with pytest.raises(UsageError, match="not a complete checkpoint archive"):
        migrate.scan(path)


def test_the_spec_names_the_new_gpus_everywhere_the_hook_looks() -> None:
    from cudahook.flow.gpu_request import visible_devices

    spec = {"process": {"env": ["A=1", "NVIDIA_VISIBLE_DEVICES=GPU-a"]},
            "annotations": {"cudahook.io/device-map": "GPU-a=GPU-q",
                            "cdi.k8s.io/x": "vendor.com/nic=eth1,nvidia.com/gpu=GPU-a",
                            "cdi.k8s.io/y": "nvidia.com/gpu=GPU-b",
                            "other": "kept"}}
    migrate.set_visible(spec, ["GPU-x", "GPU-y"])
    notes = spec["annotations"]
    assert notes == {"cdi.k8s.io/x": "vendor.com/nic=eth1,nvidia.com/gpu=GPU-x,nvidia.com/gpu=GPU-y",
                     "other": "kept"}
    assert spec["process"]["env"] == ["A=1", "NVIDIA_VISIBLE_DEVICES=GPU-x,GPU-y"]
    assert visible_devices([], notes, []) == ["GPU-x", "GPU-y"]  # CDI alone says the same


def test_a_missing_work_dir_is_one_line(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    a = archive(tmp_path, MEMBERS)
    rc = main(["migrate", "restore", str(a), "--work-dir", str(tmp_path / "nope"),
               "--podman", "/bin/false"])
    assert rc == Exit.ENVIRONMENT and "cannot make a work directory" in capsys.readouterr().err


# -- hostile archives, through the command as an operator runs it ----------------

FAKE_PODMAN = r'''
import json, os, shutil, sys, tarfile, time
state = os.environ["FAKE_PODMAN_DIR"]
argv = sys.argv[1:]
with open(os.path.join(state, "calls"), "a") as f:
    f.write(json.dumps(argv) + "\n")
conf_path = os.path.join(state, "conf.json")
conf = json.load(open(conf_path)) if os.path.exists(conf_path) else {}
time.sleep(conf.get("sleep", {}).get(" ".join(argv[:2]), 0))
if argv[:2] == ["container", "exists"]:
    made = os.path.exists(os.path.join(state, "imported.json"))  # by someone, meanwhile
    sys.exit(0 if conf.get("exists") or made and conf.get("taken_meanwhile") else 1)
if argv[:2] == ["image", "exists"]:
    sys.exit(0)
if argv[:2] == ["container", "restore"]:
    i = [n for n, a in enumerate(argv) if a.startswith("--import")][0]
    path = argv[i][len("--import="):] if "=" in argv[i] else argv[i + 1]
    with tarfile.open(path) as t:
        got = {n: json.loads(t.extractfile(n).read()) for n in ("spec.dump", "config.dump")}
    json.dump(got, open(os.path.join(state, "imported.json"), "w"))
    if conf.get("restore_fails"):
        print("Error: creating container storage: the container name is already in use",
              file=sys.stderr)
        sys.exit(125)
    print("f" * 64)
    sys.exit(0)
if argv[:2] == ["container", "inspect"]:
    if conf.get("inspect") == "own":
        spec = json.load(open(os.path.join(state, "imported.json")))["spec.dump"]
        print("a" * 64, spec["annotations"]["cudahook-migrate/restore-token"])
    elif conf.get("inspect"):
        print(conf["inspect"])
    sys.exit(0 if conf.get("inspect") else 125)
if argv[:1] == ["rm"]:
    sys.exit(0)
if argv[:2] == ["container", "checkpoint"]:
    i = [n for n, a in enumerate(argv) if a.startswith("--export")][0]
    out = argv[i][len("--export="):] if "=" in argv[i] else argv[i + 1]
    if conf.get("export_from"):  # else: exit 0, no archive written
        shutil.copyfile(conf["export_from"], out)
    sys.exit(0)
sys.exit(3)
'''


class Node:
    """A stand-in podman (its calls recorded) and cudahook's configuration,
    in `tmp`; `restore` runs `cudahook migrate restore` as a command."""

    def __init__(self, tmp: Path, **config: object) -> None:
        self.dir = tmp / "node"
        self.dir.mkdir()
        self.work = tmp / "work"
        self.work.mkdir()
        (self.dir / "podman.py").write_text(FAKE_PODMAN)
        self.podman = f"{sys.executable} {self.dir / 'podman.py'}"
        self.log = self.dir / "cudahook.log"
        self.config = self.dir / "config.yaml"
        self.configure(**config)

    def configure(self, **config: object) -> None:
        self.config.write_text(json.dumps({"log_file": str(self.log), **config}))

    def fake(self, **conf: object) -> None:
        (self.dir / "conf.json").write_text(json.dumps(conf))

    @property
    def env(self) -> dict[str, str]:
        return {**os.environ, "FAKE_PODMAN_DIR": str(self.dir), "TMPDIR": str(self.work)}

    def argv(self, *args: str) -> list[str]:
        podman = [] if args[0] == "keygen" else ["--podman", self.podman]
        return [sys.executable, "-m", "cudahook", "--config", str(self.config), "migrate",
                *args, *podman]

    def run(self, *args: str, timeout: float = 30) -> subprocess.CompletedProcess[str]:
        return subprocess.run(self.argv(*args), env=self.env, capture_output=True, text=True,
                              timeout=timeout, stdin=subprocess.DEVNULL, check=False)

    def restore(self, archive: Path, *args: str, timeout: float = 30
                ) -> subprocess.CompletedProcess[str]:
        return self.run("restore", str(archive), *args, timeout=timeout)

    def calls(self) -> list[list[str]]:
        p = self.dir / "calls"
        return [json.loads(x) for x in p.read_text().splitlines()] if p.exists() else []

    def imported(self) -> dict[str, dict]:
        return json.loads((self.dir / "imported.json").read_text())


def refused(r: subprocess.CompletedProcess[str], code: int, why: str, node: Node) -> None:
    """One line, the documented code, nothing left in the work directory,
    podman never asked to restore."""
    assert r.returncode == code, (r.returncode, r.stdout, r.stderr)
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("cudahook: ") and why in lines[0], r.stderr
    assert "\x1b" not in r.stderr and "Traceback" not in r.stderr
    assert list(node.work.iterdir()) == []
    assert not any(c[:2] == ["container", "restore"] for c in node.calls())


def header(name: str, size: int, kind: bytes = tarfile.REGTYPE, *, gnu: bool = False,
           patch: dict[int, bytes] | None = None) -> bytes:
    """A tar header block as a tar writer would make it, with `patch`ed
    bytes (its checksum made right again)."""
    info = tarfile.TarInfo(name)
    info.size, info.type, info.mtime = size, kind, 1
    block = bytearray(info.tobuf(tarfile.GNU_FORMAT if gnu else tarfile.USTAR_FORMAT)[-512:])
    for at, data in (patch or {}).items():
        block[at:at + len(data)] = data
    block[148:156] = b" " * 8
    block[148:156] = b"%06o\0 " % sum(block)
    return bytes(block)


def padded(data: bytes) -> bytes:
    return data + bytes(-len(data) % 512)


def tar_bytes(members: dict[str, bytes]) -> bytes:
    """A tar stream of `members` and its two end blocks (no padding after)."""
    out = b""
    for name, data in members.items():
        info = tarfile.TarInfo(name)
        info.size = len(data)
        out += info.tobuf(tarfile.PAX_FORMAT) + padded(data)
    return out + bytes(1024)


BASE = tar_bytes(MEMBERS)[:-1024]  # no end-of-archive blocks: members follow
END = bytes(1024)


def write(tmp: Path, raw: bytes, *, gz: bool = True, name: str = "hostile.tar.gz") -> Path:
    path = tmp / name
    path.write_bytes(gzip.compress(raw, compresslevel=1, mtime=0) if gz else raw)
    digest = hashlib.sha256(path.read_bytes()).hexdigest()
    path.with_name(path.name + ".sha256").write_text(f"{digest}  {path.name}\n")
    return path


def pax(records: dict[str, str]) -> bytes:
    body = b""
    for k, v in records.items():
        rec = f" {k}={v}\n".encode()
        n = len(rec) + 1
        while len(str(n)) + len(rec) != n:
            n += 1
        body += str(n).encode() + rec
    return header("PaxHeaders/x", len(body), tarfile.XHDTYPE) + padded(body)


@pytest.mark.parametrize("kind", ["old-gnu", "old-gnu-extended", "pax-1.0", "pax-0.1"])
def test_archive_bounded__sparse_members_refused(tmp_path: Path, kind: str) -> None:
    """A few hundred bytes that declare a huge sparse file: refused at once,
    before a byte of it is written (they spun, or wrote 512 MiB)."""
    node = Node(tmp_path)
    node.fake()
    real = b"%011o\0" % (512 << 20)
    if kind.startswith("old-gnu"):
        # type S, one map entry (offset 512 MiB - 512, 512 bytes), real size 512 MiB
        patch = {386: b"%011o\0" % ((512 << 20) - 512) + b"%011o\0" % 512, 483: real}
        if kind == "old-gnu-extended":
            patch[482] = b"\x01"  # an extension block follows: here, none that ends
        body = header("checkpoint/pages-9.img", 512, b"S", gnu=True, patch=patch) + bytes(512)
    else:
        major, minor = kind.removeprefix("pax-").split(".")
        body = pax({"GNU.sparse.major": major, "GNU.sparse.minor": minor,
                    "GNU.sparse.name": "checkpoint/pages-9.img",
                    "GNU.sparse.realsize": str(512 << 20), "GNU.sparse.numblocks": "1",
                    "GNU.sparse.offset": "0", "GNU.sparse.numbytes": "512",
                    "GNU.sparse.map": "0,512"})
        body += header("checkpoint/GNUSparseFile.0/pages-9.img", 1024) + b"1\n0\n512\n".ljust(
            512, b"\0") + bytes(512)
    a = write(tmp_path, BASE + body + END)
    t = time.monotonic()
    r = node.restore(a, timeout=20)
    refused(r, Exit.USAGE, "sparse member", node)
    assert time.monotonic() - t < 10


def test_archive_bounded__member_past_the_free_space_refused_before_writing(
        tmp_path: Path) -> None:
    """A member that declares 100 GiB: the copy would fill the disk."""
    node = Node(tmp_path, migrate_max_unpacked_bytes=1 << 50)
    node.fake()
    a = write(tmp_path, BASE + header("checkpoint/pages-9.img", 100 << 30, gnu=True) + bytes(4096))
    r = node.restore(a)
    refused(r, Exit.ENVIRONMENT, "no room for the restore's copy", node)


def test_archive_bounded__member_past_the_cap_refused_before_reading_it(tmp_path: Path) -> None:
    node = Node(tmp_path, migrate_max_unpacked_bytes=4 << 20)
    node.fake()
    a = write(tmp_path, BASE + header("checkpoint/pages-9.img", 100 << 30, gnu=True) + bytes(4096))
    for args in ([], ["--dry-run"]):
        r = node.restore(a, *args)
        refused(r, Exit.USAGE, "migrate_max_unpacked_bytes", node)


def bomb(path: Path, members: list[tuple[str, int]], trailing: int = 0) -> Path:
    """A gzip stream of tar members full of zeros (1000:1), written in pieces."""
    z = zlib.compressobj(9, zlib.DEFLATED, 31)
    with open(path, "wb") as f:
        f.write(z.compress(BASE))
        for name, size in members:
            f.write(z.compress(header(name, size)))
            zero = bytes(1 << 20)
            for _ in range(size >> 20):
                f.write(z.compress(zero))
        f.write(z.compress(END))
        for _ in range(trailing >> 20):
            f.write(z.compress(bytes(1 << 20)))
        f.write(z.flush())
    digest = hashlib.sha256(path.read_bytes()).hexdigest()
    path.with_name(path.name + ".sha256").write_text(f"{digest}  {path.name}\n")
    return path


def _bomb_refused(tmp_path: Path, members: list[tuple[str, int]], says: str, *,
                  trailing: int = 0, **settings: object) -> None:
    """A bomb() of about 1 MiB that inflates to 1 GiB: the restore refuses it
    (exit 2, `says`) within 10 s."""
    node = Node(tmp_path, **settings)
    node.fake()
    a = bomb(tmp_path / "bomb.tar.gz", members, trailing=trailing)
    assert a.stat().st_size < 2 << 20
    t = time.monotonic()
    r = node.restore(a)
    refused(r, Exit.USAGE, says, node)
    assert time.monotonic() - t < 10


def test_archive_bounded__gzip_bomb_stops_at_the_cap(tmp_path: Path) -> None:
    """In 64 MiB members: the pass stops at the first member past the cap,
    having written less than the cap."""
    _bomb_refused(tmp_path, [(f"checkpoint/pages-{i + 10}.img", 64 << 20) for i in range(16)],
                  "past 268435456 bytes unpacked", migrate_max_unpacked_bytes=256 << 20)


def test_archive_bounded__zeros_after_the_end_are_not_inflated(tmp_path: Path) -> None:
    """Zeros after the end-of-archive blocks (read only for the CRC)."""
    _bomb_refused(tmp_path, [], "after the end of the tar archive", trailing=1 << 30)


def test_archive_bounded__the_read_has_a_deadline(tmp_path: Path) -> None:
    node = Node(tmp_path)
    node.fake()
    a = write(tmp_path, BASE + header("checkpoint/pages-9.img", 64 << 20)
              + os.urandom(64 << 20) + END, gz=False, name="big.tar")
    r = node.restore(a, "--timeout", "0.05")
    refused(r, Exit.USAGE, "not read within 0.05s", node)


@pytest.mark.parametrize("spelling", ["checkpoint/./", "checkpoint//", "./checkpoint/",
                                      "checkpoint/x/../"])
def test_archive_names_canonical__manifest_under_another_spelling_reaches_the_gate(
        tmp_path: Path, spelling: str) -> None:
    """The manifest's name spelled otherwise: normalised, it is the manifest
    (here a damaged one: exit 6, as `cudahook check --image` says), or, with
    `..`, refused; never a restore that skips the gate."""
    node = Node(tmp_path)
    node.fake()
    a = write(tmp_path, tar_bytes({**MEMBERS, f"{spelling}cudahook-manifest.json": b"{"}))
    r = node.restore(a)
    if ".." in spelling:
        refused(r, Exit.USAGE, "leaves the archive", node)
    else:
        refused(r, Exit.NOT_HERE, "cudahook-manifest.json in the checkpoint is unreadable", node)


@pytest.mark.parametrize("second", ["spec.dump", "./spec.dump", ".//spec.dump"])
def test_archive_names_canonical__duplicates_refused(tmp_path: Path, second: str) -> None:
    node = Node(tmp_path)
    node.fake()
    evil = json.dumps({"process": {"env": []}, "annotations": {"x": "y"}}).encode()
    raw = tar_bytes(MEMBERS)[:-1024] + tar_bytes({second: evil})
    r = node.restore(write(tmp_path, raw))
    refused(r, Exit.USAGE, "appears twice", node)


def test_exit_codes_one_table__damaged_manifest_agrees_with_check(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    node = Node(tmp_path)
    node.fake()
    a = write(tmp_path, tar_bytes({**MEMBERS, "checkpoint/cudahook-manifest.json": b"[1"}))
    r = node.restore(a)
    image = tmp_path / "image"
    image.mkdir()
    (image / "cudahook-manifest.json").write_bytes(b"[1")
    rc = main(["--config", str(node.config), "check", "--image", str(image)])
    assert "MANIFEST_UNREADABLE" in capsys.readouterr().out
    assert rc == Exit.NOT_HERE
    refused(r, rc, "unreadable", node)


def good_archive(tmp: Path, config: dict | None = None, spec: dict | None = None) -> Path:
    tmp.mkdir(exist_ok=True)
    s = spec or SPEC
    return archive(tmp, {"spec.dump": json.dumps(s).encode(),
                         "config.dump": json.dumps({"name": "c", "spec": s, **(config or {})}
                                                   ).encode(),
                         "checkpoint/pages-1.img": b"x" * 100_000})


def test_one_line_errors__names_from_the_archive_are_escaped(tmp_path: Path) -> None:
    node = Node(tmp_path)
    node.fake(exists=True)
    a = good_archive(tmp_path, {"name": "c\x1b[2J\nEVIL"})
    r = node.restore(a)
    refused(r, Exit.USAGE, "not a container name", node)
    assert "\\x1b[2J\\nEVIL" in r.stderr
    raw = tar_bytes(MEMBERS)[:-1024] + header("a\x1b]0;x\x07", 0, tarfile.SYMTYPE) + END
    r = node.restore(write(tmp_path, raw))
    refused(r, Exit.USAGE, "\\x1b]0;x\\x07", node)
    for bad in ("-rf", "x\ny"):
        r = node.restore(good_archive(tmp_path / bad.replace("\n", "_"), {"name": bad}))
        refused(r, Exit.USAGE, "not a container name", node)
    r = node.restore(good_archive(tmp_path / "ok"), "--name", "\x1b[2J")
    refused(r, Exit.USAGE, "--name '\\x1b[2J': not a container name", node)
    assert node.calls() == []


def test_remove_only_own__a_container_someone_else_made_stays(tmp_path: Path) -> None:
    """podman fails because a container of that name appeared meanwhile:
    that container is not ours, and stays."""
    node = Node(tmp_path)
    node.fake(restore_fails=True, taken_meanwhile=True, inspect="b" * 64 + " <no value>")
    r = node.restore(good_archive(tmp_path))
    assert r.returncode == Exit.FAILED and "name is already in use" in r.stderr, r.stderr
    assert not any(c[:1] == ["rm"] for c in node.calls()), node.calls()
    assert list(node.work.iterdir()) == []


def test_remove_only_own__the_container_this_restore_made_goes_by_its_id(tmp_path: Path) -> None:
    node = Node(tmp_path)
    node.fake(restore_fails=True, inspect="own")
    r = node.restore(good_archive(tmp_path))
    assert r.returncode == Exit.FAILED, r.stderr
    assert ["rm", "-f", "-t", "0", "--", "a" * 64] in node.calls()


def test_remove_only_own__values_go_after_double_dash(tmp_path: Path) -> None:
    node = Node(tmp_path)
    node.fake()
    image = "d" * 64
    r = node.restore(good_archive(tmp_path, {"rootfsImageID": image}), "--name", "n1")
    assert r.returncode == 0, r.stderr
    calls = node.calls()
    assert ["container", "exists", "--", "n1"] in calls
    assert ["image", "exists", "--", image] in calls
    (restore,) = [c for c in calls if c[:2] == ["container", "restore"]]
    assert "--name=n1" in restore and any(x.startswith("--import=") for x in restore)
    # A name that podman would read as an option is refused outright.
    (node.dir / "calls").unlink()
    r = node.restore(good_archive(tmp_path, {"name": "--all"}))
    refused(r, Exit.USAGE, "not a container name", node)
    assert not any("--all" in c and c[c.index("--all") - 1] != "--" for c in node.calls())


def test_remove_only_own__stale_work_directories_swept(tmp_path: Path) -> None:
    node = Node(tmp_path)
    node.fake()
    done = subprocess.Popen(["true"])
    done.wait()
    me = os.getpid()
    from cudahook.platform.host import Host

    start = Host().start_time(me)
    stale = node.work / f"cudahook-migrate-{done.pid}-1-abc"
    live = node.work / f"cudahook-migrate-{me}-{start}-abc"
    reused = node.work / f"cudahook-migrate-{me}-{start + 1}-abc"  # the PID, another process
    other = node.work / "cudahook-migrate-notours"
    target = tmp_path / "elsewhere"
    for d in (stale, live, reused, other, target):
        d.mkdir()
        (d / "restore.tar").write_bytes(b"partial")
    link = node.work / f"cudahook-migrate-{done.pid}-2-lnk"
    link.symlink_to(target)
    r = node.restore(good_archive(tmp_path))
    assert r.returncode == 0, r.stderr
    assert sorted(p.name for p in node.work.iterdir()) == sorted(
        p.name for p in (live, other, link))
    assert (target / "restore.tar").exists()


def test_remove_only_own__sigterm_leaves_no_work_directory(tmp_path: Path) -> None:
    node = Node(tmp_path)
    node.fake(sleep={"container exists": 3})
    proc = subprocess.Popen(node.argv("restore", str(good_archive(tmp_path))), env=node.env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 20
    while not any(node.work.iterdir()) or not node.calls():
        assert time.monotonic() < deadline and proc.poll() is None
        time.sleep(0.02)
    proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=20)
    assert proc.returncode == 130, err
    assert list(node.work.iterdir()) == []


def test_operator_only_criu_config__archive_annotations_do_not_cross(tmp_path: Path) -> None:
    node = Node(tmp_path)
    node.fake()
    spec = {**SPEC, "annotations": {"org.criu.config": "/tmp/evil.conf",
                                    "cudahook.io/criu-config": "/tmp/evil2.conf", "keep": "1"}}
    r = node.restore(good_archive(tmp_path, spec=spec))
    assert r.returncode == 0, r.stderr
    got = node.imported()
    for s in (got["spec.dump"], got["config.dump"]["spec"]):
        assert s["annotations"].keys() == {"keep", "cudahook-migrate/restore-token"}
    assert "dropped from the spec: cudahook.io/criu-config, org.criu.config" in r.stdout
    (event,) = [json.loads(x) for x in node.log.read_text().splitlines()]
    assert event["dropped_annotations"] == ["cudahook.io/criu-config", "org.criu.config"]


# -- who made the archive -------------------------------------------------------


def checkpointed(node: Node, tmp: Path, key: Path | None, name: str = "job.tar.gz") -> Path:
    (tmp / f"src-{name}").mkdir()
    src = good_archive(tmp / f"src-{name}")
    node.fake(export_from=str(src))
    out = tmp / name
    args = ["checkpoint", "c", str(out)] + (["--sign-key", str(key)] if key else [])
    r = node.run(*args)
    assert r.returncode == 0, r.stderr
    return out


def test_archive_authenticity__signed_by_a_trusted_key(tmp_path: Path) -> None:
    node = Node(tmp_path)
    r = node.run("keygen", "--out", str(tmp_path / "key"))
    assert r.returncode == 0, r.stderr
    assert (tmp_path / "key").stat().st_mode & 0o777 == 0o600
    a = checkpointed(node, tmp_path, tmp_path / "key")
    statement = json.loads(json.loads(a.with_name(a.name + ".sig").read_text())["statement"])
    assert statement["sha256"] == hashlib.sha256(a.read_bytes()).hexdigest()
    assert statement["container"] == "c" and statement["size"] == a.stat().st_size
    r = node.restore(a, "--verify-key", str(tmp_path / "key.pub"))
    assert r.returncode == 0, r.stderr
    assert "origin (signed by ed25519:" in r.stdout and "not verified" not in r.stdout


def test_archive_authenticity__replaced_archive_or_other_key_refused(tmp_path: Path) -> None:
    node = Node(tmp_path)
    assert node.run("keygen", "--out", str(tmp_path / "key")).returncode == 0
    assert node.run("keygen", "--out", str(tmp_path / "other")).returncode == 0
    a = checkpointed(node, tmp_path, tmp_path / "key")
    r = node.restore(a, "--verify-key", str(tmp_path / "other.pub"))
    refused(r, Exit.USAGE, "not signed by a trusted key", node)
    # Someone replaces the archive and its sidecar; the signature stays.
    a.write_bytes(gzip.compress(tar_bytes(MEMBERS)))
    digest = hashlib.sha256(a.read_bytes()).hexdigest()
    a.with_name(a.name + ".sha256").write_text(f"{digest}  {a.name}\n")
    r = node.restore(a, "--verify-key", str(tmp_path / "key.pub"))
    refused(r, Exit.USAGE, "signed for another archive", node)
    # A signature file that is a link (to a good one) is not read.
    sig = a.with_name(a.name + ".sig")
    sig.rename(tmp_path / "moved.sig")
    sig.symlink_to(tmp_path / "moved.sig")
    r = node.restore(a, "--verify-key", str(tmp_path / "key.pub"))
    refused(r, Exit.USAGE, "is a symlink", node)


def test_archive_authenticity__required_signature(tmp_path: Path) -> None:
    keys = tmp_path / "trusted"
    keys.mkdir()
    node = Node(tmp_path, migrate_require_signature=True, migrate_trusted_keys_dir=str(keys))
    assert node.run("keygen", "--out", str(keys / "site")).returncode == 0
    unsigned = checkpointed(node, tmp_path, None, "unsigned.tar.gz")
    r = node.restore(unsigned)
    refused(r, Exit.USAGE, "unsigned.tar.gz.sig is missing", node)
    signed = checkpointed(node, tmp_path, keys / "site", "signed.tar.gz")
    r = node.restore(signed)
    assert r.returncode == 0, r.stderr
    assert "origin (signed by" in r.stdout


def test_archive_authenticity__unsigned_restore_says_what_it_did_not_verify(
        tmp_path: Path) -> None:
    node = Node(tmp_path)
    node.fake()
    r = node.restore(good_archive(tmp_path))
    assert r.returncode == 0, r.stderr
    assert "verified: sha256 (ckpt.tar.gz.sha256), tar structure and bounds, gzip CRC" in r.stdout
    assert "not verified: origin (unsigned)" in r.stdout


def test_exit_codes_one_table__gate_refusals_exit_as_check_says() -> None:
    """Every reason the restore gate can give: `migrate restore` exits with
    the code `cudahook check --image` gives for it (the hooks keep theirs)."""
    from cudahook.flow.checks import Verdict
    from cudahook.platform.errors import CudahookError, EnvironmentProblem
    from cudahook.platform.reasons import REASONS

    for code, reason in REASONS.items():
        if reason.side == "checkpoint":
            continue
        v = Verdict("restore", {})
        v.add(code, "x")
        err = (NotRestorableHere if reason.never_here else EnvironmentProblem)("x", reason=code)
        got = migrate.as_check(err)
        assert isinstance(got, CudahookError) and got.exit_code == v.exit_code, code
        assert got.reason == code


def test_exit_codes_one_table__a_changed_or_missing_image_file_is_6(tmp_path: Path) -> None:
    """The files of cudahook's that the manifest checksums (the VMM state),
    as the archive holds them: changed or missing, exit 6 as check says."""
    state = b"vmm state" * 1000
    a = archive(tmp_path, {**MEMBERS, "checkpoint/cuda-vmm.state": state})
    found = migrate.scan(a)
    good = FileSum(hashlib.sha256(state).hexdigest(), len(state))
    migrate.verify_files(Manifest((), files={"cuda-vmm.state": good}), found.hashed)
    changed = Manifest((), files={"cuda-vmm.state": FileSum("0" * 64, len(state))})
    with pytest.raises(NotRestorableHere) as exc:
        migrate.verify_files(changed, found.hashed)
    assert exc.value.reason == "IMAGE_CHECKSUM" and exc.value.exit_code == Exit.NOT_HERE
    with pytest.raises(NotRestorableHere) as exc:
        migrate.verify_files(Manifest((), files={"other.state": good}), found.hashed)
    assert exc.value.reason == "IMAGE_FILE_MISSING"


def test_exit_codes_one_table__a_changed_or_missing_chunk_is_6(tmp_path: Path) -> None:
    """GPU memory in storage: every chunk and the per-process manifest the
    archive holds, against the manifest's digests, before podman runs."""
    def sha(b: bytes) -> str:
        return hashlib.sha256(b).hexdigest()

    chunks, meta = [b"a" * 16, b"b" * 16, b"c" * 8], b'{"chunks": 3}'
    files = {f"checkpoint/cudahook-gpu/7/gpu0-{k:06d}.chunk": c for k, c in enumerate(chunks)}
    stored = GpuStorage("cudahook-gpu", (StoredProcess(
        7, 16, sha(meta), len(meta), (StorageRange(40, tuple(sha(c) for c in chunks)),)),))
    m = Manifest((), gpu_storage=stored)
    whole = {**MEMBERS, "checkpoint/cudahook-gpu/7/manifest.json": meta, **files}
    migrate.verify_files(m, migrate.scan(archive(tmp_path, whole)).hashed)
    changed = {**whole, "checkpoint/cudahook-gpu/7/gpu0-000001.chunk": b"b" * 15 + b"B"}
    with pytest.raises(NotRestorableHere) as exc:
        migrate.verify_files(m, migrate.scan(archive(tmp_path, changed)).hashed)
    assert exc.value.reason == "IMAGE_CHECKSUM" and exc.value.exit_code == Exit.NOT_HERE
    assert "gpu0-000001.chunk" in str(exc.value)
    missing = {k: v for k, v in whole.items() if not k.endswith("gpu0-000002.chunk")}
    with pytest.raises(NotRestorableHere) as exc:
        migrate.verify_files(m, migrate.scan(archive(tmp_path, missing)).hashed)
    assert exc.value.reason == "IMAGE_FILE_MISSING"


@pytest.mark.parametrize("process", [[1], {"env": "A=1"}, {"env": [1]}, "x"])
def test_one_line_errors__a_malformed_spec_is_bad_input(process: object) -> None:
    spec = {"process": process}
    small = {"spec.dump": json.dumps(spec).encode(),
             "config.dump": json.dumps({"name": "c", "spec": spec}).encode()}
    with pytest.raises(UsageError, match="not a list of strings"):
        migrate.retarget(small, ["GPU-x"])


@pytest.mark.parametrize("damage", ["flipped", "cut"])
def test_one_line_errors__a_damaged_gzip_stream_is_one_line(tmp_path: Path, damage: str) -> None:
    node = Node(tmp_path)
    node.fake()
    a = good_archive(tmp_path)
    data = bytearray(a.read_bytes())
    if damage == "flipped":
        data[len(data) * 2 // 3] ^= 0xFF
    else:
        del data[len(data) * 2 // 3:]
    a.write_bytes(bytes(data))
    r = node.restore(a, "--no-verify")
    refused(r, Exit.USAGE, "not a complete checkpoint archive", node)


def test_one_line_errors__podman_exits_0_without_an_archive(tmp_path: Path) -> None:
    node = Node(tmp_path)
    node.fake()  # podman's checkpoint says it succeeded, and writes nothing
    out = tmp_path / "job.tar.gz"
    r = node.run("checkpoint", "c", str(out))
    assert r.returncode == Exit.FAILED, r.stderr
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and "wrote no archive" in lines[0], r.stderr
    assert list(tmp_path.glob("job.tar.gz*")) == []


def test_one_line_errors__the_archive_path_is_escaped(tmp_path: Path) -> None:
    node = Node(tmp_path)
    node.fake()
    r = node.restore(tmp_path / "\u202e\u2066x\x1b[2J")
    refused(r, Exit.USAGE, "no such archive", node)
    assert "\u202e" not in r.stderr and "\\u202e" in r.stderr
    a = good_archive(tmp_path / "d")
    odd = a.rename(a.with_name("job\x1b]0;x\x07.tar.gz"))
    r = node.restore(odd)
    refused(r, Exit.USAGE, "is missing", node)


@pytest.mark.parametrize("data", [b'{"name": "\xff"}', b"[" * 100_000, b"[1]"])
def test_one_line_errors__a_malformed_config_dump_is_bad_input(tmp_path: Path,
                                                               data: bytes) -> None:
    node = Node(tmp_path)
    node.fake()
    a = archive(tmp_path, {**MEMBERS, "config.dump": data})
    r = node.restore(a)
    refused(r, Exit.USAGE, "config.dump in the archive", node)


# -- GPU memory in storage, deduplicated: chunks that are hard links -------------

GPU = "checkpoint/cudahook-gpu"
A0, A1, B0 = f"{GPU}/7/gpu0-000000.chunk", f"{GPU}/7/gpu0-000001.chunk", f"{GPU}/8/gpu0-000000.chunk"


def link(name: str, target: str, size: int = 0) -> bytes:
    info = tarfile.TarInfo(name)
    info.type, info.linkname, info.size = tarfile.LNKTYPE, target, size
    return info.tobuf(tarfile.PAX_FORMAT) + padded(b"d" * size)


def member(name: str, data: bytes = b"", kind: bytes = tarfile.REGTYPE) -> bytes:
    info = tarfile.TarInfo(name)
    info.type, info.size = kind, len(data)
    return info.tobuf(tarfile.PAX_FORMAT) + padded(data)


def chunks_tar(*extra: bytes) -> bytes:
    """podman's export of a deduplicated image: process 8's chunk is a link
    to process 7's first (the same bytes), written after it."""
    return (BASE + member(GPU, kind=tarfile.DIRTYPE) + member(f"{GPU}/7", kind=tarfile.DIRTYPE)
            + member(A0, b"a" * 64) + member(A1, b"b" * 64)
            + member(f"{GPU}/8", kind=tarfile.DIRTYPE) + b"".join(extra) + END)


def test_archive_bounded__a_chunk_linked_to_an_earlier_chunk_is_carried_as_a_link(
        tmp_path: Path) -> None:
    """The one hard link a checkpoint holds: a GPU-memory chunk to an earlier
    one of cudahook-gpu/ (its target spelled any way; the copy names it
    canonically), hashed as its target, a link again once extracted."""
    a = write(tmp_path, chunks_tar(link(B0, f"./{GPU}//7/./gpu0-000000.chunk")))
    found = migrate.scan(a, tmp_path / "copy.tar")
    assert found.hashed[B0] == found.hashed[A0] == (hashlib.sha256(b"a" * 64).hexdigest(), 64)
    assert found.at[B0] == found.at[A0]
    with tarfile.open(tmp_path / "copy.tar") as t:
        got = t.getmember(B0)
        assert got.islnk() and got.linkname == A0 and got.size == 0
        t.extractall(tmp_path / "out")  # the copy cudahook wrote: names it checked
    out = tmp_path / "out"
    assert (out / B0).read_bytes() == b"a" * 64 and (out / B0).stat().st_nlink == 2
    assert (out / B0).stat().st_ino == (out / A0).stat().st_ino
    node = Node(tmp_path)
    r = node.restore(a)
    assert r.returncode == 0, r.stderr
    assert any(c[:2] == ["container", "restore"] for c in node.calls())


HOSTILE_LINKS = {
    # name: (what follows process 7's chunks, what the one line says)
    "outside-the-gpu-tree": (link("checkpoint/pages-2.img", A0), "is a hard link: a checkpoint"),
    "spec-to-a-chunk": (link("spec2.dump", A0), "is a hard link: a checkpoint"),
    "to-outside-the-gpu-tree": (link(B0, "checkpoint/pages-1.img"), "only a link to an earlier"),
    "to-a-spec": (link(B0, "spec.dump"), "only a link to an earlier"),
    "to-a-later-member": (link(B0, f"{GPU}/8/gpu0-000001.chunk")
                          + member(f"{GPU}/8/gpu0-000001.chunk", b"c" * 64),
                          "only a link to an earlier"),
    "to-itself": (link(B0, B0), "only a link to an earlier"),
    "to-nothing": (link(B0, f"{GPU}/9/gpu0-000000.chunk"), "only a link to an earlier"),
    "to-a-directory": (link(B0, f"{GPU}/7"), "only a link to an earlier"),
    "to-a-symlink": (member(f"{GPU}/8/s", kind=tarfile.SYMTYPE) + link(B0, f"{GPU}/8/s"),
                     "is a symlink"),
    "to-a-fifo": (member(f"{GPU}/8/f", kind=tarfile.FIFOTYPE) + link(B0, f"{GPU}/8/f"),
                  "is a FIFO"),
    "a-chain": (link(B0, A0) + link(f"{GPU}/8/gpu0-000001.chunk", B0),
                "only a link to an earlier"),
    "with-data": (link(B0, A0, size=5), "hard link"),
    "absolute-target": (link(B0, "/" + A0), "absolute name"),
    "target-climbs-out": (link(B0, f"{GPU}/8/../7/gpu0-000000.chunk"), "leaves the archive"),
    "target-leaves-the-archive": (link(B0, "../../etc/shadow"), "leaves the archive"),
    "name-climbs-out": (link(f"{GPU}/8/../../../x.chunk", A0), "leaves the archive"),
    "twice": (link(B0, A0) + link(B0, A1), "appears twice"),
    "under-a-link": (link(B0, A0) + member(f"{B0}/x", b"x"), "is under a file"),
}


@pytest.mark.parametrize("case", sorted(HOSTILE_LINKS))
def test_archive_bounded__hard_links_but_chunk_to_earlier_chunk_refused(
        tmp_path: Path, case: str) -> None:
    """Every other hard link (and every way of spelling one out of the GPU
    tree) is refused in one line, exit 2, before podman runs, nothing left."""
    extra, why = HOSTILE_LINKS[case]
    node = Node(tmp_path)
    a = write(tmp_path, chunks_tar(extra))
    refused(node.restore(a), Exit.USAGE, why, node)


def test_archive_names_canonical__hard_link_targets_are_normalised(tmp_path: Path) -> None:
    """A link's target is decided on its canonical name, as a member's is: a
    `./`, `//`, `/./` spelling of an earlier chunk is that chunk; `..` is
    refused however it would have ended."""
    ok = write(tmp_path, chunks_tar(link(B0, f"{GPU}/./7//gpu0-000001.chunk")))
    assert migrate.scan(ok).hashed[B0] == migrate.scan(ok).hashed[A1]
    bad = write(tmp_path, chunks_tar(link(B0, f"{GPU}/7/../7/gpu0-000001.chunk")))
    with pytest.raises(UsageError, match="leaves the archive"):
        migrate.scan(bad)


def stored_manifest(kind: str, digest: Callable[[bytes], str], zstd: tuple[int, ...] = ()) -> Manifest:
    """Processes 7 (chunks a, b) and 8 (chunk a), their manifests `meta`."""
    meta = hashlib.sha256(b"{}").hexdigest()
    a, b = digest(b"a" * 64), digest(b"b" * 64)
    return Manifest((), gpu_storage=GpuStorage("cudahook-gpu", (
        StoredProcess(7, 64, meta, 2, (StorageRange(128, (a, b), zstd),)),
        StoredProcess(8, 64, meta, 2, (StorageRange(64, (a,), zstd[:1]),))), digest=kind))


def metas() -> bytes:
    return member(f"{GPU}/7/manifest.json", b"{}") + member(f"{GPU}/8/manifest.json", b"{}")


def test_exit_codes_one_table__a_link_to_the_wrong_chunk_is_6(tmp_path: Path) -> None:
    """A link is checked as the file it names: one that names another chunk
    than the manifest's is IMAGE_CHECKSUM, exit 6, before podman runs."""
    m = stored_manifest("sha256", lambda b: hashlib.sha256(b).hexdigest())
    good = migrate.scan(write(tmp_path, chunks_tar(metas(), link(B0, A0))))
    migrate.verify_files(m, good.hashed)
    wrong = migrate.scan(write(tmp_path, chunks_tar(metas(), link(B0, A1))))
    with pytest.raises(NotRestorableHere) as exc:
        migrate.verify_files(m, wrong.hashed)
    assert exc.value.reason == "IMAGE_CHECKSUM" and exc.value.exit_code == Exit.NOT_HERE
    assert "8/gpu0-000000.chunk" in str(exc.value)


@pytest.mark.parametrize("compressed", [False, True])
def test_exit_codes_one_table__a_blake3_or_zstd_chunk_is_read_back_from_the_copy(
        tmp_path: Path, compressed: bool) -> None:
    """blake3 digests (of the raw bytes, maybe stored compressed): the scan's
    sha256 cannot prove them, so each chunk - a link as its target - is read
    back from the copy and checked by the driver helper's own rule."""
    blake3 = pytest.importorskip("blake3")
    zstandard = pytest.importorskip("zstandard")

    def stored(data: bytes) -> bytes:
        return zstandard.ZstdCompressor(write_content_size=True).compress(data) \
            if compressed else data

    sa, sb = stored(b"a" * 64), stored(b"b" * 64)
    m = stored_manifest("blake3", lambda b: blake3.blake3(b).hexdigest(),
                        (len(sa), len(sb)) if compressed else ())

    def tar(target: str, b_data: bytes = sb) -> bytes:
        return (BASE + metas() + member(A0, sa) + member(A1, b_data) + link(B0, target) + END)

    for n, (target, b_data, ok) in enumerate([(A0, sb, True), (A1, sb, False),
                                              (A0, sb[:-1] + bytes([sb[-1] ^ 1]), False)]):
        copy = tmp_path / f"copy{n}.tar"
        a = write(tmp_path, tar(target, b_data))
        found = migrate.scan(a, copy)
        assert found.chunks == {}  # with a copy: read back from it
        assert migrate.verify_files(m, found.hashed) == 3  # neither: left to post-restore
        dry = migrate.scan(a)  # no copy: the digests the driver helper's rule needs
        assert set(dry.chunks) >= {A0, A1, B0}
        if ok:
            assert migrate.verify_files(m, found.hashed, found.at, copy) == 0
            assert migrate.verify_files(m, dry.hashed, chunks=dry.chunks) == 0
            continue
        for args in ((found.at, copy, None), (None, None, dry.chunks)):
            with pytest.raises(NotRestorableHere) as exc:
                migrate.verify_files(m, found.hashed, *args)
            assert exc.value.reason == "IMAGE_CHECKSUM" and exc.value.exit_code == Exit.NOT_HERE


def test_exit_codes_one_table__a_dry_run_leaves_compressed_sha256_chunks_unverified(
        tmp_path: Path) -> None:
    """An image of sha256 digests whose chunks are stored compressed (where
    blake3 did not load): the dry run hashes what it decompresses with
    blake3 only, so it counts these as not verified (post-restore checks
    them) rather than passing them."""
    zstandard = pytest.importorskip("zstandard")
    z = zstandard.ZstdCompressor(write_content_size=True)
    sa, sb = z.compress(b"a" * 64), z.compress(b"b" * 64)
    m = stored_manifest("sha256", lambda b: hashlib.sha256(b).hexdigest(), (len(sa), len(sb)))
    dry = migrate.scan(write(tmp_path, BASE + metas() + member(A0, sa) + member(A1, sb)
                             + link(B0, A0) + END))
    assert migrate.verify_files(m, dry.hashed, chunks=dry.chunks) == 3


# -- a dry run checks blake3 and compressed chunks as the driver helper would ----


def rle_bomb(blocks: int) -> bytes:
    """One zstd frame of `blocks` RLE blocks of 128 KiB each (4 bytes apiece),
    with no content size: what it makes is known only by making it."""
    frame = bytearray(b"\x28\xb5\x2f\xfd" + bytes([0x00, 0x38]))  # window 128 KiB
    block = ((131072 << 3) | (1 << 1)).to_bytes(3, "little") + b"\0"
    frame += block * (blocks - 1)
    frame += ((131072 << 3) | (1 << 1) | 1).to_bytes(3, "little") + b"\0"  # the last
    return bytes(frame)


def packed_archive(tmp: Path, sim: SimNode, chunk: int, chunks: list[bytes],
                   frames: list[bytes | None], damage: dict[int, bytes] | None = None) -> Path:
    """A podman export of check's packed image (tests/test_check.py
    `packed_image`: version 3, process 7's chunks with blake3 digests, stored
    as `frames`, identical ones hard links to one file, `damage` in place of
    chunk k's file, the manifests unchanged)."""
    image = tmp / "image"
    packed_image(image, sim, chunks, frames, chunk=chunk, damage=damage)
    path = tmp / "job.tar.gz"
    with tarfile.open(path, "w:gz") as tar:
        for name in ("spec.dump", "config.dump"):
            info = tarfile.TarInfo(name)
            info.size = len(MEMBERS[name])
            tar.addfile(info, io.BytesIO(MEMBERS[name]))
        tar.add(image, arcname="checkpoint")  # a file's second name: a hard link
    digest = hashlib.sha256(path.read_bytes()).hexdigest()
    path.with_name(path.name + ".sha256").write_text(f"{digest}  {path.name}\n")
    return path


def dry_run(tmp: Path, sim: SimNode, a: Path) -> tuple[Node, subprocess.CompletedProcess[str]]:
    """`migrate restore --dry-run --json` of `a` on `sim`'s GPUs."""
    (tmp / "podman").mkdir()
    podman = Node(tmp / "podman")  # beside the simulated node's own directory
    podman.fake()
    podman.configure(**{k: list(v) if isinstance(v, tuple) else v
                        for k, v in sim.settings().__dict__.items()})
    return podman, podman.restore(a, "--dry-run", "--json")


#: Three 4 KiB chunks: zeros twice (compressed; the second a link to the
#: first), then a raw one.
DRY_CHUNKS = [bytes(4096), bytes(4096), bytes(range(256)) * 16]


def dry_frames() -> list[bytes | None]:
    import zstandard

    frame = zstandard.ZstdCompressor(level=3, write_content_size=True).compress(DRY_CHUNKS[0])
    return [frame, frame, None]


def test_exit_codes_one_table__a_dry_run_verifies_blake3_and_zstd_chunks(
        node: SimNode, tmp_path: Path) -> None:
    """A dry run writes no copy to read chunks back from: the one pass over
    the archive checks each blake3 chunk (a compressed one by what its frame
    decompresses to, a link as its target) by the driver helper's rule, and
    says so; none is left unverified."""
    a = packed_archive(tmp_path, node, 4096, DRY_CHUNKS, dry_frames())
    with tarfile.open(a) as t:
        assert t.getmember(f"{GPU}/7/gpu0-000001.chunk").islnk()
    before = a.read_bytes()
    podman, r = dry_run(tmp_path, node, a)
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout)
    assert out["dry_run"] and "GPU-memory chunks (3, blake3; 2 zstd-decompressed)" in \
        out["verified"], out["verified"]
    assert not any("chunk" in x for x in out["not_verified"]), out["not_verified"]
    assert not any(c[:2] == ["container", "restore"] for c in podman.calls())
    assert list(podman.work.iterdir()) == [] and a.read_bytes() == before


def flip(data: bytes, at: int) -> bytes:
    return data[:at] + bytes([data[at] ^ 0x01]) + data[at + 1:]


DRY_DAMAGE: dict[str, Callable[[bytes], dict[int, bytes]]] = {
    # A changed byte of the raw chunk: its blake3 differs.
    "raw-chunk-flipped": lambda frame: {2: flip(DRY_CHUNKS[2], 100)},
    # A changed byte inside the compressed chunks' frame (one file, two names).
    "frame-flipped": lambda frame: {0: flip(frame, len(frame) - 3)},
    # Not a zstd frame at all, where the manifest says compressed.
    "not-a-frame": lambda frame: {0: bytes(len(frame))},
}


@pytest.mark.parametrize("case", sorted(DRY_DAMAGE))
def test_exit_codes_one_table__a_dry_run_refuses_a_changed_blake3_or_zstd_chunk(
        node: SimNode, tmp_path: Path, case: str) -> None:
    """A chunk whose bytes changed gives exit 6 (IMAGE_CHECKSUM) in a dry
    run, as the real restore's read-back would, and changes nothing."""
    frames = dry_frames()
    assert frames[0] is not None
    a = packed_archive(tmp_path, node, 4096, DRY_CHUNKS, frames, DRY_DAMAGE[case](frames[0]))
    before = a.read_bytes()
    podman, r = dry_run(tmp_path, node, a)
    refused(r, Exit.NOT_HERE, "blake3 or size differs from the manifest's", podman)
    assert a.read_bytes() == before


def test_archive_bounded__a_zstd_bomb_chunk_is_refused_in_a_dry_run(node: SimNode,
                                                                   tmp_path: Path) -> None:
    """A compressed chunk whose 2 MiB frame makes 64 GiB: the dry run
    decompresses it as a stream, stops past the largest chunk a manifest may
    name (1 GiB), and refuses it (exit 6, IMAGE_CHECKSUM), in bounded time
    and memory, as the driver helper would."""
    from cudahook.core.backends import driver_helper as helper

    chunk = 16 << 20
    bomb = rle_bomb((64 << 30) // (128 << 10))
    data = bytes(range(256)) * (chunk // 256)
    with pytest.raises(helper.Mismatch, match="does not hold"):
        helper.check_stored("c", memoryview(bomb), chunk, len(bomb), "sha256", "0" * 64)
    a = packed_archive(tmp_path, node, chunk, [data], [bomb])
    before = a.read_bytes()
    t = time.monotonic()
    podman, r = dry_run(tmp_path, node, a)
    refused(r, Exit.NOT_HERE, "gpu0-000000.chunk': blake3 or size differs", podman)
    assert time.monotonic() - t < 20
    assert a.read_bytes() == before
    assert migrate.scan(a).chunks[f"{GPU}/7/gpu0-000000.chunk"].unpacked is None


def frame_variants() -> dict[str, bytes]:
    """Stored bytes for a compressed chunk of 64 x "a", good and bad."""
    import zstandard

    data = b"a" * 64
    sized = zstandard.ZstdCompressor(write_content_size=True)
    frame = sized.compress(data)
    checked = zstandard.ZstdCompressor(write_checksum=True).compress(data)
    skippable = (0x184D2A53).to_bytes(4, "little") + (3).to_bytes(4, "little") + b"xyz"
    return {
        "good": frame,
        "unsized": zstandard.ZstdCompressor(write_content_size=False).compress(data),
        "in-two-frames": sized.compress(data[:30]) + sized.compress(data[30:]),
        "then-an-empty-frame": frame + sized.compress(b""),
        "then-a-skippable-frame": frame + skippable,
        "after-a-skippable-frame": skippable + frame,
        "then-garbage": frame + b"garbage",
        "then-more": frame + sized.compress(b"b"),
        "cut-short": frame[:-2],
        "checksum-flipped": checked[:-1] + bytes([checked[-1] ^ 1]),
        "fewer-bytes": sized.compress(data[:-1]),
        "more-bytes": sized.compress(data + b"a"),
        "a-bomb": rle_bomb(16),
        "not-a-frame": data,
        "empty": b"",
    }


@pytest.mark.parametrize("variant", sorted(frame_variants()))
def test_exit_codes_one_table__a_dry_run_judges_a_frame_as_the_driver_helper_does(
        tmp_path: Path, variant: str) -> None:
    """Whatever a compressed chunk's stored bytes are, the dry run's verdict
    (from the digests its one pass took) is the driver helper's own
    (`check_stored`, what post-restore and the real restore's read-back run)."""
    import blake3

    from cudahook.core.backends import driver_helper as helper

    stored = frame_variants()[variant]
    digest = blake3.blake3(b"a" * 64).hexdigest()
    meta = hashlib.sha256(b"{}").hexdigest()
    m = Manifest((), gpu_storage=GpuStorage("cudahook-gpu", (StoredProcess(
        7, 64, meta, 2, (StorageRange(64, (digest,), (len(stored),)),)),), digest="blake3"))
    try:
        helper.check_stored("c", memoryview(stored), 64, len(stored), "blake3", digest)
        helper_ok = True
    except helper.Refused:
        helper_ok = False
    dry = migrate.scan(write(tmp_path, BASE + member(f"{GPU}/7/manifest.json", b"{}")
                             + member(A0, stored) + END))
    try:
        dry_ok = migrate.verify_files(m, dry.hashed, chunks=dry.chunks) == 0
    except NotRestorableHere as exc:
        assert exc.reason == "IMAGE_CHECKSUM" and exc.exit_code == Exit.NOT_HERE
        dry_ok = False
    assert dry_ok == helper_ok, (variant, helper_ok)
    assert dry_ok == (variant in {"good", "unsized", "in-two-frames", "then-an-empty-frame",
                                  "then-a-skippable-frame", "after-a-skippable-frame"})
