from __future__ import annotations

from pathlib import Path

import pytest

from cudahook.platform import config, configcache
from cudahook.platform.config import Settings
from cudahook.platform.errors import ConfigError


def test_defaults_match_the_shipped_file() -> None:
    shipped = config.load(config.config_dir() / "config.yaml")
    assert shipped == Settings()


def test_absent_default_file_means_defaults(monkeypatch, tmp_path) -> None:  # type: ignore[no-untyped-def]
    monkeypatch.setenv("CUDAHOOK_ROOT", str(tmp_path))
    monkeypatch.delenv(config.ENV_PATH, raising=False)
    assert config.load() == Settings()
    assert Settings().state_dir == f"{tmp_path}/run/cudahook"  # defaults move with the root


def test_explicit_missing_file_is_an_error(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="no such configuration file"):
        config.load(tmp_path / "missing.yaml")


@pytest.mark.parametrize(("text", "message"), [
    ("lock_timeout_ms: soon\n", "lock_timeout_ms: 'soon' is not of type 'integer'"),
    ("bogus: 1\n", "Additional properties are not allowed"),
    ("device_pattern: '(unclosed'\n", "device_pattern: '(unclosed' is not a 'regex'"),
    ("max_parallel: 0\n", "max_parallel: 0 is less than the minimum of 1"),
    ("- a\n- b\n", "is not of type 'object'"),
    ("a: [\n", "not valid YAML"),
])
def test_invalid_files_give_one_clear_line(tmp_path: Path, text: str, message: str) -> None:
    f = tmp_path / "c.yaml"
    f.write_text(text)
    with pytest.raises(ConfigError) as err:
        config.load(f)
    assert message in str(err.value) and "\n" not in str(err.value)


def test_values_are_applied(tmp_path: Path) -> None:
    f = tmp_path / "c.yaml"
    f.write_text("sequential: true\nlock_timeout_ms: 250\ncuda_checkpoint: sh\n")
    s = config.load(f)
    assert s.sequential and s.lock_timeout_ms == 250
    assert s.tool("cuda_checkpoint").endswith("/sh")  # bare names resolve on PATH


def test_validated_files_are_cached_until_they_change(tmp_path: Path, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    monkeypatch.setenv("CUDAHOOK_ROOT", str(tmp_path))
    f = tmp_path / "c.yaml"
    f.write_text("lock_timeout_ms: 250\n")
    assert config.load(f).lock_timeout_ms == 250
    assert configcache.cache_path() == tmp_path / "run/cudahook-marks/config-cache.json"
    assert configcache.cache_path().exists()
    calls = []
    monkeypatch.setattr(config, "validate", lambda *a: calls.append(a))
    assert config.load(f).lock_timeout_ms == 250 and calls == []  # from the cache
    f.write_text("lock_timeout_ms: 500\n")  # a change: parsed and validated again
    assert config.load(f).lock_timeout_ms == 500 and len(calls) == 1


def test_an_invalid_file_is_never_cached(tmp_path: Path, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    monkeypatch.setenv("CUDAHOOK_ROOT", str(tmp_path))
    f = tmp_path / "c.yaml"
    f.write_text("lock_timeout_ms: soon\n")
    for _ in range(2):
        with pytest.raises(ConfigError):
            config.load(f)
    assert not configcache.cache_path().exists()


def test_the_cache_stays_small(tmp_path: Path, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    monkeypatch.setenv("CUDAHOOK_ROOT", str(tmp_path))
    files = []
    for i in range(3 * configcache.CACHE_ENTRIES):
        f = tmp_path / f"c{i}.yaml"
        f.write_text(f"lock_timeout_ms: {100 + i}\n")
        assert config.load(f).lock_timeout_ms == 100 + i
        files.append(f)
    import json

    kept = json.loads(configcache.cache_path().read_text())
    assert len(kept) == configcache.CACHE_ENTRIES
    assert str(files[-1].resolve()) in kept and str(files[0].resolve()) not in kept


# -- config_fails_cleanly: whatever the file holds, exit 3 in bounded time and memory ------


# Run by a shell that is not replaced by it (`exit` after it): a child
# forked straight from pytest starts with pytest's resident pages counted in
# its peak (hundreds of MB late in the suite), one forked by a small shell
# with the shell's. So the CLI reports its own peak, into a file.
_PEAK = """import resource, runpy, sys
out, sys.argv = sys.argv[1], ["cudahook", "--config", sys.argv[2], "status", "--no-live"]
try:
    runpy.run_module("cudahook", run_name="__main__", alter_sys=True)
finally:
    with open(out, "w") as f:
        f.write(str(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss))
"""


def _cli(config_path: str, timeout: float = 30.0) -> tuple[int, str, float, int]:
    """`cudahook status --no-live` on the file: (exit, stderr, seconds, peak RSS in KiB),
    in a child whose address space is capped at 1 GiB."""
    import subprocess
    import sys
    import tempfile
    import time

    start = time.monotonic()
    with tempfile.TemporaryDirectory() as tmp:
        peak = Path(tmp) / "peak"
        try:
            p = subprocess.run(
                ["/bin/sh", "-c", 'ulimit -v 1048576; "$@"; exit $?', "sh", sys.executable,
                 "-c", _PEAK, str(peak), config_path],
                stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, timeout=timeout)
        except subprocess.TimeoutExpired as exc:
            raise AssertionError(f"no answer in {timeout}s") from exc
        took = time.monotonic() - start
        return p.returncode, p.stderr, took, int(peak.read_text())


def _alias_bomb() -> str:
    lines = ['a0: &a0 ["lol","lol","lol","lol","lol","lol","lol","lol","lol","lol"]']
    lines += [f"a{i}: &a{i} [" + ",".join([f"*a{i - 1}"] * 10) + "]" for i in range(1, 11)]
    return "\n".join(lines) + "\n"


# (case, key, YAML spelling): a number YAML reads as NaN or infinite.
NON_FINITE = [("nan", "call_timeout_s", ".nan"), ("inf", "vmm_timeout_s", ".inf"),
              ("negative_inf", "guardian_wait_s", "-.inf"), ("nan_wait", "guardian_wait_s", ".nan"),
              ("nan_retention", "state_retention_s", ".NaN")]


@pytest.mark.parametrize(("case", "content", "words"), [
    ("alias_bomb", _alias_bomb(), "anchors and aliases are not allowed"),
    ("alias_in_a_value", "x: &a 5\nmax_parallel: *a\n", "anchors and aliases"),
    *[(case, f"{key}: {value}\n", f"{key}: not a finite number") for case, key, value in NON_FINITE],
    ("huge_integer", "max_parallel: " + "9" * 5000 + "\n", "too many digits"),
    ("large_integer", "lock_timeout_ms: " + "9" * 4000 + "\n", "lock_timeout_ms"),
    ("huge_float", "call_timeout_s: 1e300\n", "call_timeout_s"),
    ("invalid_utf8", b"state_dir: /run/\xff\xfe\n", "not UTF-8"),
    ("deep", "[" * 100000 + "]" * 100000 + "\n", ""),
    ("wrong_type", "sequential: [1, 2]\n", "sequential"),
    ("empty_tagged_float", "max_parallel: !!float \n", "YAML cannot read"),
    ("bad_timestamp", "call_timeout_s: !!timestamp 2001-13-45\n", "YAML cannot read"),
    ("nul_in_a_path", 'state_dir: "/run/a\\0b"\n', "state_dir"),
    ("escape_in_a_path", 'log_file: "/var/log/\\e]0;x\\a"\n', "log_file"),
    ("escape_in_a_key", "\"\\e]0;pwned\\a\": 1\n", "Additional properties"),
])
def test_config_fails_cleanly__bad_content(tmp_path: Path, case: str, content: str | bytes,
                                           words: str) -> None:
    f = tmp_path / "config.yaml"
    if isinstance(content, bytes):
        f.write_bytes(content)
    else:
        f.write_text(content)
    code, err, took, _rss = _cli(str(f))
    assert code == 3, err
    assert err.count("\n") == 1 and err.startswith("cudahook: ") and words in err, err
    assert err.isprintable() or err[:-1].isprintable(), err
    assert "Traceback" not in err and took < 10, (case, took)


@pytest.mark.parametrize("kind", ["dev_zero", "fifo", "directory", "too_large"])
def test_config_fails_cleanly__not_a_config_file(tmp_path: Path, kind: str) -> None:
    import os

    f = tmp_path / "config.yaml"
    if kind == "dev_zero":
        f = Path("/dev/zero")
    elif kind == "fifo":
        os.mkfifo(f)
    elif kind == "directory":
        f.mkdir()
    else:
        f.write_text("# padding\n" * (200 << 10))
    code, err, took, _rss = _cli(str(f))
    assert code == 3 and err.count("\n") == 1 and "Traceback" not in err, err
    assert took < 10


def test_config_fails_cleanly__a_symlinked_file_is_followed(tmp_path: Path) -> None:
    # A Kubernetes ConfigMap mount is a chain of symlinks: the operator's own.
    real = tmp_path / "data" / "config.yaml"
    real.parent.mkdir()
    real.write_text("max_parallel: 7\n")
    link = tmp_path / "config.yaml"
    link.symlink_to(real)
    assert config.load(link).max_parallel == 7


def test_config_fails_cleanly__the_alias_bomb_in_bounded_memory(tmp_path: Path) -> None:
    f = tmp_path / "config.yaml"
    f.write_text(_alias_bomb())
    code, err, took, rss = _cli(str(f))
    assert code == 3 and "aliases" in err
    assert took < 10 and rss < 300 << 10, (took, rss)


def test_config_fails_cleanly__a_nan_cached_by_an_older_version_is_not_taken(
        tmp_path: Path, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    monkeypatch.setenv("CUDAHOOK_ROOT", str(tmp_path))
    f = tmp_path / "c.yaml"
    f.write_text("call_timeout_s: .nan\n")
    # What a version without the check cached for this very file.
    key, _ = configcache.lookup(f)
    configcache.remember(f, key, {**Settings().as_dict(), "call_timeout_s": float("nan")})
    assert "NaN" in configcache.cache_path().read_text()
    with pytest.raises(ConfigError, match="not a finite number"):
        config.load(f)
