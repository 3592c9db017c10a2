"""Trust boundaries of the runtime wrapper and the OCI hook, through the
installed scripts as a runtime runs them: what a container's annotations may
choose of the CRIU configuration that CRIU runs as root, how the files they
name are read, and that nothing cudahook adds can stop a container."""

from __future__ import annotations

import json
import os
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import yaml

from cudahook.admin import hookfiles
from cudahook.platform import criuconf
from cudahook.platform.store import container_key
from cudahook.sim.lab import SimLab

U0 = "GPU-11111111-2222-3333-4444-555555555555"
SCRUBBED = {"PATH": "/usr/sbin:/usr/bin:/sbin:/bin"}


class Node:
    """A node root registered gpu-only, the hooks installed with its
    configuration, and a stand-in runc that records how it was called (the
    wrapper's subject is config.json, not runc)."""

    def __init__(self, tmp: Path, monkeypatch: pytest.MonkeyPatch):
        self.tmp = tmp
        self.root = tmp / "root"
        self.etc_criu = self.root / "etc/criu"
        self.etc_criu.mkdir(parents=True)
        monkeypatch.setenv("CUDAHOOK_ROOT", str(self.root))
        settings = SimLab(tmp / "node").settings(log_file=str(tmp / "cudahook.log"))
        self.state_dir = Path(settings.state_dir)
        self.config = tmp / "config.yaml"
        self.config.write_text(yaml.safe_dump(dict(settings.__dict__)))
        self.runc_argv = tmp / "runc-argv"
        runc = tmp / "runc"
        runc.write_text(f'#!/bin/sh\necho "$@" >> {self.runc_argv}\n')
        runc.chmod(0o755)
        self.hooks = hookfiles.install(tmp / "hooks", config=str(self.config), runc=str(runc))
        self.script = str(tmp / "hooks" / criuconf.ACTION_NAME)
        self.runc_conf("tcp-established\n" + criuconf.gpu_only_line(self.script) + "\n")
        self.sleepers: list[subprocess.Popen[bytes]] = []

    def runc_conf(self, text: str) -> None:
        (self.etc_criu / "runc.conf").write_text(text)

    def bundle(self, name: str, annotations: dict[str, str] | None = None,
               gpu: bool = True) -> Path:
        d = self.tmp / "bundles" / name
        d.mkdir(parents=True)
        env = ["PATH=/bin", *([f"NVIDIA_VISIBLE_DEVICES={U0}"] if gpu else [])]
        cfg = {"ociVersion": "1.2.0", "root": {"path": "rootfs"},
               "process": {"args": ["sh"], "env": env}, "annotations": annotations or {}}
        (d / "config.json").write_text(json.dumps(cfg))
        return d

    def wrap(self, cid: str, bundle: Path, timeout: float = 30
             ) -> subprocess.CompletedProcess[str]:
        """`runc create` through the installed wrapper; runc must have run."""
        r = subprocess.run([str(self.hooks["cudahook-runtime"]), "--log", str(self.tmp / "runc.log"),
                            "create", "--bundle", str(bundle), cid],
                           env=SCRUBBED, capture_output=True, text=True, timeout=timeout)
        assert r.returncode == 0, r.stderr
        assert self.runc_argv.read_text().splitlines()[-1].endswith(f"create --bundle {bundle} {cid}")
        return r

    def notes(self, bundle: Path) -> dict[str, str]:
        return json.loads((bundle / "config.json").read_text())["annotations"]  # type: ignore[no-any-return]

    def warnings(self) -> list[str]:
        log = self.tmp / "runc.log"
        return [x for x in log.read_text().splitlines() if "level=warning" in x] \
            if log.exists() else []

    def hook(self, stage: str, cid: str, bundle: Path) -> subprocess.CompletedProcess[bytes]:
        init = subprocess.Popen(["sleep", "60"])
        self.sleepers.append(init)
        state = {"ociVersion": "1.2.0", "id": cid, "status": "creating", "bundle": str(bundle),
                 "pid": init.pid}
        return subprocess.run([str(self.hooks["cudahook-oci-hook"]), stage],
                              input=json.dumps(state).encode(), env=SCRUBBED,
                              capture_output=True, timeout=30)

    def close(self) -> None:
        for p in self.sleepers:
            p.kill()
            p.wait()


@pytest.fixture
def node(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Node]:
    n = Node(tmp_path, monkeypatch)
    yield n
    n.close()


def evil_conf(node: Node) -> tuple[Path, Path]:
    """A CRIU configuration the container author wrote (say, in its overlay
    upperdir), naming a script of theirs, and the file that script would leave."""
    marker = node.tmp / "ran-as-root"
    evil = node.tmp / "upper" / "evil.sh"
    evil.parent.mkdir()
    evil.write_text(f"#!/bin/sh\ntouch {marker}\n")
    evil.chmod(0o755)
    conf = node.tmp / "upper" / "criu.conf"
    conf.write_text(f"action-script {evil}\nlibdir {node.tmp}/upper\n")
    return conf, evil


def copy_of(node: Node, cid: str, bundle: Path) -> Path:
    """The container's copy, named by its key (the id and the bundle)."""
    return node.state_dir / "criu" / f"{container_key(cid, str(bundle))}.conf"


def assert_only_ours(node: Node, bundle: Path, cid: str) -> str:
    """runc will hand CRIU cudahook's copy, which names one action script,
    cudahook's own, and nothing that loads code; the copy's text."""
    notes = node.notes(bundle)
    assert notes[criuconf.ANNOTATION] == str(copy_of(node, cid, bundle))
    text = copy_of(node, cid, bundle).read_text()
    assert criuconf.action_scripts(text) == [node.script]
    assert criuconf.without_code(text, node.script)[1] == []
    return text


# -- operator_only_criu_config ------------------------------------------------------------


@pytest.mark.parametrize("key", [criuconf.BASE_ANNOTATION, criuconf.ANNOTATION])
def test_operator_only_criu_config__annotation_cannot_choose_base(node: Node, key: str) -> None:
    conf, evil = evil_conf(node)
    b = node.bundle("b", {key: str(conf)})
    node.wrap("c1", b)
    text = assert_only_ours(node, b, "c1")
    assert str(evil) not in text and "libdir" not in text
    assert text.startswith("tcp-established\n")  # the site's runc.conf is the base
    assert criuconf.BASE_ANNOTATION not in node.notes(b)
    assert any("not a file in" in w for w in node.warnings())
    # Its restore through the wrapper (config.json now names cudahook's copy): the same.
    copy_of(node, "c1", b).unlink()
    node.wrap("c1", b)
    assert str(evil) not in assert_only_ours(node, b, "c1")


@pytest.mark.parametrize("line", [
    "action-script /x/evil.sh",
    "action-script=/x/evil.sh",
    "--action-script /x/evil.sh",
    "tcp-established --action-script /x/evil.sh",
    "tcp-established --action /x/evil.sh",  # getopt takes any unambiguous prefix
    "libdir /x",
    "lib /x",
    "tcp-established -L /x",
    "tcp-established -vL",
    "exec-cmd",
    "config /x/other.conf",
    'action-script "/x/evil.sh"',
    '"action-script" /x/evil.sh',
    "tcp-established\vaction-script /x/evil.sh",
    "tcp-established\raction-script /x/evil.sh",
    "tcp-established -- /x/evil.sh",
])
def test_operator_only_criu_config__chosen_base_loses_code_options(node: Node, line: str) -> None:
    """A file in the operator's directory that the container names: kept,
    less every line that could make CRIU run or load code."""
    (node.etc_criu / "site.conf").write_text(f"ghost-limit 1M\n{line}\nmanage-cgroups soft\n")
    b = node.bundle("b", {criuconf.ANNOTATION: str(node.etc_criu / "site.conf")})
    node.wrap("c2", b)
    text = assert_only_ours(node, b, "c2")
    assert text.splitlines()[:2] == ["ghost-limit 1M", "manage-cgroups soft"]
    assert "/x" not in text
    assert node.notes(b)[criuconf.BASE_ANNOTATION] == str(node.etc_criu / "site.conf")


def test_operator_only_criu_config__chosen_base_naming_ours_and_more_gets_a_copy(
        node: Node) -> None:
    """Even a file that names cudahook's script is not handed to CRIU as it
    is when it names another one too."""
    node.runc_conf(f"{criuconf.COMMENT}\naction-script {node.script}\n")  # global
    (node.etc_criu / "both.conf").write_text(f"action-script {node.script}\n"
                                             "action-script /x/evil.sh\n")
    b = node.bundle("b", {criuconf.ANNOTATION: str(node.etc_criu / "both.conf")})
    node.wrap("c3", b)
    assert "/x/evil.sh" not in assert_only_ours(node, b, "c3")


# -- outside_files_read_safely ---------------------------------------------------------------


def test_outside_files_read_safely__criu_config_fifo_link_or_device(node: Node) -> None:
    """Files the annotations name are read without following links, only if
    regular: a FIFO never blocks the container's creation."""
    conf, evil = evil_conf(node)
    os.mkfifo(node.etc_criu / "fifo.conf")
    (node.etc_criu / "link.conf").symlink_to(conf)
    (node.etc_criu / "zero.conf").symlink_to("/dev/zero")
    for i, name in enumerate(("fifo.conf", "link.conf", "zero.conf")):
        b = node.bundle(f"b{i}", {criuconf.ANNOTATION: str(node.etc_criu / name)})
        start = time.monotonic()
        node.wrap(f"c{i}", b, timeout=20)
        assert time.monotonic() - start < 10
        hooks = json.loads((b / "config.json").read_text())["hooks"]
        assert hooks["createRuntime"][0]["path"] == str(node.hooks["cudahook-oci-hook"])
        # Not that file: a copy of the site's own, as for no annotation.
        assert str(evil) not in assert_only_ours(node, b, f"c{i}")
        assert criuconf.BASE_ANNOTATION not in node.notes(b)
    assert sum("not used" in w for w in node.warnings()) == 3


def test_outside_files_read_safely__proc_fd_is_never_opened(node: Node) -> None:
    b = node.bundle("b", {criuconf.ANNOTATION: "/proc/self/fd/0"})
    node.wrap("c1", b, timeout=20)
    assert_only_ours(node, b, "c1")


# -- never_break_plain_container --------------------------------------------------------------


@pytest.mark.parametrize("value", ["{etc}/a\tb.conf", "{etc}/" + "x" * 5000, "rel.conf",
                                   "{etc}/../criu/runc.conf"])
def test_never_break_plain_container__odd_criu_config_value(node: Node, value: str) -> None:
    """An org.criu.config value cudahook will not use: the container still
    starts (its createRuntime hook included), covered by the site's file."""
    b = node.bundle("b", {criuconf.ANNOTATION: value.format(etc=node.etc_criu)})
    node.wrap("c1", b)
    assert_only_ours(node, b, "c1")
    r = node.hook("createRuntime", "c1", b)
    assert (r.returncode, r.stderr) == (0, b"")


@pytest.mark.parametrize("value", ["a\tb", "/etc/criu/" + "x" * 5000])
def test_never_break_plain_container__odd_wrapper_annotation_without_the_wrapper(
        node: Node, value: str) -> None:
    """cudahook.io/criu-config is the wrapper's own note: a runtime that runs
    the hooks without the wrapper (podman's hooks.d) never refuses for it."""
    b = node.bundle("b", {criuconf.BASE_ANNOTATION: value})
    r = node.hook("createRuntime", "c1", b)
    assert (r.returncode, r.stderr) == (0, b"")


@pytest.mark.parametrize("notes", [{"cudahook.io/sequential": "yes"},
                                   {"cudahook.io/lock-timout-ms": "5"},
                                   {"cudahook.io/enabled": "yes\t"}])
def test_never_break_plain_container__non_gpu_with_a_bad_annotation(
        node: Node, notes: dict[str, str]) -> None:
    b = node.bundle("plain", notes, gpu=False)
    before = (b / "config.json").read_bytes()
    node.wrap("p1", b)
    assert (b / "config.json").read_bytes() == before
    r = node.hook("createRuntime", "p1", b)
    assert (r.returncode, r.stderr) == (0, b"")
    assert not (node.state_dir / "containers" / "p1.json").exists()


# -- exact_registration_match -------------------------------------------------------------------


@pytest.mark.parametrize("other", ["/tmp/evil/cudahook-criu-action",
                                   "{hooks}/../hooks/cudahook-criu-action"])
def test_exact_registration_match__suffix_is_not_ours(node: Node, other: str) -> None:
    """A runc.conf naming some other cudahook-criu-action is not a global
    registration of this installation: a GPU container still gets its copy."""
    other = other.format(hooks=node.tmp / "hooks")
    node.runc_conf(f"{criuconf.COMMENT}\naction-script {other}\n")
    b = node.bundle("b")
    node.wrap("c1", b)
    notes = node.notes(b)
    assert notes[criuconf.ANNOTATION] == str(copy_of(node, "c1", b))
    assert node.script in criuconf.action_scripts(copy_of(node, "c1", b).read_text())
    assert not criuconf.is_ours(other, node.script)
    assert criuconf.is_ours(node.script, node.script)


def test_exact_registration_match__the_installed_path_is_global(node: Node) -> None:
    node.runc_conf(f"{criuconf.COMMENT}\naction-script {node.script}\n")
    b = node.bundle("b")
    node.wrap("c1", b)
    assert criuconf.ANNOTATION not in node.notes(b)
    assert not copy_of(node, "c1", b).exists()


# -- one_line_errors, hook_dies_with_runtime ------------------------------------------------------


@pytest.mark.parametrize("key", ["bundle", "id"])
def test_one_line_errors__nul_in_state_exits_2(node: Node, key: str) -> None:
    st = {"ociVersion": "1.2.0", "id": "c1", "status": "creating",
          "bundle": str(node.bundle("b"))}
    st[key] += "\u0000x"
    for stage in ("createRuntime", "poststop"):
        r = subprocess.run([str(node.hooks["cudahook-oci-hook"]), stage],
                           input=json.dumps(st).encode(), env=SCRUBBED, capture_output=True,
                           timeout=30)
        err = r.stderr.decode()
        assert r.returncode == 2, err
        assert err.count("\n") == 1 and "NUL" in err and "internal error" not in err, err


def _hook_python(hook_pid: int) -> int | None:
    """The PID of the Python running the OCI hook started as `hook_pid`:
    that PID itself once exec'd, or a child of it."""
    for d in Path("/proc").iterdir():
        if not d.name.isdigit():
            continue
        try:
            cmd = (d / "cmdline").read_bytes()
            ppid = int((d / "stat").read_text().rsplit(")", 1)[1].split()[1])
        except (OSError, ValueError, IndexError):
            continue
        if b"cudahook.hooks.oci_hook" in cmd and hook_pid in (int(d.name), ppid):
            return int(d.name)
    return None


def _alive(pid: int) -> bool:
    try:
        return (Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]) != "Z"
    except OSError:
        return False


def test_hook_dies_with_runtime__killed_hook_leaves_no_python(node: Node) -> None:
    """A runtime that kills the hook (its timeout) kills cudahook's Python
    with it: the hook is Python by then, not a shell waiting on a pipeline."""
    from cudahook.platform.marks import marks_dir
    from cudahook.platform.store import Store, container_key, lock_file

    b = node.bundle("b")
    # The hook waits on the record's lock, named by the container's key.
    fd = lock_file(Store(node.state_dir).lock_path(container_key("c1", str(b))))
    init = subprocess.Popen(["sleep", "60"])
    node.sleepers.append(init)
    state = json.dumps({"ociVersion": "1.2.0", "id": "c1", "status": "creating",
                        "bundle": str(b), "pid": init.pid}).encode()
    hook = subprocess.Popen([str(node.hooks["cudahook-oci-hook"]), "createRuntime"],
                            stdin=subprocess.PIPE, env=SCRUBBED)
    py = None
    try:
        assert hook.stdin is not None
        hook.stdin.write(state)
        hook.stdin.close()
        deadline = time.monotonic() + 20
        while not (marks_dir() / "gpu" / "c1").exists():  # left just before the lock
            assert time.monotonic() < deadline and hook.poll() is None
            time.sleep(0.02)
        py = _hook_python(hook.pid)
        assert py is not None
        hook.kill()
        hook.wait(timeout=10)
        time.sleep(0.5)
        assert not _alive(py), "the hook's Python outlived the hook"
    finally:
        os.close(fd)
        if py is not None and _alive(py):
            os.kill(py, 9)
        if hook.poll() is None:
            hook.kill()
            hook.wait()


# -- own_directories_only ----------------------------------------------------------------------


def test_own_directories_only__state_dir_typo_is_refused_not_changed(node: Node) -> None:
    """`state_dir: /run` by mistake: the hook refuses it in one line (exit 3)
    and leaves its mode alone."""
    run = node.tmp / "run"  # stands in for /run: root's, 0755
    run.mkdir()
    os.chmod(run, 0o755)
    cfg = yaml.safe_load(node.config.read_text())
    node.config.write_text(yaml.safe_dump({**cfg, "state_dir": str(run)}))
    r = node.hook("createRuntime", "c1", node.bundle("b"))
    err = r.stderr.decode()
    assert r.returncode == 3, err
    assert err.count("\n") == 1 and str(run) in err and "refusing" in err, err
    assert os.stat(run).st_mode & 0o7777 == 0o755
    assert os.listdir(run) == []


@pytest.mark.parametrize("mode", [0o755, 0o750, 0o711, 0o500, 0o1700])
def test_own_directories_only__existing_directory_is_never_chmodded(tmp_path: Path,
                                                                    mode: int) -> None:
    from cudahook.platform.privdir import ForeignDirectory, ensure_private_dir

    d = tmp_path / "found"
    d.mkdir()
    os.chmod(d, mode)
    with pytest.raises(ForeignDirectory, match="refusing") as exc:
        ensure_private_dir(d)
    assert exc.value.exit_code == 3
    assert os.stat(d).st_mode & 0o7777 == mode


def test_own_directories_only__created_private_and_found_again(tmp_path: Path) -> None:
    from cudahook.platform.privdir import ensure_private_dir

    old = os.umask(0o177)  # a umask that would leave a new directory unusable
    try:
        d = ensure_private_dir(tmp_path / "a" / "b" / "c")
    finally:
        os.umask(old)
    for p in (tmp_path / "a", tmp_path / "a/b", d):
        assert os.stat(p).st_mode & 0o7777 == 0o700, p
    assert ensure_private_dir(d) == d  # cudahook's own, found again


def test_never_break_plain_container__uncovered_gpu_container_still_starts(node: Node) -> None:
    """No copy can be written (a state_dir cudahook refuses): runc still
    runs the container, the wrapper says loudly it is not covered, and the
    file the container named never reaches CRIU."""
    conf, _ = evil_conf(node)
    run = node.tmp / "run"
    run.mkdir()
    os.chmod(run, 0o755)
    cfg = yaml.safe_load(node.config.read_text())
    node.config.write_text(yaml.safe_dump({**cfg, "state_dir": str(run)}))
    b = node.bundle("b", {criuconf.ANNOTATION: str(conf)})
    node.wrap("c1", b)
    assert node.notes(b)[criuconf.ANNOTATION] == ""  # CRIU gets no file at all
    hooks = json.loads((b / "config.json").read_text())["hooks"]
    assert hooks["createRuntime"][0]["path"] == str(node.hooks["cudahook-oci-hook"])
    assert [w for w in node.warnings() if "NOT covered" in w]
    events = [json.loads(x) for x in Path(cfg["log_file"]).read_text().splitlines()]
    assert [e["container"] for e in events if e["event"] == "wrapper-not-covered"] == ["c1"]
    assert os.stat(run).st_mode & 0o7777 == 0o755


def test_never_break_plain_container__bad_configuration_still_names_no_foreign_file(
        node: Node) -> None:
    conf, _ = evil_conf(node)
    node.config.write_text("state_dir: [unclosed\n")
    b = node.bundle("b", {criuconf.ANNOTATION: str(conf)})
    node.wrap("c1", b)
    assert node.notes(b)[criuconf.ANNOTATION] == ""
    assert [w for w in node.warnings() if "NOT covered" in w]


@pytest.mark.parametrize("value", ["/dev/zero", "{etc}", "{etc}/sub", "a\tb", "{etc}/\u00e9.conf"])
def test_operator_only_criu_config__odd_values_never_reach_criu(node: Node, value: str) -> None:
    (node.etc_criu / "sub").mkdir()
    b = node.bundle("b", {criuconf.ANNOTATION: value.format(etc=node.etc_criu)})
    node.wrap("c1", b)
    assert_only_ours(node, b, "c1")


@pytest.mark.parametrize("args", [["--bundle", "{b}", ""], ["--bundle", "{b}", "--", "-c1"],
                                  ["--bundle", "{b}", "c/1"]])
def test_operator_only_criu_config__no_usable_id_names_no_file(node: Node,
                                                               args: list[str]) -> None:
    """An id the wrapper cannot name a copy by: the container's own file is
    not left for CRIU either."""
    conf, _ = evil_conf(node)
    b = node.bundle("b", {criuconf.ANNOTATION: str(conf)})
    r = subprocess.run([str(node.hooks["cudahook-runtime"]), "--log", str(node.tmp / "runc.log"),
                        "create", *(a.format(b=b) for a in args)],
                       env=SCRUBBED, capture_output=True, text=True, timeout=30)
    assert r.returncode == 0, r.stderr
    assert node.runc_argv.exists()  # runc ran, to refuse or not as it sees fit
    assert node.notes(b)[criuconf.ANNOTATION] == ""
    assert [w for w in node.warnings() if "NOT covered" in w]
