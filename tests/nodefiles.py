"""A node's files kept in a directory (CUDAHOOK_ROOT), for the install and
configure tests: the files other tools own, and a digest of the whole tree."""

from __future__ import annotations

import os
import stat
from pathlib import Path


def site_node(root: Path) -> Path:
    """Files other tools own, with content and modes of their own."""
    (root / "etc/criu").mkdir(parents=True)
    (root / "etc/criu/runc.conf").write_text("# site settings\ntcp-established\n")
    os.chmod(root / "etc/criu/runc.conf", 0o640)
    (root / "etc/docker").mkdir(parents=True)
    (root / "etc/docker/daemon.json").write_text('{"log-level": "warn", "experimental": true}')
    return root


def tree(root: Path, *, empty_dirs: bool = False, skip: str | None = None
         ) -> dict[str, str | bytes]:
    """Every file's bytes and mode and every link's target under `root`
    (with `empty_dirs`, empty directories too; paths holding `skip` left out)."""
    out: dict[str, str | bytes] = {}
    for p in sorted(root.rglob("*")):
        rel = str(p.relative_to(root))
        if skip and skip in rel:
            continue
        if p.is_symlink():
            out[rel] = "->" + os.readlink(p)
        elif p.is_file():
            out[rel] = p.read_bytes() + f"|{stat.S_IMODE(p.stat().st_mode):o}".encode()
        elif empty_dirs and not any(p.iterdir()):
            out[rel] = "(empty dir)"
    return out
