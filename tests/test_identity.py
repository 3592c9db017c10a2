"""A container's state is keyed on its identity on the node, not on its id:
two containers of one id (two runc roots, containerd namespaces, podman
storages) have a record, a lock, a mark entry and a CRIU copy each, and the
poststop of one leaves the other's.

Through the hooks' own entry points as the runtimes call them (the OCI hook
reading the state on stdin, the runtime wrapper editing a bundle), with real
processes as the containers' inits."""

from __future__ import annotations

import hashlib
import io
import json
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
import yaml

from cudahook.flow.registration import add_hooks
from cudahook.hooks import oci_hook
from cudahook.platform import criuconf, paths
from cudahook.platform.errors import UsageError
from cudahook.platform.marks import mark
from cudahook.platform.store import Store, container_key

ACTION = "/opt/h/cudahook-criu-action"


@pytest.fixture
def node(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Path]:
    """A node root registered gpu-only; its state directory."""
    root = tmp_path / "root"
    (root / "etc/criu").mkdir(parents=True)
    (root / "etc/criu/runc.conf").write_text("tcp-established\n"
                                            + criuconf.gpu_only_line(ACTION) + "\n")
    cfg = tmp_path / "cfg.yaml"
    cfg.write_text(yaml.safe_dump({"state_dir": str(tmp_path / "state"),
                                   "log_file": str(tmp_path / "cudahook.log")}))
    monkeypatch.setenv("CUDAHOOK_ROOT", str(root))
    monkeypatch.setenv("CUDAHOOK_CONFIG", str(cfg))
    yield tmp_path / "state"


@pytest.fixture
def inits() -> Iterator[list[subprocess.Popen[bytes]]]:
    procs: list[subprocess.Popen[bytes]] = []
    yield procs
    for p in procs:
        p.kill()
        p.wait()


def gpu_bundle(where: Path, annotations: dict[str, str] | None = None) -> Path:
    where.mkdir(parents=True)
    (where / "config.json").write_text(json.dumps({
        "ociVersion": "1.0.2", "root": {"path": "rootfs"},
        "process": {"args": ["sh"], "env": ["NVIDIA_VISIBLE_DEVICES=0"]},
        "annotations": annotations or {}}))
    return where


def oci(stage: str, state: dict[str, object], monkeypatch: pytest.MonkeyPatch) -> int:
    monkeypatch.setattr(sys, "stdin", io.TextIOWrapper(io.BytesIO(json.dumps(state).encode())))
    return oci_hook.main([stage])


def create(cid: str, bundle: Path, inits: list[subprocess.Popen[bytes]],
           monkeypatch: pytest.MonkeyPatch) -> dict[str, object]:
    """What runc does: the wrapper edits the bundle, createRuntime records it."""
    assert add_hooks(str(bundle), "/opt/h/cudahook-oci-hook", cid)
    init = subprocess.Popen(["sleep", "600"], stdin=subprocess.DEVNULL)
    inits.append(init)
    state = {"ociVersion": "1.0.2", "id": cid, "status": "created", "pid": init.pid,
             "bundle": str(bundle)}
    assert oci("createRuntime", state, monkeypatch) == 0
    return state


def criu_config(bundle: Path) -> Path:
    return Path(json.loads((bundle / "config.json").read_text())["annotations"][criuconf.ANNOTATION])


def test_container_key_is_the_id_and_where_its_bundle_really_is(tmp_path: Path) -> None:
    a, b = tmp_path / "a", tmp_path / "b"
    a.mkdir()
    b.mkdir()
    (tmp_path / "link").symlink_to(a)
    key = container_key("web", str(a))
    assert key == "web@" + hashlib.sha256(f"web\0{a.resolve()}".encode()).hexdigest()[:16]
    assert key != container_key("web", str(b))
    assert key != container_key("web2", str(a))
    # runc reports its working directory, maybe through a symlink (its $PWD).
    assert container_key("web", str(tmp_path / "link")) == key
    assert container_key("web", f"{a}/") == key
    long = container_key("x" * 250, str(a))
    assert len(long) + len(".json") <= 255 and long != container_key("x" * 249 + "y", str(a))
    for bad_id, bad_bundle in (("../x", str(a)), ("a\n", str(a)), ("web", ""), ("web", "a\0b")):
        with pytest.raises(UsageError):
            container_key(bad_id, bad_bundle)


def test_two_containers_of_one_id_keep_their_own_state(
        node: Path, tmp_path: Path, inits: list[subprocess.Popen[bytes]],
        monkeypatch: pytest.MonkeyPatch) -> None:
    # The second one names its own CRIU configuration (one of the operator's,
    # in /etc/criu): its copy holds its options.
    own = paths.at("/etc/criu/own.conf")
    own.write_text("ghost-limit 2M\n")
    ba = gpu_bundle(tmp_path / "root-a" / "web")
    bb = gpu_bundle(tmp_path / "root-b" / "web", {criuconf.ANNOTATION: str(own)})
    sa = create("web", ba, inits, monkeypatch)
    sb = create("web", bb, inits, monkeypatch)
    store = Store(node)
    recs = {r["bundle"]: r for r in store.records()}
    assert set(recs) == {str(ba), str(bb)} and {r["id"] for r in recs.values()} == {"web"}
    assert recs[str(ba)]["pid"] == sa["pid"] and recs[str(bb)]["pid"] == sb["pid"]
    ca, cb = criu_config(ba), criu_config(bb)
    assert ca != cb and ca.parent == cb.parent == node / "criu"
    assert "ghost-limit" not in ca.read_text() and f"action-script {ACTION}" in ca.read_text()
    assert cb.read_text().splitlines()[0] == "ghost-limit 2M"
    assert f"action-script {ACTION}" in cb.read_text()
    mark = paths.at(paths.MARKS_DIR) / "gpu" / "web"
    assert mark.exists()

    # a's poststop: a's record and copy go; b's stay, and so does the mark
    # the shell tests before it starts Python for b's poststop.
    assert oci("poststop", {**sa, "status": "stopped"}, monkeypatch) == 0
    assert [r["bundle"] for r in store.records()] == [str(bb)]
    assert not ca.exists() and cb.exists()
    assert mark.exists()
    assert oci("poststop", {**sb, "status": "stopped"}, monkeypatch) == 0
    assert store.records() == [] and not cb.exists() and not mark.exists()


def test_a_record_from_before_keys_is_forgotten_by_its_own_container_only(
        node: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    ba = gpu_bundle(tmp_path / "a")
    bb = gpu_bundle(tmp_path / "b")
    store = Store(node)
    store.update("web", bundle=str(ba), pid=None)  # as written before keys: named by the id
    mark("gpu", "web")
    criuconf.write(node, "web", "x\n")
    # Another container of that id (another root) stops: the old record is not its.
    state = {"ociVersion": "1.0.2", "id": "web", "status": "stopped", "bundle": str(bb)}
    assert oci("poststop", state, monkeypatch) == 0
    assert store.load("web") is not None and criuconf.conf_path(node, "web").exists()
    assert paths.at(paths.MARKS_DIR).joinpath("gpu", "web").exists()
    # Its own container stops: record, copy and mark go.
    assert oci("poststop", {**state, "bundle": str(ba)}, monkeypatch) == 0
    assert store.load("web") is None and not criuconf.conf_path(node, "web").exists()
    assert not paths.at(paths.MARKS_DIR).joinpath("gpu", "web").exists()


def test_the_action_script_finds_each_containers_own_record(
        node: Path, tmp_path: Path, inits: list[subprocess.Popen[bytes]],
        monkeypatch: pytest.MonkeyPatch) -> None:
    """CRIU names the init: each one's record, with the key its lock and
    guardian marker are named by."""
    from cudahook.flow.containers import container_for, lock_key
    from cudahook.flow.context import Context
    from cudahook.platform import config

    ba = gpu_bundle(tmp_path / "a")
    bb = gpu_bundle(tmp_path / "b")
    sa = create("web", ba, inits, monkeypatch)
    sb = create("web", bb, inits, monkeypatch)
    ctx = Context(config.load())
    keys = set()
    for state, bundle in ((sa, ba), (sb, bb)):
        pid = state["pid"]
        assert isinstance(pid, int)
        record, _, _ = container_for(ctx, pid)
        assert record is not None and record["bundle"] == str(bundle)
        keys.add(lock_key(ctx, record, pid))
    assert keys == {container_key("web", str(ba)), container_key("web", str(bb))}
    assert os.path.isdir(node / "containers")
