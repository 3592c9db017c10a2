from __future__ import annotations

import contextlib
import os
import shlex
import shutil
import signal
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest

from cudahook.core.backends import make_backend
from cudahook.core.engine import Engine
from cudahook.platform.host import Host
from cudahook.sim.lab import SimLab

from .sandbox import Sandbox

DRIVERS = [550, 555, 570, 580, 590]
REPO = Path(__file__).resolve().parents[1]

# The suite never touches the node (tests/sandbox.py). Entered when pytest
# imports this file, the first conftest: before any other conftest or test
# module looks at a path, and before any thread exists (unshare needs one).
_SANDBOX = Sandbox()
_SANDBOX.enter()
# The suite's CRIU (scripts/test.sh provisions it beside the checkout).
if "CUDAHOOK_CRIU" not in os.environ and (REPO / ".cache/criu/bin/criu").exists():
    os.environ["CUDAHOOK_CRIU"] = str(REPO / ".cache/criu/bin/criu")


def count_opens(monkeypatch: pytest.MonkeyPatch, path: str) -> list[str]:
    """Every os.open of `path` from now on: the list grows as they happen."""
    opened: list[str] = []
    real_open = os.open

    def counting_open(p: object, *args: object, **kwargs: object) -> int:
        if os.fspath(p) == path:  # type: ignore[call-overload]
            opened.append(path)
        return real_open(p, *args, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(os, "open", counting_open)
    return opened


def pytest_report_header(config: pytest.Config) -> str:
    how = "private mount namespace" if _SANDBOX.private else "no namespace (not root)"
    return f"cudahook sandbox: CUDAHOOK_ROOT={_SANDBOX.root}, {how}"


@pytest.fixture(scope="session", autouse=True)
def node_untouched(tmp_path_factory: pytest.TempPathFactory) -> Iterator[None]:
    """Fails the run if the node's cudahook installation or registrations
    changed, or its live state holds what only this run writes (see
    tests/sandbox.py: the node's own cudahook may checkpoint meanwhile)."""
    yield
    changes = _SANDBOX.changes(own=(str(tmp_path_factory.getbasetemp()),))
    _SANDBOX.close()
    assert not changes, "the suite changed the node:\n" + "\n".join(changes[:50])


@pytest.fixture(scope="session", autouse=True)
def fake_libcuda() -> Path:
    """The simulated node's libcuda.so.1, compiled once for the session."""
    from cudahook.sim import fakelib

    return fakelib.build()


@pytest.fixture
def backend_kind() -> str:
    """The backend `Node.engine` drives; test modules parametrise it."""
    return "cli"


class Node:
    """A simulated GPU node plus the workloads a test started on it."""

    def __init__(self, root: Path, backend: str = "cli", **kw: object):
        self.lab = SimLab(root, **kw).start()  # type: ignore[arg-type]
        self.backend = backend
        self.procs: list[subprocess.Popen[bytes]] = []

    def spawn(self, tag: str, **opts: object) -> subprocess.Popen[bytes]:
        p = self.lab.spawn(tag, **opts)
        self.procs.append(p)
        return p

    def spawn_tree(self, *workloads: tuple[str, dict[str, object]]) -> subprocess.Popen[bytes]:
        """A shell "init" with the workloads as its children, as in a container."""
        script = " ".join(shlex.join(self.lab.workload_argv(tag, **opts)) + " &"
                          for tag, opts in workloads) + " wait"
        p = subprocess.Popen(["bash", "-c", script], env=self.lab.workload_env(),
                             stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                             start_new_session=True)
        self.procs.append(p)
        return p

    def settings(self, **over: object):  # type: ignore[no-untyped-def]
        return self.lab.settings(**{"backend": self.backend, **over})

    def engine(self, **over: object) -> Engine:
        settings = self.settings(**over)
        host = Host()
        return Engine(make_backend(settings, host), settings, host)

    def close(self) -> None:
        for p in self.procs:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(p.pid, signal.SIGKILL)
            p.wait()
        self.lab.stop()


@pytest.fixture
def make_node(tmp_path: Path, backend_kind: str) -> Iterator:  # type: ignore[type-arg]
    nodes: list[Node] = []

    def make(name: str = "node", **kw: object) -> Node:
        if backend_kind == "driver-api" and int(kw.get("driver", 580)) < 570:  # type: ignore[call-overload]
            pytest.skip("the checkpoint driver API needs driver R570 or newer")
        node = Node(tmp_path / name, backend_kind, **kw)
        nodes.append(node)
        return node

    yield make
    for n in nodes:
        n.close()


@pytest.fixture
def node(make_node) -> Node:  # type: ignore[no-untyped-def]
    return make_node()


def pids_of(node: Node, tag: str, procs: int) -> list[int]:
    """Host PIDs of a multi-process workload's workers, from their reports."""
    tags = [f"{tag}.{i}" for i in range(procs)] if procs > 1 else [tag]
    return [node.lab.wait_counter(t)["pid"] for t in tags]


requires_root = pytest.mark.skipif(os.geteuid() != 0, reason="needs root")
requires_unshare = pytest.mark.skipif(shutil.which("unshare") is None, reason="needs unshare")
