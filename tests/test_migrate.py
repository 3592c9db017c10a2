"""`cudahook migrate`'s decisions that need no podman: the archive's checksum
and its tar read to the end, the members it may hold, the GPUs chosen on the
target node, and the spec rewritten to name them. The end-to-end moves are in
tests/e2e/test_migrate.py."""

from __future__ import annotations

import hashlib
import io
import json
import tarfile
from pathlib import Path

import pytest

from cudahook.admin import migrate
from cudahook.admin.cli import main
from cudahook.platform.errors import Exit, NotRestorableHere, UsageError


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
        assert set(migrate.scan(a)) == {"spec.dump", "config.dump"}
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


@pytest.mark.parametrize("kind", ["abs", "dotdot", "symlink", "fifo"])
def test_members_a_checkpoint_never_holds_are_refused(tmp_path: Path, kind: str) -> None:
    path = tmp_path / "bad.tar"
    with tarfile.open(path, "w") as tar:
        info = tarfile.TarInfo({"abs": "/etc/x", "dotdot": "checkpoint/../../x"}.get(kind, "x"))
        if kind == "symlink":
            info.type, info.linkname = tarfile.SYMTYPE, "/etc/shadow"
        elif kind == "fifo":
            info.type = tarfile.FIFOTYPE
        tar.addfile(info, io.BytesIO(b""))
    with pytest.raises(UsageError, match=r"leaves the archive|not a file or directory"):
        migrate.scan(path)
    with pytest.raises(UsageError, match=r"leaves the archive|not a file or directory"):
        migrate.scan(path, copy_to=tmp_path / "copy.tar")


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
    copy = tmp_path / "copy.tar"
    small = migrate.scan(a, copy_to=copy)
    migrate.finish_copy(copy, migrate.retarget(small, ["GPU-x", "GPU-y"]))
    with tarfile.open(copy) as tar:
        got = {m.name: tar.extractfile(m).read() for m in tar}  # type: ignore[union-attr]
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
    from cudahook.hooks.gpu_request import visible_devices

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
