"""eventlog: one JSON line per event, appended, and a log that never grows
past its cap (plus the one older generation it keeps)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from cudahook.platform import eventlog


def lines(path: Path) -> list[dict[str, object]]:
    return [json.loads(x) for x in path.read_text().splitlines()] if path.exists() else []


def test_the_log_is_renamed_to_dot_1_past_its_cap(tmp_path: Path,
                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(eventlog, "MAX_BYTES", 4096)
    log = tmp_path / "cudahook.log"
    n = 0
    while not (tmp_path / "cudahook.log.1").exists():
        eventlog.log(str(log), "x", n=n, pad="p" * 50)
        n += 1
        assert n < 1000
    first = lines(tmp_path / "cudahook.log.1")
    assert [e["n"] for e in first] == list(range(n))  # every line, whole, in order
    assert (tmp_path / "cudahook.log.1").stat().st_size > 4096
    assert not log.exists()  # the next line starts a new file
    eventlog.log(str(log), "x", n=n)
    assert [e["n"] for e in lines(log)] == [n]
    assert log.stat().st_mode & 0o777 == 0o600
    # Past the cap again: the older generation goes, one is kept.
    while len(list(tmp_path.iterdir())) == 2 and log.exists():
        n += 1
        eventlog.log(str(log), "x", n=n, pad="p" * 50)
    assert sorted(os.listdir(tmp_path)) == ["cudahook.log.1"]
    assert lines(tmp_path / "cudahook.log.1")[0]["n"] == first[-1]["n"] + 1


WRITER = """
import sys
from cudahook.platform import eventlog
eventlog.MAX_BYTES = int(sys.argv[2])
for i in range(int(sys.argv[3])):
    eventlog.log(sys.argv[1], "x", writer=sys.argv[4], i=i, pad="p" * 80)
"""


def test_concurrent_writers_rotate_once_and_keep_every_line_whole(tmp_path: Path) -> None:
    log = tmp_path / "cudahook.log"
    cap, per_writer, writers = 64 * 1024, 400, 6
    procs = [subprocess.Popen([sys.executable, "-c", WRITER, str(log), str(cap),
                               str(per_writer), str(w)]) for w in range(writers)]
    for p in procs:
        assert p.wait(120) == 0
    names = sorted(os.listdir(tmp_path))
    assert names in (["cudahook.log", "cudahook.log.1"], ["cudahook.log.1"]), names
    seen = lines(log) + lines(tmp_path / "cudahook.log.1")  # no torn line: all parse
    # Each file is at most the cap plus the lines the other writers append
    # while one renames it (a handful, or more when the renamer is descheduled).
    for name in names:
        assert (tmp_path / name).stat().st_size <= 2 * cap
    # Only whole older generations go: what is kept of each writer's lines
    # is its newest ones, without gaps; and a full generation is kept.
    for w in range(writers):
        mine = sorted(e["i"] for e in seen if e["writer"] == str(w))
        assert mine == list(range(per_writer - len(mine), per_writer)), (w, mine[:3])
    assert (tmp_path / "cudahook.log.1").stat().st_size > cap


def test_an_unwritable_log_never_fails_the_caller(tmp_path: Path,
                                                  capsys: pytest.CaptureFixture[str]) -> None:
    eventlog.log(str(tmp_path / "missing-dir" / "x.log"), "e", error="boom")
    assert capsys.readouterr().err == "cudahook: e: boom\n"


def test_a_writer_late_to_rotate_leaves_the_new_log_alone(tmp_path: Path,
                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    """Two hooks cross the cap at once: the one that rotates second must not
    rename the fresh log over the generation the first one just kept."""
    monkeypatch.setattr(eventlog, "MAX_BYTES", 1024)
    log = tmp_path / "cudahook.log"
    eventlog.log(str(log), "first")
    late = os.open(log, os.O_WRONLY | os.O_APPEND)  # opened before the rotation
    try:
        n = 0
        while log.exists():
            eventlog.log(str(log), "x", n=n, pad="p" * 50)
            n += 1
        kept = (tmp_path / "cudahook.log.1").read_bytes()
        eventlog.log(str(log), "fresh")
        eventlog.rotate(str(log), late)  # its size check also saw the old file over the cap
        assert [e["event"] for e in lines(log)] == ["fresh"]
        assert (tmp_path / "cudahook.log.1").read_bytes() == kept
    finally:
        os.close(late)
