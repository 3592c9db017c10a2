"""The CUDA toggle engine: move a set of processes between running and checkpointed.

Checkpoint locks every process before it checkpoints any: a lock waits for
in-flight GPU work, and with NCCL one rank locked while another still runs can
hang them both (cuda-checkpoint #30), so locks run all at once with a timeout.
Any failure rolls every touched process back to `running` and says so; a
checkpoint that fails must leave the workload working on its GPU.

Restore never rolls back: a process that failed to restore cannot run, and
unlocking its siblings would release a half-restored workload. The engine
holds them all locked and reports exactly which process failed at which step,
so the caller can fail closed (kill it) and retry from the intact image.

Every phase reads the states first and only moves processes that are not
already where the phase wants them: CRIU 3.19-4.1.1 run each action script
twice, and a toggle that runs twice undoes itself. Every phase also ends by
reading the states back: a result reports what the driver says, never what
the calls were meant to do. Any exception in a call on one process, of any
type, is that process's failure.

On R590+ the processes of one `--launch-job` job (they share CUDA IPC) are
driven one at a time - two members at once fail or hang in the driver -
while different jobs and processes outside any job stay parallel.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable, Iterable

from cudahook.platform.config import Settings
from cudahook.platform.errors import EnvironmentProblem, PhaseError, ToolError
from cudahook.platform.host import Host, ProcessGone
from cudahook.platform.record import Record

from .backends import (
    CHECKPOINTED,
    CHECKPOINTING,
    LOCKED,
    RESTORING,
    RUNNING,
    STABLE,
    explain_state,
)
from .discovery import CudaProcess, has_device_fd
from .fanout import Raised, fan_out
from .timeline import Timeline

# typing costs milliseconds at every hook start: annotations only.
TYPE_CHECKING = False
if TYPE_CHECKING:
    from typing import Any

    from .backends import Backend



class PhaseResult(Record):
    phase: str
    pids: list[int]
    timeline: Timeline
    initial: dict[int, str] = {}  # (a fresh dict for each: see Record)
    final: dict[int, str] = {}
    changed: list[int] = []
    errors: dict[int, str] = {}
    device_map: dict[str, str] | None = None
    rolled_back: bool = False
    # Custom storage: what each process's checkpoint wrote (ranges, bytes).
    stored: dict[int, Any] = {}

    @property
    def ok(self) -> bool:
        return not self.errors

    def brought_back(self) -> set[int]:
        """The processes this phase put back on their GPU: a restore's, or a
        failed checkpoint's rollback. A checkpoint drops a process's VMM
        mappings; these are the ones that run again without them."""
        steps = ("restore", "toggle") if self.phase == "restore" else (
            "rollback-restore", "rollback-toggle")
        return {s.pid for s in self.timeline.steps if s.ok and s.step in steps}

    def to_dict(self) -> dict[str, Any]:
        return {
            "phase": self.phase,
            "ok": self.ok,
            "pids": self.pids,
            "initial": {str(k): v for k, v in self.initial.items()},
            "final": {str(k): v for k, v in self.final.items()},
            "changed": self.changed,
            "errors": {str(k): v for k, v in self.errors.items()},
            "device_map": self.device_map,
            "rolled_back": self.rolled_back,
            "timeline": self.timeline.to_dict(),
        }


# How a process started with `cuda-checkpoint --launch-job FILE` knows its job.
JOB_FILE_ENV = "CUDA_CHECKPOINT_JOB_FILE"


def _pid(p: CudaProcess | int) -> int:
    return p.pid if isinstance(p, CudaProcess) else int(p)


def _phase(method: Callable[..., PhaseResult]) -> Callable[..., PhaseResult]:
    """A phase's driver session ends with the phase: the backend's helper
    (the driver-API backend's one attach) exits and is reaped here, not when
    the hook exits, so it holds no driver attach while the hook goes on
    (the manifest, the guardian, CRIU's dump) and leaves no orphan behind.
    A later call on the same backend attaches afresh."""

    @functools.wraps(method)
    def phase(self: Engine, *args: Any, **kwargs: Any) -> PhaseResult:
        try:
            return method(self, *args, **kwargs)
        finally:
            self.end_phase()

    return phase


class Engine:
    def __init__(self, backend: Backend, settings: Settings, host: Host | None = None):
        self.backend = backend
        self.settings = settings
        self.host = host or Host()
        self._jobs: dict[int, str | None] = {}  # pid -> job identity, read once
        # pid -> the directory its GPU memory was checkpointed into (custom
        # storage): a rollback must bring it back from there, since a plain
        # restore has nothing in the process's host memory to restore.
        self.storage: dict[int, str] = {}
        # The PIDs whose storage the caller verified chunk by chunk just
        # before this restore (post-restore): the helper skips its own
        # verification before the restore, never the one on the way in.
        self.storage_checked: set[int] = set()

    def end_phase(self) -> None:
        close = getattr(self.backend, "close", None)
        if close is not None:
            close()

    # -- helpers -----------------------------------------------------------

    def _each(
        self, pids: list[int], fn: Callable[[int], None], *, parallel: bool | None = None,
        all_at_once: bool = False,
    ) -> dict[int, BaseException]:
        """Run fn for every PID; the failures, by PID.

        Whatever fn raises is that process's failure: a bug or an unexpected
        error must fail the phase, never pass as success. `all_at_once`
        ignores max_parallel (locks: see the module notes).
        """
        if parallel is None:
            parallel = not self.settings.sequential
        failures: dict[int, BaseException] = {}

        def group(members: list[int]) -> None:
            for pid in members:
                try:
                    fn(pid)
                except BaseException as exc:  # every failure is that process's
                    failures[pid] = exc

        # Members of one --launch-job job (R590+) one at a time, jobs and
        # processes outside any job side by side.
        groups = self._job_groups(pids) if parallel and len(pids) > 1 else [[p] for p in pids]
        workers = len(groups) if all_at_once else (self.settings.max_parallel if parallel else 1)
        for members, outcome in zip(groups, fan_out(group, groups, workers), strict=True):
            if isinstance(outcome, Raised):  # the group itself failed: so did its members
                for pid in members:
                    failures.setdefault(pid, outcome.exc)
        return failures

    def _job_groups(self, pids: list[int]) -> list[list[int]]:
        try:
            jobs = self.backend.features.launch_job
        except EnvironmentProblem:
            jobs = False
        if not jobs:
            return [[p] for p in pids]
        groups: dict[str, list[int]] = {}
        for pid in pids:
            groups.setdefault(self._job_of(pid) or f"pid:{pid}", []).append(pid)
        return list(groups.values())

    def _job_of(self, pid: int) -> str | None:
        """The job a process belongs to: its CUDA_CHECKPOINT_JOB_FILE, by identity."""
        if pid not in self._jobs:
            try:
                path = self.host.environ(pid, JOB_FILE_ENV)
                self._jobs[pid] = self.host.job_file_id(pid, path) if path else None
            except (ProcessGone, PermissionError):
                self._jobs[pid] = None
        return self._jobs[pid]

    def read_state(self, pid: int) -> str:
        if self.backend.features.get_state:
            return self.backend.get_state(pid)
        # Toggle-only drivers cannot be asked; a checkpointed process has
        # released every device node, a running one holds them.
        if not self.host.exists(pid):
            raise ProcessGone(pid)
        return RUNNING if has_device_fd(self.host, pid, self.settings.device_regex) else CHECKPOINTED

    def settled_state(self, pid: int, wait_s: float | None = None) -> str:
        """The process's state once no operation is in progress on it.

        CUDA 13.4+ reports `checkpointing` or `restoring` while the driver
        carries a checkpoint or restore out - it may still do so after the
        call that asked for it was killed. Judging the process then would
        act on a state about to change: wait (call_timeout_s by default)
        for it to end, and return what it ended in (a state still in
        progress after the wait is returned as is: not safe, not actable)."""
        import time

        deadline = time.monotonic() + (self.settings.call_timeout_s if wait_s is None
                                       else wait_s)
        while True:
            state = self.read_state(pid)
            if state not in (CHECKPOINTING, RESTORING) or time.monotonic() >= deadline:
                return state
            time.sleep(0.05)

    def read_states(
        self, pids: list[int], tl: Timeline, step: str = "get-state", *, settle: bool = False
    ) -> tuple[dict[int, str], dict[int, str]]:
        """States by PID, and the errors of those that could not be read.
        `settle`: each once no operation is in progress on it (settled_state)."""
        states: dict[int, str] = {}
        read = self.settled_state if settle else self.read_state

        def one(pid: int) -> None:
            with tl.step(pid, step):
                states[pid] = read(pid)

        failures = self._each(pids, one, parallel=True)
        return states, {pid: _describe(pid, exc, self.host) for pid, exc in failures.items()}

    def _toggle_only(self) -> bool:
        return not self.backend.features.actions

    # -- checkpoint ----------------------------------------------------------

    @_phase
    def checkpoint(self, procs: Iterable[CudaProcess | int], *,
                   fresh_states: bool = False,
                   storage: dict[int, str] | None = None) -> PhaseResult:
        """Lock all, then checkpoint all; roll back on any failure.

        `fresh_states`: the processes' states were read just now (discovery
        probes with --get-state), so they are not read again - one
        cuda-checkpoint call per process saved. A state kept from earlier
        must not be passed as fresh: a checkpoint twice would then act on it.
        `storage`: pid -> a new directory its GPU memory goes to (CUDA 13.4+
        custom storage, driver API) instead of the process's host memory.
        A storage checkpoint that fails puts the memory back (the helper)
        and leaves the process locked: the rollback unlocks it.
        """
        procs = list(procs)
        pids = sorted({_pid(p) for p in procs})
        tl = Timeline()
        res = PhaseResult("checkpoint", pids, tl)
        if not pids:
            return res
        # Discovery has just read these states (one cuda-checkpoint call each,
        # seconds on real hardware): read only what it did not.
        known = ({p.pid: p.state for p in procs if isinstance(p, CudaProcess) and p.state}
                 if fresh_states else {})
        res.initial, errors = self.read_states([p for p in pids if p not in known], tl)
        res.initial.update(known)
        errors.update(_troubled(res.initial, "nothing was locked"))
        if errors:
            res.errors = errors
            raise PhaseError("checkpoint", _lines(errors), safe=True, result=res)

        if self._toggle_only():
            todo = [p for p in pids if res.initial[p] == RUNNING]
            failures = self._each(todo, lambda p: self._step(tl, p, "toggle", self.backend.toggle))
            res.changed = [p for p in todo if p not in failures]
            if failures:
                return self._abort(res, failures, touched=todo)
        else:
            to_lock = [p for p in pids if res.initial[p] == RUNNING]
            timeout = self.settings.lock_timeout_ms
            # All at once, whatever max_parallel says: a rank left unlocked
            # while its peers are locked can hang them (NCCL).
            failures = self._each(
                to_lock,
                lambda p: self._step(tl, p, "lock", lambda q: self.backend.lock(q, timeout)),
                parallel=True, all_at_once=True,
            )
            if failures:
                return self._abort(res, failures, touched=to_lock)
            to_ckpt = [p for p in pids if res.initial[p] in (RUNNING, LOCKED)]
            self.storage.update({p: d for p, d in (storage or {}).items() if p in to_ckpt})
            failures = self._each(
                to_ckpt, lambda p: self._step(tl, p, "checkpoint",
                                              lambda q: self._checkpoint_one(q, res))
            )
            res.changed = sorted(set(to_lock) | set(to_ckpt))
            if failures:
                return self._abort(res, failures, touched=res.changed)
        # Trust only a read: a call that returned 0 without acting, or one
        # that acted on the wrong process, must not pass as checkpointed.
        final, errors = self.read_states(pids, tl, step="verify")
        for pid, state in final.items():
            if state != CHECKPOINTED:
                errors[pid] = f"pid {pid}: ended {state}, not checkpointed"
        if errors:
            return self._abort(res, {p: _Unverified(m) for p, m in errors.items()},
                               touched=pids)
        res.final = final
        return res

    def _checkpoint_one(self, pid: int, res: PhaseResult) -> None:
        where = self.storage.get(pid)
        if where is None:
            self.backend.checkpoint(pid)
        else:
            res.stored[pid] = self.backend.checkpoint_to_storage(pid, where)  # type: ignore[attr-defined]

    def _restore_one(self, pid: int, *device_map: dict[str, str] | None) -> None:
        """A plain restore, or from the storage its checkpoint went to (the
        rollback's passes no device map; the restore phase's one, maybe None)."""
        where = self.storage.get(pid)
        if where is None:
            self.backend.restore(pid, *device_map)
        else:
            self.backend.restore_from_storage(  # type: ignore[attr-defined]
                pid, where, *device_map, checked=pid in self.storage_checked)

    def _step(self, tl: Timeline, pid: int, name: str, call: Callable[[int], None]) -> None:
        with tl.step(pid, name):
            call(pid)

    def _abort(
        self, res: PhaseResult, failures: dict[int, BaseException], touched: list[int]
    ) -> PhaseResult:
        res.errors = {p: _describe(p, e, self.host) for p, e in failures.items()}
        safe, rb_errors, final = self.rollback(touched, res.timeline)
        res.rolled_back = True
        res.final = final
        for pid, msg in rb_errors.items():
            res.errors[pid] = f"{res.errors[pid]}; {msg}" if pid in res.errors else msg
        raise PhaseError(res.phase, _lines(res.errors), safe=safe, result=res)

    def rollback(
        self, pids: list[int], tl: Timeline
    ) -> tuple[bool, dict[int, str], dict[int, str]]:
        """Bring every process back to running; (all alive verified running, errors, states).

        States are read again rather than remembered: a call killed at its
        deadline may still have changed the process, or still be changing
        it (a state in progress is waited out first: `settled_state`). Only
        `running` counts as back: any other final state fails the rollback.
        """
        final: dict[int, str] = {}
        errors: dict[int, str] = {}
        gone: set[int] = set()

        def back(pid: int) -> None:
            try:
                state = self.settled_state(pid)
            except ProcessGone:
                raise
            except Exception:
                # Hazard: a state the driver cannot tell (get-state failing
                # or timing out) must not leave a checkpointed process off
                # its GPU while CRIU resumes the container. Undo: take the
                # whole way back regardless - the driver refuses a step the
                # process is not in the state for, which changes nothing -
                # and let the read below decide what is reported.
                if self._toggle_only() or not self.host.exists(pid):
                    raise
                self._whole_way_back(tl, pid)
                state = RUNNING
            if state == CHECKPOINTED:
                if self._toggle_only():
                    self._step(tl, pid, "rollback-toggle", self.backend.toggle)
                    state = RUNNING
                else:
                    self._step(tl, pid, "rollback-restore", self._restore_one)
                    state = LOCKED
            if state == LOCKED:
                self._step(tl, pid, "rollback-unlock", self.backend.unlock)
            with tl.step(pid, "verify"):
                final[pid] = self.read_state(pid)
            if final[pid] != RUNNING:
                raise ToolError(pid, "verify", 0,
                                f"{explain_state(final[pid])} after the rollback, not running")

        failures = self._each(pids, back, parallel=True)
        for pid, exc in failures.items():
            if isinstance(exc, ProcessGone) or not self.host.exists(pid):
                gone.add(pid)
                errors[pid] = "process exited"
            else:
                errors[pid] = f"rollback failed: {_describe(pid, exc, self.host)}"
        safe = all(p in gone for p in failures)
        return safe, errors, final

    def _whole_way_back(self, tl: Timeline, pid: int) -> None:
        """Restore, then unlock, a process whose state is unknown; a step it
        is not ready for fails in the driver (illegal state) and is skipped."""
        for name, call in (("rollback-restore", self._restore_one),
                           ("rollback-unlock", self.backend.unlock)):
            with contextlib.suppress(ToolError):
                self._step(tl, pid, name, call)

    # -- restore -------------------------------------------------------------

    @_phase
    def restore(
        self,
        procs: Iterable[CudaProcess | int],
        device_map: dict[str, str] | None = None,
        *,
        unlock: bool = True,
        storage: dict[int, str] | None = None,
        storage_checked: bool = False,
    ) -> PhaseResult:
        """Restore all (with the device map), then unlock all and verify each
        one `running`. `storage`: pid -> the directory its GPU memory is in
        (custom storage); the others are restored from host memory.
        `storage_checked`: the caller has just verified every chunk of it."""
        self.storage.update(storage or {})
        if storage_checked:
            self.storage_checked.update(storage or {})
        pids = sorted({_pid(p) for p in procs})
        tl = Timeline()
        res = PhaseResult("restore", pids, tl, device_map=device_map or None)
        if not pids:
            return res
        feats = self.backend.features
        if device_map and (not feats.device_map or self._toggle_only()):
            # The real tool accepts --toggle --device-map and ignores the map:
            # a remap only ever goes with --action restore.
            raise EnvironmentProblem(
                f"the restore needs a GPU remap but cuda-checkpoint {feats.version or ''} "
                "has no --device-map (driver R580 or newer)"
            )
        res.initial, errors = self.read_states(pids, tl)
        # Restoring the others would release a workload that lacks one process.
        errors.update(_troubled(res.initial, "nothing was restored"))
        if errors:
            res.errors = errors
            raise PhaseError("restore", _lines(errors), safe=False, result=res)
        todo = [p for p in pids if res.initial[p] == CHECKPOINTED]
        res.changed = list(todo)

        if self._toggle_only():
            failures = self._each(todo, lambda p: self._step(tl, p, "toggle", self.backend.toggle))
            self._fail_if(res, failures, "toggle")
        else:
            failures = self._each(
                todo,
                lambda p: self._step(
                    tl, p, "restore", lambda q: self._restore_one(q, device_map or None)
                ),
            )
            self._fail_if(res, failures, "restore")
            if not unlock:
                res.final = {p: LOCKED for p in pids if res.initial[p] != RUNNING}
                return res
            to_unlock = [p for p in pids if res.initial[p] in (CHECKPOINTED, LOCKED)]
            failures = self._each(
                to_unlock, lambda p: self._step(tl, p, "unlock", self.backend.unlock)
            )
            res.changed = sorted(set(res.changed) | set(to_unlock))
            self._fail_if(res, failures, "unlock")
        self._verify_running(res)
        return res

    @_phase
    def unlock(self, procs: Iterable[CudaProcess | int]) -> PhaseResult:
        """Second half of a restore run with unlock=False."""
        pids = sorted({_pid(p) for p in procs})
        res = PhaseResult("unlock", pids, Timeline())
        res.initial, errors = self.read_states(pids, res.timeline)
        errors.update(_troubled(res.initial, "nothing was unlocked"))
        if errors:
            res.errors = errors
            raise PhaseError("unlock", _lines(errors), safe=False, result=res)
        todo = [p for p in pids if res.initial[p] == LOCKED]
        failures = self._each(
            todo, lambda p: self._step(res.timeline, p, "unlock", self.backend.unlock)
        )
        res.changed = todo
        self._fail_if(res, failures, "unlock")
        self._verify_running(res)
        return res

    def _verify_running(self, res: PhaseResult) -> None:
        # A restore with a device map that skipped unlock leaves the workload
        # alive but blocked forever (beam-cloud/beta9 #1918): trust only a read.
        res.final, errors = self.read_states(res.pids, res.timeline, step="verify")
        for pid, state in res.final.items():
            if state != RUNNING:
                errors[pid] = f"pid {pid}: ended {explain_state(state)}, not running"
        if errors:
            res.errors.update(errors)
            raise PhaseError(res.phase, _lines(res.errors), safe=False, result=res)

    def _fail_if(self, res: PhaseResult, failures: dict[int, BaseException], step: str) -> None:
        if not failures:
            return
        res.errors = {p: _describe(p, e, self.host) for p, e in failures.items()}
        held = [p for p in res.pids if p not in failures]
        # Report what each process is now, read back, not what was intended.
        res.final, unread = self.read_states(res.pids, res.timeline, step="verify")
        for pid, msg in unread.items():
            res.errors.setdefault(pid, msg)
        note = f"no process was released; {len(held)} other(s) held" if held else ""
        raise PhaseError(res.phase, [*_lines(res.errors), note] if note else _lines(res.errors),
                         safe=False, result=res)


class _Unverified(Exception):
    """A process that a phase's final read found somewhere else."""


def _describe(pid: int, exc: BaseException, host: Host) -> str:
    if isinstance(exc, ProcessGone) or (isinstance(exc, ToolError) and not host.exists(pid)):
        return f"pid {pid}: process exited"
    if not isinstance(exc, (ToolError, EnvironmentProblem, _Unverified)):
        text = f"{type(exc).__name__}: {exc}"
        return f"pid {pid}: {text}"
    text = str(exc)
    return text if text.startswith(f"pid {pid}") else f"pid {pid}: {text}"


def _troubled(states: dict[int, str], outcome: str) -> dict[int, str]:
    """CUDA processes in a state no phase may act on, each named with it."""
    return {pid: f"pid {pid}: CUDA process is {explain_state(state)}; {outcome}"
            for pid, state in states.items() if state not in STABLE}


def _lines(errors: dict[int, str]) -> list[str]:
    return [errors[p] for p in sorted(errors)]
