"""Hostile and malformed input: what a checkpoint image, a bundle, the OCI
state, CRIU's environment or a damaged state directory can hold, and the one
line and documented exit code each gets instead of a hang, a traceback or a
signal to the wrong process."""

from __future__ import annotations

import fcntl
import json
import os
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from cudahook.admin import hookfiles
from cudahook.core import manifest
from cudahook.core.manifest import ManifestError
from cudahook.flow import oci_bundle
from cudahook.hooks import criu_env, oci_state
from cudahook.platform import marks, safeio
from cudahook.platform.errors import StateError, UsageError, one_line
from cudahook.platform.store import Store, container_key

SCRUBBED = {"PATH": "/usr/sbin:/usr/bin:/sbin:/bin"}
U0 = "GPU-11111111-2222-3333-4444-555555555555"
GOOD = {"version": 1, "container_id": "c", "driver_version": "580.65.06", "gpus": [U0],
        "processes": [{"nspid": 7, "pid": 4242, "state": "running"}]}


@pytest.fixture
def root(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A node root of the test's own: state, marks and log live under it."""
    r = tmp_path / "node"
    (r / "var" / "log").mkdir(parents=True)
    monkeypatch.setenv("CUDAHOOK_ROOT", str(r))
    monkeypatch.delenv("CUDAHOOK_CONFIG", raising=False)
    return r


@pytest.fixture
def hooks(root: Path, tmp_path: Path) -> dict[str, Path]:
    return hookfiles.install(tmp_path / "hooks")


@pytest.fixture
def sleeper() -> Iterator[subprocess.Popen[bytes]]:
    p = subprocess.Popen(["sleep", "120"], start_new_session=True)
    yield p
    p.kill()
    p.wait()


def env_of(root: Path, **extra: str) -> dict[str, str]:
    return {**SCRUBBED, "CUDAHOOK_ROOT": str(root), **extra}


def one_line_error(r: subprocess.CompletedProcess[bytes], code: int, text: str) -> str:
    err = r.stderr.decode(errors="replace")
    assert r.returncode == code, (r.returncode, err)
    assert err.count("\n") == 1 and err.startswith("cudahook: "), err
    assert "Traceback" not in err
    assert text in err, err
    return err


def fifo(path: Path) -> Path:
    os.mkfifo(path)
    return path


# -- 1, 9: CRTOOLS_INIT_PID -----------------------------------------------------------------


@pytest.mark.parametrize("text, words", [
    ("0", "not a PID"), ("00", "not a PID"), ("0123", "not a PID"), ("1", "host's init"),
    ("4194305", "beyond"), ("9" * 30, "not a PID"), ("9" * 5000, "not a PID"),
])
def test_init_pid_that_is_no_container_init_is_refused(text: str, words: str) -> None:
    with pytest.raises(UsageError) as exc:
        criu_env.from_env({"CRTOOLS_SCRIPT_ACTION": "pre-dump", "CRTOOLS_INIT_PID": text})
    assert words in str(exc.value) and len(str(exc.value)) < 200


def test_init_pid_at_the_kernel_limit_is_a_pid() -> None:
    call = criu_env.from_env({"CRTOOLS_SCRIPT_ACTION": "pre-dump", "CRTOOLS_INIT_PID": "4194304"})
    assert call.init_pid == 4194304


def dead_pid() -> int:
    p = subprocess.Popen(["true"])
    p.wait()
    return p.pid


@pytest.mark.parametrize("action", ["pre-dump", "post-restore", "post-resume"])
@pytest.mark.parametrize("pid", ["0", "1", "dead", "9" * 30, "9" * 5000])
def test_bad_init_pid_is_exit_2_in_one_line(root: Path, hooks: dict[str, Path], tmp_path: Path,
                                            action: str, pid: str) -> None:
    image = tmp_path / "img"
    image.mkdir()
    manifest.write(image, {k: v for k, v in GOOD.items() if k != "version"})
    marks.mark("restore", str(os.getpid()))  # post-resume's shell then starts Python
    text = str(dead_pid()) if pid == "dead" else pid
    r = subprocess.run([str(hooks["cudahook-criu-action"])], capture_output=True, timeout=60,
                       env=env_of(root, CRTOOLS_SCRIPT_ACTION=action, CRTOOLS_INIT_PID=text,
                                  CRTOOLS_IMAGE_DIR=str(image)))
    one_line_error(r, 2, "CRTOOLS_INIT_PID")


KILLER = """
import os, subprocess, sys
from cudahook.platform.marks import mark
mark("restore", str(os.getpid()))  # as post-restore leaves it for this CRIU run
r = subprocess.run([sys.argv[1]], capture_output=True, text=True)
print(r.returncode, r.stderr.strip())
"""


def test_init_pid_0_at_post_resume_kills_no_process_group(root: Path, hooks: dict[str, Path],
                                                         tmp_path: Path) -> None:
    """A failing restore kills the container: with PID 0 that was kill(0),
    CRIU's own process group. Here "CRIU" runs in a session of its own."""
    image = tmp_path / "img"
    image.mkdir()
    manifest.write(image, {k: v for k, v in GOOD.items() if k != "version"})
    env = env_of(root, CRTOOLS_SCRIPT_ACTION="post-resume", CRTOOLS_INIT_PID="0",
                 CRTOOLS_IMAGE_DIR=str(image))
    r = subprocess.run([sys.executable, "-c", KILLER, str(hooks["cudahook-criu-action"])],
                       env=env, capture_output=True, text=True, timeout=60,
                       start_new_session=True)
    assert r.returncode == 0, (r.returncode, r.stderr)  # -9 when its group was killed
    rc, _, err = r.stdout.strip().partition(" ")
    assert rc == "2" and "CRTOOLS_INIT_PID" in err, r.stdout


# -- 2: files in the checkpoint image -----------------------------------------------------


def hostile(kind: str, path: Path, tmp_path: Path) -> None:
    if kind == "fifo":
        fifo(path)
    elif kind == "dev-zero":
        path.symlink_to("/dev/zero")
    elif kind == "symlink":
        target = tmp_path / "host-file.json"
        target.write_text(json.dumps(GOOD))
        path.symlink_to(target)
    elif kind == "dangling":
        path.symlink_to(tmp_path / "nowhere")
    elif kind == "directory":
        path.mkdir()
    elif kind == "huge":
        with open(path, "wb") as f:
            f.truncate(manifest.MAX_BYTES + 1)  # sparse: no disk, but too large


KINDS = ["fifo", "dev-zero", "symlink", "dangling", "directory", "huge"]


@pytest.mark.parametrize("kind", KINDS)
def test_manifest_that_is_no_plain_file_is_refused_at_once(tmp_path: Path, kind: str) -> None:
    image = tmp_path / "img"
    image.mkdir()
    hostile(kind, image / manifest.NAME, tmp_path)
    t0 = time.monotonic()
    with pytest.raises(ManifestError) as exc:
        manifest.read(image)
    assert time.monotonic() - t0 < 2
    assert "unreadable" in str(exc.value) and "\n" not in str(exc.value)


@pytest.mark.parametrize("kind", KINDS)
def test_post_restore_with_a_hostile_manifest(root: Path, hooks: dict[str, Path], tmp_path: Path,
                                              sleeper: subprocess.Popen[bytes], kind: str) -> None:
    image = tmp_path / "img"
    image.mkdir()
    hostile(kind, image / manifest.NAME, tmp_path)
    r = subprocess.run([str(hooks["cudahook-criu-action"])], capture_output=True, timeout=30,
                       env=env_of(root, CRTOOLS_SCRIPT_ACTION="post-restore",
                                  CRTOOLS_INIT_PID=str(sleeper.pid), CRTOOLS_IMAGE_DIR=str(image)))
    # MANIFEST_UNREADABLE: this image can never be restored here (exit 6).
    one_line_error(r, 6, manifest.NAME)


@pytest.mark.parametrize("kind", ["fifo", "dev-zero", "symlink", "directory"])
def test_safeio_refuses_what_is_not_a_regular_file(tmp_path: Path, kind: str) -> None:
    path = tmp_path / "f"
    hostile(kind, path, tmp_path)
    with pytest.raises(safeio.FileRefused):
        safeio.read_bytes(path, 1 << 20)
    with pytest.raises(safeio.FileRefused):
        safeio.copy_file(path, tmp_path / "copy", 1 << 20)
    assert not (tmp_path / "copy").exists()


def test_safeio_cap_and_deadline(tmp_path: Path) -> None:
    path = tmp_path / "f"
    path.write_bytes(b"x" * 100)
    assert safeio.read_bytes(path, 100) == b"x" * 100
    with pytest.raises(safeio.FileRefused, match="larger than 99 bytes"):
        safeio.read_bytes(path, 99)
    t0 = time.monotonic()
    with pytest.raises(safeio.FileRefused, match=r"no answer within 0\.2s"):
        safeio.with_deadline(lambda: time.sleep(5), 0.2, "slow")
    assert time.monotonic() - t0 < 1


@pytest.mark.parametrize("change, words", [
    ({"gpus": [1, None]}, "malformed GPU list"),
    ({"gpus": ["not-a-uuid"]}, "malformed GPU list"),
    ({"driver_version": 580}, "driver_version"),
    ({"driver_version": ["580"]}, "driver_version"),
    ({"processes": [{"nspid": 7, "pid": "x"}]}, "malformed process list"),
    ({"processes": [{"nspid": 1 << 40}]}, "malformed process list"),
    ({"processes": [{"nspid": True}]}, "malformed process list"),
    ({"vmm": "yes"}, "vmm"),
    ({"container_id": 5}, "container_id"),
])
def test_manifest_is_held_to_its_schema(tmp_path: Path, change: dict[str, Any],
                                         words: str) -> None:
    (tmp_path / manifest.NAME).write_text(json.dumps({**GOOD, **change}))
    with pytest.raises(ManifestError) as exc:
        manifest.read(tmp_path)
    assert words in str(exc.value) and "\n" not in str(exc.value)
    assert exc.value.exit_code == 2


def test_deeply_nested_manifest_is_one_line(tmp_path: Path) -> None:
    (tmp_path / manifest.NAME).write_text("[" * 100_000 + "]" * 100_000)
    with pytest.raises(ManifestError, match="nested too deeply"):
        manifest.read(tmp_path)


# -- 2, 3, 4: config.json and the OCI state through the installed hooks -------------------


def bundle(tmp_path: Path, name: str, cfg: Any = None, raw: bytes | None = None) -> Path:
    d = tmp_path / "bundles" / name
    d.mkdir(parents=True)
    if raw is not None:
        (d / "config.json").write_bytes(raw)
    elif cfg is not None:
        (d / "config.json").write_text(json.dumps(cfg))
    return d


def state(cid: str, b: Path | str, pid: int, **extra: Any) -> bytes:
    return json.dumps({"ociVersion": "1.2.0", "id": cid, "status": "creating",
                       "bundle": str(b), "pid": pid, **extra}).encode()


def run_hook(hooks: dict[str, Path], root: Path, stage: str, data: bytes,
             timeout: float = 30) -> subprocess.CompletedProcess[bytes]:
    return subprocess.run([str(hooks["cudahook-oci-hook"]), stage], input=data,
                          env=env_of(root), capture_output=True, timeout=timeout)


def record(root: Path, cid: str) -> dict[str, Any] | None:
    """The record of the one container of that id (named by its key)."""
    recs = [r for r in Store(root / "run" / "cudahook").records() if r.get("id") == cid]
    assert len(recs) <= 1, recs
    return {k: v for k, v in recs[0].items() if k != "key"} if recs else None


@pytest.mark.parametrize("kind", ["fifo", "dev-zero", "directory", "huge", "symlink"])
def test_config_json_that_is_no_plain_file(root: Path, hooks: dict[str, Path], tmp_path: Path,
                                           sleeper: subprocess.Popen[bytes], kind: str) -> None:
    b = bundle(tmp_path, "b")
    path = b / "config.json"
    if kind == "huge":
        with open(path, "wb") as f:
            f.truncate(oci_bundle.MAX_CONFIG + 1)
    else:
        hostile(kind, path, tmp_path)
    t0 = time.monotonic()
    r = run_hook(hooks, root, "createRuntime", state("c", b, sleeper.pid))
    assert time.monotonic() - t0 < 5
    one_line_error(r, 2, "config.json")


def test_big_non_gpu_config_json_is_quick(root: Path, hooks: dict[str, Path], tmp_path: Path,
                                          sleeper: subprocess.Popen[bytes]) -> None:
    cfg = {"process": {"env": ["PATH=/bin"], "args": ["sh"]},
           "annotations": {f"k{i}": "v" * 100 for i in range(30_000)}}  # about 3.5 MB
    b = bundle(tmp_path, "b", cfg)
    t0 = time.monotonic()
    r = run_hook(hooks, root, "createRuntime", state("c", b, sleeper.pid))
    assert (r.returncode, r.stderr) == (0, b"")
    assert time.monotonic() - t0 < 1.5


@pytest.mark.parametrize("data", [
    b'{"id": "c", "bundle": "/b", "pad": "' + b"x" * (100 << 20) + b'"}',  # 100 MB, one line
    b"{\n" + b'"a": "xxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxx",\n' * 80_000 + b"}",  # 4 MB
])
def test_huge_state_is_refused_quickly(root: Path, hooks: dict[str, Path], data: bytes) -> None:
    t0 = time.monotonic()
    r = run_hook(hooks, root, "createRuntime", data)
    assert time.monotonic() - t0 < 3
    one_line_error(r, 2, "too large")


def test_a_megabyte_of_multi_line_state_is_quick(root: Path, hooks: dict[str, Path],
                                                 tmp_path: Path) -> None:
    b = bundle(tmp_path, "plain", {"process": {"env": []}})
    notes = {f"note{i}": "x" * 40 for i in range(17_000)}
    data = json.dumps({"id": "c", "bundle": str(b), "annotations": notes}, indent=1).encode()
    assert 900_000 < len(data) < oci_state.MAX_STATE
    t0 = time.monotonic()
    r = run_hook(hooks, root, "createRuntime", data)
    assert (r.returncode, r.stderr) == (0, b"")
    assert time.monotonic() - t0 < 2


def gpu_recorded(root: Path, hooks: dict[str, Path], data: bytes, cid: str = "c") -> None:
    r = run_hook(hooks, root, "createRuntime", data)
    assert r.returncode == 0, r.stderr
    assert record(root, cid) is not None


def test_escaped_marker_is_no_way_around_python(root: Path, hooks: dict[str, Path],
                                                tmp_path: Path,
                                                sleeper: subprocess.Popen[bytes]) -> None:
    raw = b'{"process": {"env": ["\\u004eVIDIA_VISIBLE_DEVICES=all"]}}'
    b = bundle(tmp_path, "b", raw=raw)
    assert oci_bundle.read_bundle(str(b)).visible == ["all"]
    gpu_recorded(root, hooks, state("c", b, sleeper.pid))
    raw = b'{"linux": {"devices": [{"path": "\\/dev\\/nvidia0"}]}}'
    b = bundle(tmp_path, "d", raw=raw)
    gpu_recorded(root, hooks, state("d", b, sleeper.pid), "d")


def test_bundle_key_inside_annotations_is_no_way_around_python(
        root: Path, hooks: dict[str, Path], tmp_path: Path,
        sleeper: subprocess.Popen[bytes]) -> None:
    plain = bundle(tmp_path, "plain", {"process": {"env": []}})
    gpu = bundle(tmp_path, "gpu", {"process": {"env": ["NVIDIA_VISIBLE_DEVICES=all"]}})
    data = json.dumps({"annotations": {"bundle": str(plain)}, "id": "c", "bundle": str(gpu),
                       "pid": sleeper.pid}).encode()
    gpu_recorded(root, hooks, data)
    # The same with the keys in runc's order, and with tabs and newlines between.
    data = (b'{\n\t"id"\t:\n"e",\r\n "bundle" :"' + str(gpu).encode() + b'", "pid": '
            + str(sleeper.pid).encode() + b'}')
    gpu_recorded(root, hooks, data, "e")


def test_nul_bytes_in_the_bundle_path_are_refused(root: Path, hooks: dict[str, Path],
                                                  tmp_path: Path,
                                                  sleeper: subprocess.Popen[bytes]) -> None:
    gpu = bundle(tmp_path, "gpu", {"process": {"env": ["NVIDIA_VISIBLE_DEVICES=all"]}})
    data = state("c", gpu, sleeper.pid).replace(str(gpu).encode(),
                                               str(gpu).encode()[:5] + b"\0" + str(gpu).encode()[5:])
    one_line_error(run_hook(hooks, root, "createRuntime", data), 2, "not JSON")


@pytest.mark.parametrize("stage", ["createContainer", "startContainer"])
def test_stages_inside_the_container_are_refused(root: Path, hooks: dict[str, Path],
                                                 tmp_path: Path, stage: str) -> None:
    b = bundle(tmp_path, "plain", {"process": {"env": []}})
    one_line_error(run_hook(hooks, root, stage, state("c", b, 1234)), 2,
                   f"{stage} runs inside the container's namespaces")


# -- 5, 6: one line, whatever breaks --------------------------------------------------------


def test_deeply_nested_config_json_is_one_line(root: Path, hooks: dict[str, Path],
                                               tmp_path: Path,
                                               sleeper: subprocess.Popen[bytes]) -> None:
    raw = b'{"env": "NVIDIA_VISIBLE_DEVICES=all", "x": ' + b"[" * 200_000 + b"]" * 200_000 + b"}"
    b = bundle(tmp_path, "b", raw=raw)
    one_line_error(run_hook(hooks, root, "createRuntime", state("c", b, sleeper.pid)), 2,
                   "nested too deeply")


def gpu_key(tmp_path: Path, cid: str = "c") -> str:
    """The key gpu_state's container is stored under."""
    return container_key(cid, str(tmp_path / "bundles" / "gpu"))


def gpu_state(tmp_path: Path, pid: int, cid: str = "c") -> bytes:
    b = tmp_path / "bundles" / "gpu"
    if not b.exists():
        bundle(tmp_path, "gpu", {"process": {"env": ["NVIDIA_VISIBLE_DEVICES=all"]}})
    return state(cid, b, pid)


def test_state_dir_that_is_a_file_is_exit_5(root: Path, hooks: dict[str, Path], tmp_path: Path,
                                            sleeper: subprocess.Popen[bytes]) -> None:
    (root / "run").mkdir()
    (root / "run" / "cudahook").write_text("not a directory")
    one_line_error(run_hook(hooks, root, "createRuntime", gpu_state(tmp_path, sleeper.pid)), 5,
                   "run/cudahook")


def test_unwritable_state_is_exit_5(root: Path, hooks: dict[str, Path], tmp_path: Path,
                                    sleeper: subprocess.Popen[bytes]) -> None:
    """A read-only or full filesystem: the record cannot be written."""
    containers = root / "run" / "cudahook" / "containers"
    containers.mkdir(parents=True, mode=0o700)
    os.chmod(root / "run" / "cudahook", 0o700)
    (containers / f"{gpu_key(tmp_path)}.json").mkdir()  # the rename onto it fails, as on a read-only mount
    r = run_hook(hooks, root, "createRuntime", gpu_state(tmp_path, sleeper.pid))
    one_line_error(r, 5, "")


def test_symlinked_lock_file_is_refused(root: Path, hooks: dict[str, Path], tmp_path: Path,
                                        sleeper: subprocess.Popen[bytes]) -> None:
    containers = root / "run" / "cudahook" / "containers"
    containers.mkdir(parents=True, mode=0o700)
    os.chmod(root / "run" / "cudahook", 0o700)
    target = tmp_path / "elsewhere"
    target.write_text("")
    (containers / f"{gpu_key(tmp_path)}.lock").symlink_to(target)
    one_line_error(run_hook(hooks, root, "createRuntime", gpu_state(tmp_path, sleeper.pid)), 5,
                   f"{gpu_key(tmp_path)}.lock")


@pytest.mark.parametrize("content", ["dir", "[1, 2]", '{"pid": "x", "restores": "many", '
                                     '"options": [1], "visible": 7, "snapshot_control": 5}',
                                     "[" * 100_000, "symlink"])
def test_damaged_record_is_replaced_not_a_traceback(root: Path, hooks: dict[str, Path],
                                                    tmp_path: Path,
                                                    sleeper: subprocess.Popen[bytes],
                                                    content: str) -> None:
    containers = root / "run" / "cudahook" / "containers"
    containers.mkdir(parents=True, mode=0o700)
    os.chmod(root / "run" / "cudahook", 0o700)
    path = containers / f"{gpu_key(tmp_path)}.json"
    if content == "dir":
        path.mkdir()
    elif content == "symlink":
        other = tmp_path / "other.json"
        other.write_text(json.dumps({"id": "c", "pid": 77, "secret": "from elsewhere"}))
        path.symlink_to(other)
    else:
        path.write_text(content)
    r = run_hook(hooks, root, "createRuntime", gpu_state(tmp_path, sleeper.pid))
    if content == "dir":
        one_line_error(r, 5, "")
        return
    assert r.returncode == 0, r.stderr
    rec = record(root, "c")
    assert rec is not None and rec["pid"] == sleeper.pid and "secret" not in rec
    assert "restores" not in rec or rec["restores"] == 1
    r = run_hook(hooks, root, "poststop", gpu_state(tmp_path, sleeper.pid))
    assert (r.returncode, r.stderr) == (0, b"")
    assert record(root, "c") is None


def test_annotation_key_with_a_newline_is_escaped(root: Path, hooks: dict[str, Path],
                                                  tmp_path: Path,
                                                  sleeper: subprocess.Popen[bytes]) -> None:
    b = bundle(tmp_path, "b", {"annotations": {"cudahook.io/x\nINJECTED line": "1"},
                               "process": {"env": ["NVIDIA_VISIBLE_DEVICES=all"]}})
    err = one_line_error(run_hook(hooks, root, "createRuntime", state("c", b, sleeper.pid)), 2,
                         "unknown annotation")
    assert "x\\nINJECTED" in err


def test_one_line_escapes_and_cuts() -> None:
    assert one_line("a\nb\rc\x00d\u2028e") == "a\\nb\\rc\\x00d\\u2028e"
    assert one_line("x" * 50, limit=10) == "x" * 10 + "..."


def test_criuhook_internal_errors_are_one_line(root: Path, hooks: dict[str, Path],
                                               sleeper: subprocess.Popen[bytes]) -> None:
    """A run's progress file of the wrong shape is no progress, not a traceback."""
    runs = root / "run" / "cudahook" / "runs"
    runs.mkdir(parents=True, mode=0o700)
    os.chmod(root / "run" / "cudahook", 0o700)
    from cudahook.platform.host import Host

    key = f"{os.getpid()}-{Host().start_time(os.getpid())}"
    for content in ("[1]", '{"done": [1]}', '{"done": {"pre-dump": "x"}}'):
        (runs / f"{key}.json").write_text(content)
        r = subprocess.run([sys.executable, "-I", "-c", "import sys; from cudahook.hooks.criu_action "
                            "import main; sys.exit(main())"], capture_output=True, timeout=60,
                           env=env_of(root, CRTOOLS_SCRIPT_ACTION="pre-dump",
                                      CRTOOLS_INIT_PID=str(sleeper.pid)))
        assert (r.returncode, r.stderr) == (0, b""), content


# -- 8: bounded lock waits --------------------------------------------------------------------


HOLDER = """
import fcntl, os, sys, time
fd = os.open(sys.argv[1], os.O_RDWR | os.O_CREAT, 0o600)
fcntl.flock(fd, fcntl.LOCK_EX)
print("held", flush=True)
time.sleep(60)
"""


@pytest.fixture
def held_lock(root: Path) -> Iterator[Store]:
    s = Store(root / "run" / "cudahook")
    path = s._dir("containers") / "c.lock"
    p = subprocess.Popen([sys.executable, "-c", HOLDER, str(path)], stdout=subprocess.PIPE)
    assert p.stdout is not None and p.stdout.readline() == b"held\n"
    yield s
    p.kill()
    p.wait()


def test_lock_wait_is_bounded(held_lock: Store) -> None:
    t0 = time.monotonic()
    with pytest.raises(StateError, match="held by another cudahook process"), \
            held_lock.locked("c", timeout_s=0.3):
        pass
    assert 0.3 <= time.monotonic() - t0 < 2


def test_history_gives_up_quickly_on_a_held_lock(held_lock: Store) -> None:
    """remember() runs between a CUDA checkpoint and CRIU's dump: it must
    not keep a checkpointed workload waiting."""
    t0 = time.monotonic()
    with pytest.raises(StateError):
        held_lock.remember("c", "checkpoint", {"ok": True})
    assert time.monotonic() - t0 < 2


def test_lock_is_taken_when_free(root: Path) -> None:
    s = Store(root / "run" / "cudahook")
    with s.locked("c", timeout_s=0.1):
        fd = os.open(s.root / "containers" / "c.lock", os.O_RDWR)
        with pytest.raises(BlockingIOError):
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        os.close(fd)


# -- 10: housekeeping -----------------------------------------------------------------------


def test_stale_restore_marks_are_pruned(root: Path) -> None:
    marks.mark("restore", str(os.getpid()))
    marks.mark("restore", str(dead_pid()))
    marks.prune_restore_marks()
    assert os.listdir(marks.marks_dir() / "restore") == [str(os.getpid())]


def test_no_gpu_mark_no_record(root: Path, hooks: dict[str, Path], tmp_path: Path,
                               sleeper: subprocess.Popen[bytes]) -> None:
    """Without its mark poststop's shell would skip Python and the record
    would stay forever: a create that cannot leave the mark records nothing."""
    (root / "run").mkdir(exist_ok=True)
    (root / "run" / "cudahook-marks").write_text("in the way")
    r = run_hook(hooks, root, "createRuntime", gpu_state(tmp_path, sleeper.pid))
    one_line_error(r, 5, "cudahook-marks")
    assert record(root, "c") is None


def test_second_call_of_a_failed_action_says_so_in_one_line(root: Path,
                                                            sleeper: subprocess.Popen[bytes]) -> None:
    """CRIU runs each action twice; the second call returns the first one's
    failure, and a failure is never silent."""
    runs = root / "run" / "cudahook" / "runs"
    runs.mkdir(parents=True, mode=0o700)
    os.chmod(root / "run" / "cudahook", 0o700)
    from cudahook.platform.host import Host

    key = f"{os.getpid()}-{Host().start_time(os.getpid())}"
    (runs / f"{key}.json").write_text('{"done": {"pre-dump": 1}}')
    r = subprocess.run([sys.executable, "-I", "-c", "import sys; from cudahook.hooks.criu_action "
                        "import main; sys.exit(main())"], capture_output=True, timeout=60,
                       env=env_of(root, CRTOOLS_SCRIPT_ACTION="pre-dump",
                                  CRTOOLS_INIT_PID=str(sleeper.pid)))
    one_line_error(r, 1, "failed earlier in this CRIU run")
