"""One exit-code table: the README's, cudahook.platform.errors.Exit, and what
the CLI and the hooks really return."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

from cudahook.core import manifest
from cudahook.platform import errors
from cudahook.platform.errors import CudahookError, Exit

from .conftest import Node
from .test_criu_action import action, install

ROOT = Path(__file__).resolve().parents[1]


def readme_table() -> dict[int, str]:
    """code -> meaning, from docs/cli.md's "## Exit codes" table (code, name, meaning)."""
    text = (ROOT / "docs" / "cli.md").read_text()
    section = text.split("## Exit codes", 1)[1].split("\n#", 1)[0]
    return {int(m[1]): m[2].strip()
            for m in re.finditer(r"^\| (\d+) \| `\w+` \| (.+) \|$", section, re.M)}


def test_exit_codes_one_table__readme_and_exit_agree() -> None:
    table = readme_table()
    assert set(table) == {int(e) for e in Exit}, (table, list(Exit))
    # Each meaning starts as the enum's comment does (one wording of each).
    source = (ROOT / "cudahook/platform/errors.py").read_text()
    for e in Exit:
        comment = re.search(rf"^    {e.name} = {int(e)}(?:  # (.*))?$", source, re.M)
        assert comment, e
        if comment[1]:
            assert table[int(e)].startswith(comment[1].split(";")[0][:30]), (e, table[int(e)])
    # The CLI's docstring names the same codes.
    from cudahook.admin import cli

    assert set(map(int, re.findall(r"\b([0-9]) (?:done|the|bad|invalid|a required|\(`check)",
                                   cli.__doc__ or ""))) == set(table)


def _codes_in_code() -> set[int]:
    """Every code some module outside errors.py returns or raises."""
    found: set[int] = set()
    sources = "\n".join(p.read_text() for p in (ROOT / "cudahook").rglob("*.py")
                        if "sim" not in p.parts and p.name != "errors.py")
    for e in Exit:
        if re.search(rf"\bExit\.{e.name}\b", sources):
            found.add(int(e))
    for cls in vars(errors).values():
        if (isinstance(cls, type) and issubclass(cls, CudahookError)
                and re.search(rf"\b{cls.__name__}\(", sources)):
            found.add(int(cls.exit_code))
    if re.search(r"safe=False", sources):  # PhaseError(..., safe=False)
        found.add(int(Exit.UNSAFE))
    return found


def test_exit_codes_one_table__every_documented_code_is_reachable() -> None:
    assert set(readme_table()) <= _codes_in_code() | {0}


def cli(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "cudahook", *args], capture_output=True,
                          text=True, timeout=60)


def test_exit_codes_one_table__the_cli_returns_them(tmp_path: Path) -> None:
    cfg = tmp_path / "config.yaml"
    cfg.write_text(f"state_dir: {tmp_path}/state\nlog_file: {tmp_path}/log\n"
                   "cuda_checkpoint: /nonexistent/cuda-checkpoint\n")
    image = tmp_path / "img"
    image.mkdir()
    (image / manifest.NAME).write_text('{"version": 1, "processes": "x"}')
    bad = tmp_path / "bad.yaml"
    bad.write_text("max_parallel: .nan\n")
    runs = {
        0: cli("--config", str(cfg), "status", "--no-live"),
        2: cli("--config", str(cfg), "restore", "--pid", "0"),
        3: cli("--config", str(bad), "status"),
        5: cli("--config", str(cfg), "features"),
        6: cli("--config", str(cfg), "check", "--image", str(image)),
    }
    for code, r in runs.items():
        assert r.returncode == code, (code, r)
        assert "Traceback" not in r.stderr


def test_exit_codes_one_table__unreadable_manifest_at_post_restore_is_6(
        node: Node, tmp_path: Path) -> None:
    script = install(tmp_path, node)
    image = tmp_path / "img"
    image.mkdir()
    init = subprocess.Popen(["sleep", "60"], start_new_session=True)
    node.procs.append(init)  # type: ignore[arg-type]
    for n, text in enumerate(['{"version": 1, "processes": "x"}', "{not json", ""]):
        (image / manifest.NAME).write_text(text)
        r = action(script, "post-restore", new_run=True, CRTOOLS_INIT_PID=str(init.pid),
                   CRTOOLS_IMAGE_DIR=str(image))
        assert r.returncode == Exit.NOT_HERE, (n, r)
        assert "MANIFEST_UNREADABLE" in r.stderr and r.stderr.count("\n") == 1, r.stderr
    assert init.poll() is None  # refused, nothing killed
