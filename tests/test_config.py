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
