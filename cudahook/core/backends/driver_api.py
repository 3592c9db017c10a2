"""Backend over the CUDA driver API (cuCheckpointProcess*, CUDA 12.8+, R570+).

Every `cuda-checkpoint` run attaches to the driver (seconds on real nodes);
this backend attaches once per phase. The calls run in one helper process
(`driver_helper.py`) started at the first call: it loads libcuda, calls
cuInit once and serves every call of the phase, in parallel. A call that
outlives its deadline gets the helper's process group killed, so a hung
driver call fails that call (timed out, as the CLI backend's do) instead
of hanging the hook; the next call starts a fresh helper for the rollback.
The helper is started like every tool (platform/tools.py `spawn`): it dies
with the hook (parent-death signal, forked by a thread that lasts as long
as the hook, not by the engine worker that made the first call of the
phase), and it carries the phase's name for the guardian's sweep.

Errors carry the PID, the action and the CUresult, with the driver's own
name and message (cuGetErrorName, cuGetErrorString), worded as
cuda-checkpoint words them so that discovery reads them the same way.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import threading

from cudahook.platform.config import Settings
from cudahook.platform.errors import EnvironmentProblem, ToolError
from cudahook.platform.host import Host
from cudahook.platform.tools import spawn

from .base import CHECKPOINTED, RUNNING, STATES, Features, driver_major
from .cli import driver_version

# typing costs milliseconds at every hook start: annotations only.
TYPE_CHECKING = False
if TYPE_CHECKING:
    from collections.abc import Callable
    from typing import Any

HELPER = os.path.join(os.path.dirname(os.path.abspath(__file__)), "driver_helper.py")
MIN_MAJOR = 570  # cuCheckpointProcess* first shipped with R570 (CUDA 12.8)
# Custom storage copies GPU memory in chunks of this size, each its own file
# with its own digest, through two pinned staging buffers per GPU.
STORAGE_CHUNK = 16 << 20


# The packages the helper's storage path imports (chunk digest, compression).
STORAGE_PACKAGES = ("blake3", "zstandard")
_libs: list[str] = []


def storage_libs() -> str:
    """Where this interpreter has the storage path's packages installed, for
    the helper (which starts with the standard library alone and imports
    them only on that path, from these directories if root's; see
    driver_helper._extension): found without importing them, once."""
    if not _libs:
        import importlib.util

        dirs = []
        for name in STORAGE_PACKAGES:
            spec = importlib.util.find_spec(name)
            if spec is not None and spec.origin:
                where = os.path.dirname(os.path.dirname(os.path.abspath(spec.origin)))
                if where not in dirs:
                    dirs.append(where)
        _libs.append(os.pathsep.join(dirs))
    return _libs[0]


def features_for(version: str) -> Features:
    """What the driver API can do on this driver release (nothing before R570)."""
    major = driver_major(version) or 0
    api = major >= MIN_MAJOR
    return Features(version=version, toggle=api, actions=api, get_state=api, restore_tid=api,
                    device_map=major >= 580, launch_job=major >= 590)


def fail_text(action: str, pid: int, message: str, name: str, code: int) -> str:
    """cuda-checkpoint's failure line, plus the CUresult's name and number."""
    if action == "get-state":
        head = f'Error getting process state for process ID {pid}: "{message}"'
    elif action == "get-restore-tid":
        head = f'Could not find restore thread for process ID {pid}: "{message}"'
    else:
        head = f'Could not {action} on process ID {pid}: "{message}"'
    return f"{head} ({name}, {code})"


def uuid_hex(uuid: str) -> str:
    """A GPU-xxxxxxxx-xxxx-... (or MIG-...) UUID as CUuuid's 16 bytes, in hex."""
    body = uuid.split("-", 1)[1] if uuid.startswith(("GPU-", "MIG-")) else uuid
    digits = body.replace("-", "")
    if len(digits) != 32:
        raise ValueError(f"not a GPU UUID: {uuid!r}")
    bytes.fromhex(digits)
    return digits


def probe_library(path: str) -> str | None:
    """Why libcuda at `path` cannot serve this backend, or None when it can.

    Loads it in this process only to look up symbols: nothing is called.
    """
    import ctypes

    from .driver_helper import SYMBOLS

    try:
        lib = ctypes.CDLL(path)
    except OSError as exc:
        return f"{path} not loadable ({exc})"
    missing = [s for s in SYMBOLS if not hasattr(lib, s)]
    if missing:
        return f"{path} does not export {', '.join(missing)}"
    return None


def choose(settings: Settings, host: Host) -> tuple[Features | None, str]:
    """`backend: auto`: the driver API's features when it can run, else None; and why."""
    try:
        version = driver_version(host, settings)
    except EnvironmentProblem as exc:
        return None, f"auto: cli, the driver version is unknown ({exc})"
    features = features_for(version)
    if not features.actions:
        return None, f"auto: cli, driver {version} predates the checkpoint driver API (R570)"
    why_not = probe_library(settings.libcuda)
    if why_not:
        return None, f"auto: cli, {why_not}"
    return features, f"auto: driver-api, driver {version} and {settings.libcuda} export " \
                     "cuCheckpointProcess*"


class _Channel:
    """One line-protocol channel to something that has attached to the
    driver (driver_helper.py's protocol): calls multiplexed by id. A reply
    carrying `lost` instead of a result (the node agent's word for a call it
    had to abandon) ends the channel like a helper's death."""

    what = "the driver helper"
    # How long past a call's deadline the caller still waits for its reply.
    grace = 0.0

    def __init__(self, reader: Any, writer: Callable[[bytes], None], timeout: float):
        self._reader = reader
        self._writer = writer
        self.lock = threading.Lock()
        self.waiting: dict[int, tuple[threading.Event, list[dict]]] = {}
        self.next_id = 1
        self.dead: str | None = None
        self.ready = threading.Event()
        self.hello: dict = {}
        threading.Thread(target=self._read, name="driver-api-reader", daemon=True).start()
        if not self.ready.wait(timeout):
            self.kill("driver initialisation timed out")
            raise TimeoutError("cuInit timed out")
        if not self.hello.get("ready"):
            self.kill("driver initialisation failed")

    def _read(self) -> None:
        """Hand each reply to its caller. Any line that is not a reply this
        helper writes (not JSON, not an object, no known id) means its
        output can no longer be trusted: the helper is killed at once and
        every pending call fails with the reason, instead of waiting out
        its deadline. Whatever happens here, the callers are woken."""
        gone = f"{self.what} exited"
        why = gone
        try:
            for line in self._reader:
                problem = self._take(line)
                if problem:
                    why = f"{self.what} wrote an unexpected line ({problem}): {line[:80]!r}"
                    break
        except Exception as exc:  # a reader that dies silently would strand every call
            why = f"reading {self.what} failed: {type(exc).__name__}: {exc}"
        if why != gone:
            self.kill(why)
        self._fail_all(why)

    def _take(self, line: bytes) -> str | None:
        """Deliver one line; what is wrong with it, if anything."""
        try:
            msg = json.loads(line)
        except ValueError:
            return "not JSON"
        if not isinstance(msg, dict):
            return f"JSON {type(msg).__name__}, not an object"
        if "ready" in msg:
            self.hello = msg
            self.ready.set()
            return None
        if "lost" in msg:
            self.kill(f"{self.what}: {msg['lost']}")
            return None
        with self.lock:
            entry = self.waiting.pop(msg.get("id"), None)  # type: ignore[arg-type]
        if entry is None:
            return "a reply to no pending call"
        entry[1].append(msg)
        entry[0].set()
        return None

    def _fail_all(self, why: str) -> None:
        with self.lock:
            self.dead = self.dead or why
            entries = list(self.waiting.values())
            self.waiting.clear()
        self.ready.set()
        for event, _ in entries:
            event.set()

    def _end(self) -> None:
        """End the other side's work at once (every pending call with it)."""

    def _reap(self) -> None:
        """Wait (bounded) for the other side to be gone, once callers are woken."""

    def kill(self, why: str) -> None:
        with self.lock:
            self.dead = self.dead or why
        self._end()
        self._fail_all(why)
        self._reap()

    def call(self, request: dict, timeout: float) -> dict | None:
        """The reply, or None when the call timed out (channel killed) or the other side died."""
        event: threading.Event = threading.Event()
        box: list[dict] = []
        with self.lock:
            if self.dead:
                return None
            ident = self.next_id
            self.next_id += 1
            self.waiting[ident] = (event, box)
            try:
                self._writer((json.dumps({**request, "id": ident}) + "\n").encode())
            except OSError:
                self.waiting.pop(ident, None)
                self.dead = f"{self.what} exited"
                return None
        if not event.wait(timeout):
            self.kill(f"a {request['op']} call outlived its deadline")
            return None
        return box[0] if box else None

    def close(self) -> None:
        self.kill("closed")


class _Helper(_Channel):
    """One helper process: one driver attach, calls multiplexed by id."""

    def __init__(self, python: str, library: str, timeout: float):
        # Bound to the hook and named as its call (platform/tools.py): a
        # helper never outlives the hook that started it.
        self.proc = spawn(
            [python, "-I", "-S", HELPER, library, storage_libs()], stdin=subprocess.PIPE,
            stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, close_fds=True,
        )
        assert self.proc.stdin is not None
        stdin = self.proc.stdin

        def write(data: bytes) -> None:
            stdin.write(data)
            stdin.flush()

        super().__init__(self.proc.stdout, write, timeout)

    def _end(self) -> None:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.proc.pid, signal.SIGKILL)

    def _reap(self) -> None:
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.proc.wait(5)

    def close(self) -> None:
        try:
            if self.proc.stdin:
                self.proc.stdin.close()
        except OSError:
            pass
        try:
            self.proc.wait(2)
        except subprocess.TimeoutExpired:
            self.kill("closed")


class AgentLink(_Channel):
    """A session with the node agent (core/agent.py): a worker it attached
    ahead of time, reached over its Unix socket. Ending it (a deadline, the
    phase's end) closes the connection; the agent then abandons any call
    still in flight with its worker, as a killed helper would be."""

    what = "the driver agent"

    def __init__(self, sock: Any, timeout: float):
        from cudahook.core.agent_client import CLIENT_GRACE_S

        self.grace = CLIENT_GRACE_S
        self.sock = sock
        sock.settimeout(None)
        super().__init__(sock.makefile("rb"), sock.sendall, timeout)

    def _end(self) -> None:
        with contextlib.suppress(OSError):
            self.sock.shutdown(2)  # SHUT_RDWR: the reader sees the end at once

    def close(self) -> None:
        self.kill("closed")
        self.sock.close()


class DriverAPI:
    name = "driver-api"

    def __init__(self, host: Host, settings: Settings, features: Features | None = None,
                 why: str = ""):
        self.host = host
        self.settings = settings
        self.library = settings.libcuda
        self.timeout = settings.call_timeout_s
        self.why = why
        self._features = features
        self._probe = threading.Lock()
        self._start = threading.Lock()
        self._helper: _Channel | None = None
        self.attaches = 0  # helpers started: one per phase unless a call hung
        self.agent_sessions = 0  # phases (or parts) served by the node agent
        self.container: str | None = None  # named to the node agent when known
        self._agent_failed = False  # an agent session ended badly: helpers from now on

    @property
    def features(self) -> Features:
        with self._probe:
            if self._features is None:
                self._features = features_for(driver_version(self.host, self.settings))
            return self._features

    def probe(self) -> Features:
        """The features, with custom storage as the driver answers it: the
        helper asks at start-up (cuGetProcAddress), so this costs one attach."""
        features = self.features
        if not features.actions:
            return features.replace(custom_storage=False, custom_storage_why=(
                f"driver {features.version or '(unknown version)'} has no checkpoint driver API"))
        try:
            hello = self._helper_for(0, "probe").hello
        except (ToolError, EnvironmentProblem) as exc:
            return features.replace(custom_storage=False,
                                    custom_storage_why=f"the driver could not be asked: {exc}")
        return features.replace(custom_storage=hello.get("custom_storage") is True,
                                custom_storage_why=str(hello.get("custom_storage_why") or
                                                       "the driver helper did not say"))

    def _need(self, flag: str, what: str) -> None:
        if not getattr(self.features, flag):
            raise EnvironmentProblem(
                f"the CUDA driver API on driver {self.features.version or '(unknown version)'} "
                f"does not support {what}")

    def _helper_for(self, pid: int, action: str) -> _Channel:
        with self._start:
            helper = self._helper
            if isinstance(helper, AgentLink) and helper.dead:
                # The rest of the phase (its rollback) never depends on the agent again.
                self._agent_failed = True
            if helper is None or helper.dead:
                helper = None if self._agent_failed else self._agent_link()
            if helper is None:
                try:
                    helper = _Helper(sys.executable, self.library, self.timeout)
                except TimeoutError:
                    raise ToolError(pid, action, None, "cuInit did not return",
                                    timed_out=True) from None
                except OSError as exc:
                    raise EnvironmentProblem(
                        f"cannot start the driver-API helper: {exc.strerror or exc}") from exc
                self.attaches += 1
                self._helper = helper
            hello = helper.hello
            if not hello.get("ready"):
                self._helper = None
                if hello.get("stage") == "init":
                    raise ToolError(pid, action, int(hello.get("code", 999)),
                                    f'Error initializing CUDA: "{hello.get("error")}" '
                                    f'({hello.get("name")}, {hello.get("code")})',
                                    status="CUresult")
                raise EnvironmentProblem(
                    f"libcuda not usable at {self.library}: "
                    f"{hello.get('error') or helper.dead or 'no answer'}")
            return helper

    def _agent_link(self) -> AgentLink | None:
        """A session with the node agent when one answers in time, else None."""
        from cudahook.core.agent_client import open_session, start_detached

        link = open_session(self.settings, self.settings.agent_connect_ms / 1000, self.container,
                            AgentLink)
        if link is not None:
            self.agent_sessions += 1
            self._helper = link
        elif self.settings.agent == "auto":
            start_detached(self.settings)  # for the next phases; this one attaches itself
        return link  # type: ignore[no-any-return]

    def _call(self, pid: int, action: str, request: dict, timeout: float | None = None) -> object:
        helper = self._helper_for(pid, action)
        deadline = timeout or self.timeout
        reply = helper.call({**request, "op": action, "pid": pid, "deadline_s": deadline},
                            deadline + helper.grace)
        if reply is None:
            timed_out = "deadline" in (helper.dead or "")
            raise ToolError(pid, action, None,
                            helper.dead or "the driver helper exited", timed_out=timed_out)
        if not reply.get("ok"):
            code = int(reply.get("code", 999))
            raise ToolError(pid, action, code,
                            fail_text(action, pid, str(reply.get("error")),
                                      str(reply.get("name")), code), status="CUresult")
        return reply.get("value")

    def get_state(self, pid: int) -> str:
        self._need("get_state", "cuCheckpointProcessGetState (driver R570 or newer)")
        state = str(self._call(pid, "get-state", {}))
        if state not in STATES:
            raise ToolError(pid, "get-state", 0, f"unexpected state {state!r}", cuda=True)
        return state

    def get_restore_tid(self, pid: int) -> int:
        self._need("restore_tid", "cuCheckpointProcessGetRestoreThreadId (driver R570 or newer)")
        value = self._call(pid, "get-restore-tid", {})
        if not isinstance(value, int) or value <= 0:
            raise ToolError(pid, "get-restore-tid", 0, f"unexpected thread id {value!r}")
        return value

    def lock(self, pid: int, timeout_ms: int) -> None:
        self._need("actions", "cuCheckpointProcessLock (driver R570 or newer)")
        # The lock waits up to timeout_ms itself; our deadline must outlast it.
        self._call(pid, "lock", {"timeout_ms": timeout_ms},
                   timeout=self.timeout + timeout_ms / 1000)

    def checkpoint(self, pid: int) -> None:
        self._need("actions", "cuCheckpointProcessCheckpoint (driver R570 or newer)")
        self._call(pid, "checkpoint", {})

    def restore(self, pid: int, device_map: dict[str, str] | None = None) -> None:
        self._need("actions", "cuCheckpointProcessRestore (driver R570 or newer)")
        request: dict = {}
        if device_map:
            self._need("device_map", "GPU remapping on restore (driver R580 or newer)")
            try:
                request["pairs"] = [[uuid_hex(old), uuid_hex(new)]
                                    for old, new in device_map.items()]
            except ValueError as exc:
                raise ToolError(pid, "restore", None, str(exc)) from exc
        self._call(pid, "restore", request)

    def unlock(self, pid: int) -> None:
        self._need("actions", "cuCheckpointProcessUnlock (driver R570 or newer)")
        self._call(pid, "unlock", {})

    def _need_storage(self, pid: int, action: str) -> None:
        features = self.probe()
        if not features.custom_storage:
            raise ToolError(pid, action, None,
                            f"custom storage unavailable: {features.custom_storage_why}")

    def checkpoint_to_storage(self, pid: int, directory: str, chunk: int = STORAGE_CHUNK,
                              dedupe: bool | None = None) -> dict:
        """Checkpoint a locked process's GPU memory into `directory` (new; CUDA
        13.4+ custom storage) instead of its host memory: chunks, each with a
        digest, fsynced before the driver releases the memory; a chunk that
        another process of the checkpoint stored already is linked to it
        (`dedupe`, by default `gpu_storage_dedupe`), and with `gpu_storage_compression: zstd` one that shrinks
        is stored compressed. The process ends checkpointed; after a failure
        past the driver's checkpoint call it stays checkpointing (the API has
        no abort)."""
        self._need_storage(pid, "checkpoint")
        zstd = self.settings.gpu_storage_zstd_level \
            if self.settings.gpu_storage_compression == "zstd" else 0
        return self._call(pid, "storage-checkpoint", {  # type: ignore[return-value]
            "dir": directory, "chunk": chunk, "zstd": zstd,
            "dedupe": self.settings.gpu_storage_dedupe if dedupe is None else dedupe})

    def restore_from_storage(self, pid: int, directory: str,
                             device_map: dict[str, str] | None = None, *,
                             checked: bool = False) -> None:
        """Restore a process's GPU memory from `directory`, every chunk checked
        against its digest on its way in, and before the process is touched
        unless `checked` (the caller has just verified them all). It ends
        locked (unlock is the caller's); a bad image found before leaves it
        checkpointed, a chunk bad on its way in leaves it locked."""
        self._need_storage(pid, "restore")
        request: dict = {"dir": directory, "checked": checked}
        if device_map:
            try:
                request["pairs"] = [[uuid_hex(old), uuid_hex(new)]
                                    for old, new in device_map.items()]
            except ValueError as exc:
                raise ToolError(pid, "restore", None, str(exc)) from exc
        self._call(pid, "storage-restore", request)

    def toggle(self, pid: int) -> None:
        """cuda-checkpoint --toggle's meaning: lock+checkpoint or restore+unlock."""
        state = self.get_state(pid)
        if state == RUNNING:
            self.lock(pid, 0)
            self.checkpoint(pid)
        elif state == CHECKPOINTED:
            self.restore(pid)
            self.unlock(pid)
        else:
            raise ToolError(pid, "toggle", 401, f"cannot toggle a process that is {state}",
                            cuda=True)

    def close(self) -> None:
        with self._start:
            if self._helper is not None:
                self._helper.close()
                self._helper = None
