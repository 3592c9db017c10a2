"""The shell fast paths (hooks/cudahook-lib.sh), decided both ways on purpose.

"No GPU" in the shell skips Python, so it must imply "no GPU" in Python: a
property test holds config_may_want_gpu to oci_bundle.read_bundle on generated
config.json files. The action script's may_hold_gpu reads /proc and the
cgroup tree through CUDAHOOK_PROC_ROOT and CUDAHOOK_CGROUP_ROOT here, so the
"skip Python" answer comes from a container built for the test, not from the
cgroup the test runner happens to sit in.
"""

from __future__ import annotations

import json
import os
import random
import subprocess
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from cudahook.admin import hookfiles
from cudahook.flow import annotations as ann
from cudahook.flow import oci_bundle
from cudahook.hooks import oci_state
from cudahook.platform.errors import CudahookError

LIB = hookfiles.templates_dir() / hookfiles.LIB
SCRUBBED = {"PATH": "/usr/sbin:/usr/bin:/sbin:/bin"}
NO_PYTHON = "/nonexistent/python"  # a hook that starts Python exits 127


def test_markers_are_one_list() -> None:
    """The shell's grep and Python's GPU_MARKERS name the same strings."""
    text = LIB.read_text()
    for marker in oci_bundle.GPU_MARKERS:
        assert f"-e {marker}" in text
    assert f"CUDAHOOK_MAX_STATE={oci_state.MAX_STATE}" in text
    assert f"CUDAHOOK_MAX_CONFIG={oci_bundle.MAX_CONFIG}" in text


def test_installed_hooks_carry_the_library_inline(tmp_path: Path) -> None:
    paths = hookfiles.install(tmp_path / "hooks", python=NO_PYTHON)
    assert not (tmp_path / "hooks" / hookfiles.LIB).exists()
    for p in paths.values():
        text = p.read_text()
        assert hookfiles.SOURCE_LIB not in text and "config_may_want_gpu() {" in text


# -- config_may_want_gpu -----------------------------------------------------------------


def shell_says(bundles: list[Path]) -> list[bool]:
    """config_may_want_gpu for each bundle, in one shell run: True = "maybe"."""
    script = f'. "{LIB}"\nfor b in "$@"; do config_may_want_gpu "$b" && echo maybe || echo no; done'
    r = subprocess.run(["sh", "-c", script, "sh", *map(str, bundles)], capture_output=True,
                       text=True, timeout=60, env=SCRUBBED)
    assert r.returncode == 0, r.stderr
    return [w == "maybe" for w in r.stdout.split()]


def python_says(bundle: Path) -> bool | None:
    """True: the OCI hook goes on with this container (a GPU container, or
    one with cudahook's annotations); False: it leaves; None: it refuses."""
    try:
        info = oci_bundle.read_bundle(str(bundle))
    except CudahookError:
        return None
    return info.wants_gpu or bool(ann.ours(info.annotations))


def write(tmp: Path, name: str, raw: bytes) -> Path:
    d = tmp / name
    d.mkdir()
    (d / "config.json").write_bytes(raw)
    return d


@pytest.mark.parametrize("raw, maybe", [
    (b'{"process": {"env": ["PATH=/bin"]}}', False),
    (b'{"process": {"env": ["NVIDIA_VISIBLE_DEVICES=void"]}}', True),  # Python decides
    (b'{"process": {"args": ["sh", "-c", "a \\u0026\\u0026 b"]}}', True),
    (b'{"process": {"args": ["x\\/y"]}}', True),
    (b'{"process": {"args": ["say \\"hi\\"\\n"]}}', False),  # escapes that spell no marker
    (b'{"linux": {"devices": [{"path": "/dev/fuse"}]}}', False),
    (b'{"linux": {"devices": [{"path": "/dev/nvidia3"}]}}', True),
    (b'{"annotations": {"cdi.k8s.io/x": "nvidia.com/gpu=0"}}', True),
    (b'{"annotations": {"cudahook.io/enabled": "true"}}', True),
    (b"\x00\x01 binary", False),
])
def test_config_decisions_both_ways(tmp_path: Path, raw: bytes, maybe: bool) -> None:
    b = write(tmp_path, "b", raw)
    assert shell_says([b]) == [maybe]


@pytest.mark.parametrize("kind", ["missing", "directory", "fifo", "symlink", "huge"])
def test_config_that_is_no_plain_file_goes_to_python(tmp_path: Path, kind: str) -> None:
    b = tmp_path / "b"
    b.mkdir()
    p = b / "config.json"
    if kind == "directory":
        p.mkdir()
    elif kind == "fifo":
        os.mkfifo(p)
    elif kind == "symlink":
        (tmp_path / "plain.json").write_text("{}")
        p.symlink_to(tmp_path / "plain.json")
    elif kind == "huge":
        with open(p, "wb") as f:
            f.truncate(oci_bundle.MAX_CONFIG + 1)
    assert shell_says([b]) == [True]


def escaped(text: str, rnd: random.Random) -> str:
    """`text` as a JSON string, some characters escaped the ways JSON allows."""
    out = ['"']
    for c in text:
        roll = rnd.random()
        if ord(c) > 0xFFFF and roll < 0.15:  # a surrogate pair
            hi, lo = divmod(ord(c) - 0x10000, 0x400)
            out.append(f"\\u{0xD800 + hi:04x}\\u{0xDC00 + lo:04x}")
        elif c in '"\\' or ord(c) < 0x20 or (roll < 0.15 and ord(c) <= 0xFFFF):
            out.append(f"\\u{ord(c):04x}" if roll < 0.5 or c not in '"\\/' else "\\" + c)
        elif c == "/" and roll < 0.3:
            out.append("\\/")
        else:
            out.append(c)
    return "".join(out) + '"'


def dump(obj: Any, rnd: random.Random) -> str:
    ws = rnd.choice(["", " ", "\n", "\t", "\r\n "])
    if isinstance(obj, dict):
        items = [f"{ws}{escaped(str(k), rnd)}{ws}:{dump(v, rnd)}" for k, v in obj.items()]
        return "{" + ",".join(items) + ws + "}"
    if isinstance(obj, list):
        return "[" + ",".join(dump(v, rnd) for v in obj) + ws + "]"
    if isinstance(obj, str):
        return escaped(obj, rnd)
    return json.dumps(obj)


MARKERISH = st.sampled_from([
    "NVIDIA_VISIBLE_DEVICES=all", "NVIDIA_VISIBLE_DEVICES=0,1", "NVIDIA_VISIBLE_DEVICES=",
    "NVIDIA_VISIBLE_DEVICES=void", "NVIDIA_VISIBLE_DEVICES", "/dev/nvidia0", "/dev/nvidiactl",
    "/dev/nvidia-uvm", "nvidia.com/gpu=0", "nvidia.com/gpu=all", "vendor.com/x=1,nvidia.com/gpu=1",
    "cudahook.io/enabled", "cudahook.io/sequential", "cdi.k8s.io/gpu", "PATH=/bin", "/dev/fuse",
    "nvidia", "NVIDIA", "GPU-1", "x",
])
TEXT = st.one_of(MARKERISH, st.text(max_size=12), MARKERISH.map(lambda s: " " + s + " "))


@st.composite
def configs(draw: st.DrawFn) -> dict[str, Any]:
    cfg: dict[str, Any] = {}
    if draw(st.booleans()):
        cfg["process"] = {"env": draw(st.lists(TEXT, max_size=4)),
                          "args": draw(st.lists(TEXT, max_size=2))}
    if draw(st.booleans()):
        cfg["annotations"] = draw(st.dictionaries(TEXT, TEXT, max_size=3))
    if draw(st.booleans()):
        cfg["linux"] = {"devices": draw(st.lists(
            st.one_of(st.fixed_dictionaries({"path": TEXT}), TEXT), max_size=3))}
    if draw(st.booleans()):
        cfg["mounts"] = [{"destination": draw(TEXT), "source": draw(TEXT)}]
    return cfg


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.lists(st.tuples(configs(), st.randoms(use_true_random=False)), min_size=1, max_size=12))
def test_shell_never_says_no_where_python_says_gpu(tmp_path_factory: pytest.TempPathFactory,
                                                   cases: list[tuple[dict[str, Any],
                                                                     random.Random]]) -> None:
    tmp = tmp_path_factory.mktemp("cfg")
    bundles = [write(tmp, f"b{i}", dump(cfg, rnd).encode("utf-8", "surrogatepass"))
               for i, (cfg, rnd) in enumerate(cases)]
    for b, maybe in zip(bundles, shell_says(bundles), strict=True):
        if not maybe:
            assert python_says(b) is not True, (b / "config.json").read_bytes()


# -- the OCI hook and the runtime wrapper, installed -----------------------------------------


@pytest.fixture
def installed(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> dict[str, Path]:
    monkeypatch.setenv("CUDAHOOK_ROOT", str(tmp_path / "node"))
    return hookfiles.install(tmp_path / "hooks", python=NO_PYTHON)


def oci_hook(installed: dict[str, Path], stage: str, data: bytes) -> int:
    r = subprocess.run([str(installed["cudahook-oci-hook"]), stage], input=data,
                       env=SCRUBBED, capture_output=True, timeout=30)
    return r.returncode


@pytest.mark.parametrize("template, python", [
    ('{"id": "c", "bundle": "%s"}', False),
    ('{"ociVersion":"1.0.2","id":"c","status":"creating","pid":5,"bundle":"%s",'
     '"annotations":{"a":"b"}}', False),
    ('\n {\t"id" : "c" ,\n"bundle"\t:\t"%s" }\n', False),
    ('{"id": "c", "bundle": "%s", "bundle": "/elsewhere"}', True),  # JSON's last one wins
    ('{"annotations": {"bundle": "/x"}, "id": "c", "bundle": "%s"}', True),
    ('{"id": "c", "bundle": "%s", "x": "\\u0041"}', True),
    ('{"id": "c\r", "bundle": "%s"}', True),
    ('{"id": "../c", "bundle": "%s"}', True),
    ('{"id": "c", "bundle": "%s"', False),  # a runtime never sends this; a plain bundle anyway
    ('["id", "c", "bundle", "%s"]', True),
    ('{"x": "a\\"", "id": "c", "bundle": "%s"}', True),
])
def test_oci_hook_reads_fields_or_defers(installed: dict[str, Path], tmp_path: Path,
                                         template: str, python: bool) -> None:
    b = write(tmp_path, "plain", b'{"process": {"env": ["PATH=/bin"]}}')
    rc = oci_hook(installed, "createRuntime", (template % b).encode())
    assert rc == (127 if python else 0)


def test_oci_hook_gpu_bundle_and_poststop_marks(installed: dict[str, Path],
                                                tmp_path: Path) -> None:
    gpu = write(tmp_path, "gpu", b'{"process": {"env": ["NVIDIA_VISIBLE_DEVICES=all"]}}')
    data = json.dumps({"id": "c", "bundle": str(gpu)}).encode()
    assert oci_hook(installed, "createRuntime", data) == 127
    assert oci_hook(installed, "poststop", data) == 0  # no mark: no record to forget
    marks = tmp_path / "node" / "run" / "cudahook-marks" / "gpu"
    marks.mkdir(parents=True)
    (marks / "c").touch()
    assert oci_hook(installed, "poststop", data) == 127
    assert oci_hook(installed, "poststart", data) == 0


def test_runtime_wrapper_decisions(installed: dict[str, Path], tmp_path: Path) -> None:
    fake = tmp_path / "runc"
    fake.write_text("#!/bin/sh\nexit 42\n")
    fake.chmod(0o755)
    wrapper = hookfiles.install(tmp_path / "wrapped", python=NO_PYTHON,
                                runc=str(fake))["cudahook-runtime"]
    plain = write(tmp_path, "plain", b'{"process": {"env": ["PATH=/bin"]}}')
    gpu = write(tmp_path, "gpu", b'{"process": {"env": ["\\u004eVIDIA_VISIBLE_DEVICES=1"]}}')
    odd = tmp_path / "odd"
    odd.mkdir()
    os.mkfifo(odd / "config.json")

    def run(*args: str) -> int:
        return subprocess.run([str(wrapper), *args], env=SCRUBBED, capture_output=True,
                              timeout=30).returncode

    assert run("create", "--bundle", str(plain), "c") == 42  # straight to runc
    assert run("state", "c") == 42
    assert run("create", "--bundle", str(gpu), "c") == 127  # Python adds the hooks
    assert run("create", f"--bundle={odd}", "c") == 127  # Python refuses it, in one line


# -- may_hold_gpu (the action script's pre-dump) -------------------------------------------


class FakeNode:
    """A /proc and a cgroup tree of the test's own, for one container."""

    def __init__(self, tmp: Path, init: int = 4242):
        self.proc = tmp / "proc"
        self.cgroup = tmp / "cgroup"
        self.init = init
        self.dev = tmp / "nodes"
        self.dev.mkdir(parents=True)
        (self.dev / "nvidia0").write_text("")  # stands in for the device node
        (self.dev / "null").write_text("")

    def process(self, pid: int, cgroup: str = "/ctr", fds: tuple[str, ...] = ("null",)) -> None:
        p = self.proc / str(pid)
        (p / "fd").mkdir(parents=True)
        (p / "root" / "dev").mkdir(parents=True)
        (p / "root" / "dev" / "nvidia0").symlink_to(self.dev / "nvidia0")
        (p / "cgroup").write_text(f"0::{cgroup}\n")
        for i, name in enumerate(fds):
            (p / "fd" / str(i)).symlink_to(self.dev / name)
        procs = self.cgroup / cgroup.lstrip("/") / "cgroup.procs"
        procs.parent.mkdir(parents=True, exist_ok=True)
        with open(procs, "a") as f:
            f.write(f"{pid}\n")

    def pre_dump(self, script: Path, config: Path | None = None) -> int:
        env = {**SCRUBBED, "CUDAHOOK_PROC_ROOT": str(self.proc),
               "CUDAHOOK_CGROUP_ROOT": str(self.cgroup), "CRTOOLS_SCRIPT_ACTION": "pre-dump",
               "CRTOOLS_INIT_PID": str(self.init)}
        if config is not None:
            env["CUDAHOOK_CONFIG"] = str(config)
        return subprocess.run([str(script)], env=env, capture_output=True,
                              timeout=30).returncode


@pytest.fixture
def fake(tmp_path: Path) -> FakeNode:
    return FakeNode(tmp_path / "fake")


def test_may_hold_gpu_no_device_skips_python(installed: dict[str, Path], fake: FakeNode) -> None:
    fake.process(fake.init)
    fake.process(4243)
    assert fake.pre_dump(installed["cudahook-criu-action"]) == 0


@pytest.mark.parametrize("case", ["device-fd-in-init", "device-fd-in-child", "init-elsewhere",
                                  "nested-cgroup", "root-cgroup", "no-proc-entry"])
def test_may_hold_gpu_maybe_starts_python(installed: dict[str, Path], fake: FakeNode,
                                          case: str) -> None:
    if case == "device-fd-in-init":
        fake.process(fake.init, fds=("null", "nvidia0"))
    elif case == "device-fd-in-child":
        fake.process(fake.init)
        fake.process(4243, fds=("nvidia0",))
    elif case == "init-elsewhere":
        fake.process(fake.init)
        procs = fake.cgroup / "ctr" / "cgroup.procs"
        procs.write_text("4243\n")
        fake.process(4243)
        procs.write_text("4243\n")
    elif case == "nested-cgroup":
        fake.process(fake.init)
        (fake.cgroup / "ctr" / "sub").mkdir()
    elif case == "root-cgroup":
        fake.process(fake.init, cgroup="/")
    assert fake.pre_dump(installed["cudahook-criu-action"]) == 127


def test_may_hold_gpu_defers_to_a_configured_device_pattern(installed: dict[str, Path],
                                                            fake: FakeNode, tmp_path: Path) -> None:
    fake.process(fake.init)
    config = tmp_path / "config.yaml"
    config.write_text("sequential: true\n")
    assert fake.pre_dump(installed["cudahook-criu-action"], config) == 0
    config.write_text("device_pattern: '^/dev/dri/.*'\n")
    assert fake.pre_dump(installed["cudahook-criu-action"], config) == 127
    config.write_text("  device_pattern: x\n")  # a key, whatever the indent
    assert fake.pre_dump(installed["cudahook-criu-action"], config) == 127
    config.write_text("x: 'a\\u0064evice_pattern'\n")  # an escape could spell anything
    assert fake.pre_dump(installed["cudahook-criu-action"], config) == 127
    config.write_text("x\n" * 500)  # longer than the shell reads
    assert fake.pre_dump(installed["cudahook-criu-action"], config) == 127


def test_the_shipped_configuration_keeps_pre_dump_in_the_shell(
        installed: dict[str, Path], fake: FakeNode) -> None:
    """The default configuration names device_pattern only in a comment: a
    container without NVIDIA device files costs no Python start at pre-dump."""
    from cudahook.platform.config import config_dir

    fake.process(fake.init)
    assert fake.pre_dump(installed["cudahook-criu-action"], config_dir() / "config.yaml") == 0


def test_pre_dump_odd_init_pid_goes_to_python(installed: dict[str, Path], fake: FakeNode) -> None:
    for pid in ("", "0", "1", "007", "12345678", "x"):
        fake.init = pid  # type: ignore[assignment]
        assert fake.pre_dump(installed["cudahook-criu-action"]) == 127, pid

