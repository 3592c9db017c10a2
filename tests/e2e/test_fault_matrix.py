"""The fault matrix: every step of a GPU container's checkpoint and restore,
crossed with the ways it can fail, through real runc and CRIU and the
simulated GPU. CASES below is the matrix; each case is one test id.

Every case ends in one of exactly two outcomes (tests/e2e/outcomes.py):

- checkpoint side: the checkpoint fails and every CUDA process is running
  and intact (state `running` read back from the driver, counter advancing
  after the operation, memory and VMM mappings checked) - except a process
  the fault itself killed, which must be gone;
- restore side: the restore fails, no process of the container is left
  alive, the image is byte-for-byte unchanged, and a retry once the fault is
  cleared brings the workload back healthy from the checkpoint.

Fault kinds: `error` (the driver or tool reports a failure), `hang` (the
call never returns: cudahook's deadline must end it), `crash` (the
cuda-checkpoint tool, the driver-API helper or the VMM coordinator dies of
SIGSEGV, after the driver carried the call out), `target-dies` (the CUDA
process is killed in the middle of the call), `disk-full` (ENOSPC in the
image directory, a small tmpfs in the suite's private mount namespace).

Containers and images are shared between cases, which cannot hide a
failure: a checkpoint-side container is checked healthy by the case that
used it, and recreated when that check failed or a process was killed; a
restore-side image is hashed before each case and restored from only after
the workloads' old status files are gone.
"""

from __future__ import annotations

import contextlib
import errno
import os
import signal
import subprocess
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

from .conftest import Env, needs_runc, private_node
from .outcomes import (
    SharedBoxes,
    assert_nothing_restored,
    assert_running_and_intact,
    image_hashes,
    restore_and_check,
    workload_pids,
)

pytestmark = needs_runc

# Short deadlines, so a hang costs seconds: every outside call has one.
DEADLINES = {"call_timeout_s": 3.0, "lock_timeout_ms": 1000, "vmm_timeout_s": 3.0}

CHECKPOINT_STEPS = ("discovery", "vmm-prepare", "lock", "checkpoint", "verify-checkpointed",
                    "manifest-write", "criu-freeze", "criu-dump")
RESTORE_STEPS = ("post-restore", "restore", "unlock", "vmm-restore", "verify-running")
KINDS = ("error", "hang", "crash", "target-dies", "disk-full")

# The driver call each CUDA step makes, and how many of those calls on the
# victim go through before the fault (the restore side reads states first).
DRIVER_CALLS = {"discovery": ("get-state", 0), "lock": ("lock", 0),
                "checkpoint": ("checkpoint", 0), "verify-checkpointed": ("get-state", 1),
                "restore": ("restore", 0), "unlock": ("unlock", 0),
                "verify-running": ("get-state", 1)}
# The CUDA error each step fails with (cuda.h): a lock that timed out, out of
# memory at checkpoint and restore (cuda-checkpoint #44), unknown elsewhere.
ERROR_CODES = {"lock": 909, "checkpoint": 2, "restore": 2}


@dataclass(frozen=True)
class Case:
    step: str
    kind: str
    workload: str = "plain"  # or "vmm": the CUDA VMM interposer in every process
    backend: str = "driver-api"  # or "cli": the cuda-checkpoint executable
    variant: str = ""

    @property
    def side(self) -> str:
        return "checkpoint" if self.step in CHECKPOINT_STEPS else "restore"

    @property
    def id(self) -> str:
        parts = [self.step, self.kind, self.workload]
        if self.backend != "driver-api":
            parts.append(self.backend)
        if self.variant:
            parts.append(self.variant)
        return "-".join(parts)


def _cuda_steps(steps: tuple[str, ...], kinds: tuple[str, ...] = ("error", "hang", "crash",
                                                                   "target-dies")) -> list[Case]:
    return [Case(s, k) for s in steps for k in kinds]


# The matrix. A step/kind pair that is absent does not apply: the driver
# calls and the post-restore check write nothing to disk, and a restore
# writes nothing into the image; the CRIU steps run no cudahook code to crash
# and no CUDA call whose target could die; the post-restore check calls no
# CUDA process (the restored tasks do not run yet), and its one outside call
# that could hang (nvidia-smi) has a fixed 30 s deadline, too slow here.
CASES: list[Case] = [
    *_cuda_steps(("discovery", "lock", "checkpoint", "verify-checkpointed")),
    # The driver cannot say the victim's state any more, from the final
    # check on: the rollback must take the whole way back regardless.
    Case("verify-checkpointed", "error", variant="persistent"),
    Case("lock", "crash", backend="cli"),
    Case("lock", "hang", backend="cli"),
    Case("checkpoint", "crash", backend="cli"),
    Case("checkpoint", "error", "vmm"),
    Case("checkpoint", "crash", "vmm"),
    *[Case("vmm-prepare", k, "vmm") for k in ("error", "hang", "crash", "target-dies",
                                              "disk-full")],
    Case("manifest-write", "disk-full"),
    Case("manifest-write", "disk-full", "vmm"),
    # CRIU cannot seize a task and gives up at its own deadline (--timeout).
    Case("criu-freeze", "hang", variant="traced-task"),
    Case("criu-freeze", "hang", "vmm", variant="traced-task"),
    Case("criu-dump", "error", variant="external-socket"),
    Case("criu-dump", "error", "vmm", variant="external-socket"),
    Case("criu-dump", "disk-full"),
    Case("post-restore", "error", variant="driver-branch"),
    Case("post-restore", "error", variant="nvidia-smi"),
    *_cuda_steps(("restore", "unlock", "verify-running")),
    Case("restore", "crash", backend="cli"),
    Case("unlock", "crash", backend="cli"),
    Case("restore", "error", "vmm"),
    *[Case("vmm-restore", k, "vmm") for k in ("error", "hang", "crash", "target-dies")],
]

assert len({c.id for c in CASES}) == len(CASES)


# -- the node, its shared containers and images ---------------------------------

PROCS = 3
VICTIM = 1  # the middle one of three processes


@dataclass
class Box:
    cid: str
    bundle: Path
    tags: list[str]
    spoiled: bool = False
    image: Path | None = None
    frozen: dict[str, int] = field(default_factory=dict)


class Matrix(SharedBoxes):
    deadlines = DEADLINES

    def __init__(self, env: Env, tmp: Path):
        super().__init__(env, tmp)
        self.live: dict[str, Box] = {}
        self.images: dict[str, Box] = {}

    def start(self, prefix: str, workload: str, others: tuple[str, ...] = (),
              annotations: dict[str, str] | None = None) -> Box:
        """A running container of three CUDA processes tagged prefix.N."""
        self.count += 1
        name = f"{prefix}{self.count}"
        opts: dict[str, Any] = {"mib": 2, "procs": PROCS, "vmm": workload == "vmm"}
        control = None
        if workload == "vmm":
            control = self.tmp / f"control-{name}"
            control.mkdir()
        bundle = self.env.box.bundle(name, [(prefix, opts)], others=list(others),
                                     snapshot_control=control, annotations=annotations)
        tags = [f"{prefix}.{i}" for i in range(PROCS)]
        return Box(self.run(bundle, tags), bundle, tags)

    def live_box(self, workload: str) -> Box:
        """The shared running container for checkpoint-side cases."""
        box = self.live.get(workload)
        if box is None or box.spoiled:
            if box is not None:
                self.env.box.delete(box.cid)
            box = self.live[workload] = self.start("c" if workload == "plain" else "cv",
                                                   workload)
        return box

    def image_box(self, workload: str) -> Box:
        """The shared checkpoint image for restore-side cases."""
        box = self.images.get(workload)
        if box is None:
            box = self.start("r" if workload == "plain" else "rv", workload)
            box.image = self.tmp / f"image-{workload}"
            box.frozen = self.dump(box.cid, box.image, box.tags)
            self.images[workload] = box
        return box


@pytest.fixture(scope="module")
def matrix(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Matrix]:
    tmp = tmp_path_factory.mktemp("matrix")
    env = Env(tmp / "env")
    try:
        yield Matrix(env, tmp)
    finally:
        env.close()


# -- fault injection -----------------------------------------------------------


# runc writes descriptors.json into the image directory before it starts
# CRIU: one file, one page.
RUNC_FILES = 1


@contextlib.contextmanager
def small_fs(path: Path, fill: str, leave_inodes: int = 0) -> Iterator[Path]:
    """A 2 MiB tmpfs at `path`, filled: "bytes" (one page left, for runc's
    own file), "inodes" (room for `leave_inodes` more files), or "none"."""
    path.mkdir()
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=2m,nr_inodes=64,mode=0755", "tmpfs",
                    str(path)], check=True)
    try:
        if fill == "bytes":
            with open(path / ".filler", "wb", buffering=0) as f, contextlib.suppress(OSError):
                while True:
                    f.write(b"\0" * 4096)
            size = (path / ".filler").stat().st_size
            os.truncate(path / ".filler", size - 4096)
        elif fill == "inodes":
            made = []
            while True:
                try:
                    p = path / f".filler{len(made)}"
                    p.touch()
                    made.append(p)
                except OSError as exc:
                    assert exc.errno == errno.ENOSPC, exc
                    break
            for p in made[:leave_inodes]:
                p.unlink()
        yield path
    finally:
        subprocess.run(["umount", "-l", str(path)], check=False)


# A process CRIU cannot seize: it is already traced (by its parent). CRIU
# retries until its freeze deadline (--timeout, 10 s unless configured) and
# fails the dump without running another action script.
FREEZE_TIMEOUT_S = 2
TRACED = ("/usr/bin/python3 -c 'import ctypes,os,time; os.fork() or "
          "ctypes.CDLL(None).ptrace(0, 0, 0, 0); time.sleep(1e6)'")
# A process holding a connection to a socket outside the container: CRIU
# refuses to dump it ("External socket is used"), after freezing.
EXTERNAL = ("/usr/bin/python3 -c 'import socket,time; s=socket.socket(socket.AF_UNIX); "
            "s.connect(\"/run/cuda-sim/gpu.sock\"); time.sleep(1e6)'")


def driver_fault(m: Matrix, case: Case, victim: str) -> None:
    action, skip = DRIVER_CALLS[case.step]
    # One failure at that point, unless the case says it persists.
    rule: dict[str, Any] = {"tag": victim, "skip": skip}
    if case.variant != "persistent":
        rule["times"] = 1
    if case.kind == "error":
        rule.update(mode="error", code=ERROR_CODES.get(case.step, 999))
    elif case.kind == "hang":
        rule.update(mode="hang")
    elif case.kind == "crash":
        rule.update(mode="segv", after=True)
    else:
        rule.update(mode="crash")
    m.env.lab.fault(action, **rule)


def vmm_fault(m: Matrix, case: Case, victim_pid: int | None) -> None:
    op = "vmm-prepare" if case.step == "vmm-prepare" else "vmm-restore"
    if case.kind == "error":
        m.env.lab.fault(op, message="shim did not answer")
    elif case.kind == "hang":
        m.env.lab.fault(op, mode="hang")
    elif case.kind == "crash":
        m.env.lab.fault(op, mode="segv")
    else:
        m.env.lab.fault(op, mode="crash", pid=victim_pid)


# -- the cases -------------------------------------------------------------------


# A tmpfs is mounted only inside the suite's private mount namespace.
PARAMS = [pytest.param(c, id=c.id, marks=[private_node] if c.kind == "disk-full" else [])
          for c in CASES]


@pytest.mark.parametrize("case", PARAMS)
def test_fault(matrix: Matrix, case: Case, tmp_path: Path) -> None:
    matrix.env.lab.clear_faults()
    matrix.configure(case.backend)
    if case.side == "checkpoint":
        checkpoint_case(matrix, case, tmp_path)
    else:
        restore_case(matrix, case)


def checkpoint_case(m: Matrix, case: Case, tmp: Path) -> None:
    env = m.env
    # CRIU's own refusals need a process of their own beside the workloads.
    extra = {"traced-task": TRACED, "external-socket": EXTERNAL}.get(case.variant)
    notes = None
    if case.step == "criu-freeze":
        conf = tmp / "criu.conf"  # runc's CRIU configuration, with a short --timeout
        conf.write_text(env.box.criu_conf.read_text() + f"timeout {FREEZE_TIMEOUT_S}\n")
        notes = {"org.criu.config": str(conf)}
    own = extra is not None
    box = m.start("x", case.workload, (extra,), notes) if extra else m.live_box(case.workload)
    box.spoiled = True  # until this case has shown it healthy
    victim = box.tags[VICTIM]
    dead: tuple[str, ...] = ()
    image = tmp / "img"
    fs: contextlib.AbstractContextManager[Any] = contextlib.nullcontext()
    if case.step in DRIVER_CALLS:
        driver_fault(m, case, victim)
        dead = (victim,) if case.kind == "target-dies" else ()
    elif case.step == "vmm-prepare":
        if case.kind == "disk-full":
            fs = small_fs(image, "bytes")  # cuda-vmm.state does not fit
        else:
            vmm_fault(m, case, workload_pids(env.lab, box.cid, [victim])[victim])
            dead = (victim,) if case.kind == "target-dies" else ()
    elif case.step == "manifest-write":
        # runc's file and the VMM coordinator's state file fit, the manifest not.
        fs = small_fs(image, "inodes",
                      leave_inodes=RUNC_FILES + (1 if case.workload == "vmm" else 0))
    elif case.step == "criu-dump" and case.kind == "disk-full":
        fs = small_fs(image, "none")  # the manifest fits, CRIU's pages do not
    n_events = len(env.events())
    with fs:
        r = env.box.checkpoint(box.cid, image)
        assert r.returncode != 0, "the checkpoint succeeded despite the fault"
        new = env.events()[n_events:]
        assert_running_and_intact(env, box.cid, box.tags, dead)
    explain = CHECKPOINT_EVIDENCE.get(case.step, _cudahook_refused)
    explain(case, new, env.events()[n_events:], image)
    if own:
        env.box.delete(box.cid)
    elif not dead:
        box.spoiled = False


# What cudahook's error says, where the step alone does not tell.
SAYS = {("manifest-write", "disk-full"): "cannot record the checkpoint: [Errno 28]",
        ("vmm-prepare", "disk-full"): "No space left on device",
        ("vmm-prepare", "hang"): "timed out",
        ("lock", "hang"): "timed out", ("checkpoint", "hang"): "timed out",
        ("discovery", "hang"): "timed out", ("lock", "error"): "timed out",
        ("checkpoint", "error"): "out of memory"}


def crash_text(case: Case) -> str | None:
    """What cudahook says of a driver call whose tool or library crashed."""
    if case.kind != "crash" or case.step not in DRIVER_CALLS:
        return None
    return f"exit -{int(signal.SIGSEGV)}" if case.backend == "cli" else "driver helper exited"


def _cudahook_refused(case: Case, at_return: list[dict], _later: list[dict],
                      _image: Path) -> None:
    """cudahook itself failed the checkpoint, before CRIU froze anything."""
    errors = [e for e in at_return if e.get("error") and e["event"] in
              ("pre-dump", "checkpoint")]
    assert errors, f"no checkpoint error logged for {case.id}: {at_return}"
    says = SAYS.get((case.step, case.kind)) or crash_text(case)
    assert says is None or any(says in e["error"] for e in errors), (says, errors)
    assert not any(e["event"] == "checkpoint" and not e.get("error") for e in at_return)


def _guardian_resumed(case: Case, _at_return: list[dict], later: list[dict],
                      image: Path) -> None:
    """pre-dump succeeded, CRIU failed after it (for the reason the case
    set up): the guardian brought the processes back."""
    log = (image.parent / f"{image.name}.work" / "dump.log").read_text()
    why = {"criu-freeze": "Timeout reached", "external-socket": "External socket is used",
           "disk-full": "No space left on device"}
    says = why[case.step if case.step == "criu-freeze" else case.variant or case.kind]
    assert says in log, log[-2000:]
    assert any(e["event"] == "checkpoint" and not e.get("error") for e in later), later
    assert any(e["event"] == "guardian" and "resumed" in e.get("outcome", "")
               for e in later), later


CHECKPOINT_EVIDENCE: dict[str, Callable[[Case, list[dict], list[dict], Path], None]] = {
    "criu-freeze": _guardian_resumed,
    "criu-dump": _guardian_resumed,
}


def restore_case(m: Matrix, case: Case) -> None:
    env = m.env
    box = m.image_box(case.workload)
    assert box.image is not None
    victim = box.tags[VICTIM]
    before = image_hashes(box.image)
    undo: Callable[[], None] = lambda: None  # noqa: E731
    if case.step in DRIVER_CALLS:
        driver_fault(m, case, victim)
    elif case.step == "vmm-restore":
        # The victim's host PID exists only once restored: kill the first.
        vmm_fault(m, case, None)
    elif case.variant == "driver-branch":
        env.lab.set(driver=570)
        undo = lambda: env.lab.set(driver=580)  # noqa: E731
    elif case.variant == "nvidia-smi":
        env.lab.fault("nvidia-smi")
    n_events = len(env.events())
    try:
        env.box.restore(box.cid, box.bundle, box.image)
        assert_nothing_restored(env, box.cid, box.image, before)
    finally:
        undo()
    new = env.events()[n_events:]
    if case.step == "post-restore":
        assert any(e["event"] == "post-restore" and e.get("error") for e in new), new
    else:
        killed = [e["error"] for e in new
                  if e["event"] == "restore" and "container killed" in e.get("error", "")]
        assert killed, new
        says = crash_text(case)
        assert says is None or says in killed[0], (says, killed)
    restore_and_check(env, box.cid, box.bundle, box.image, box.tags, box.frozen)
    env.box.delete(box.cid)


def test_the_outcome_checks_can_fail(matrix: Matrix, tmp_path: Path) -> None:
    """Each outcome check fails on what it must catch: a process left
    checkpointed, a container left running, an image changed."""
    env = matrix.env
    matrix.configure("driver-api")
    box = matrix.live_box("plain")
    pid = workload_pids(env.lab, box.cid, box.tags)[box.tags[VICTIM]]
    assert pid is not None
    tool = str(env.lab.cuda_checkpoint)
    box.spoiled = True
    for action in ("lock", "checkpoint"):
        subprocess.run([tool, "--action", action, "--pid", str(pid)], check=True, timeout=30)
    with pytest.raises(AssertionError, match="not running"):
        assert_running_and_intact(env, box.cid, box.tags, settle=0.5)
    for action in ("restore", "unlock"):
        subprocess.run([tool, "--action", action, "--pid", str(pid)], check=True, timeout=30)
    assert_running_and_intact(env, box.cid, box.tags)
    box.spoiled = False
    image = tmp_path / "img"
    image.mkdir()
    (image / "pages-1.img").write_bytes(b"x")
    before = image_hashes(image)
    with pytest.raises(AssertionError, match="left running"):
        assert_nothing_restored(env, box.cid, image, before, settle=0.5)
    (image / "pages-1.img").write_bytes(b"y")
    with pytest.raises(AssertionError, match="changed the image"):
        # Nothing of this container (an unknown ID) runs: only the image differs.
        assert_nothing_restored(env, "gpu-nosuchid", image, before, settle=0.5)


def test_the_matrix_covers_every_step_and_kind() -> None:
    """Every step and every fault kind is in the matrix, with at least 40 cases."""
    assert {c.step for c in CASES} == set(CHECKPOINT_STEPS) | set(RESTORE_STEPS)
    assert {c.kind for c in CASES} == set(KINDS)
    assert len(CASES) >= 40
