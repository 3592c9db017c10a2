"""The OCI hook as a runtime runs it: the installed script, the state on stdin,
a scrubbed environment. The hook calls no GPU tool, so the node's settings are
used without starting its GPU service."""

from __future__ import annotations

import json
import os
import socket
import stat
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

from cudahook.admin import hookfiles
from cudahook.platform.host import Host
from cudahook.sim.lab import SimLab

U0 = "GPU-11111111-2222-3333-4444-555555555555"
SCRUBBED = {"PATH": "/usr/sbin:/usr/bin:/sbin:/bin"}


class Hook:
    def __init__(self, tmp: Path):
        self.tmp = tmp
        settings = SimLab(tmp / "node").settings()
        self.state_dir = Path(settings.state_dir)
        self.log_file = Path(settings.log_file)
        self.config = tmp / "cudahook config.yaml"  # a space: the script must quote it
        self.config.write_text(yaml.safe_dump(dict(settings.__dict__)))
        self.path = hookfiles.install(tmp / "hooks", config=str(self.config))["cudahook-oci-hook"]
        self.sleepers: list[subprocess.Popen[bytes]] = []

    def run(self, *args: str, state: Any = None) -> subprocess.CompletedProcess[bytes]:
        data = state if isinstance(state, bytes) else (
            state.encode() if isinstance(state, str) else json.dumps(state).encode())
        return subprocess.run([str(self.path), *args], input=data, env=SCRUBBED,
                              capture_output=True, timeout=30)

    def bundle(self, name: str, env: list[str] = (), annotations: dict[str, str] | None = None,
               mounts: list[dict[str, Any]] = (), devices: list[dict[str, Any]] = ()) -> str:
        d = self.tmp / "bundles" / name
        d.mkdir(parents=True)
        cfg = {"ociVersion": "1.2.0", "root": {"path": "rootfs"},
               "process": {"args": ["sh"], "env": ["PATH=/bin", *env]},
               "annotations": annotations or {}, "mounts": list(mounts),
               "linux": {"devices": list(devices)}}
        (d / "config.json").write_text(json.dumps(cfg))
        return str(d)

    def init(self) -> int:
        """A live process standing in for the container's init."""
        p = subprocess.Popen(["sleep", "60"])
        self.sleepers.append(p)
        return p.pid

    def state(self, cid: str, bundle: str, pid: int | None = None, **extra: Any) -> dict[str, Any]:
        st = {"ociVersion": "1.2.0", "id": cid, "status": "creating", "bundle": bundle,
              "annotations": {}, **extra}
        if pid is not None:
            st["pid"] = pid
        return st

    def record(self, cid: str) -> dict[str, Any] | None:
        p = self.state_dir / "containers" / f"{cid}.json"
        return json.loads(p.read_text()) if p.exists() else None

    def events(self) -> list[dict[str, Any]]:
        if not self.log_file.exists():
            return []
        return [json.loads(x) for x in self.log_file.read_text().splitlines()]

    def close(self) -> None:
        for p in self.sleepers:
            p.kill()
            p.wait()


@pytest.fixture
def hook(tmp_path: Path) -> Iterator[Hook]:
    h = Hook(tmp_path)
    yield h
    h.close()


def one_line_error(r: subprocess.CompletedProcess[bytes], code: int, text: str) -> str:
    err = r.stderr.decode()
    assert r.returncode == code, (r.returncode, err)
    assert err.count("\n") == 1 and err.startswith("cudahook: "), err
    assert "Traceback" not in err
    assert text in err, err
    return err


def gpu_bundle(hook: Hook, name: str = "b", **kw: Any) -> str:
    return hook.bundle(name, env=[f"NVIDIA_VISIBLE_DEVICES={U0}"], **kw)


# -- arguments and input ---------------------------------------------------------------


@pytest.mark.parametrize("args", [[], ["frobnicate"], ["createRuntime", "poststop"], ["CREATERUNTIME"]])
def test_bad_stage_exits_2(hook: Hook, args: list[str]) -> None:
    one_line_error(hook.run(*args, state={}), 2, "usage: cudahook-oci-hook")


@pytest.mark.parametrize("data, text", [
    (b"", "not JSON"),
    (b"not json", "not JSON"),
    (b"\xff\xfe\x00garbage", "not JSON"),
    (b"[" * 300_000, "not JSON"),
    (b"[]", "not a JSON object"),
    (b'{"id": "x"}', "'bundle'"),
    (b'{"id": "x", "bundle": "/b", "p": "' + b"x" * (1 << 20) + b'"}', "too large"),
])
def test_bad_stdin_exits_2_one_line(hook: Hook, data: bytes, text: str) -> None:
    for stage in ("createRuntime", "poststop"):
        one_line_error(hook.run(stage, state=data), 2, text)


def test_poststart_does_nothing(hook: Hook) -> None:
    r = hook.run("poststart", state=hook.state("c", "/nonexistent"))
    assert r.returncode == 0 and r.stderr == b""


# -- create: the fast path ---------------------------------------------------------------


def test_non_gpu_bundle_leaves_nothing(hook: Hook) -> None:
    b = hook.bundle("plain", devices=[{"path": "/dev/fuse", "type": "c"}])
    for stage in ("createRuntime", "prestart"):
        r = hook.run(stage, state=hook.state("plain", b, hook.init()))
        assert r.returncode == 0 and r.stderr == b"", r.stderr
    assert not (hook.state_dir / "containers").exists()
    assert hook.events() == []


def test_missing_config_json_stops_the_container(hook: Hook) -> None:
    one_line_error(hook.run("createRuntime", state=hook.state("c", str(hook.tmp / "gone"))), 2,
                   "config.json: no such file")


PROBE = """
import json, sys
from cudahook.hooks.oci_hook import main
rc = main(["createRuntime"])
heavy = sorted(m for m in sys.modules if m.split(".")[0] in ("jsonschema", "yaml", "referencing"))
print(json.dumps([rc, heavy]))
"""


def modules_after_create(hook: Hook, state: dict[str, Any]) -> tuple[int, list[str]]:
    r = subprocess.run([sys.executable, "-I", "-c", PROBE], input=json.dumps(state).encode(),
                       env={**SCRUBBED, "CUDAHOOK_CONFIG": str(hook.config)},
                       capture_output=True, timeout=30)
    assert r.returncode == 0, r.stderr
    rc, heavy = json.loads(r.stdout.splitlines()[-1])
    return rc, heavy


def test_fast_path_imports_no_yaml_or_jsonschema(hook: Hook) -> None:
    rc, heavy = modules_after_create(hook, hook.state("plain", hook.bundle("plain"), hook.init()))
    assert (rc, heavy) == (0, [])
    # The probe can see them: a GPU container's create does load both.
    rc, heavy = modules_after_create(hook, hook.state("g", gpu_bundle(hook), hook.init()))
    assert rc == 0
    assert "yaml" in heavy and "jsonschema" in heavy


# -- create: GPU containers -----------------------------------------------------------


def test_gpu_bundle_is_recorded(hook: Hook) -> None:
    ctl = hook.tmp / "ctl"
    b = gpu_bundle(hook, annotations={"cudahook.io/sequential": "true", "other": "x"},
                   mounts=[{"destination": "/snapshot-control", "source": str(ctl), "type": "bind"}])
    pid = hook.init()
    r = hook.run("createRuntime", state=hook.state("gpu-1", b, pid))
    assert r.returncode == 0, r.stderr
    rec = hook.record("gpu-1")
    assert rec is not None
    assert rec["id"] == "gpu-1" and rec["bundle"] == b and rec["status"] == "creating"
    assert rec["pid"] == pid and rec["pid_start"] == Host().start_time(pid)
    assert rec["visible"] == [U0]
    assert rec["options"] == {"sequential": "true"}
    assert rec["snapshot_control"] == str(ctl)
    assert "restores" not in rec
    path = hook.state_dir / "containers" / "gpu-1.json"
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    assert stat.S_IMODE(hook.state_dir.stat().st_mode) == 0o700
    assert [e["event"] for e in hook.events()] == ["oci-createRuntime"]
    assert hook.events()[0]["container"] == "gpu-1" and hook.events()[0]["pid"] == pid


@pytest.mark.parametrize("env, devices, annotations", [
    (["NVIDIA_VISIBLE_DEVICES=0"], [], {}),
    ([], [{"path": "/dev/nvidia1", "type": "c"}], {}),
    ([], [], {"cdi.k8s.io/gpu": "nvidia.com/gpu=0"}),
    ([], [], {"cudahook.io/enabled": "true"}),  # no GPU visible, but asked for
])
def test_ways_to_be_a_gpu_container(hook: Hook, env: list[str], devices: list[dict[str, Any]],
                                    annotations: dict[str, str]) -> None:
    b = hook.bundle("b", env=env, devices=devices, annotations=annotations)
    assert hook.run("createRuntime", state=hook.state("c", b, hook.init())).returncode == 0
    assert hook.record("c") is not None


def test_disabled_by_annotation(hook: Hook) -> None:
    b = gpu_bundle(hook, annotations={"cudahook.io/enabled": "false"})
    assert hook.run("createRuntime", state=hook.state("c", b, hook.init())).returncode == 0
    assert hook.record("c") is None


def test_restore_with_a_new_pid_counts_restores(hook: Hook) -> None:
    b = gpu_bundle(hook)
    first, second, third = hook.init(), hook.init(), hook.init()
    assert hook.run("createRuntime", state=hook.state("c", b, first)).returncode == 0
    created = hook.record("c")["created"]  # type: ignore[index]
    assert hook.run("prestart", state=hook.state("c", b, first)).returncode == 0  # same pid
    assert "restores" not in hook.record("c")  # type: ignore[operator]
    assert hook.run("createRuntime", state=hook.state("c", b, second)).returncode == 0
    rec = hook.record("c")
    assert rec is not None and rec["restores"] == 1 and rec["pid"] == second
    assert rec["pid_start"] == Host().start_time(second) and rec["created"] == created
    assert hook.run("createRuntime", state=hook.state("c", b, third)).returncode == 0
    assert hook.record("c")["restores"] == 2  # type: ignore[index]


@pytest.mark.parametrize("annotations, text", [
    ({"cudahook.io/lock-timeout-ms": "abc"}, "cudahook.io/lock-timeout-ms"),
    ({"cudahook.io/enabled": "yes"}, "cudahook.io/enabled"),
    ({"cudahook.io/lock-timout-ms": "5"}, "cudahook.io/lock-timout-ms"),
    ({"cudahook.io/device-map": "GPU-1=GPU-2"}, "cudahook.io/device-map"),
])
def test_invalid_annotation_stops_the_container(hook: Hook, annotations: dict[str, str],
                                                text: str) -> None:
    b = gpu_bundle(hook, annotations=annotations)
    one_line_error(hook.run("createRuntime", state=hook.state("c", b, hook.init())), 2, text)
    assert hook.record("c") is None
    # A container without GPUs runs as it would without cudahook: its
    # annotations are not read (test_trust_wrapper.py).
    b = hook.bundle("plain", annotations=annotations)
    r = hook.run("createRuntime", state=hook.state("d", b, hook.init()))
    assert (r.returncode, r.stderr) == (0, b"")
    assert hook.record("d") is None


def changed(st: dict[str, Any], change: dict[str, Any]) -> dict[str, Any]:
    for k, v in change.items():
        if v is None:
            del st[k]
        else:
            st[k] = v
    return st


@pytest.mark.parametrize("change", [
    {"ociVersion": None}, {"ociVersion": 1.2}, {"status": "paused"}, {"status": 7},
    {"annotations": {"a": 1}}, {"annotations": "x"}, {"extra": [1, {"deep": None}]},
])
def test_state_details_cudahook_does_not_use_never_stop_a_container(
        hook: Hook, change: dict[str, Any]) -> None:
    """Only the id, the bundle and the PID are checked: a runtime that
    writes a state the schema would quibble with still runs GPU containers."""
    st = changed(hook.state("c", gpu_bundle(hook), hook.init()), change)
    r = hook.run("createRuntime", state=st)
    assert r.returncode == 0 and r.stderr == b"", r.stderr
    rec = hook.record("c")
    assert rec is not None and rec["status"] in ("creating", "paused", None)


@pytest.mark.parametrize("pid", [-3, 1, "12", 1.5, True, 1 << 23, [7]])
def test_gpu_container_state_needs_a_pid_that_is_one(hook: Hook, pid: Any) -> None:
    st = changed(hook.state("c", gpu_bundle(hook), hook.init()), {"pid": pid})
    one_line_error(hook.run("createRuntime", state=st), 2, "is not a PID")
    assert hook.record("c") is None


def test_gpu_container_with_a_dead_init(hook: Hook) -> None:
    p = subprocess.Popen(["true"])
    p.wait()
    one_line_error(hook.run("createRuntime", state=hook.state("c", gpu_bundle(hook), p.pid)), 2,
                   "does not exist")
    assert hook.record("c") is None


@pytest.mark.parametrize("cid", ["../escape", "a/b", ".hidden"])
def test_bad_container_id(hook: Hook, cid: str) -> None:
    one_line_error(hook.run("createRuntime", state=hook.state(cid, gpu_bundle(hook), hook.init())),
                   2, "invalid container id")
    assert [p.name for p in hook.tmp.rglob("*.json")] == ["config.json"]  # only the bundle's
    assert not (hook.state_dir / "containers").exists()


# -- poststop -----------------------------------------------------------------------------


def sock(path: Path, held: list[socket.socket]) -> None:
    s = socket.socket(socket.AF_UNIX)
    held.append(s)
    dfd = os.open(path.parent, os.O_PATH | os.O_DIRECTORY)
    try:
        s.bind(f"/proc/self/fd/{dfd}/{path.name}")
    finally:
        os.close(dfd)


def test_poststop_forgets_the_container_and_only_its_own_sockets(hook: Hook) -> None:
    """The directory is shared with d: only the sockets recorded as c's go."""
    from cudahook.platform.store import Store

    ctl = hook.tmp / "ctl"
    ctl.mkdir()
    held: list[socket.socket] = []
    try:
        for n in (6, 7, 8):
            sock(ctl / f"cuda-vmm-{n}.sock", held)
        sock(ctl / "other.sock", held)
        (ctl / "cuda-vmm-9.sock").write_text("not a socket")
        (ctl / "data").write_text("keep")
        b = gpu_bundle(hook, mounts=[{"destination": "/snapshot-control", "source": str(ctl)}])
        assert hook.run("createRuntime", state=hook.state("c", b, hook.init())).returncode == 0
        assert hook.run("createRuntime", state=hook.state("d", b, hook.init())).returncode == 0
        ident = {n: [os.lstat(ctl / n).st_dev, os.lstat(ctl / n).st_ino]
                 for n in ("cuda-vmm-6.sock", "cuda-vmm-7.sock")}
        Store(hook.state_dir).update("c", vmm_sockets=ident)  # as c's pre-dump saw them
        held[0].listen(1)  # cuda-vmm-6.sock: since taken over by a live process
        st = hook.state("c", b, status="stopped")
        r = hook.run("poststop", state=st)
        assert r.returncode == 0, r.stderr
    finally:
        for s in held:
            s.close()
    assert sorted(os.listdir(ctl)) == ["cuda-vmm-6.sock", "cuda-vmm-8.sock", "cuda-vmm-9.sock",
                                       "data", "other.sock"]
    # c's record is gone, and its lock file with it (see Store.delete).
    assert sorted(os.listdir(hook.state_dir / "containers")) == ["d.json", "d.lock"]
    assert [e["event"] for e in hook.events()][-1] == "oci-poststop"
    assert hook.events()[-1]["container"] == "c"


def test_poststop_does_not_follow_a_symlinked_control_dir(hook: Hook) -> None:
    host = hook.tmp / "host-dir"
    host.mkdir()
    held: list[socket.socket] = []
    try:
        sock(host / "cuda-vmm-7.sock", held)
        link = hook.tmp / "ctl"
        link.symlink_to(host)
        b = gpu_bundle(hook, mounts=[{"destination": "/snapshot-control", "source": str(link)}])
        assert hook.run("createRuntime", state=hook.state("c", b, hook.init())).returncode == 0
        assert hook.run("poststop", state=hook.state("c", b)).returncode == 0
    finally:
        for s in held:
            s.close()
    assert os.listdir(host) == ["cuda-vmm-7.sock"]
    assert hook.record("c") is None


def test_poststop_of_an_unknown_container(hook: Hook) -> None:
    r = hook.run("poststop", state=hook.state("never-seen", str(hook.tmp / "gone")))
    assert r.returncode == 0 and r.stderr == b""
    assert hook.events() == []


def test_installed_script_carries_interpreter_and_config(hook: Hook) -> None:
    text = hook.path.read_text()
    assert f"PYTHON={sys.executable}" in text
    assert "CUDAHOOK_CONFIG='" in text and str(hook.config) in text
    assert os.access(hook.path, os.X_OK)
    assert not [p for p in hook.path.parent.iterdir() if p.name.startswith(".")]
