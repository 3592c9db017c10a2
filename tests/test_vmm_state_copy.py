"""The guardian's copy of cuda-vmm.state, taken at pre-dump from the image
directory (the container's to fill): never through a link, never from
anything but a regular file, never blocking."""

from __future__ import annotations

import os
import threading
import time
from pathlib import Path

import pytest

from cudahook.flow import guardian
from cudahook.flow.criu_run import CriuRun
from cudahook.flow.vmm_steps import keep_for_guardian
from cudahook.platform.errors import CudahookError
from cudahook.platform.host import Host
from cudahook.platform.store import Store
from cudahook.vmm.coordinator import STATE_FILE


def _setup(tmp_path: Path) -> tuple[Path, CriuRun, Path]:
    image = tmp_path / "image"
    image.mkdir()
    run = CriuRun(Store(tmp_path / "state"), Host(), os.getpid())
    return image, run, image


def keep_vmm_state(image: Path, run: CriuRun) -> None:
    keep_for_guardian(image, guardian.vmm_dir(run.path))


def _left(run: CriuRun) -> list[str]:
    return sorted(p.name for p in run.path.parent.iterdir() if ".vmm" in p.name)


def test_keeps_a_regular_state_file(tmp_path: Path) -> None:
    call, run, image = _setup(tmp_path)
    (image / STATE_FILE).write_bytes(b"vmm state\n")
    keep_vmm_state(call, run)
    assert (guardian.vmm_dir(run.path) / STATE_FILE).read_bytes() == b"vmm state\n"


def test_outside_files_read_safely__vmm_state_symlink(tmp_path: Path) -> None:
    call, run, image = _setup(tmp_path)
    secret = tmp_path / "host-secret"
    secret.write_text("root's secret\n")
    (image / STATE_FILE).symlink_to(secret)
    with pytest.raises(CudahookError, match="symlink"):
        keep_vmm_state(call, run)
    assert _left(run) == []  # nothing copied, no half copy left behind


def test_outside_files_read_safely__vmm_state_fifo(tmp_path: Path) -> None:
    call, run, image = _setup(tmp_path)
    os.mkfifo(image / STATE_FILE)
    # A writer that would feed the FIFO if anyone opened it for reading:
    # a copy that follows the FIFO reads its bytes instead of refusing.
    stop = threading.Event()

    def feed() -> None:
        while not stop.is_set():
            try:
                fd = os.open(image / STATE_FILE, os.O_WRONLY | os.O_NONBLOCK)
            except OSError:  # no reader yet
                time.sleep(0.01)
                continue
            os.write(fd, b"from the fifo\n")
            os.close(fd)

    writer = threading.Thread(target=feed, daemon=True)
    writer.start()
    began = time.monotonic()
    try:
        with pytest.raises(CudahookError, match="not a regular file"):
            keep_vmm_state(call, run)
    finally:
        stop.set()
        writer.join(5)
    assert time.monotonic() - began < 5
    assert _left(run) == []


def test_outside_files_read_safely__vmm_state_symlink_to_fifo(tmp_path: Path) -> None:
    call, run, image = _setup(tmp_path)
    os.mkfifo(tmp_path / "fifo")
    (image / STATE_FILE).symlink_to(tmp_path / "fifo")
    with pytest.raises(CudahookError, match="symlink"):
        keep_vmm_state(call, run)
    assert _left(run) == []
