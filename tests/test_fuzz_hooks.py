"""Fuzzing both hooks' inputs: the OCI hook's stage, state on stdin, the
bundle's config.json and its annotations; the action script's environment,
the image's manifest and cuda-vmm.state; and the state directory's records,
locks and progress files, damaged.

For every input: the exit code is a documented one, nothing escapes as a
traceback, a failure is exactly one line on stderr (a success prints
nothing), the call ends in bounded time under an address-space limit, no
signal goes to a process that is not the container's, and nothing is
written outside the state directory, the marks directory and the log.

Most examples run in-process in one worker (tests/fuzz_worker.py); a few
hundred go through the installed shell hooks as the runtimes and CRIU start them.
"""

from __future__ import annotations

import base64
import contextlib
import json
import os
import resource
import shutil
import signal
import stat
import subprocess
import sys
import time
import unicodedata
from collections import Counter, defaultdict
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st

from cudahook.admin import hookfiles
from cudahook.core import manifest
from cudahook.flow import oci_bundle
from cudahook.hooks import oci_state
from cudahook.hooks.criu_env import PID_MAX_LIMIT
from cudahook.platform.host import Host
from cudahook.vmm import coordinator as vmm

from .fuzz_worker import HANG_S, MEMORY_LIMIT, Worker, assert_bounded, new_root

EXITS = {0, 1, 2, 3, 4, 5, 6}
SCRUBBED = {"PATH": "/usr/sbin:/usr/bin:/sbin:/bin"}
# Written by cudahook, relative to the node root; everything else must stay as it was.
ALLOWED = ("run/cudahook", "run/cudahook-marks", "var/log/cudahook.log")
U0 = "GPU-11111111-2222-3333-4444-555555555555"


def fuzz(env: str, default: int) -> settings:
    """Hypothesis settings for `default` examples ($CUDAHOOK_FUZZ_* overrides).

    No shrinking unless $CUDAHOOK_FUZZ_SHRINK is set: a failing case is
    printed whole, and a hang found in CI costs one deadline, not one per
    shrinking step."""
    phases = list(Phase) if os.environ.get("CUDAHOOK_FUZZ_SHRINK") else [
        Phase.explicit, Phase.generate]
    return settings(max_examples=int(os.environ.get(env, default)), deadline=None,
                    database=None, phases=phases,
                    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large,
                                           HealthCheck.function_scoped_fixture])


# -- what the run did, per surface: printed at the end of the session ---------------------------


STATS: dict[str, Counter[str]] = defaultdict(Counter)
DURATIONS: dict[str, float] = {}


def tally(surface: str, result: dict[str, Any]) -> None:
    """Count one example of `surface` by its outcome."""
    if result.get("hang"):
        outcome = "hang"
    elif result.get("raised"):
        outcome = "traceback"
    else:
        outcome = f"exit {result.get('rc')}"
    STATS[surface][outcome] += 1
    STATS[surface]["examples"] += 1


EXPLORE = os.environ.get("CUDAHOOK_FUZZ_EXPLORE")


@contextlib.contextmanager
def verdict(surface: str) -> Iterator[None]:
    """The checks of one example of `surface`. With $CUDAHOOK_FUZZ_EXPLORE
    (a file), a failed check is appended there and the run goes on: how a
    fuzzing session collects every distinct finding, not only the first."""
    try:
        yield
    except AssertionError as exc:
        STATS[surface]["failed"] += 1
        if not EXPLORE:
            raise
        with open(EXPLORE, "a") as f:
            f.write(json.dumps({"surface": surface, "failure": str(exc)[:4000]}) + "\n")


class FuzzSummary:
    """Examples and outcomes per surface, and each fuzz test's time, in the
    terminal summary (with or without -s) and in $CUDAHOOK_FUZZ_REPORT."""

    def pytest_runtest_logreport(self, report: pytest.TestReport) -> None:
        if report.when == "call" and "fuzz" in report.nodeid:
            DURATIONS[report.nodeid] = report.duration

    def pytest_terminal_summary(self, terminalreporter: Any) -> None:
        if not STATS:
            return
        terminalreporter.section("cudahook fuzz: examples per surface")
        for surface, counts in sorted(STATS.items()):
            outcomes = ", ".join(f"{k}: {v}" for k, v in sorted(counts.items())
                                 if k != "examples")
            terminalreporter.write_line(f"{surface}: {counts['examples']} examples ({outcomes})")
        for nodeid, seconds in sorted(DURATIONS.items()):
            terminalreporter.write_line(f"{nodeid}: {seconds:.1f}s")
        out = os.environ.get("CUDAHOOK_FUZZ_REPORT")
        if out:
            Path(out).write_text(json.dumps({"surfaces": STATS, "seconds": DURATIONS}, indent=1))


@pytest.fixture(scope="session", autouse=True)
def fuzz_summary(request: pytest.FixtureRequest) -> None:
    manager = request.config.pluginmanager
    if not manager.has_plugin("cudahook-fuzz-summary"):
        plugin = FuzzSummary()
        manager.register(plugin, "cudahook-fuzz-summary")


# -- the harness ------------------------------------------------------------------------------


class Sleeper:
    """A live process standing in for a container's init; respawned if a
    case killed it (a failed restore kills the container, as it should)."""

    def __init__(self) -> None:
        self.proc = self._spawn()

    @staticmethod
    def _spawn() -> subprocess.Popen[bytes]:
        return subprocess.Popen(["sleep", "3600"], start_new_session=True)

    @property
    def pid(self) -> int:
        if self.proc.poll() is not None:
            self.proc = self._spawn()
        return self.proc.pid

    def close(self) -> None:
        self.proc.kill()
        self.proc.wait()


@pytest.fixture(scope="module")
def worker() -> Iterator[Worker]:
    w = Worker()
    yield w
    w.close()


@pytest.fixture(scope="module")
def sleeper() -> Iterator[Sleeper]:
    s = Sleeper()
    yield s
    s.close()


@pytest.fixture(scope="module")
def dead() -> int:
    p = subprocess.Popen(["true"])
    p.wait()
    return p.pid


@pytest.fixture(scope="module")
def base(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("fuzz")


def snapshot(root: Path, allowed: tuple[str, ...] = ALLOWED) -> dict[str, tuple[Any, ...]]:
    """Every path under root outside `allowed`, as lstat sees it."""
    seen: dict[str, tuple[Any, ...]] = {}
    for dirpath, dirs, files in os.walk(root):
        for name in dirs + files:
            p = Path(dirpath, name)
            rel = str(p.relative_to(root))
            if any(rel == a or rel.startswith(a + "/") for a in allowed):
                continue
            st_ = p.lstat()
            kind = stat.S_IFMT(st_.st_mode)
            if stat.S_ISDIR(st_.st_mode):
                seen[rel] = (kind, stat.S_IMODE(st_.st_mode))
            elif stat.S_ISLNK(st_.st_mode):
                seen[rel] = (kind, os.readlink(p))
            else:
                seen[rel] = (kind, st_.st_size, st_.st_mtime_ns, stat.S_IMODE(st_.st_mode))
    return seen


# Never on a terminal from cudahook: C0/C1 controls, format characters (bidi
# overrides), line and paragraph separators, lone surrogates. "\n" ends a line.
UNSAFE_CATEGORIES = {"Cc", "Cf", "Zl", "Zp", "Cs"}


def unsafe_chars(text: str) -> list[str]:
    return [repr(c) for c in text if c != "\n" and unicodedata.category(c) in UNSAFE_CATEGORIES]


def check(result: dict[str, Any], case: str) -> None:
    assert_bounded(result, case)
    rc, err = result["rc"], result["stderr"]
    assert rc in EXITS, (rc, err, case)
    assert "Traceback" not in err and "MemoryError" not in err, (err, case)
    if rc == 0:
        assert err == "", (err, case)
    else:
        assert err.count("\n") == 1 and err.endswith("\n") and err.startswith("cudahook"), \
            (rc, err, case)
    assert not unsafe_chars(err + result.get("stdout", "")), (err, result.get("stdout"), case)


# -- strategies: what lies on disk --------------------------------------------------------------


JSON = st.recursive(
    st.none() | st.booleans() | st.integers(-(1 << 40), 1 << 40) | st.floats(allow_nan=False)
    | st.text(max_size=20),
    lambda children: st.lists(children, max_size=4)
    | st.dictionaries(st.text(max_size=10), children, max_size=4),
    max_leaves=12)
ODD_TEXT = st.sampled_from(["", "x\ny", "a\rb", "\x00", "\u2028", "../../etc", "-rf", "é", " ",
                            "x" * 300, "\\", '"', "%s%n", "$(id)", "`id`"])
TEXT = st.one_of(st.text(max_size=30), ODD_TEXT)
# Past the interpreter's recursion limit (1000), which is what the decoder trips on.
DEEP = st.sampled_from([1100, 5000, 100_000]).map(lambda n: "[" * n + "]" * n)
HOSTILE_FILE = st.sampled_from(["fifo", "dev-zero", "symlink", "dangling", "directory", "huge"])


def lay(path: Path, kind: str, content: bytes | None = None, cap: int = 1 << 20) -> None:
    """Put a file of `kind` at path."""
    path.parent.mkdir(parents=True, exist_ok=True)
    if kind == "fifo":
        os.mkfifo(path)
    elif kind == "dev-zero":
        path.symlink_to("/dev/zero")
    elif kind == "symlink":
        target = path.parent / f".target-{path.name}"
        target.write_bytes(content or b"{}")
        path.symlink_to(target.name)
    elif kind == "dangling":
        path.symlink_to(path.parent / "nowhere")
    elif kind == "dirlink":  # a directory elsewhere: writes through it would show
        target = path.parent / f".target-{path.name}"
        target.mkdir()
        path.symlink_to(target.name)
    elif kind == "directory":
        path.mkdir()
    elif kind == "huge":
        with open(path, "wb") as f:
            f.truncate(cap + 1)
    elif kind == "file":
        path.write_bytes(content or b"")


def as_bytes(value: Any) -> bytes:
    if isinstance(value, bytes):
        return value
    if isinstance(value, str):
        return value.encode("utf-8", "surrogatepass")
    return json.dumps(value).encode()


@st.composite
def config_json(draw: st.DrawFn) -> tuple[str, bytes]:
    """(kind, content) of a bundle's config.json."""
    kind = draw(st.sampled_from(["file"] * 8 + ["none", "fifo", "dev-zero", "symlink",
                                                "directory", "huge"]))
    env = draw(st.lists(st.one_of(
        st.sampled_from(["NVIDIA_VISIBLE_DEVICES=all", f"NVIDIA_VISIBLE_DEVICES={U0}",
                         "NVIDIA_VISIBLE_DEVICES=0,7", "NVIDIA_VISIBLE_DEVICES=void",
                         "PATH=/bin"]), TEXT, JSON), max_size=3))
    notes = draw(st.dictionaries(
        st.one_of(st.sampled_from(["cudahook.io/enabled", "cudahook.io/sequential",
                                   "cudahook.io/lock-timeout-ms", "cudahook.io/device-map",
                                   "cudahook.io/call-timeout-s", "cdi.k8s.io/gpu"]),
                  TEXT.map(lambda t: "cudahook.io/" + t), TEXT),
        st.one_of(st.sampled_from(["true", "false", "5", "0", "1e9", "nvidia.com/gpu=0",
                                   f"{U0}={U0}"]), TEXT, JSON), max_size=3))
    cfg: dict[str, Any] = {"ociVersion": "1.2.0", "process": {"env": env, "args": ["sh"]},
                           "annotations": notes}
    if draw(st.booleans()):
        cfg["linux"] = {"devices": draw(st.lists(st.one_of(
            st.fixed_dictionaries({"path": st.sampled_from(["/dev/nvidia0", "/dev/fuse"])}),
            JSON), max_size=2))}
    if draw(st.booleans()):
        # Inside the case's own tree (or nowhere): poststop removes sockets there.
        cfg["mounts"] = [{"destination": "/snapshot-control",
                          "source": draw(st.one_of(st.sampled_from(["CTL", "/nonexistent/ctl"]),
                                                   JSON))}]
    mutate = draw(st.sampled_from(["none"] * 6 + ["json", "deep", "bytes", "replace"]))
    if mutate == "json":
        cfg = draw(JSON)
    elif mutate == "replace":
        cfg[draw(st.sampled_from(["process", "annotations", "linux", "mounts"]))] = draw(JSON)
    content = as_bytes(cfg)
    if mutate == "deep":
        content = b'{"env": "NVIDIA_VISIBLE_DEVICES=all", "x": ' + draw(DEEP).encode() + b"}"
    elif mutate == "bytes":
        content = draw(st.binary(max_size=200))
    return kind, content


@st.composite
def state_damage(draw: st.DrawFn) -> list[tuple[str, str, bytes]]:
    """(relative path under the node root, kind, content) to lay before the call."""
    items = []
    for _ in range(draw(st.integers(0, 2))):
        where = draw(st.sampled_from([
            "run/cudahook", "run/cudahook/containers", "run/cudahook/containers/c.json",
            "run/cudahook/containers/c.lock", "run/cudahook/history/c.json",
            "run/cudahook-marks", "run/cudahook-marks/gpu", "run/cudahook-marks/gpu/c",
            "run/cudahook/runs"]))
        kind = draw(st.sampled_from(["file", "file", "file", "fifo", "dev-zero", "symlink",
                                     "dangling", "directory", "dirlink"]))
        content = draw(st.one_of(
            JSON.map(as_bytes), DEEP.map(as_bytes), st.binary(max_size=50),
            st.fixed_dictionaries({"id": st.just("c"), "pid": st.just("PID"),
                                   "options": JSON, "visible": JSON, "restores": JSON,
                                   "snapshot_control": st.one_of(st.just("CTL"), JSON)})
            .map(as_bytes)))
        items.append((where, kind, content))
    return items


def lay_damage(root: Path, items: list[tuple[str, str, bytes]], pid: int) -> None:
    for where, kind, content in items:
        path = root / where
        if path.exists() or path.is_symlink():
            continue
        content = content.replace(b'"PID"', str(pid).encode()).replace(
            b'"CTL"', json.dumps(str(root / "ctl")).encode())
        try:  # an earlier item may stand in the way (a file where a directory goes)
            if path.parent != root / "run":
                path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
            lay(path, kind, content)
        except OSError:
            continue
    for d in (root / "run" / "cudahook", root / "run" / "cudahook-marks"):
        if d.is_dir() and not d.is_symlink():
            os.chmod(d, 0o700)


def hook_root(base: Path) -> Path:
    """A case's node root, with a snapshot-control directory holding a file
    that only looks like a VMM socket (poststop removes sockets there)."""
    root = new_root(base, "ctl")
    (root / "ctl" / "cuda-vmm-7.sock").write_text("not a socket: stays")
    return root


# -- the OCI hook -------------------------------------------------------------------------------


STAGE = st.sampled_from(["createRuntime", "prestart", "poststop", "poststart", "createContainer",
                         "startContainer", "", "CREATERUNTIME", "create\nRuntime"])


@st.composite
def oci_case(draw: st.DrawFn) -> dict[str, Any]:
    argv = draw(st.one_of(STAGE.map(lambda s: [s]), st.lists(st.one_of(STAGE, TEXT),
                                                             max_size=3)))
    fields: dict[str, Any] = {
        "ociVersion": draw(st.one_of(st.just("1.2.0"), JSON)),
        "id": draw(st.one_of(st.sampled_from(["c", "gpu-1", "a.b_c+d-e"]), TEXT, JSON)),
        "status": draw(st.one_of(st.sampled_from(["creating", "created", "stopped"]), JSON)),
        "bundle": draw(st.sampled_from(["BUNDLE", "BUNDLE", "BUNDLE", "/nonexistent", "rel/b",
                                        "", "BUNDLE\x00x", 7])),
        "pid": draw(st.one_of(st.sampled_from(["PID", "PID", "DEAD", 0, 1, -5, 1 << 40, "12",
                                               True, None]), JSON)),
    }
    if draw(st.booleans()):
        fields["annotations"] = draw(st.one_of(
            st.dictionaries(TEXT, TEXT, max_size=3),
            st.just({"bundle": "/nonexistent"}), JSON))
    drop = draw(st.lists(st.sampled_from(sorted(fields)), max_size=2))
    for k in drop:
        fields.pop(k, None)
    stdin_kind = draw(st.sampled_from(["state"] * 8 + ["bytes", "deep", "big", "json"]))
    extra = {"bytes": st.binary(max_size=100), "deep": DEEP.map(as_bytes),
             "json": JSON.map(as_bytes)}.get(stdin_kind, st.just(b""))
    return {"argv": argv, "fields": fields, "stdin_kind": stdin_kind,
            "stdin_extra": draw(extra),
            "indent": draw(st.sampled_from([None, 0, 1, "\t"])),
            "config": draw(config_json()), "damage": draw(state_damage())}


def oci_stdin(case: dict[str, Any], bundle: Path, pid: int, dead: int) -> bytes:
    kind = case["stdin_kind"]
    if kind in ("bytes", "deep", "json"):
        return case["stdin_extra"]  # type: ignore[no-any-return]
    subst = {"BUNDLE": str(bundle), "BUNDLE\x00x": str(bundle) + "\x00x", "PID": pid,
             "DEAD": dead}
    fields = {k: subst.get(v, v) if isinstance(v, str) else v for k, v in case["fields"].items()}
    data = json.dumps(fields, indent=case["indent"]).encode()
    if kind == "big":
        data = data[:-1] + b', "pad": "' + b"x" * (oci_state.MAX_STATE - len(data) + 2) + b'"}'
    return data


def lay_oci(root: Path, case: dict[str, Any], pid: int) -> Path:
    bundle = root / "bundle"
    bundle.mkdir()
    kind, content = case["config"]
    content = content.replace(b'"CTL"', json.dumps(str(root / "ctl")).encode())
    if kind != "none":
        lay(bundle / "config.json", kind, content, cap=oci_bundle.MAX_CONFIG)
    lay_damage(root, case["damage"], pid)
    return bundle


def env_for(root: Path, **extra: str) -> dict[str, str]:
    return {**SCRUBBED, "CUDAHOOK_ROOT": str(root), **extra}


@fuzz("CUDAHOOK_FUZZ_OCI", 4400)
@given(case=oci_case())
def test_fuzz_oci_hook_in_process(worker: Worker, sleeper: Sleeper, dead: int, base: Path,
                                  case: dict[str, Any]) -> None:
    root = hook_root(base)
    pid = sleeper.pid
    bundle = lay_oci(root, case, pid)
    before = snapshot(root)
    result = worker.call({"hook": "oci", "argv": case["argv"], "env": env_for(root),
                          "cwd": str(root),
                          "stdin": base64.b64encode(oci_stdin(case, bundle, pid, dead)).decode()})
    tally("oci hook", result)
    check(result, repr(case)[:3000])
    assert snapshot(root) == before, case
    shutil.rmtree(root)


# -- the CRIU action script -----------------------------------------------------------------------


GOOD = {"version": 1, "container_id": "c", "driver_version": "580.65.06", "gpus": [U0],
        "vmm": False, "processes": [{"nspid": 7, "pid": 4242, "state": "running"}]}
ACTION = st.sampled_from(["pre-dump", "post-restore", "post-resume"] * 3
                         + ["pre-restore", "post-dump", "network-lock", "", "PRE-DUMP", "x\ny"])
INIT_PID = st.one_of(st.sampled_from(["PID"] * 6 + ["DEAD", "", "0", "1", "2", "00", "007", "-5",
                                                    "4194304", "4194305", "9" * 30, "9" * 5000,
                                                    " 5", "5 ", "٣", "0x10"]),
                     # Never a live process of the host's: CRIU names the container's init,
                     # and a failed restore kills what it names.
                     st.integers(PID_MAX_LIMIT + 1, 1 << 64).map(str),
                     TEXT.filter(lambda t: not (t.isascii() and t.isdigit())))


@st.composite
def criu_case(draw: st.DrawFn) -> dict[str, Any]:
    man = dict(GOOD)
    for _ in range(draw(st.integers(0, 3))):
        key = draw(st.sampled_from([*sorted(GOOD), "extra"]))
        man[key] = draw(st.one_of(JSON, st.just([1, None]), st.just(["GPU-x", 5])))
    if draw(st.booleans()):
        man["processes"] = draw(st.lists(st.one_of(
            st.fixed_dictionaries({"nspid": st.one_of(st.integers(-5, 1 << 33), JSON),
                                   "pid": st.one_of(st.integers(-5, 1 << 33), JSON)}), JSON),
            max_size=3))
    content = as_bytes(man)
    mutate = draw(st.sampled_from(["none"] * 5 + ["deep", "bytes", "json"]))
    if mutate == "deep":
        content = draw(DEEP).encode()
    elif mutate == "bytes":
        content = draw(st.binary(max_size=100))
    elif mutate == "json":
        content = as_bytes(draw(JSON))
    return {
        "action": draw(ACTION),
        "init_pid": draw(INIT_PID),
        "image": draw(st.sampled_from(["IMAGE"] * 6 + ["", "/nonexistent/img", "rel", "FILE"])),
        "manifest": (draw(st.sampled_from(["file"] * 6 + ["none", "fifo", "dev-zero", "symlink",
                                                          "dangling", "directory", "huge"])),
                     content),
        "vmm_state": draw(st.sampled_from(["none", "none", "file", "fifo", "dev-zero", "symlink",
                                           "directory"])),
        "progress": draw(st.one_of(st.none(), JSON.map(as_bytes), st.fixed_dictionaries({
            "done": st.one_of(st.dictionaries(st.sampled_from(["pre-dump", "post-restore",
                                                               "post-resume", "x"]),
                                              st.one_of(st.integers(-3, 9), JSON)), JSON),
            "manifest": st.one_of(st.just(GOOD), JSON),
            "device_map": st.one_of(st.none(), st.just({U0: U0}), JSON),
            "vmm_dir": st.one_of(st.none(), st.just("CTL"), JSON)}).map(as_bytes))),
        "damage": draw(state_damage()),
    }


def run_key(pid: int) -> str:
    return f"{pid}-{Host().start_time(pid)}"


def lay_criu(root: Path, case: dict[str, Any], pid: int, dead: int,
             criu_pid: int) -> dict[str, str]:
    image = root / "img"
    image.mkdir()
    kind, content = case["manifest"]
    if kind != "none":
        lay(image / manifest.NAME, kind, content, cap=manifest.MAX_BYTES)
    if case["vmm_state"] != "none":
        lay(image / vmm.STATE_FILE, case["vmm_state"], b"state", cap=vmm.MAX_STATE_BYTES)
    (root / "afile").write_text("x")
    lay_damage(root, case["damage"], pid)
    runs = root / "run" / "cudahook" / "runs"
    if case["progress"] is not None and not (root / "run" / "cudahook").is_symlink():
        try:  # unless the damage laid above stands in the way
            runs.mkdir(parents=True, mode=0o700, exist_ok=True)
            os.chmod(root / "run" / "cudahook", 0o700)
            if not runs.is_symlink():
                (runs / f"{run_key(criu_pid)}.json").write_bytes(
                    case["progress"].replace(b'"CTL"', json.dumps(str(root / "ctl")).encode()))
        except OSError:
            pass
    env = env_for(root)
    if case["action"]:
        env["CRTOOLS_SCRIPT_ACTION"] = case["action"]
    text = {"PID": str(pid), "DEAD": str(dead)}.get(case["init_pid"], case["init_pid"])
    if text:
        env["CRTOOLS_INIT_PID"] = text.replace("\x00", "")
    img = {"IMAGE": str(image), "FILE": str(root / "afile")}.get(case["image"], case["image"])
    if img:
        env["CRTOOLS_IMAGE_DIR"] = img
    return env


@fuzz("CUDAHOOK_FUZZ_CRIU", 5200)
@given(case=criu_case())
def test_fuzz_criu_action_in_process(worker: Worker, sleeper: Sleeper, dead: int, base: Path,
                                     case: dict[str, Any]) -> None:
    root = hook_root(base)
    pid = sleeper.pid
    env = lay_criu(root, case, pid, dead, criu_pid=os.getpid())  # the worker's parent: "CRIU"
    before = snapshot(root)
    result = worker.call({"hook": "criu", "argv": [], "env": env, "cwd": str(root),
                          "stdin": "", "killable": [pid]})
    tally("criu action", result)
    check(result, repr(case)[:3000])
    assert snapshot(root) == before, case
    shutil.rmtree(root)


# -- through the installed shell hooks ------------------------------------------------------------


@pytest.fixture(scope="module")
def installed(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    old = os.environ.pop("CUDAHOOK_ROOT", None)  # each case passes its own root
    try:
        return hookfiles.install(tmp_path_factory.mktemp("hooks"), python=sys.executable)
    finally:
        if old is not None:
            os.environ["CUDAHOOK_ROOT"] = old


def limit_memory() -> None:
    resource.setrlimit(resource.RLIMIT_AS, (MEMORY_LIMIT, MEMORY_LIMIT))


def run_installed(argv: list[str], env: dict[str, str], data: bytes,
                  cwd: Path) -> dict[str, Any]:
    t0 = time.monotonic()
    try:
        r = subprocess.run(argv, input=data, env=env, cwd=cwd, capture_output=True,
                           timeout=HANG_S, preexec_fn=limit_memory)
    except subprocess.TimeoutExpired:
        return {"rc": None, "stderr": "", "stdout": "", "seconds": HANG_S, "raised": None,
                "hang": True}
    return {"rc": r.returncode, "stderr": r.stderr.decode("utf-8", "replace"),
            "stdout": r.stdout.decode("utf-8", "replace"), "seconds": time.monotonic() - t0,
            "raised": None}


@fuzz("CUDAHOOK_FUZZ_SHELL", 200)
@given(case=oci_case())
def test_fuzz_installed_oci_hook(installed: dict[str, Path], sleeper: Sleeper, dead: int,
                                 base: Path, case: dict[str, Any]) -> None:
    root = hook_root(base)
    pid = sleeper.pid
    bundle = lay_oci(root, case, pid)
    before = snapshot(root)
    argv = [str(installed["cudahook-oci-hook"]), *[a.replace("\x00", "") for a in case["argv"]]]
    result = run_installed(argv, env_for(root), oci_stdin(case, bundle, pid, dead), root)
    tally("oci hook (installed)", result)
    check(result, repr(case)[:3000])
    assert snapshot(root) == before, case
    shutil.rmtree(root)


@fuzz("CUDAHOOK_FUZZ_SHELL", 200)
@given(case=criu_case())
def test_fuzz_installed_action_script(installed: dict[str, Path], sleeper: Sleeper, dead: int,
                                      base: Path, case: dict[str, Any]) -> None:
    root = hook_root(base)
    pid = sleeper.pid
    # The script's parent is this test process: CRIU, for the run's key.
    env = lay_criu(root, case, pid, dead, criu_pid=os.getpid())
    env = {k: v.replace("\x00", "") for k, v in env.items()}
    before = snapshot(root)
    result = run_installed([str(installed["cudahook-criu-action"])], env, b"", root)
    tally("criu action (installed)", result)
    check(result, repr(case)[:3000])
    assert snapshot(root) == before, case
    shutil.rmtree(root)


# -- the harness's own guard ----------------------------------------------------------------------


def test_signal_guard_catches_a_pidfd_kill_of_a_wrong_process(worker: Worker) -> None:
    """cudahook kills through a pidfd (containers.kill_same): the guard sees
    that path too, reports it, and the process lives; offered as the
    container's, the same call kills it."""
    victim = subprocess.Popen(["sleep", "60"], start_new_session=True)
    try:
        case = {"hook": "kill_same", "pid": victim.pid, "argv": [], "env": SCRUBBED, "cwd": "/",
                "stdin": ""}
        result = worker.call({**case, "killable": []})
        assert result["refused"] == [f"pidfd_send_signal(pid {victim.pid}, 9)"], result
        time.sleep(0.1)
        assert victim.poll() is None
        result = worker.call({**case, "killable": [victim.pid]})
        assert result["rc"] == 1 and not result["refused"], result
        assert victim.wait(timeout=5) == -signal.SIGKILL
    finally:
        victim.kill()
        victim.wait()
