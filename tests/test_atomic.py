"""The one atomic write: whole files only, private from the first byte."""

from __future__ import annotations

import os
import stat
import threading
from pathlib import Path

import pytest

from cudahook.platform.atomic import write_atomic, write_json_atomic


def test_the_mode_holds_from_the_start_whatever_the_umask(tmp_path: Path, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    seen = []
    real_write = os.write

    def spy(fd: int, data) -> int:  # type: ignore[no-untyped-def]
        seen.append(stat.S_IMODE(os.fstat(fd).st_mode))  # while the bytes go in
        return real_write(fd, data)

    monkeypatch.setattr(os, "write", spy)
    old = os.umask(0)
    try:
        write_atomic(tmp_path / "config.json", b'{"env": ["TOKEN=secret"]}', 0o600)
    finally:
        os.umask(old)
    assert seen and set(seen) == {0o600}
    assert stat.S_IMODE((tmp_path / "config.json").stat().st_mode) == 0o600


def test_a_symlink_at_the_target_is_replaced_not_followed(tmp_path: Path) -> None:
    victim = tmp_path / "victim"
    victim.write_text("keep")
    (tmp_path / "state.json").symlink_to(victim)
    write_json_atomic(tmp_path / "state.json", {"a": 1})
    assert victim.read_text() == "keep"
    assert not (tmp_path / "state.json").is_symlink()


def test_concurrent_writers_never_leave_a_torn_file(tmp_path: Path) -> None:
    target = tmp_path / "f.json"
    errors: list[BaseException] = []

    def writer(n: int) -> None:
        try:
            for _ in range(50):
                write_json_atomic(target, {"n": n, "pad": "x" * 4096})
        except BaseException as exc:  # pragma: no cover - reported below
            errors.append(exc)

    threads = [threading.Thread(target=writer, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == []
    assert len(target.read_text()) > 4096
    assert [p.name for p in tmp_path.iterdir()] == ["f.json"]  # no temp file left


def test_a_failed_write_leaves_the_old_file_and_no_temp(tmp_path: Path) -> None:
    target = tmp_path / "f"
    target.write_bytes(b"old")
    with pytest.raises(TypeError):
        write_json_atomic(target, {"bad": object()})
    assert target.read_bytes() == b"old"
    assert [p.name for p in tmp_path.iterdir()] == ["f"]
