"""VMM detection reads container-controlled paths: it must not hang on them."""

from __future__ import annotations

import contextlib
import ctypes
import os
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from cudahook.core.discovery import CudaProcess
from cudahook.platform.host import Host
from cudahook.vmm import coordinator as vmm

MNT_DETACH = 2


@contextlib.contextmanager
def hung_fuse(where: Path) -> Iterator[None]:
    """A FUSE mount whose server never answers: every lookup under it blocks,
    as a paused container's FUSE /snapshot-control does."""
    if os.geteuid() != 0 or not os.path.exists("/dev/fuse"):
        pytest.skip("needs root and /dev/fuse")
    libc = ctypes.CDLL(None, use_errno=True)
    fd = os.open("/dev/fuse", os.O_RDWR)
    opts = f"fd={fd},rootmode=40000,user_id=0,group_id=0".encode()
    if libc.mount(b"cudahook-test", str(where).encode(), b"fuse", 0, opts) != 0:
        os.close(fd)
        pytest.skip(f"cannot mount FUSE: {os.strerror(ctypes.get_errno())}")
    try:
        yield
    finally:
        os.close(fd)  # aborts the connection: the blocked lookups fail and end
        libc.umount2(str(where).encode(), MNT_DETACH)


def test_a_hung_control_dir_refuses_within_the_deadline(tmp_path: Path) -> None:
    proc = tmp_path / "proc"
    pid = os.getpid()
    (proc / str(pid) / "root" / "snapshot-control").mkdir(parents=True)
    (proc / str(pid) / "maps").write_text(
        "7f00-7f01 r--s 00000000 08:01 42 /opt/lib/libcuda-vmm-interposer.so\n")
    host = Host(proc=proc)
    with hung_fuse(proc / str(pid) / "root" / "snapshot-control"):
        t = time.monotonic()
        with pytest.raises(vmm.VmmRefused, match="within 1s"):
            vmm.detect(host, [CudaProcess(pid, 7)], timeout=1)
        assert time.monotonic() - t < 3


def test_the_shim_in_the_mappings_without_a_socket_is_refused(tmp_path: Path) -> None:
    proc = tmp_path / "proc"
    pid = os.getpid()
    (proc / str(pid) / "root" / "snapshot-control").mkdir(parents=True)
    (proc / str(pid) / "maps").write_text(
        "7f00-7f01 r-xp 00000000 08:01 42 /usr/lib/libcuda_vmm.so.1\n")
    with pytest.raises(vmm.VmmRefused, match="interposer loaded"):
        vmm.detect(Host(proc=proc), [CudaProcess(pid, 7)])
    (proc / str(pid) / "maps").write_text("7f00-7f01 r-xp 00000000 08:01 42 /usr/lib/libc.so.6\n")
    assert not vmm.detect(Host(proc=proc), [CudaProcess(pid, 7)]).participates
