"""Fuzzing the input surfaces outside the two hooks: `cudahook migrate
restore` (hostile tar and gzip streams, checksum and signature sidecars, the
spec files and the manifest inside), the admin command line (argv over every
command but `demo`), the runtime wrapper (a bundle's config.json and the CRIU
configuration annotations) and config.yaml.

Every example runs the real entry point in-process in the fuzz worker
(tests/fuzz_worker.py) as tests/test_fuzz_hooks.py does, a few through the
installed shell wrapper. For each one: no traceback; the exit code is one of
the table's (cudahook.platform.errors.Exit); a failure is one line on stderr;
no control character reaches stdout or stderr; the call ends in time (a
hang kills the worker and fails the case); no signal to a process that is not
the container's; nothing outside the surface's own state changes. Where an
input is hostile by construction, the rule it breaks says what must happen
(an archive with a link is refused before podman runs, a FIFO as config.yaml
is exit 3, ...).

Only podman (for migrate), runc (for the wrapper) and nvidia-smi are stand-ins:
executables that record how they were called; they are not under test.
"""

from __future__ import annotations

import functools
import gzip
import json
import os
import posixpath
import shutil
import stat
import subprocess
import sys
import tarfile
import zlib
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from hypothesis import example, given
from hypothesis import strategies as st

from cudahook.admin import hookfiles, signing
from cudahook.platform.errors import Exit

from . import test_fuzz_hooks
from .fuzz_worker import Worker, assert_bounded
from .fuzz_worker import new_root as node_root
from .test_fuzz_hooks import (
    DEEP,
    JSON,
    ODD_TEXT,
    SCRUBBED,
    TEXT,
    U0,
    as_bytes,
    config_json,
    fuzz,
    fuzz_summary,  # noqa: F401  (the session's summary, for this module's tests too)
    lay,
    run_installed,
    snapshot,
    tally,
    unsafe_chars,
    verdict,
)

EXITS = {int(e) for e in Exit}
STATE = ("run/cudahook", "run/cudahook-marks", "var/log/cudahook.log")
EVIL = "EVILMARK"  # in every file a container or archive offers as CRIU configuration
HERE = Path(__file__).resolve().parent


# The harness's fixtures, as test_fuzz_hooks.py's tests have them: one worker
# and one directory of node roots per module.
worker = test_fuzz_hooks.worker
base = test_fuzz_hooks.base


def new_root(base: Path) -> Path:
    return node_root(base, "tmp", "etc/cudahook")


def env_for(root: Path, **extra: str) -> dict[str, str]:
    return {**SCRUBBED, "CUDAHOOK_ROOT": str(root), "TMPDIR": str(root / "tmp"), **extra}


def check_cli(result: dict[str, Any], case: str) -> None:
    """The admin command line's contract: as the hooks', except that a
    success may print to stdout (and warnings, one line each, to stderr)."""
    assert_bounded(result, case)
    rc, err, out = result["rc"], result["stderr"], result["stdout"]
    assert rc in EXITS, (rc, err, case)
    assert "Traceback" not in err + out, (err, case)
    assert not unsafe_chars(err + out), (unsafe_chars(err + out), err, out[:500], case)
    lines = err.splitlines(keepends=True)
    if rc != 0:  # one line; or none where the verdict is the report (doctor, check)
        assert (len(lines) == 1 and err.endswith("\n")) or (not lines and out), (rc, err, case)
    assert all(x.startswith("cudahook") for x in lines), (rc, err, case)


def fake(path: Path, body: str) -> Path:
    """A stand-in executable: a Python script without site packages."""
    path.write_text(f"#!{sys.executable} -I\n{body}")
    path.chmod(0o755)
    return path


FAKE_PODMAN = '''
import json, os, sys, tarfile
args = sys.argv[1:]
rec = {"argv": args}
if args[:2] == ["container", "restore"] and "--import" in args:
    path = args[args.index("--import") + 1]
    with tarfile.open(path) as tar:
        rec["members"] = tar.getnames()
        for name in ("spec.dump", "config.dump"):
            try:
                rec[name] = json.load(tar.extractfile(name))
            except Exception as exc:
                rec[name] = repr(exc)
with open(os.environ["FAKE_PODMAN_LOG"], "a") as f:
    f.write(json.dumps(rec) + "\\n")
if args[:2] in (["container", "exists"], ["image", "exists"]):
    sys.exit(1 if args[0] == "container" else 0)
if args[:2] == ["container", "restore"]:
    print("restored-container")
sys.exit(0)
'''
# One GPU, the one the manifests name.
FAKE_SMI = f'''
import sys
if "-L" in sys.argv:
    print("GPU 0: NVIDIA H100 80GB HBM3 (UUID: {U0})")
elif "--query-gpu=driver_version" in sys.argv:
    print("580.65.06")
else:
    print("0, {U0}, NVIDIA H100 80GB HBM3, 81559, 580.65.06, Enabled")
'''
FAKE_RUNC = '''
import json, os, sys
with open(os.environ["FAKE_RUNC_LOG"], "a") as f:
    f.write(json.dumps(sys.argv[1:]) + "\\n")
'''


@pytest.fixture(scope="module")
def tools(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    d = tmp_path_factory.mktemp("tools")
    return {"podman": fake(d / "podman", FAKE_PODMAN), "nvidia-smi": fake(d / "nvidia-smi", FAKE_SMI),
            "runc": fake(d / "runc", FAKE_RUNC),
            # Never called by a restore's checks: only its presence counts.
            "cuda-checkpoint": fake(d / "cuda-checkpoint", "import sys\nsys.exit(1)\n")}


def node_config(root: Path, tools: dict[str, Path], trust: str | None = None,
                keys: dict[str, Path] | None = None) -> None:
    """The node: one simulated GPU, its driver version from nvidia-smi, and
    what it trusts to sign archives."""
    text = (f"nvidia_smi: {tools['nvidia-smi']}\ncuda_checkpoint: {tools['cuda-checkpoint']}\n"
            f"backend: cli\ndriver_version_file: {root / 'no-driver'}\n")
    if trust == "require" and keys:
        text += f"migrate_require_signature: true\nmigrate_trusted_keys_dir: {keys['dir']}\n"
    elif trust == "keys-dir" and keys:
        text += f"migrate_trusted_keys_dir: {keys['dir']}\n"
    (root / "etc" / "cudahook" / "config.yaml").write_text(text)


@pytest.fixture(scope="module")
def keys(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """The node's signing key (its public half trusted), and another."""
    d = tmp_path_factory.mktemp("keys")
    (d / "trusted").mkdir()
    signing.keygen(d / "node")
    signing.keygen(d / "other")
    shutil.copy(d / "node.pub", d / "trusted" / "node.pub")
    return {"node": d / "node", "other": d / "other", "public": d / "node.pub",
            "dir": d / "trusted"}


def podman_calls(root: Path) -> list[dict[str, Any]]:
    log = root / "podman.log"
    return [json.loads(x) for x in log.read_text().splitlines()] if log.exists() else []


# -- migrate restore: the archive ---------------------------------------------------------------


SPEC = {"ociVersion": "1.0.0", "process": {"env": ["PATH=/bin", f"NVIDIA_VISIBLE_DEVICES={U0}"],
                                           "args": ["sh"]},
        "annotations": {"io.podman.annotations.autoremove": "FALSE"}}
GOOD_MANIFEST = {"version": 1, "container_id": "c", "driver_version": "580.65.06", "gpus": [U0],
                 "vmm": False, "processes": [{"nspid": 7, "pid": 4242, "state": "running"}]}
MANIFEST = "checkpoint/cudahook-manifest.json"
# GPU memory in storage, deduplicated: process 8's chunk a hard link to 7's.
GPU = "checkpoint/cudahook-gpu"
CHUNK_A, CHUNK_B = f"{GPU}/7/gpu0-000000.chunk", f"{GPU}/8/gpu0-000000.chunk"
CHUNK_NAMES = [CHUNK_A, CHUNK_B, f"{GPU}/7", f"./{GPU}//7/./gpu0-000000.chunk",
               f"{GPU}/8/../7/gpu0-000000.chunk", f"{GPU}/../{GPU}/8/x.chunk", f"/{CHUNK_A}"]
# Names a checkpoint holds, the same names in other spellings, and names no
# checkpoint holds.
NAMES = st.one_of(st.sampled_from([
    "spec.dump", "config.dump", MANIFEST, "checkpoint/pages-1.img", "checkpoint", "rootfs-diff.tar",
    "./spec.dump", "./config.dump", ".//spec.dump", "//spec.dump", "checkpoint//cudahook-manifest.json",
    "checkpoint/./cudahook-manifest.json", "checkpoint/../spec.dump", "./checkpoint/pages-1.img",
    "../spec.dump", "/etc/passwd", "/spec.dump", "a/../../x", "./", "/", ".", "..", "x\ny",
    "\x1b[31mred", "ctl\x07", "é/ü", "\u202espec.dump", "a" * 300,
    "checkpoint/" + "d/" * 60 + "f", "spec.dump/", "checkpoint/pages-1.img\x00x",
    *CHUNK_NAMES]),
    st.text(max_size=20))
KINDS = {"reg": tarfile.REGTYPE, "dir": tarfile.DIRTYPE, "sym": tarfile.SYMTYPE,
         "lnk": tarfile.LNKTYPE, "chr": tarfile.CHRTYPE, "blk": tarfile.BLKTYPE,
         "fifo": tarfile.FIFOTYPE, "sparse": tarfile.GNUTYPE_SPARSE, "cont": tarfile.CONTTYPE}
# What a podman checkpoint never holds: refused before podman runs.
FORBIDDEN_KINDS = {"sym", "lnk", "chr", "blk", "fifo", "sparse"}
SPEC_VALUE = st.one_of(
    st.just(SPEC).map(as_bytes),
    JSON.map(as_bytes), DEEP.map(as_bytes), st.binary(max_size=60),
    st.fixed_dictionaries({"process": st.one_of(JSON, st.just({"env": 5}), st.just([])),
                           "annotations": st.one_of(JSON, st.just([1]))}).map(as_bytes),
    # A spec choosing CRIU's configuration: never carried across.
    st.sampled_from(["org.criu.config", "cudahook.io/criu-config"]).map(
        lambda k: as_bytes({**SPEC, "annotations": {k: f"/tmp/{EVIL}.conf"}})))
CONFIG_VALUE = st.one_of(
    st.builds(lambda name, spec: as_bytes({"name": name, "spec": spec,
                                           "rootfsImageID": ""}),
              st.one_of(st.just("c"), TEXT, JSON, st.just("-rf"), st.just("x" * 5000)),
              st.one_of(st.just(SPEC), JSON)),
    st.sampled_from(["org.criu.config", "cudahook.io/criu-config"]).map(
        lambda k: as_bytes({"name": "c", "spec": {**SPEC, "annotations": {k: f"/tmp/{EVIL}"}}})),
    JSON.map(as_bytes), DEEP.map(as_bytes), st.binary(max_size=60))


@st.composite
def manifest_value(draw: st.DrawFn) -> bytes:
    man: dict[str, Any] = dict(GOOD_MANIFEST)
    for _ in range(draw(st.integers(0, 3))):
        key = draw(st.sampled_from([*sorted(GOOD_MANIFEST), "extra"]))
        man[key] = draw(st.one_of(JSON, st.just("x" * 100_000), st.just("\udc80"),
                                  st.just(["GPU-x\n", 5]), st.just(1 << 70),
                                  st.just("\x1b]0;title\x07"), st.just(float("inf"))))
    mutate = draw(st.sampled_from(["none"] * 5 + ["deep", "bytes", "json", "surrogate"]))
    if mutate == "deep":
        return draw(DEEP).encode()
    if mutate == "bytes":
        return draw(st.binary(max_size=100))
    if mutate == "json":
        return as_bytes(draw(JSON))
    if mutate == "surrogate":  # escaped in JSON, a lone surrogate once decoded
        return json.dumps({**man, "container_id": "\udcff\ud800"}).encode()
    return json.dumps(man, allow_nan=True, ensure_ascii=draw(st.booleans()),
                      ).encode("utf-8", "surrogatepass")


@st.composite
def member(draw: st.DrawFn) -> dict[str, Any]:
    name = draw(NAMES)
    kind = draw(st.sampled_from(["reg"] * 8 + sorted(KINDS)))
    key = posixpath.normpath(name).lstrip("/") if name else ""
    data = draw({"spec.dump": SPEC_VALUE, "config.dump": CONFIG_VALUE,
                 MANIFEST: manifest_value()}.get(key, st.binary(max_size=64)))
    return {"name": name, "kind": kind, "data": data,
            "size": draw(st.sampled_from([None] * 8 + ["huge", "short", "long"])),
            "linkname": draw(st.sampled_from(["/etc/shadow", "../../x", "spec.dump", "",
                                              "checkpoint/pages-1.img", *CHUNK_NAMES]))}


def header(m: dict[str, Any], fmt: int) -> bytes:
    info = tarfile.TarInfo(m["name"])
    info.type = KINDS[m["kind"]]
    data = m["data"] if m["kind"] in ("reg", "cont", "sparse") else b""
    # Huge: a terabyte, or the most a plain ustar field holds (8 GiB).
    huge = 8**11 - 1 if fmt == tarfile.USTAR_FORMAT else 1 << 40
    info.size = {"huge": huge, "short": max(len(data) - 7, 0), "long": len(data) + 900
                 }.get(m["size"], len(data))
    info.linkname = m["linkname"] if m["kind"] in ("sym", "lnk") else ""
    info.mode = 0o644
    try:
        buf = info.tobuf(fmt, "utf-8", "surrogateescape")
    except (ValueError, UnicodeError):  # a name this format cannot hold
        info.name = "checkpoint/odd"
        buf = info.tobuf(fmt, "utf-8", "surrogateescape")
    return buf + data + b"\0" * (-len(data) % 512)


def archive_bytes(members: list[dict[str, Any]], fmt: int, ending: str) -> bytes:
    body = b"".join(header(m, fmt) for m in members)
    if ending == "zeros":
        body += b"\0" * 1024
    return body


def base_members() -> list[dict[str, Any]]:
    return [{"name": "spec.dump", "kind": "reg", "data": as_bytes(SPEC), "size": None,
             "linkname": ""},
            {"name": "config.dump", "kind": "reg", "data": as_bytes({"name": "c", "spec": SPEC}),
             "size": None, "linkname": ""},
            {"name": "checkpoint", "kind": "dir", "data": b"", "size": None, "linkname": ""},
            {"name": "checkpoint/pages-1.img", "kind": "reg", "data": b"p" * 3000, "size": None,
             "linkname": ""}]


@st.composite
def migrate_case(draw: st.DrawFn) -> dict[str, Any]:
    members = base_members()
    choose = draw(st.sampled_from([None] * 4 + ["org.criu.config", "cudahook.io/criu-config"]))
    if choose:  # the container's spec names a CRIU configuration of the supplier's
        spec = {**SPEC, "annotations": {choose: f"/tmp/{EVIL}.conf"}}
        members[0] = {**members[0], "data": as_bytes(spec)}
        members[1] = {**members[1], "data": as_bytes({"name": "c", "spec": spec})}
    if draw(st.booleans()):
        members.append({"name": MANIFEST, "kind": "reg", "data": draw(manifest_value()),
                        "size": None, "linkname": ""})
    if draw(st.booleans()):  # a deduplicated chunk: the one hard link a checkpoint holds
        members += [{"name": CHUNK_A, "kind": "reg", "data": b"c" * 700, "size": None,
                     "linkname": ""},
                    {"name": CHUNK_B, "kind": "lnk", "data": b"", "size": None,
                     "linkname": draw(st.sampled_from([CHUNK_A, *CHUNK_NAMES]))}]
    for _ in range(draw(st.integers(0, 3))):
        members.insert(draw(st.integers(0, len(members))), draw(member()))
    if draw(st.integers(0, 9)) == 0:  # some members dropped: a spec file missing
        members = draw(st.lists(st.sampled_from(members), max_size=len(members)))
    return {
        "members": members,
        "format": draw(st.sampled_from([tarfile.GNU_FORMAT, tarfile.PAX_FORMAT,
                                        tarfile.USTAR_FORMAT])),
        "ending": draw(st.sampled_from(["zeros", "zeros", "none"])),
        "compress": draw(st.sampled_from(["gzip", "gzip", "none", "bomb", "concat"])),
        "cut": draw(st.sampled_from([None] * 7 + ["half", "tail", "flip"])),
        "sha256": draw(st.sampled_from(["good"] * 8 + ["wrong", "missing", "garbage", "fifo",
                                                     "symlink", "dev-zero", "directory", "huge",
                                                     "upper", "two"])),
        "sig": draw(st.sampled_from(["none"] * 4 + ["good"] * 3 + [
            "garbage", "fifo", "symlink", "dev-zero", "huge", "directory", "other-key",
            "tampered", "wrong-size"])),
        # What this node trusts: nothing, a required signature, --verify-key, a keys directory.
        "trust": draw(st.sampled_from([None] * 3 + ["require", "verify-key", "keys-dir"])),
        "archive_kind": draw(st.sampled_from(["file"] * 20 + ["fifo", "symlink", "directory"])),
        "flags": draw(st.lists(st.sampled_from(["--no-verify", "--dry-run", "--json"]),
                               unique=True, max_size=2)),
        "name": draw(st.sampled_from([None] * 6 + ["x", "-rf", "x\ny", "a" * 300, "\x1b[2J"])),
    }


def bomb_member() -> bytes:
    big = tarfile.TarInfo("checkpoint/pages-2.img")
    big.size = 16 << 20
    return big.tobuf(tarfile.GNU_FORMAT) + b"\0" * big.size


@functools.cache
def bomb_state() -> Any:
    """A gzip compressor that has taken 16 MiB of zeros (a tar member):
    copied for each archive, the same gzip member goes on with its tar."""
    z = zlib.compressobj(9, zlib.DEFLATED, 31)
    z.compress(bomb_member())
    return z


@functools.cache
def bomb() -> bytes:
    """The 16 MiB member alone, in about 16 KiB of gzip: a member of its own."""
    return gzip.compress(bomb_member(), 9)


def build_archive(case: dict[str, Any]) -> bytes:
    raw = archive_bytes(case["members"], case["format"], case["ending"])
    how = case["compress"]
    if how == "bomb":  # 16 MiB of zeros, then the archive, in one gzip member
        z = bomb_state().copy()
        data = z.compress(raw) + z.flush()
    elif how == "bomb-then-member":  # the same bomb, then the archive in a second member
        data = bomb() + gzip.compress(raw, 1)
    elif how == "concat":  # two gzip members back to back (gzip reads both)
        data = gzip.compress(raw[: len(raw) // 2]) + gzip.compress(raw[len(raw) // 2:])
    elif how == "gzip":
        data = gzip.compress(raw, 1)
    else:
        data = raw
    if case["cut"] == "half":
        data = data[: len(data) // 2]
    elif case["cut"] == "tail":
        data = data[:-9]
    elif case["cut"] == "flip" and data:
        i = len(data) * 2 // 3
        data = data[:i] + bytes([data[i] ^ 0x40]) + data[i + 1:]
    return data


def hostile_by_construction(case: dict[str, Any]) -> list[str]:
    """Why this archive must be refused before podman runs ([] if it may pass)."""
    why = []
    verify = "--no-verify" not in case["flags"]
    if verify and case["sha256"] not in ("good", "upper", "two"):
        why.append(f"sha256 sidecar {case['sha256']}")
    trust, sig = case.get("trust"), case.get("sig")
    if (trust in ("require", "verify-key") and sig != "good") or (
            trust == "keys-dir" and sig not in ("good", "none")):
        why.append(f"signature {sig} where {trust}")
    seen: set[str] = set()
    regular: set[str] = set()  # what a chunk's link may name: an earlier file, no link
    for m in case["members"]:
        name = m["name"]
        norm = posixpath.normpath(name) if name else name
        if m["kind"] == "lnk":
            if not chunk_link_kept(m, regular):
                why.append(f"member {name!r} is a link to {m['linkname']!r}")
        elif m["kind"] in FORBIDDEN_KINDS:
            why.append(f"member {name!r} is {m['kind']}")
        if m["kind"] == "reg" and canonical(name) is not None:
            regular.add(canonical(name) or "")
        if name.startswith("/") or norm == ".." or norm.startswith("../"):
            why.append(f"member {name!r} escapes")
        if norm in seen and norm not in ("", "."):
            why.append(f"duplicate {norm!r}")
        seen.add(norm)
        if m["size"] == "huge" and m["kind"] in ("reg", "cont", "sparse"):
            why.append(f"member {name!r} cut short")
    if case["compress"] != "none" and case["cut"]:
        why.append("gzip stream cut short")
    return why


def canonical(name: str) -> str | None:
    """`name` as the archive reader decides on it (None: refused)."""
    parts = [p for p in name.split("/") if p not in ("", ".")]
    return None if name.startswith("/") or ".." in parts else "/".join(parts)


def chunk_link_kept(m: dict[str, Any], regular: set[str]) -> bool:
    """The one hard link a checkpoint may hold: a GPU-memory chunk's, with
    no data, to an earlier regular file of cudahook-gpu/."""
    name, target = canonical(m["name"]), canonical(m["linkname"])
    return (name is not None and name.startswith(GPU + "/") and target is not None
            and target.startswith(GPU + "/") and target in regular
            and m["size"] in (None, "short"))


def lay_sidecar(path: Path, kind: str, good: str) -> None:
    content = {"good": f"{good}  ckpt\n", "upper": f"{good.upper()}\n", "two": f"{good} {good}\n",
               "wrong": f"{'0' * 64}  ckpt\n", "garbage": "\x1b[2J\nnot a digest\x07\n"}
    if kind == "missing":
        return
    if kind in content:
        path.write_text(content[kind])
    else:
        lay(path, kind, f"{good}  ckpt\n".encode(), cap=4096)


def lay_archive(root: Path, case: dict[str, Any], keys: dict[str, Path] | None = None) -> Path:
    import hashlib

    data = build_archive(case)
    d = root / "in"
    d.mkdir()
    archive = d / "ckpt.tar.gz"
    if case["archive_kind"] == "file":
        archive.write_bytes(data)
    elif case["archive_kind"] == "symlink":
        (d / "real.tar.gz").write_bytes(data)
        archive.symlink_to("real.tar.gz")
    else:
        lay(archive, case["archive_kind"])
    digest = hashlib.sha256(data).hexdigest()
    lay_sidecar(d / "ckpt.tar.gz.sha256", case["sha256"], digest)
    sig, target = case["sig"], d / "ckpt.tar.gz.sig"
    if sig in ("good", "other-key", "tampered", "wrong-size") and keys is not None:
        key = signing.load_private(keys["other" if sig == "other-key" else "node"])
        signing.sign(archive, digest, len(data) + (sig == "wrong-size"), "c", key)
        if sig == "tampered":  # the statement changed after signing
            doc = json.loads(target.read_text())
            doc["statement"] = doc["statement"].replace('"c"', '"d"')
            target.write_text(json.dumps(doc))
    elif sig == "garbage":
        target.write_bytes(b"\x00\xff" * 40)
    elif sig not in ("none", "good", "other-key", "tampered", "wrong-size"):
        lay(target, sig, b"sig", cap=4096)
    return archive


def criu_notes(spec: Any) -> list[str]:
    notes = spec.get("annotations") if isinstance(spec, dict) else None
    if not isinstance(notes, dict):
        return []
    return [k for k in notes if k in ("org.criu.config", "cudahook.io/criu-config")]


def check_migrate(root: Path, case: dict[str, Any], result: dict[str, Any], what: str) -> None:
    check_cli(result, what)
    calls = podman_calls(root)
    restores = [c for c in calls if c["argv"][:2] == ["container", "restore"]]
    for call in restores:  # operator_only_criu_config: never carried across
        spec = call.get("spec.dump")
        cfg = call.get("config.dump")
        carried = criu_notes(spec) + criu_notes(cfg.get("spec") if isinstance(cfg, dict) else None)
        assert not carried, (f"carried across: {carried}", what)
    why = hostile_by_construction(case)
    if why:  # archive_bounded, archive_names_canonical, archive_authenticity
        assert result["rc"] != 0 and not restores, (f"not refused: {why}", result, what)
    name = case["name"]
    for call in calls:  # remove_only_own: a value from outside goes after "--"
        argv = call["argv"]
        for value in (name, "-rf", "x" * 5000):
            if value and value in argv and argv[:2] != ["container", "restore"]:
                assert "--" in argv and argv.index("--") < argv.index(value), (argv, what)


@fuzz("CUDAHOOK_FUZZ_MIGRATE", 2000)
@given(case=migrate_case())
def test_fuzz_migrate_restore(worker: Worker, base: Path, tools: dict[str, Path],
                              keys: dict[str, Path], case: dict[str, Any]) -> None:
    root = new_root(base)
    node_config(root, tools, case["trust"], keys)
    archive = lay_archive(root, case, keys)
    argv = ["migrate", "restore", str(archive), "--podman", str(tools["podman"]),
            "--timeout", "10", *case["flags"]]
    if case["trust"] == "verify-key":
        argv += ["--verify-key", str(keys["public"])]
    if case["name"] is not None:
        argv.append(f"--name={case['name']}")
    before = snapshot(root, allowed=(*STATE, "podman.log"))
    result = worker.call({"hook": "cli", "argv": argv,
                          "env": env_for(root, FAKE_PODMAN_LOG=str(root / "podman.log")),
                          "cwd": str(root), "stdin": ""})
    tally("migrate restore", result)
    if os.environ.get("CUDAHOOK_FUZZ_DEBUG"):
        print(result["rc"], result["stderr"][:300])
    what = repr({k: v for k, v in case.items() if k != "members"})[:1500] + repr(
        [(m["name"], m["kind"], m["size"], m["data"][:200]) for m in case["members"]])[:2500]
    with verdict("migrate restore"):
        check_migrate(root, case, result, what)
        # The archive and its sidecars as they came; no work directory left in $TMPDIR.
        assert snapshot(root, allowed=(*STATE, "podman.log")) == before, what
    shutil.rmtree(root)


# The bomb, then the archive in a second gzip member: read in bounded time
# (an ended gzip member once made archive.Stream spin until --timeout).
BOMB_THEN_MEMBER = {"members": base_members(), "format": tarfile.GNU_FORMAT, "ending": "zeros",
                    "compress": "bomb-then-member", "cut": None, "sha256": "good", "sig": "none",
                    "trust": None, "archive_kind": "file", "flags": [], "name": None}


def test_archive_bounded__a_bomb_then_a_second_gzip_member_in_bounded_time(
        worker: Worker, base: Path, tools: dict[str, Path], keys: dict[str, Path]) -> None:
    test_fuzz_migrate_restore.hypothesis.inner_test(  # type: ignore[attr-defined]
        worker=worker, base=base, tools=tools, keys=keys, case=BOMB_THEN_MEMBER)


# -- the admin command line ---------------------------------------------------------------------


INT = st.one_of(st.sampled_from(["1", "0", "-1", "PID", "4194305", "9" * 30, "1e3", "٣", " 5",
                                 "0x10", ""]), TEXT)
STR = st.one_of(TEXT, ODD_TEXT, st.just("x" * 5000), st.just("\x1b]0;owned\x07"),
                st.just("GPU-a=GPU-b,GPU-c"), st.just(f"{U0}={U0}"),
                st.just("nvidia.com/gpu=all"), st.just("\u202e\u2066"))
PATH = st.one_of(st.sampled_from(["FILE", "FIFO", "DEVZERO", "DIR", "MISSING", "LINK",
                                  "/proc/self/fd/0", "BUNDLE", "IMAGE", "ARCHIVE", "HUGE",
                                  "x" * 5000, "rel/ative", ""]), TEXT)
PODMAN = st.sampled_from(["PODMAN", "PODMAN", "/bin/false", "", "no-such-podman", "PODMAN --x"])
OPTIONS: dict[str, dict[str, Any]] = {
    "discover": {"--init-pid": INT, "--checkpointed": None},
    "checkpoint": {"--pid": INT, "--init-pid": INT, "--sequential": None,
                   "--lock-timeout-ms": INT},
    "restore": {"--pid": INT, "--init-pid": INT, "--device-map": STR, "--source-gpus": STR,
                "--target-gpus": STR, "--sequential": None},
    "state": {"--pid": INT},
    "gpus": {},
    "features": {},
    "status": {"--manifest": PATH, "--no-live": None},
    "check": {"--container": STR, "--init-pid": INT, "--pid": INT, "--image": PATH,
              "--image-dir": PATH, "--bundle": PATH, "--visible-gpus": STR, "--fresh": None},
    "doctor": {},
    "configure": {"--runtime": st.one_of(st.sampled_from(["runc", "containerd", "docker",
                                                          "podman", "crio"]), STR),
                  "--dry-run": None, "--revert": None, "--default": None,
                  "--criu-registration": st.one_of(st.sampled_from(["global", "gpu-only"]), STR),
                  "--hooks-dir": PATH},
    "migrate checkpoint": {"": STR, " ": PATH, "--leave-running": None,
                           "--compress": st.one_of(st.just("gzip"), STR), "--podman": PODMAN,
                           "--timeout": st.sampled_from(["5", "0", "-1", "nan", "inf", "1e308"])},
    "migrate restore": {"": PATH, "--name": STR, "--gpus": STR, "--no-verify": None,
                        "--dry-run": None, "--work-dir": PATH, "--podman": PODMAN,
                        "--timeout": st.sampled_from(["5", "0", "-1", "nan", "inf", "1e308"])},
}
COMMON = {"--json": None, "--config": PATH, "--help": None}


@st.composite
def cli_case(draw: st.DrawFn) -> tuple[str, list[str]]:
    cmd = draw(st.sampled_from(sorted(OPTIONS)))
    argv = cmd.split()
    opts = {**OPTIONS[cmd], **COMMON}
    for name in draw(st.lists(st.sampled_from(sorted(opts)), max_size=4)):
        if name == "--help" and draw(st.integers(0, 4)):
            continue
        value = opts[name]
        if name.strip() == "":  # a positional argument
            argv.append(draw(value))
        elif value is None:
            argv.append(name)
        elif draw(st.booleans()):
            argv += [name, draw(value)]
        else:
            argv.append(f"{name}={draw(value)}")
    if draw(st.integers(0, 5)) == 0:
        argv.insert(draw(st.integers(0, len(argv))), draw(STR))
    if cmd == "migrate checkpoint" and "--podman" not in " ".join(argv):
        argv += ["--podman", "PODMAN"]  # never the node's own podman
    return cmd, argv


def lay_cli(root: Path, tools: dict[str, Path], sleeper: int) -> dict[str, str]:
    (root / "file").write_text('{"nvidia_smi": 1}\n')
    os.mkfifo(root / "fifo")
    (root / "dir").mkdir()
    (root / "link").symlink_to("/dev/zero")
    with open(root / "huge", "wb") as f:
        f.truncate((64 << 20) + 1)
    bundle = root / "bundle"
    bundle.mkdir()
    (bundle / "config.json").write_text(json.dumps(SPEC))
    image = root / "image"
    image.mkdir()
    (image / "cudahook-manifest.json").write_text(json.dumps(GOOD_MANIFEST))
    case = {"members": base_members(), "format": tarfile.GNU_FORMAT, "ending": "zeros",
            "compress": "gzip", "cut": None, "sha256": "good", "sig": "none",
            "archive_kind": "file"}
    archive = lay_archive(root, case)
    return {"FILE": str(root / "file"), "FIFO": str(root / "fifo"), "DEVZERO": "/dev/zero",
            "DIR": str(root / "dir"), "MISSING": str(root / "missing"),
            "LINK": str(root / "link"), "BUNDLE": str(bundle), "IMAGE": str(image),
            "ARCHIVE": str(archive), "HUGE": str(root / "huge"), "PID": str(sleeper),
            "PODMAN": str(tools["podman"]), "PODMAN --x": f"{tools['podman']} --x"}


@pytest.fixture(scope="module")
def sleeper() -> Iterator[int]:
    p = subprocess.Popen(["sleep", "3600"], start_new_session=True)
    yield p.pid
    p.kill()
    p.wait()


@fuzz("CUDAHOOK_FUZZ_CLI", 2000)
@given(case=cli_case())
def test_fuzz_admin_cli(worker: Worker, base: Path, tools: dict[str, Path], sleeper: int,
                        case: tuple[str, list[str]]) -> None:
    cmd, raw = case
    root = new_root(base)
    subst = lay_cli(root, tools, sleeper)
    argv = [subst.get(a, a).replace("\x00", "") for a in raw]
    # configure writes the runtimes' files, under the node root it is given.
    allowed = (*STATE, "podman.log", "etc", "usr", "opt", "var/lib") if cmd == "configure" \
        else (*STATE, "podman.log")
    before = snapshot(root, allowed=allowed)
    result = worker.call({"hook": "cli", "argv": argv,
                          "env": env_for(root, FAKE_PODMAN_LOG=str(root / "podman.log")),
                          "cwd": str(root), "stdin": "", "killable": [sleeper]})
    tally(f"cli {cmd}", result)
    tally("cli (all)", result)
    with verdict("cli (all)"):
        check_cli(result, repr(argv)[:3000])
        assert snapshot(root, allowed=allowed) == before, argv
    shutil.rmtree(root)


# -- the runtime wrapper ------------------------------------------------------------------------


CRIU_TARGETS = st.one_of(st.sampled_from([
    "EVIL", "EVIL_SUFFIX", "FIFO", "/dev/zero", "DEVZERO_LINK", "LINK", "DIR", "HUGE",
    "/proc/self/fd/0", "", "rel/path.conf", "x" * 5000, "a\tb", "/etc/criu/x\nlog-file /tmp/y",
    "OTHER_COPY", "COPY_DOTDOT", "OPERATOR"]), TEXT)
RUNC_CONF = st.sampled_from(["absent", "empty", "global", "gpu-only", "suffix", "options"])


@st.composite
def wrapper_case(draw: st.DrawFn) -> dict[str, Any]:
    kind, content = draw(config_json())
    notes = {}
    for key in draw(st.lists(st.sampled_from(["org.criu.config", "cudahook.io/criu-config"]),
                             unique=True, max_size=2)):
        notes[key] = draw(CRIU_TARGETS)
    return {"config": (kind, content), "gpu": draw(st.sampled_from(["env", "env", "none",
                                                                   "enabled"])),
            "criu_notes": notes, "runc_conf": draw(RUNC_CONF),
            "command": draw(st.sampled_from(["create", "create", "run", "restore", "start",
                                             "delete"])),
            "cid": draw(st.one_of(st.sampled_from(["c1", "gpu-1", "a.b_c+d-e"]), TEXT)),
            "log": draw(st.sampled_from(["none", "text", "json"])),
            "bundle_flag": draw(st.sampled_from(["--bundle", "-b", "--bundle=", "cwd"]))}


def with_notes(content: bytes, case: dict[str, Any], targets: dict[str, str]) -> bytes:
    try:
        cfg = json.loads(content)
    except (ValueError, RecursionError):
        return content
    if not isinstance(cfg, dict):
        return content
    notes = cfg.get("annotations")
    if not isinstance(notes, dict):
        notes = cfg["annotations"] = {}
    for key, target in case["criu_notes"].items():
        notes[key] = targets.get(target, target)
    process = cfg.get("process")
    if case["gpu"] == "env" and isinstance(process, dict):
        env = process.get("env")
        process["env"] = [*(env if isinstance(env, list) else []), "NVIDIA_VISIBLE_DEVICES=all"]
    elif case["gpu"] == "enabled":
        notes["cudahook.io/enabled"] = "true"
    return json.dumps(cfg).encode("utf-8", "surrogatepass")


def lay_wrapper(root: Path, case: dict[str, Any]) -> tuple[Path, dict[str, str], Path]:
    hooks = root / "libexec"
    hooks.mkdir()
    script = hooks / "cudahook-criu-action"
    evil = root / "evil.conf"
    evil.write_text(f"action-script /tmp/{EVIL}\n# {EVIL}\n")
    (root / "evil-suffix.conf").write_text(f"action-script /tmp/{EVIL}/cudahook-criu-action\n")
    os.mkfifo(root / "fifo.conf")
    (root / "link.conf").symlink_to("evil.conf")
    (root / "devzero.conf").symlink_to("/dev/zero")
    (root / "dir.conf").mkdir()
    with open(root / "huge.conf", "wb") as f:
        f.truncate(1 << 20)
    copies = root / "run" / "cudahook" / "criu"
    copies.mkdir(parents=True, mode=0o700)
    os.chmod(root / "run" / "cudahook", 0o700)
    (copies / "other.conf").write_text(f"action-script /tmp/{EVIL}\n")
    conf = root / "etc" / "criu" / "runc.conf"
    conf.parent.mkdir(parents=True)
    text = {"empty": "", "global": f"action-script {script}\n",
            "gpu-only": f"# cudahook: gpu-only registration of {script} (the runtime wrapper "
                        "names it for GPU containers only)\n",
            "suffix": "action-script /opt/elsewhere/cudahook-criu-action\n",
            "options": "tcp-established\n"}
    if case["runc_conf"] in text:
        conf.write_text(text[case["runc_conf"]])
    targets = {"EVIL": str(evil), "EVIL_SUFFIX": str(root / "evil-suffix.conf"),
               "FIFO": str(root / "fifo.conf"), "DEVZERO_LINK": str(root / "devzero.conf"),
               "LINK": str(root / "link.conf"), "DIR": str(root / "dir.conf"),
               "HUGE": str(root / "huge.conf"), "OTHER_COPY": str(copies / "other.conf"),
               "COPY_DOTDOT": str(copies / ".." / ".." / ".." / "evil.conf"),
               "OPERATOR": str(conf)}
    bundle = root / "bundle"
    bundle.mkdir()
    kind, content = case["config"]
    if kind != "none":
        lay(bundle / "config.json", kind, with_notes(content, case, targets), cap=4 << 20)
    return bundle, targets, hooks / "cudahook-oci-hook"


def runc_args(root: Path, case: dict[str, Any], bundle: Path) -> list[str]:
    args = ["--root", str(root / "runc-state")]
    if case["log"] != "none":
        args += ["--log", str(root / "runc.log")]
        if case["log"] == "json":
            args += ["--log-format", "json"]
    args.append(case["command"])
    flag = case["bundle_flag"]
    if flag == "--bundle=":
        args.append(f"--bundle={bundle}")
    elif flag != "cwd":
        args += [flag, str(bundle)]
    args += ["--pid-file", str(root / "pid"), case["cid"].replace("\x00", "")]
    return args


def effective_criu_config(root: Path, bundle: Path) -> tuple[str | None, str]:
    """The CRIU configuration runc will hand CRIU for this bundle: (the
    annotation's value or None for runc's default file, that file's text)."""
    try:
        current = snapshot_config(bundle)
        cfg = json.loads(current[1]) if isinstance(current, tuple) else {}
        note = cfg["annotations"].get("org.criu.config")
    except (OSError, ValueError, KeyError, AttributeError, TypeError):
        return None, ""
    path = note if isinstance(note, str) else None
    if path == "":
        return "", ""
    target = Path(path) if path else root / "etc" / "criu" / "runc.conf"
    try:
        st_ = target.lstat()
        text = target.read_text(errors="replace") if stat.S_ISREG(st_.st_mode) else ""
    except OSError:
        text = ""
    return path, text


def check_wrapper(root: Path, bundle: Path, args: list[str], runc: str,
                  result: dict[str, Any], before_config: Any, what: str) -> None:
    assert_bounded(result, what)
    # never_break_plain_container: runc runs, with the arguments unchanged.
    assert result["exec"] == [runc, *args], (result, what)
    err = result["stderr"]
    assert not unsafe_chars(err + result["stdout"]), (err, what)
    assert len(err.splitlines()) <= 1, (err, what)
    log = root / "runc.log"
    if log.exists():
        text = log.read_text(errors="replace")
        assert not unsafe_chars(text), (text, what)
        # One warning at most (the info line that the hooks went in may follow).
        warnings = [x for x in text.splitlines() if "warning" in x or "error" in x]
        assert len(warnings) <= 1, (text, what)
    after = snapshot_config(bundle)
    if after != before_config:  # the wrapper wrote config.json
        # operator_only_criu_config: what runc hands CRIU is the operator's file or
        # cudahook's copy of it, never a file the container named.
        path, text = effective_criu_config(root, bundle)
        copies = root / "run" / "cudahook" / "criu"
        where = os.path.dirname(os.path.normpath(path)) if path else ""
        assert path in (None, "") or where in (str(root / "etc" / "criu"), "/etc/criu") or (
            where == str(copies) and Path(path).name != "other.conf"), (path, what)
        # Comments may keep what the container wrote; no option line may.
        options = [x for x in text.splitlines() if x.strip() and not x.lstrip().startswith("#")]
        assert not [x for x in options if EVIL in x], (path, text, what)


def snapshot_config(bundle: Path) -> Any:
    """config.json as it is now (never opened unless a regular file: it may be a FIFO)."""
    path = bundle / "config.json"
    try:
        st_ = path.lstat()
        if not stat.S_ISREG(st_.st_mode):
            return stat.S_IFMT(st_.st_mode)
        return st_.st_mtime_ns, path.read_bytes()
    except OSError:
        return None


@fuzz("CUDAHOOK_FUZZ_WRAPPER", 2000)
@given(case=wrapper_case())
def test_fuzz_runtime_wrapper(worker: Worker, base: Path, tools: dict[str, Path],
                              case: dict[str, Any]) -> None:
    root = new_root(base)
    bundle, _targets, hook = lay_wrapper(root, case)
    args = runc_args(root, case, bundle)
    allowed = (*STATE, "bundle/config.json", "runc.log")
    before = snapshot(root, allowed=allowed)
    before_config = snapshot_config(bundle)
    cwd = bundle if case["bundle_flag"] == "cwd" else root
    result = worker.call({"hook": "wrapper", "argv": [str(tools["runc"]), str(hook), *args],
                          "env": env_for(root), "cwd": str(cwd), "stdin": ""})
    tally("runtime wrapper", result)
    what = repr(case)[:3000]
    with verdict("runtime wrapper"):
        check_wrapper(root, bundle, args, str(tools["runc"]), result, before_config, what)
        assert snapshot(root, allowed=allowed) == before, what
    shutil.rmtree(root)


# A GPU container whose id the wrapper refuses, naming its own CRIU file:
# one warning line, not one for each (the id is checked before the file).
TWO_WARNINGS = {"config": ("file", json.dumps(SPEC).encode()), "gpu": "env",
                "criu_notes": {"org.criu.config": "EVIL"}, "runc_conf": "absent",
                "command": "create", "cid": "a\rb", "log": "none", "bundle_flag": "--bundle"}


def test_never_break_plain_container__one_warning_for_a_refused_id(
        worker: Worker, base: Path, tools: dict[str, Path]) -> None:
    root = new_root(base)
    bundle, _, hook = lay_wrapper(root, TWO_WARNINGS)
    args = runc_args(root, TWO_WARNINGS, bundle)
    result = worker.call({"hook": "wrapper", "argv": [str(tools["runc"]), str(hook), *args],
                          "env": env_for(root), "cwd": str(root), "stdin": ""})
    assert result["exec"] == [str(tools["runc"]), *args], result
    assert result["stderr"].count("\n") == 1, result["stderr"]


@pytest.fixture(scope="module")
def installed(tmp_path_factory: pytest.TempPathFactory, tools: dict[str, Path]
              ) -> dict[str, Path]:
    old = os.environ.pop("CUDAHOOK_ROOT", None)  # each case passes its own root
    try:
        # runc: the stand-in (the installed wrapper names it once, at install).
        return hookfiles.install(tmp_path_factory.mktemp("hooks"), python=sys.executable,
                                 runc=str(tools["runc"]))
    finally:
        if old is not None:
            os.environ["CUDAHOOK_ROOT"] = old


@fuzz("CUDAHOOK_FUZZ_SHELL", 100)
@given(case=wrapper_case())
def test_fuzz_installed_runtime_wrapper(installed: dict[str, Path], base: Path,
                                        tools: dict[str, Path], case: dict[str, Any]) -> None:
    """The shell wrapper as containerd and docker start it: runc always runs,
    with its arguments unchanged, whatever the bundle holds."""
    root = new_root(base)
    bundle, _targets, _ = lay_wrapper(root, case)
    args = runc_args(root, case, bundle)
    allowed = (*STATE, "bundle/config.json", "runc.log", "runc-calls")
    before = snapshot(root, allowed=allowed)
    env = env_for(root, FAKE_RUNC_LOG=str(root / "runc-calls"))
    cwd = bundle if case["bundle_flag"] == "cwd" else root
    result = run_installed([str(installed["cudahook-runtime"]), *args], env, b"", cwd)
    tally("runtime wrapper (installed)", result)
    what = repr(case)[:3000]
    with verdict("runtime wrapper (installed)"):
        assert not result.get("hang") and result["rc"] == 0, (result, what)
        calls = [json.loads(x) for x in (root / "runc-calls").read_text().splitlines()]
        assert calls == [args], (calls, what)
        err = result["stderr"]
        assert len(err.splitlines()) <= 1, (err, what)
        assert not unsafe_chars(err), (err, what)
        assert snapshot(root, allowed=allowed) == before, what
    shutil.rmtree(root)


# -- config.yaml --------------------------------------------------------------------------------


KEYS = ["backend", "lock_timeout_ms", "call_timeout_s", "max_parallel", "state_dir", "log_file",
        "sequential", "device_pattern", "metrics_file", "guardian_wait_s", "nvidia_smi"]
BAD_VALUES = [".nan", ".NaN", ".inf", "-.inf", "1e309", "9" * 5000, "0x7fffffffffffffffffff",
              "[1, 2]", "{a: 1}", "!!binary aGVsbG8=", "!!python/object/apply:os.system ['id']",
              "!!set {a}", "&a [*a]", "\"\\x1b[2J\\u202e\"", "\"a\\nb\"", "\"\"", "~",
              "2001-12-14", "!!float nan", "'(?P<x'", "'((((((((((((((((((((a*)*)*)*)*)*)*)*)*)*)'"]
GOOD_VALUES = {"backend": "cli", "lock_timeout_ms": "500", "call_timeout_s": "5", "max_parallel": "4",
               "sequential": "true", "guardian_wait_s": "1"}


def alias_bomb(depth: int, width: int) -> str:
    lines = ["a0: &a0 [x, y]"]
    for i in range(1, depth + 1):
        refs = ", ".join(f"*a{i - 1}" for _ in range(width))
        lines.append(f"a{i}: &a{i} [{refs}]")
    return "\n".join(lines) + "\n"


@st.composite
def config_case(draw: st.DrawFn) -> dict[str, Any]:
    """(kind of file, its bytes, whether it must be refused with exit 3)."""
    kind = draw(st.sampled_from(["yaml"] * 10 + ["bomb", "bomb", "bytes", "fifo", "dev-zero",
                                                 "symlink", "directory", "huge", "proc-stdin",
                                                 "missing", "run-state-dir"]))
    if kind == "bomb":
        depth, width = draw(st.integers(3, 9)), draw(st.integers(4, 9))
        where = draw(st.sampled_from(["top", "value"]))
        text = alias_bomb(depth, width)
        if where == "value":  # under a known key: the schema must not walk it all either
            text = text.replace("\na", "\n  a").replace("a0:", "state_dir:\n  a0:", 1)
        return {"kind": "file", "content": text.encode(), "bad": True}
    if kind == "bytes":
        data = draw(st.one_of(st.binary(max_size=80), st.just(b"state_dir: \xff\xfe/x\n"),
                              st.just(b"\xef\xbb\xbfbackend: cli\n\x80"),
                              st.just("state_dir: \udc80\n".encode("utf-8", "surrogatepass"))))
        try:
            data.decode("utf-8")
            bad = None
        except UnicodeDecodeError:
            bad = True
        return {"kind": "file", "content": data, "bad": bad}
    if kind == "run-state-dir":  # own_directories_only: a typo naming a directory not its own
        return {"kind": "file", "content": draw(st.sampled_from(
            ["state_dir: ROOT/run\n", "state_dir: ROOT\n", "state_dir: ROOT/etc\n",
             "state_dir: /\n", "log_file: ROOT/run\n"])).encode(), "bad": None}
    if kind != "yaml":
        # Given explicitly, a missing file is an error too; a symlink to a good
        # file (a Kubernetes ConfigMap) is the operator's to choose.
        return {"kind": kind, "content": b"backend: cli\n", "bad": kind != "symlink" or None}
    lines, bad = [], False
    for key in draw(st.lists(st.sampled_from([*KEYS, "unknown_key", "", "1", "? [a]"]),
                             max_size=4, unique=True)):
        if draw(st.booleans()) and key in GOOD_VALUES:
            lines.append(f"{key}: {GOOD_VALUES[key]}")
            continue
        value = draw(st.one_of(st.sampled_from(BAD_VALUES), TEXT.map(json.dumps)))
        lines.append(f"{key}: {value}")
        if key in ("lock_timeout_ms", "max_parallel", "call_timeout_s", "guardian_wait_s",
                   "sequential") and value in BAD_VALUES[:12]:
            bad = True  # not a number (or not a boolean) the schema allows
        if key in ("unknown_key", "1"):
            bad = True
    text = "\n".join(lines) + "\n"
    shape = draw(st.sampled_from(["map"] * 6 + ["list", "scalar", "deep", "tabs"]))
    if shape == "list":
        text, bad = "- " + text.replace("\n", "\n  "), True
    elif shape == "scalar":
        text, bad = draw(st.sampled_from(["42\n", "'x'\n", ".nan\n", "[]\n"])), True
    elif shape == "deep":
        text, bad = "a: " + "[" * 3000 + "]" * 3000 + "\n", True
    elif shape == "tabs":
        text, bad = "backend:\tcli\n\tstate_dir: x\n", True
    return {"kind": "file", "content": text.encode("utf-8", "surrogatepass"),
            "bad": bad or None}


def lay_config(root: Path, case: dict[str, Any]) -> str:
    path = root / "etc" / "cudahook" / "config.yaml"
    kind = case["kind"]
    if kind == "proc-stdin":
        return "/proc/self/fd/0"
    if kind == "missing":
        return str(path)
    content = case["content"].replace(b"ROOT", str(root).encode())
    lay(path, kind, content, cap=64 << 20)
    return str(path)


@fuzz("CUDAHOOK_FUZZ_CONFIG", 2000)
@given(case=config_case(), how=st.sampled_from(["argument", "argument", "environment"]),
       command=st.sampled_from([["status", "--no-live"], ["status", "--no-live", "--json"],
                                ["check", "--pid", "1"]]))
def test_fuzz_config_yaml(worker: Worker, base: Path, case: dict[str, Any], how: str,
                          command: list[str]) -> None:
    root = new_root(base)
    path = lay_config(root, case)
    before = snapshot(root, allowed=STATE)
    env = env_for(root)
    argv = list(command)
    if how == "argument":
        argv += ["--config", path]
    else:
        env["CUDAHOOK_CONFIG"] = path
    # fd 0 is a pipe nobody writes to: /proc/self/fd/0 would block on it.
    result = worker.call({"hook": "cli", "argv": argv, "env": env, "cwd": str(root),
                          "stdin": "", "fd0": "pipe"})
    tally("config.yaml", result)
    what = f"{how} {command} {case!r}"[:3000]
    with verdict("config.yaml"):
        check_cli(result, what)
        if case["bad"]:  # config_fails_cleanly
            assert result["rc"] == Exit.CONFIG, (result["rc"], result["stderr"], what)
        # own_directories_only: nothing outside the state changed (modes included).
        assert snapshot(root, allowed=STATE) == before, what
    shutil.rmtree(root)


# -- GPU memory in storage: the image's cudahook-gpu/ and the manifest's gpu_storage -------------


STORAGE_CHUNK = 4096  # the smallest chunk size: a few chunks per example
# Integrity problems: one of these for an image whose chunks were tampered with.
IMAGE_REASONS = {"IMAGE_CHECKSUM", "IMAGE_FILE_MISSING", "MANIFEST_UNREADABLE"}
CHUNK_ATTACKS = ["truncate", "extend", "flip", "symlink-devzero", "symlink-other", "dangling",
                 "fifo", "directory", "missing", "bad-frame", "bomb", "unsized-bomb",
                 "two-frames", "foreign-link"]
ENTRY_ATTACKS = ["digest-kind", "digest-text", "zstd-length", "zstd-size", "zstd-negative",
                 "zstd-type", "chunks-count", "chunk-hex", "chunk-size", "dir-traversal",
                 "nspid", "version-2", "extra-key", "deep", "sizes", "proc-manifest"]
DIR_ATTACKS = ["storage-symlink", "process-symlink", "index-left", "odd-names"]


@st.composite
def storage_case(draw: st.DrawFn) -> dict[str, Any]:
    """A good image of two processes holding the same weights (blake3, shared
    chunks as hard links, compressed where that shrinks), then 0-3 attacks on
    its chunk files, its manifest's gpu_storage entries and its directories."""
    procs = draw(st.sampled_from([[7], [7, 9]]))
    content = [draw(st.sampled_from(["zeros", "ramp", "random"])) for _ in range(3)]
    compress = [draw(st.booleans()) for _ in range(3)]
    attacks = draw(st.lists(st.one_of(
        st.tuples(st.just("chunk"), st.sampled_from(CHUNK_ATTACKS), st.sampled_from(procs),
                  st.integers(0, 2)),
        st.tuples(st.just("entry"), st.sampled_from(ENTRY_ATTACKS), st.sampled_from(procs),
                  st.integers(0, 2)),
        st.tuples(st.just("dir"), st.sampled_from(DIR_ATTACKS), st.sampled_from(procs),
                  st.just(0))), max_size=3, unique_by=lambda a: a[:2]))
    return {"procs": procs, "content": content, "compress": compress, "attacks": attacks,
            "junk": draw(st.one_of(JSON, TEXT))}


def chunk_bytes(label: str, k: int) -> bytes:
    import random

    return {"zeros": bytes(STORAGE_CHUNK), "ramp": bytes(range(256)) * 16,
            "random": random.Random(k).randbytes(STORAGE_CHUNK)}[label]


def _frame(data: bytes, **kw: Any) -> bytes:
    import zstandard

    return zstandard.ZstdCompressor(level=3, **kw).compress(data)


def lay_storage(root: Path, case: dict[str, Any]) -> tuple[Path, bool]:
    """The image for `case`; whether an attack must show as an integrity
    problem (every attack but those on names nobody reads)."""
    import hashlib

    import blake3

    image = root / "image"
    store = image / "cudahook-gpu"
    chunks = [chunk_bytes(label, k) for k, label in enumerate(case["content"])]
    frames: list[bytes | None] = []
    for data, packed in zip(chunks, case["compress"], strict=True):
        frame = _frame(data) if packed else b""
        frames.append(frame if packed and len(frame) < len(data) else None)
    rng: dict[str, Any] = {"size": 3 * STORAGE_CHUNK,
                           "chunks": [blake3.blake3(c).hexdigest() for c in chunks],
                           "zstd": [0 if f is None else len(f) for f in frames]}
    first: dict[tuple[bytes, bytes | None], Path] = {}
    procs = []
    for nspid in case["procs"]:
        d = store / str(nspid)
        d.mkdir(parents=True)
        for k, (data, frame) in enumerate(zip(chunks, frames, strict=True)):
            path = d / f"gpu0-{k:06d}.chunk"
            if (data, frame) in first:  # dedupe: one file, linked
                os.link(first[data, frame], path)
            else:
                path.write_bytes(data if frame is None else frame)
                first[data, frame] = path
        own = json.dumps({"format": 2, "digest": "blake3", "chunk": STORAGE_CHUNK,
                          "ranges": [rng]}).encode()
        (d / "manifest.json").write_bytes(own)
        procs.append({"nspid": nspid, "chunk": STORAGE_CHUNK,
                      "manifest": {"sha256": hashlib.sha256(own).hexdigest(), "size": len(own)},
                      "ranges": [json.loads(json.dumps(rng))]})
    man: dict[str, Any] = {**GOOD_MANIFEST, "version": 3,
                           "processes": [{"nspid": n, "pid": 4242 + n, "state": "running"}
                                         for n in case["procs"]],
                           "gpu_storage": {"dir": "cudahook-gpu", "digest": "blake3",
                                           "processes": procs}}
    integrity = False
    entries = dict(zip(case["procs"], procs, strict=True))
    attacked: dict[Path, bytes] = {}  # each attacked chunk file's bytes before
    for where, attack, nspid, k in case["attacks"]:
        entry = entries[nspid]
        path = store / str(nspid) / f"gpu0-{k:06d}.chunk"
        if where == "chunk":
            if path not in attacked and path.is_file() and not path.is_symlink():
                attacked[path] = path.read_bytes()
            _attack_chunk(store, path, attack, entry, k, chunks[k])
        elif where == "entry":
            was = json.dumps(man, sort_keys=True)
            _attack_entry(man, entry, attack, k, case["junk"])
            # junk can be what was there (an nspid of 7): only a change tampers
            integrity |= json.dumps(man, sort_keys=True) != was
        else:
            integrity |= _attack_dir(store, attack, nspid)
    # Attacks can undo each other (extend, then truncate; flip twice): only a
    # chunk that ends up other than it was is tampered.
    integrity |= any(not path.is_file() or path.is_symlink() or path.read_bytes() != before
                     for path, before in attacked.items())
    (image / "cudahook-manifest.json").write_text(json.dumps(man))
    return image, integrity


def _attack_chunk(store: Path, path: Path, attack: str, entry: dict[str, Any], k: int,
                  raw: bytes) -> None:
    rng = entry["ranges"][0]
    if not path.is_file() or path.is_symlink():  # an earlier attack's: tampered already
        return
    data = path.read_bytes()
    if attack in ("bomb", "unsized-bomb", "two-frames", "bad-frame"):
        frame = {"bomb": _frame(raw * 1024),
                 "unsized-bomb": _frame(raw * 64, write_content_size=False),
                 "two-frames": _frame(raw) + _frame(raw),
                 "bad-frame": b"\x28\xb5\x2f\xfd" + bytes(40)}[attack]
        if len(frame) >= STORAGE_CHUNK:
            frame = frame[:STORAGE_CHUNK - 1]
        path.unlink()  # a file of its own: the other links keep theirs
        path.write_bytes(frame)
        _put(rng, "zstd", k, len(frame))  # the manifest agrees on its size: the frame lies
        return
    path.unlink()
    if attack == "truncate":
        path.write_bytes(data[:-1])
    elif attack == "extend":
        path.write_bytes(data + b"\0")
    elif attack == "flip":
        path.write_bytes(bytes([data[0] ^ 1]) + data[1:])
    elif attack == "symlink-devzero":
        path.symlink_to("/dev/zero")
    elif attack == "symlink-other":  # the same bytes, through a link
        (store.parent / "elsewhere").write_bytes(data)
        path.symlink_to(store.parent / "elsewhere")
    elif attack == "dangling":
        path.symlink_to(store / "nowhere")
    elif attack == "fifo":
        os.mkfifo(path)
    elif attack == "directory":
        path.mkdir()
    elif attack == "foreign-link":  # a hard link to a file outside the image
        outside = store.parent.parent / "outside"
        outside.write_bytes(b"secret" * 100)
        os.link(outside, path)


def _attack_entry(man: dict[str, Any], entry: dict[str, Any], attack: str, k: int,
                  junk: Any) -> None:
    rng = entry["ranges"][0]
    if attack == "digest-kind":
        man["gpu_storage"]["digest"] = "sha256"  # the chunks are blake3's
    elif attack == "digest-text":
        man["gpu_storage"]["digest"] = junk
    elif attack == "zstd-length":
        rng["zstd"] = rng["zstd"][:-1] if isinstance(rng["zstd"], list) else []
    elif attack == "zstd-size":
        _put(rng, "zstd", k, STORAGE_CHUNK)
    elif attack == "zstd-negative":
        _put(rng, "zstd", k, -1)
    elif attack == "zstd-type":
        rng["zstd"] = junk
    elif attack == "chunks-count":
        rng["chunks"] = rng["chunks"][:-1]
    elif attack == "chunk-hex":
        _put(rng, "chunks", k, "../../etc/passwd".ljust(64, "0"))
    elif attack == "chunk-size":
        entry["chunk"] = junk
    elif attack == "dir-traversal":
        man["gpu_storage"]["dir"] = "../../etc"
    elif attack == "nspid":
        entry["nspid"] = junk
    elif attack == "version-2":
        man["version"] = 2
    elif attack == "extra-key":
        rng["\x1b[31mred"] = junk
        entry["chunks"] = [1] * 3  # a key the schema does not know: kept away from use
        k = min(k, len(rng["chunks"]) - 1)  # and a real digest mismatch (equal chunks
        d = rng["chunks"][k]  # share digests)
        rng["chunks"][k] = d[:-1] + ("1" if d[-1] == "0" else "0")
    elif attack == "deep":
        rng["zstd"] = json.loads("[" * 200 + "]" * 200)
    elif attack == "sizes":
        rng["size"] = junk
    elif attack == "proc-manifest":
        entry["manifest"]["sha256"] = "0" * 64


def _put(rng: dict[str, Any], key: str, k: int, value: Any) -> None:
    """Item k of rng[key] set to value; an earlier attack may have left that
    list shorter, or no list at all: then the last item, or the whole field."""
    items = rng[key]
    if isinstance(items, list) and items:
        items[min(k, len(items) - 1)] = value
    else:
        rng[key] = [value]


def _attack_dir(store: Path, attack: str, nspid: int) -> bool:
    import shutil as sh

    if attack == "storage-symlink":
        if store.is_symlink():
            return True
        sh.move(store, store.parent / "real-gpu")
        store.symlink_to("real-gpu")
        return True
    if attack == "process-symlink":
        if not (store / str(nspid)).is_dir() or (store / str(nspid)).is_symlink():
            return True
        sh.move(store / str(nspid), store.parent / f"real-{nspid}")
        (store / str(nspid)).symlink_to(store.parent / f"real-{nspid}")
        return True
    if attack == "index-left" and store.is_dir() and not store.is_symlink():
        (store / "by-digest").mkdir(exist_ok=True)
        (store / "by-digest" / "x").symlink_to("/etc/shadow")
        return False  # nothing reads the index at restore
    if attack == "odd-names" and store.is_dir() and not store.is_symlink():
        (store / "\x1b]0;title\x07.chunk").write_bytes(b"x")
        (store / "..chunk").write_bytes(b"x")
    return False


@fuzz("CUDAHOOK_FUZZ_STORAGE", 200)
@given(case=storage_case())
@example(case={"procs": [7], "content": ["ramp", "ramp", "zeros"],  # attacks that undo
               "compress": [False, True, True], "junk": True,  # each other: untampered
               "attacks": [("chunk", "extend", 7, 0), ("chunk", "truncate", 7, 0)]})
def test_fuzz_gpu_storage_image(worker: Worker, base: Path, tools: dict[str, Path],
                                case: dict[str, Any]) -> None:
    """`cudahook check --image` over a GPU-memory image from a supplier: the
    admin command line's contract; the image unchanged (a chunk read never
    writes, a link never followed, no FIFO waited on); a tampered image
    reported as one (never passed); an untampered one never reported."""
    root = new_root(base)
    node_config(root, tools)
    image, integrity = lay_storage(root, case)
    before = snapshot(root, allowed=STATE)
    result = worker.call({"hook": "cli", "argv": ["--json", "check", "--image", str(image)],
                          "env": env_for(root), "cwd": str(root), "stdin": ""})
    tally("gpu storage image", result)
    what = repr(case)[:3000]
    with verdict("gpu storage image"):
        check_cli(result, what)
        assert snapshot(root, allowed=STATE) == before, what
        out = json.loads(result["stdout"]) if result["stdout"].strip() else {}
        codes = {p["code"] for p in out.get("problems", [])}
        if integrity:  # tampered: never passes
            assert result["rc"] != 0 and codes & IMAGE_REASONS, (result, what)
        else:  # only this cli node's missing custom storage
            assert not codes & IMAGE_REASONS, (codes, result["stdout"][:2000], what)
    shutil.rmtree(root)


@fuzz("CUDAHOOK_FUZZ_STORAGE", 300)
@given(data=st.one_of(JSON.map(as_bytes), DEEP.map(str.encode), st.binary(max_size=200),
                      st.fixed_dictionaries({
                          "format": st.sampled_from([1, 2, 3, "2", None]),
                          "digest": st.sampled_from(["blake3", "sha256", "md5", "", None]),
                          "chunk": st.one_of(st.integers(-1, 1 << 31), TEXT),
                          "ranges": st.lists(st.fixed_dictionaries({
                              "size": st.one_of(st.integers(-1, 1 << 50), TEXT),
                              "chunks": st.lists(st.sampled_from(["a" * 64, "A" * 64, "g" * 64,
                                                                  "a" * 63, 5]), max_size=3),
                              "zstd": st.one_of(JSON, st.lists(st.integers(-1, 1 << 31),
                                                               max_size=3))}), max_size=3),
                      }).map(as_bytes)))
def test_fuzz_gpu_storage_process_manifest(tmp_path_factory: pytest.TempPathFactory,
                                           data: bytes) -> None:
    """The helper's own reading of a process's manifest.json (restore side):
    one refusal or a manifest every later step can use, never an exception
    of another kind."""
    from cudahook.core.backends import driver_helper as helper

    d = tmp_path_factory.mktemp("m")
    (d / "manifest.json").write_bytes(data)
    fd = os.open(d, os.O_RDONLY | os.O_DIRECTORY)
    try:
        m = helper._manifest(fd)
    except helper.Refused as exc:
        assert "\n" not in str(exc)
        return
    finally:
        os.close(fd)
    for rng in m["ranges"]:  # what restore goes on to use, all there and in range
        for k in range(len(rng["chunks"])):
            assert 0 <= helper._zstd(rng, k) < helper._chunk_size(rng["size"], m["chunk"], k)  \
                or helper._zstd(rng, k) == 0
