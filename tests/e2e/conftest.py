from __future__ import annotations

import hashlib
import json
import os
import shutil
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

from cudahook.admin import hookfiles
from cudahook.sim.bundle import find_criu
from cudahook.sim.lab import SimLab
from cudahook.sim.runcbox import RuncBox

from ..conftest import _SANDBOX as SANDBOX
from .outcomes import assert_dumped, workload_pids

CRIU = find_criu()


def real_node_env() -> dict[str, str]:
    """The environment for a command that must use the node's real paths
    (install.sh registering with /etc/criu/runc.conf, which runc reads):
    only ever inside the suite's private mount namespace."""
    env = dict(os.environ)
    env.pop("CUDAHOOK_ROOT", None)
    return env


# Tests that write the node's real paths: only where those are private.
private_node = pytest.mark.skipif(
    not SANDBOX.private,
    reason="writes /etc, /usr/local and /run: only inside the suite's private mount namespace")

needs_runc = [
    pytest.mark.e2e,
    pytest.mark.skipif(os.geteuid() != 0, reason="needs root"),
    pytest.mark.skipif(shutil.which("runc") is None, reason="runc not found"),
    pytest.mark.skipif(CRIU is None, reason="criu >= 4.0 not found (scripts/provision-criu.sh)"),
]


class Env:
    """A simulated GPU node, cudahook's hooks installed for it, and runc."""

    def __init__(self, tmp: Path, **lab_kw: Any):
        self.tmp = tmp
        self.lab = SimLab(tmp / "node", **lab_kw).start()
        settings = self.lab.settings()
        self.config = tmp / "cudahook.yaml"
        self.config.write_text(yaml.safe_dump(dict(settings.__dict__)))
        self.state_dir = Path(settings.state_dir)
        self.log_file = Path(settings.log_file)
        self.hooks = tmp / "hooks"
        hookfiles.install(self.hooks, config=str(self.config))
        self.box = RuncBox(tmp / "runc", self.lab, hooks_dir=self.hooks, criu=CRIU)

    def cid(self) -> str:
        return f"gpu-{uuid.uuid4().hex[:8]}"

    def events(self, name: str | None = None) -> list[dict[str, Any]]:
        if not self.log_file.exists():
            return []
        lines = [json.loads(x) for x in self.log_file.read_text().splitlines() if x.strip()]
        return [x for x in lines if name is None or x["event"] == name]

    def wait_event(self, name: str, pred: Any = lambda e: True, timeout: float = 10) -> dict:
        deadline = time.monotonic() + timeout
        while True:
            hits = [e for e in self.events(name) if pred(e)]
            if hits:
                return hits[-1]
            assert time.monotonic() < deadline, f"no {name} event: {self.events()}"
            time.sleep(0.05)

    def wait_running(self, tags: list[str], since: dict[str, int] | None = None,
                     steps: int = 11, timeout: float = 20) -> None:
        """Each workload advanced `steps` past `since` with memory intact."""
        for t in tags:
            st = self.lab.wait_counter(t, (since or {}).get(t, 0) + steps, timeout=timeout)
            assert st["intact"], st
            assert st["errors"] == [], st

    def counters(self, tags: list[str]) -> dict[str, int]:
        return {t: self.lab.status(t).get("counter", 0) for t in tags}

    def frozen(self, cid: str, tags: list[str]) -> dict[str, int]:
        """After a dump (not --leave-running): the container and every
        process of it are gone, so nothing runs on from the checkpoint. The
        counters each workload last reported: wait_running(tags, frozen)
        after a restore sees them go on from there."""
        return assert_dumped(self, cid, tags)

    def paused(self, cid: str, tags: list[str], for_s: float = 0.3) -> dict[str, int]:
        """A paused container: each workload's process alive and frozen in
        its cgroup, its counter not moving. The counters."""
        from cudahook.platform.host import Host

        pids = workload_pids(self.lab, cid, tags)
        assert all(pids.values()), f"workloads not alive: {pids}"
        host = Host()
        assert all(host.is_frozen(p) for p in pids.values() if p), f"not frozen: {pids}"
        before = self.counters(tags)
        time.sleep(for_s)
        after = self.counters(tags)
        assert before == after, f"paused workloads kept running: {before} -> {after}"
        return after

    def close(self) -> None:
        self.box.close()
        self.lab.stop()


@pytest.fixture
def make_env(tmp_path: Path) -> Iterator[Any]:
    envs: list[Env] = []

    def make(**kw: Any) -> Env:
        e = Env(tmp_path / f"env{len(envs)}", **kw)
        envs.append(e)
        return e

    yield make
    for e in envs:
        e.close()


@pytest.fixture
def gpu_only_env(make_env: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Env:
    """An Env under a node root of its own (CUDAHOOK_ROOT), cudahook
    configured for runc with `--criu-registration gpu-only` over the
    operator's runc.conf: CRIU runs the action script only for the
    containers the runtime wrapper (wrapped_runc) registers."""
    from cudahook.admin.configure import configure

    root = tmp_path / "root"
    (root / "etc/criu").mkdir(parents=True)
    (root / "etc/criu/runc.conf").write_text("tcp-established\n")
    monkeypatch.setenv("CUDAHOOK_ROOT", str(root))
    env: Env = make_env()
    configure("runc", env.hooks, root=str(root), criu_registration="gpu-only")
    return env


def wrapped_runc(work: Path, lab: SimLab, hooks: Path) -> RuncBox:
    """runc under a root of its own (`work`), started through the runtime
    wrapper installed in `hooks` (cudahook-runtime), as a runtime configured
    for it starts runc."""
    return RuncBox(work, lab, criu=CRIU, runc=str(hooks / "cudahook-runtime"))


def dump_log(image: Path) -> str:
    """CRIU's log of the dump into `image` (runc keeps it in <image>.work)."""
    return (Path(f"{image}.work") / "dump.log").read_text(errors="replace")


def tree_digest(path: Path) -> str:
    h = hashlib.sha256()
    for p in sorted(path.rglob("*")):
        if p.is_file():
            h.update(str(p.relative_to(path)).encode())
            h.update(p.read_bytes())
    return h.hexdigest()
