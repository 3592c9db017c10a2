"""store: private, atomic little JSON files; per-container locks."""

from __future__ import annotations

import json
import os
import stat
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import pytest

from cudahook.platform import paths, store
from cudahook.platform.errors import UsageError
from cudahook.platform.host import Host
from cudahook.platform.store import Store, check_id, read_json, write_json_atomic

PKG = str(Path(__file__).resolve().parent.parent)


def mode(p: Path) -> int:
    return stat.S_IMODE(p.stat().st_mode)


def test_files_are_0600_and_dirs_0700(tmp_path: Path) -> None:
    root = tmp_path / "state"
    s = Store(root)
    s.update("c1", pid=1)
    s.remember("c1", "checkpoint", {"ok": True})
    s.run_path("123-456").write_text("{}")
    assert mode(root) == 0o700
    for d in ("containers", "history", "runs"):
        assert mode(root / d) == 0o700, d
    for f in ("containers/c1.json", "containers/c1.lock", "history/c1.json"):
        assert mode(root / f) == 0o600, f


def test_root_found_open_is_refused_not_changed(tmp_path: Path) -> None:
    """A directory cudahook did not create (not 0700) is never chmodded."""
    from cudahook.platform.privdir import ForeignDirectory

    root = tmp_path / "state"
    root.mkdir(mode=0o755)
    os.chmod(root, 0o755)
    with pytest.raises(ForeignDirectory):
        Store(root).update("c", pid=1)
    assert mode(root) == 0o755


def test_write_json_atomic_mode_and_no_temp_left(tmp_path: Path) -> None:
    path = tmp_path / "f.json"
    for i in range(5):
        write_json_atomic(path, {"i": i})
    assert read_json(path) == {"i": 4}
    assert mode(path) == 0o600
    assert os.listdir(tmp_path) == ["f.json"]


def test_failed_write_leaves_old_file_and_no_temp(tmp_path: Path) -> None:
    path = tmp_path / "f.json"
    write_json_atomic(path, {"ok": 1})
    with pytest.raises(TypeError):
        write_json_atomic(path, {"bad": object()})
    assert read_json(path) == {"ok": 1}
    assert os.listdir(tmp_path) == ["f.json"]


def test_update_merges_and_leaves_no_temp_files(tmp_path: Path) -> None:
    s = Store(tmp_path)
    s.update("c", a=1)
    rec = s.update("c", b=2)
    assert rec == {"id": "c", "a": 1, "b": 2} == s.load("c")
    assert sorted(os.listdir(tmp_path / "containers")) == ["c.json", "c.lock"]


def test_load_missing_or_corrupt_is_none(tmp_path: Path) -> None:
    s = Store(tmp_path)
    assert s.load("nope") is None
    s.record_path("bad").write_text('{"id": "ba')
    assert s.load("bad") is None


def test_delete(tmp_path: Path) -> None:
    s = Store(tmp_path)
    s.update("c", pid=5)
    s.update("d", pid=6)
    s.delete("c")
    s.delete("c")  # twice: nothing there, no error
    assert s.load("c") is None and s.load("d") == {"id": "d", "pid": 6}
    # The lock file goes with the record (see Store.delete and lock_file).
    assert sorted(os.listdir(tmp_path / "containers")) == ["d.json", "d.lock"]


# -- ids ----------------------------------------------------------------------------


@pytest.mark.parametrize("cid", ["../x", "a/b", "", ".hidden", "..", ".", "/abs", "x\n",
                                 "x\x00", "a b", "-lead", "a" * 251, "é"])
def test_check_id_rejects(cid: str) -> None:
    with pytest.raises(UsageError, match="invalid container id"):
        check_id(cid)


@pytest.mark.parametrize("cid", ["a", "gpu-1234abcd", "A.b_c+d-e", "0" * 64, "a" * 250])
def test_check_id_accepts(cid: str, tmp_path: Path) -> None:
    assert check_id(cid) == cid
    Store(tmp_path).update(cid, pid=1)  # and the files fit NAME_MAX
    assert Store(tmp_path).load(cid) == {"id": cid, "pid": 1}


@pytest.mark.parametrize("cid", ["../escape", "a/../../escape", "sub/x"])
def test_traversal_touches_nothing_outside(tmp_path: Path, cid: str) -> None:
    s = Store(tmp_path / "state")
    for call in (lambda: s.update(cid, x=1), lambda: s.remember(cid, "k", {}),
                 lambda: s.record_path(cid), lambda: s.delete(cid), lambda: s.load(cid)):
        with pytest.raises(UsageError):
            call()
    outside = [p for p in tmp_path.rglob("*") if not str(p).startswith(str(tmp_path / "state"))]
    assert outside == []
    assert not list((tmp_path / "state").rglob("*.json"))


# -- concurrency ------------------------------------------------------------------------

WRITER = textwrap.dedent("""
    import sys
    sys.path.insert(0, {pkg!r})
    from cudahook.platform.store import Store
    s = Store(sys.argv[1])
    me, n = sys.argv[2], int(sys.argv[3])
    pad = "x" * 40000
    for i in range(1, n + 1):
        s.update("c", **{{me: i, "pad": pad}})
""")


def test_concurrent_processes_and_threads_never_show_a_partial_file(tmp_path: Path) -> None:
    s = Store(tmp_path)
    s.update("c", pad="")
    path = s.record_path("c")
    n = 60
    script = WRITER.format(pkg=PKG)
    procs = [subprocess.Popen([sys.executable, "-c", script, str(tmp_path), f"p{i}", str(n)])
             for i in range(3)]

    def thread_writer(me: str) -> None:
        st = Store(tmp_path)  # its own lock fd: flock excludes it like another process
        for i in range(1, n + 1):
            st.update("c", **{me: i})

    threads = [threading.Thread(target=thread_writer, args=(f"t{i}",)) for i in range(2)]
    for t in threads:
        t.start()
    reads, bad = 0, []
    while any(p.poll() is None for p in procs) or any(t.is_alive() for t in threads):
        text = path.read_text()
        try:
            assert json.loads(text)["id"] == "c"
        except (ValueError, KeyError, AssertionError):
            bad.append(text[:80])
        reads += 1
    for t in threads:
        t.join()
    assert [p.wait() for p in procs] == [0, 0, 0]
    assert bad == [] and reads > 10
    final = s.load("c")
    assert final is not None
    # Every update is a locked read-modify-write: none of them is lost.
    assert [final[k] for k in ("p0", "p1", "p2", "t0", "t1")] == [n] * 5
    assert sorted(os.listdir(tmp_path / "containers")) == ["c.json", "c.lock"]


def test_threads_writing_one_file_unlocked_stay_atomic(tmp_path: Path) -> None:
    """write_json_atomic itself, as the CRIU run file and the manifest use it."""
    path = tmp_path / "f.json"
    write_json_atomic(path, {"w": -1})
    errors: list[BaseException] = []

    def writer(w: int) -> None:
        try:
            for i in range(150):
                write_json_atomic(path, {"w": w, "i": i, "pad": "y" * (20000 + 997 * w)})
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=writer, args=(w,)) for w in range(4)]
    for t in threads:
        t.start()
    bad = []
    while any(t.is_alive() for t in threads):
        data = json.loads(path.read_text() or "null")
        if not (isinstance(data, dict) and len(data.get("pad", "")) in (0, *(20000 + 997 * w
                                                                            for w in range(4)))):
            bad.append(data)
    for t in threads:
        t.join()
    assert errors == [] and bad == []
    assert os.listdir(tmp_path) == ["f.json"]


HOLDER = textwrap.dedent("""
    import sys, time
    sys.path.insert(0, {pkg!r})
    from cudahook.platform.store import Store
    root, cid, log, hold = sys.argv[1], sys.argv[2], sys.argv[3], sys.argv[4] == "hold"
    def note(what):
        with open(log, "a") as f:
            f.write(f"{{what}} {{time.monotonic():.6f}}\\n")
    with Store(root).locked(cid):
        note("in")
        print("in", flush=True)
        if hold:
            sys.stdin.readline()  # hold the lock until the test says so
        note("out")
""")


def locker(tmp_path: Path, cid: str, log: Path, hold: bool) -> subprocess.Popen[str]:
    return subprocess.Popen([sys.executable, "-c", HOLDER.format(pkg=PKG), str(tmp_path / "s"),
                             cid, str(log), "hold" if hold else "go"],
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)


def entered(p: subprocess.Popen[str]) -> None:
    assert p.stdout is not None and p.stdout.readline() == "in\n"


def release(p: subprocess.Popen[str]) -> None:
    assert p.stdin is not None
    p.stdin.write("\n")
    p.stdin.close()
    assert p.wait(10) == 0


def events(log: Path) -> list[tuple[str, float]]:
    if not log.exists():
        return []
    return [(w, float(t)) for w, t in (line.split() for line in log.read_text().splitlines())]


def test_locked_serialises_two_processes(tmp_path: Path) -> None:
    la, lb = tmp_path / "a.log", tmp_path / "b.log"
    a = locker(tmp_path, "c", la, hold=True)
    entered(a)  # a holds the lock now
    b = locker(tmp_path, "c", lb, hold=False)
    time.sleep(0.5)
    assert b.poll() is None and events(lb) == []  # b waits
    release(a)
    entered(b)
    assert b.wait(10) == 0
    (_, t_a_in), (_, t_a_out) = events(la)
    assert [w for w, _ in events(lb)] == ["in", "out"]
    assert events(lb)[0][1] >= t_a_out > t_a_in  # b only got in after a let go


def test_locks_of_different_containers_do_not_block(tmp_path: Path) -> None:
    la, lb = tmp_path / "a.log", tmp_path / "b.log"
    a = locker(tmp_path, "c", la, hold=True)
    entered(a)
    b = locker(tmp_path, "d", lb, hold=False)
    assert b.wait(30) == 0  # "d" went through while "c" is held
    assert a.poll() is None and [w for w, _ in events(la)] == ["in"]
    release(a)


# -- lookups, history, runs --------------------------------------------------------------


def test_find_by_pid(tmp_path: Path) -> None:
    s = Store(tmp_path)
    s.update("a", pid=100)
    s.update("b", pid=200)
    s.update("c", pid=None)
    (tmp_path / "containers" / "junk.json").write_text("{")
    (tmp_path / "containers" / "list.json").write_text("[200]")
    assert s.find_by_pid(200)["id"] == "b"  # type: ignore[index]
    assert s.find_by_pid(100)["id"] == "a"  # type: ignore[index]
    assert s.find_by_pid(300) is None
    assert [r["id"] for r in s.records()] == ["a", "b", "c"]
    assert Store(tmp_path / "empty").find_by_pid(100) is None


def test_remember_and_history(tmp_path: Path) -> None:
    s = Store(tmp_path)
    assert s.history() == {}
    s.remember("a", "checkpoint", {"ok": True, "n": 1})
    s.remember("a", "restore", {"ok": False})
    s.remember("a", "checkpoint", {"ok": True, "n": 2})
    s.remember("b", "checkpoint", {"ok": True})
    s.delete("a")  # the container's record goes; its history stays
    assert s.history() == {"a": {"checkpoint": {"ok": True, "n": 2}, "restore": {"ok": False}},
                           "b": {"checkpoint": {"ok": True}}}


def test_prune_runs_keeps_live_criu_runs_and_young_ones(tmp_path: Path) -> None:
    s = Store(tmp_path)
    s.prune_runs()  # no runs directory yet
    criu = subprocess.Popen(["sleep", "60"])  # a CRIU process still running
    try:
        live_key = f"{criu.pid}-{Host().start_time(criu.pid)}"
        live, live_vmm = s.run_path(live_key), s.run_path(live_key).with_suffix(".vmm")
        reused = s.run_path(f"{criu.pid}-1")  # same PID, another start: another run
        dead, dead_vmm = s.run_path("999999999-5"), s.run_path("999999999-5").with_suffix(".vmm")
        for p in (live, reused, dead):
            p.write_text("{}")
        for d in (live_vmm, dead_vmm):
            d.mkdir()
            (d / "cuda-vmm.state").write_text("x")
        stale = time.time() - 7200
        for p in (reused, dead, dead_vmm):
            os.utime(p, (stale, stale))
        assert s.prune_runs(grace_s=0) == 3  # the live run stays, however old
        assert sorted(os.listdir(tmp_path / "runs")) == sorted([live.name, live_vmm.name])
    finally:
        criu.kill()
        criu.wait()
    assert s.prune_runs(grace_s=3600) == 0  # its CRIU is gone, but recently written
    os.utime(live, (stale, stale))
    os.utime(live_vmm, (stale, stale))
    assert s.prune_runs(grace_s=3600) == 2 and os.listdir(tmp_path / "runs") == []


def test_a_pruned_runs_kept_chunk_links_go_with_it(tmp_path: Path) -> None:
    """The hard links pre-dump keeps beside a storage image for its guardian
    are removed by the guardian; if it and every successor were killed, the
    run's record names them until it is pruned, and they go with it. A
    record naming anything else removes nothing."""
    from cudahook.flow import guardian

    s = Store(tmp_path / "state")
    images = tmp_path / "images"
    kept = images / f".img{guardian.KEPT_INFIX}abc"
    (kept / "7").mkdir(parents=True)
    chunk = images / "img" / "cudahook-gpu" / "7" / "gpu0-000000.chunk"
    chunk.parent.mkdir(parents=True)
    chunk.write_bytes(b"x" * 4096)
    os.link(chunk, kept / "7" / chunk.name)
    other = images / "not-kept"
    other.mkdir()
    gone, live = s.run_path("999999999-5"), s.run_path("999999998-5")
    write_json_atomic(gone, {guardian.KEPT: str(kept)})
    write_json_atomic(live, {guardian.KEPT: str(other)})
    stale = time.time() - 7200
    os.utime(gone, (stale, stale))
    assert s.prune_runs(grace_s=3600, gone=guardian.drop_kept) == 1
    assert not kept.exists() and chunk.stat().st_nlink == 1  # the image's own file stays
    assert live.exists()
    os.utime(live, (stale, stale))
    assert s.prune_runs(grace_s=3600, gone=guardian.drop_kept) == 1
    assert other.is_dir()  # no kept-links name: never removed


def test_prune_forgets_gone_containers_after_the_retention(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(paths.ROOT_ENV, str(tmp_path / "node"))  # its GPU marks go too
    s = Store(tmp_path / "state")
    tmp_path = tmp_path / "state"
    init = subprocess.Popen(["sleep", "60"])
    try:
        s.update("live", pid=init.pid, pid_start=Host().start_time(init.pid))
        s.remember("live", "checkpoint", {"ok": True})
        s.update("crashed", pid=999999999, pid_start=1)  # no poststop ran
        s.remember("crashed", "checkpoint", {"ok": True})
        s.remember("stopped", "checkpoint", {"ok": True})  # poststop ran: no record
        with s.locked("orphan"):  # a lock with no record
            pass
        assert s.prune(3600) == 0  # all younger than the retention
        later = time.time() + 7200
        # crashed (record), the locks of orphan and stopped, the histories of both gone
        assert s.prune(3600, now=later) == 5
        assert sorted(os.listdir(tmp_path / "containers")) == ["live.json", "live.lock"]
        assert list(s.history()) == ["live"]  # a live container keeps its results
    finally:
        init.kill()
        init.wait()


def test_prune_never_waits_for_a_held_lock(tmp_path: Path,
                                           monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(paths.ROOT_ENV, str(tmp_path / "node"))
    s = Store(tmp_path / "state")
    s.update("crashed", pid=999999999, pid_start=1)
    s.remember("crashed", "checkpoint", {"ok": True})
    with s.locked("crashed"):  # a hook busy with it
        t0 = time.monotonic()
        assert s.prune(0, now=time.time() + 10) == 0
        assert time.monotonic() - t0 < 2
    assert s.load("crashed") is not None and "crashed" in s.history()
    assert s.prune(0, now=time.time() + 10) == 2  # free now: record and results go


def test_history_is_capped(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(store, "HISTORY_MAX", 3)
    s = Store(tmp_path)
    for i in range(6):
        s.remember(f"c{i}", "checkpoint", {"ok": True})
        os.utime(tmp_path / "history" / f"c{i}.json", (1000 + i, 1000 + i))
    s.prune(10**9, now=2000)
    assert sorted(s.history()) == ["c3", "c4", "c5"]


UNLINKER = """
import sys
from cudahook.platform import store
lock = store.lock_file

def held(path, **kw):  # Store.delete's lock, held until the test says go
    fd = lock(path, **kw)
    print("held", flush=True)
    sys.stdin.readline()
    return fd

store.lock_file = held
store.Store(sys.argv[1]).delete("c")  # unlinks the lock file while holding it
print("deleted", flush=True)
"""

WAITER = """
import sys, time
from cudahook.platform.store import Store
s = Store(sys.argv[1])
with s.locked("c"):
    print("in", time.time(), flush=True)
    time.sleep(1.0)
    print("out", time.time(), flush=True)
"""


def test_a_lock_unlinked_while_waited_on_never_lets_two_in(tmp_path: Path) -> None:
    """A waits on the lock B holds; B deletes the container (lock file
    unlinked) and lets go, and C takes a new lock file: A and C must never
    both be in (A must not trust the unlinked file it was waiting on)."""
    py = sys.executable
    b = subprocess.Popen([py, "-c", UNLINKER, str(tmp_path)], stdin=subprocess.PIPE,
                         stdout=subprocess.PIPE, text=True)
    assert b.stdout is not None and b.stdin is not None
    assert b.stdout.readline() == "held\n"
    a = subprocess.Popen([py, "-c", WAITER, str(tmp_path)], stdout=subprocess.PIPE, text=True)
    time.sleep(1.0)  # A is blocked on B's lock file
    b.stdin.write("\n")
    b.stdin.flush()
    assert b.stdout.readline() == "deleted\n"
    # A now gets the unlinked file's lock; C takes the new lock file at once.
    c = subprocess.Popen([py, "-c", WAITER, str(tmp_path)], stdout=subprocess.PIPE, text=True)
    assert b.wait(10) == 0
    spans = []
    for p in (a, c):
        out, _ = p.communicate(timeout=20)
        assert p.returncode == 0
        lines = [line.split() for line in out.splitlines()]
        spans.append((float(lines[0][1]), float(lines[1][1])))
    (a_in, a_out), (c_in, c_out) = sorted(spans)
    assert a_out <= c_in or c_out <= a_in, spans  # never both inside


# -- keys ------------------------------------------------------------------------------


def test_records_carry_their_key_and_find_needs_one_of_that_id(tmp_path: Path) -> None:
    s = Store(tmp_path)
    ka, kb = store.container_key("web", "/a"), store.container_key("web", "/b")
    s.update(ka, id="web", pid=1)
    assert s.find("web") == {"id": "web", "pid": 1, "key": ka}
    s.update(kb, id="web", pid=2)
    assert sorted(r["key"] for r in s.records()) == sorted([ka, kb])
    assert s.find("web") is None  # two of that id: only the key tells which
    assert s.find(kb) == {"id": "web", "pid": 2, "key": kb}
    assert s.load(kb) == {"id": "web", "pid": 2}  # the key is the name, not in the file
    s.update("old", pid=3)  # a record from before keys, named by the id
    assert s.find("old") == {"id": "old", "pid": 3, "key": "old"}


def test_busy_locks_of_gone_inits_are_pruned(tmp_path: Path) -> None:
    from cudahook.platform import busy

    s = Store(tmp_path)
    alive = subprocess.Popen(["sleep", "60"])
    gone = subprocess.Popen(["true"])
    gone.wait()
    try:
        host = Host()
        live_key = store.init_key(alive.pid, host.start_time(alive.pid))
        dead_key = store.init_key(gone.pid, 12345)
        for key in (live_key, dead_key):
            with busy.hold(str(tmp_path), key, 1.0):
                pass
        # Guardian markers: a killed guardian's of a gone init goes; a live
        # guardian's stays, as does any marker of a live init.
        (tmp_path / "guardians").mkdir()
        me = {"pid": os.getpid(), "start": host.start_time(os.getpid())}
        for key, guard in ((live_key, {"pid": gone.pid, "start": 1}), (dead_key, me),
                           (store.init_key(gone.pid, 777), {"pid": gone.pid, "start": 1})):
            write_json_atomic(tmp_path / "guardians" / f"{key}.json", guard)
        s.prune(0.0)
        assert sorted(os.listdir(tmp_path / "busy")) == [f"{live_key}.lock"]
        assert sorted(os.listdir(tmp_path / "guardians")) == sorted(
            [f"{live_key}.json", f"{dead_key}.json"])
    finally:
        alive.kill()
        alive.wait()
