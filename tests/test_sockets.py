"""sockets: the interposer's sockets in a container-owned directory, never via a symlink."""

from __future__ import annotations

import os
import socket
from collections.abc import Iterator
from pathlib import Path

import pytest

from cudahook.vmm import sockets


@pytest.fixture
def bound() -> Iterator[list[socket.socket]]:
    held: list[socket.socket] = []
    yield held
    for s in held:
        s.close()


def make_socket(path: Path, held: list[socket.socket]) -> Path:
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    held.append(s)
    # Through the directory's fd: tmp paths can pass AF_UNIX's 108-byte limit.
    dfd = os.open(path.parent, os.O_PATH | os.O_DIRECTORY)
    try:
        s.bind(f"/proc/self/fd/{dfd}/{path.name}")
    finally:
        os.close(dfd)
    assert path.is_socket()
    return path


def populate(d: Path, held: list[socket.socket]) -> dict[str, Path]:
    """A control dir with valid sockets and every kind of look-alike."""
    d.mkdir(parents=True, exist_ok=True)
    made = {
        "ok7": make_socket(d / "cuda-vmm-7.sock", held),
        "ok1234567890": make_socket(d / "cuda-vmm-1234567890.sock", held),
        "bad_zero": make_socket(d / "cuda-vmm-0.sock", held),  # PIDs start at 1
        "bad_lead0": make_socket(d / "cuda-vmm-07.sock", held),
        "bad_long": make_socket(d / "cuda-vmm-12345678901.sock", held),
        "bad_name": make_socket(d / "other.sock", held),
        "bad_suffix": make_socket(d / "cuda-vmm-8.sock.bak", held),
        "bad_newline": make_socket(d / "cuda-vmm-15.sock\n", held),  # "$" would take it
    }
    target = make_socket(d.parent / f"{d.name}-outside.sock", held)
    (d / "cuda-vmm-11.sock").symlink_to(target)  # a symlink named like a socket
    made["link"] = d / "cuda-vmm-11.sock"
    os.mkfifo(d / "cuda-vmm-12.sock")
    made["fifo"] = d / "cuda-vmm-12.sock"
    (d / "cuda-vmm-13.sock").write_text("regular")
    made["file"] = d / "cuda-vmm-13.sock"
    (d / "cuda-vmm-14.sock").mkdir()
    made["dir"] = d / "cuda-vmm-14.sock"
    (d / "notes.txt").write_text("keep")
    made["notes"] = d / "notes.txt"
    made["outside"] = target
    return made


def test_list_sockets_only_valid_sockets(tmp_path: Path, bound: list[socket.socket]) -> None:
    populate(tmp_path / "ctl", bound)
    assert sockets.list_sockets(str(tmp_path / "ctl")) == {
        7: "cuda-vmm-7.sock", 1234567890: "cuda-vmm-1234567890.sock"}


def test_list_sockets_missing_or_odd_paths(tmp_path: Path) -> None:
    assert sockets.list_sockets(str(tmp_path / "nope")) == {}
    (tmp_path / "f").write_text("x")
    assert sockets.list_sockets(str(tmp_path / "f")) == {}  # not a directory
    assert sockets.list_sockets("relative/dir") == {}
    assert sockets.list_sockets(str(tmp_path) + "/../" + tmp_path.name) == {}
    assert sockets.list_sockets(str(tmp_path / "." / "x")) == {}


def _ident(path: Path) -> list[int]:
    st = os.lstat(path)
    return [st.st_dev, st.st_ino]


def test_remove_owned_sockets_removes_only_the_recorded_ones(
        tmp_path: Path, bound: list[socket.socket]) -> None:
    d = tmp_path / "ctl"
    made = populate(d, bound)
    before = sorted(os.listdir(d))
    owned = {"cuda-vmm-7.sock": _ident(made["ok7"]),
             # another container's socket took this name since: not ours any more
             "cuda-vmm-1234567890.sock": [0, 0],
             "other.sock": _ident(made["bad_name"]),  # not an interposer name
             "cuda-vmm-11.sock": _ident(made["outside"])}  # a symlink there
    assert sockets.remove_owned_sockets(str(d), owned) == 1
    assert sorted(set(before) - set(os.listdir(d))) == ["cuda-vmm-7.sock"]
    assert made["link"].is_symlink() and made["outside"].is_socket()
    assert sockets.remove_owned_sockets(str(d), owned) == 0  # nothing left to remove
    assert sockets.remove_owned_sockets(str(d), {}) == 0


def test_a_live_socket_is_never_removed(tmp_path: Path, bound: list[socket.socket]) -> None:
    d = tmp_path / "ctl"
    d.mkdir()
    path = make_socket(d / "cuda-vmm-7.sock", bound)
    bound[-1].listen(1)  # someone still serves it
    assert sockets.remove_owned_sockets(str(d), {"cuda-vmm-7.sock": _ident(path)}) == 0
    assert path.is_socket()


def test_owned_socket_is_the_one_the_process_listens_on(
        tmp_path: Path, bound: list[socket.socket]) -> None:
    d = tmp_path / "ctl"
    d.mkdir()
    path = make_socket(d / "cuda-vmm-7.sock", bound)
    assert sockets.owned_socket(7, os.getpid(), str(d), "/") is None  # nobody listens
    bound[-1].listen(1)
    assert sockets.owned_socket(7, os.getpid(), str(d), "/") == (
        "cuda-vmm-7.sock", *_ident(path))
    assert sockets.owned_socket(7, os.getpid() + 1, str(d), "/") is None  # another's socket
    assert sockets.owned_socket(8, os.getpid(), str(d), "/") is None


@pytest.mark.parametrize("where", ["leaf", "parent"])
def test_symlinked_directory_is_treated_as_missing(
        tmp_path: Path, bound: list[socket.socket], where: str) -> None:
    host = tmp_path / "host" / "ctl"  # a host directory the container must not reach
    populate(host, bound)
    before = sorted(os.listdir(host))
    container = tmp_path / "container"
    container.mkdir()
    if where == "leaf":
        (container / "ctl").symlink_to(host)
        path = container / "ctl"
    else:
        (container / "mnt").symlink_to(host.parent)
        path = container / "mnt" / "ctl"
    assert sorted(os.listdir(path)) == before  # the path does lead there when followed
    assert sockets.open_dir_nofollow(str(path)) is None
    assert sockets.list_sockets(str(path)) == {}
    owned = {n: _ident(host / n) for n in ("cuda-vmm-7.sock", "cuda-vmm-1234567890.sock")}
    assert sockets.remove_owned_sockets(str(path), owned) == 0
    assert sockets.owned_socket(7, os.getpid(), str(path), "/") is None
    assert sorted(os.listdir(host)) == before  # untouched
    assert sockets.list_sockets(str(host)) != {}  # (the real path itself is fine)


def test_symlink_to_a_socket_dir_elsewhere_in_the_path(
        tmp_path: Path, bound: list[socket.socket]) -> None:
    host = tmp_path / "a" / "b" / "ctl"
    populate(host, bound)
    (tmp_path / "l1").symlink_to(tmp_path / "a")
    (tmp_path / "a" / "l2").symlink_to(tmp_path / "a" / "b")
    for path in (tmp_path / "l1" / "b" / "ctl", tmp_path / "a" / "l2" / "ctl"):
        assert sockets.remove_owned_sockets(
            str(path), {"cuda-vmm-7.sock": _ident(host / "cuda-vmm-7.sock")}) == 0
        assert sockets.list_sockets(str(path)) == {}
    assert len(sockets.list_sockets(str(host))) == 2


def test_base_confines_the_lookup(tmp_path: Path, bound: list[socket.socket]) -> None:
    root = tmp_path / "root"
    populate(root / "snapshot-control", bound)
    got = sockets.list_sockets("/snapshot-control", base=str(root))
    assert set(got) == {7, 1234567890}
    (tmp_path / "root2").mkdir()
    (tmp_path / "root2" / "snapshot-control").symlink_to(root / "snapshot-control")
    assert sockets.list_sockets("/snapshot-control", base=str(tmp_path / "root2")) == {}
    assert sockets.list_sockets("/snapshot-control", base=str(tmp_path / "none")) == {}
