"""annotations: per-container overrides under cudahook.io/, whitelisted and validated."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from cudahook.flow import annotations as ann
from cudahook.platform.config import Settings
from cudahook.platform.errors import UsageError

U0 = "GPU-11111111-2222-3333-4444-555555555555"
U1 = "GPU-aaaaaaaa-bbbb-cccc-dddd-eeeeeeeeeeee"


def a(**kv: str) -> dict[str, str]:
    return {ann.PREFIX + k.replace("_", "-"): v for k, v in kv.items()}


def test_no_annotations_of_ours() -> None:
    assert ann.parse(None) == ann.Options()
    assert ann.parse({"other.io/enabled": "yes", "io.kubernetes.x": "y"}) == ann.Options()


def test_whitelisted_keys_parse_into_options() -> None:
    opts = ann.parse({**a(enabled="true", sequential="false", lock_timeout_ms="2500",
                          call_timeout_s="12.5", device_map=f"{U0}={U1}",
                          vmm_restore_before_unlock="true"),
                      "unrelated": "x"})
    assert opts == ann.Options(enabled=True, sequential=False, lock_timeout_ms=2500,
                               call_timeout_s=12.5, device_map=f"{U0}={U1}",
                               vmm_restore_before_unlock=True)
    assert ann.parse(a(enabled="false")).enabled is False


def test_ours_strips_the_prefix() -> None:
    assert ann.ours({**a(enabled="true"), "x/enabled": "false"}) == {"enabled": "true"}


def test_unknown_key_is_named() -> None:
    with pytest.raises(UsageError) as exc:
        ann.parse(a(enabled="true", lock_timeuot_ms="5"))
    assert "cudahook.io/lock-timeuot-ms" in str(exc.value)
    assert "\n" not in str(exc.value)


@pytest.mark.parametrize("kv, words", [
    ({"enabled": "yes"}, "cudahook.io/enabled"),
    ({"enabled": "True"}, "cudahook.io/enabled"),
    ({"sequential": ""}, "cudahook.io/sequential"),
    ({"lock_timeout_ms": "abc"}, "cudahook.io/lock-timeout-ms"),
    ({"lock_timeout_ms": "-5"}, "cudahook.io/lock-timeout-ms"),
    ({"lock_timeout_ms": "12345678"}, "cudahook.io/lock-timeout-ms"),
    ({"lock_timeout_ms": "3600001"}, "cudahook.io/lock-timeout-ms"),  # past the config maximum
    ({"call_timeout_s": "1e3"}, "cudahook.io/call-timeout-s"),
    ({"call_timeout_s": "0"}, "cudahook.io/call-timeout-s"),  # the config says > 0
    ({"call_timeout_s": "0.000"}, "cudahook.io/call-timeout-s"),
    ({"device_map": "GPU-1=GPU-2"}, "cudahook.io/device-map"),
    ({"device_map": f"{U0}:{U1}"}, "cudahook.io/device-map"),
    ({"device_map": f"{U0}={U1},"}, "cudahook.io/device-map"),
    # Past the schema's pattern, refused by the device-map parser:
    ({"device_map": "GPU-" + "-" * 36 + "=" + U1}, "not a GPU UUID"),
    ({"device_map": f"{U0}={U1},{U0}={U0}"}, "twice"),
    ({"device_map": f"{U0}={U1},{U1}={U1}"}, "same target"),
    ({"vmm_restore_before_unlock": "1"}, "cudahook.io/vmm-restore-before-unlock"),
    # The patterns end in "$", which Python's re matches before a trailing newline:
    ({"lock_timeout_ms": "5\n"}, "cudahook.io/lock-timeout-ms"),
    ({"device_map": f"{U0}={U1}\n"}, "cudahook.io/device-map"),
])
def test_bad_values_are_usage_errors(kv: dict[str, str], words: str) -> None:
    with pytest.raises(UsageError) as exc:
        ann.parse(a(**kv))
    text = str(exc.value)
    assert words in text and "\n" not in text
    assert "annotation cudahook.io/" in text


def test_apply_changes_settings() -> None:
    base = Settings()
    opts = ann.parse(a(sequential="true", lock_timeout_ms="123", call_timeout_s="7"))
    out = opts.apply(base)
    assert (out.sequential, out.lock_timeout_ms, out.call_timeout_s) == (True, 123, 7.0)
    assert (base.sequential, base.lock_timeout_ms, base.call_timeout_s) == (False, 10000, 300.0)
    assert out.state_dir == base.state_dir


def test_apply_without_overrides_keeps_the_same_settings() -> None:
    base = Settings()
    assert ann.parse(a(enabled="true", device_map=f"{U0}={U1}")).apply(base) is base


@settings(max_examples=150, deadline=None)
@given(st.integers(0, 3_600_000), st.integers(0, 3))
def test_lock_timeout_round_trips(n: int, zeros: int) -> None:
    text = "0" * zeros + str(n)
    if len(text) > 7:  # the pattern allows 1-7 digits
        return
    opts = ann.parse(a(lock_timeout_ms=text))
    assert opts.lock_timeout_ms == n
    assert opts.apply(Settings()).lock_timeout_ms == n


@settings(max_examples=50, deadline=None)
@given(st.integers(3_600_001, 9_999_999))
def test_lock_timeout_past_the_config_limit_is_refused(n: int) -> None:
    with pytest.raises(UsageError, match=r"cudahook\.io/lock-timeout-ms"):
        ann.parse(a(lock_timeout_ms=str(n)))


@settings(max_examples=100, deadline=None)
@given(st.text(max_size=12))
def test_any_other_lock_timeout_text_is_refused_or_an_int(text: str) -> None:
    try:
        opts = ann.parse(a(lock_timeout_ms=text))
    except UsageError:
        return
    assert opts.lock_timeout_ms == int(text) and text.isascii() and text.isdigit()


def test_the_backend_is_chosen_per_container() -> None:
    from cudahook.core.backends.cli import CudaCheckpointCLI
    from cudahook.flow.context import Context

    opts = ann.parse(a(backend="cli"))
    assert opts.backend == "cli"
    assert opts.apply(Settings(backend="driver-api")).backend == "cli"
    assert ann.parse(a(sequential="true")).apply(Settings(backend="cli")).backend == "cli"
    with pytest.raises(UsageError, match="backend"):
        ann.parse(a(backend="fast"))
    # The hooks build the container's context from the applied settings.
    assert isinstance(Context(opts.apply(Settings())).backend, CudaCheckpointCLI)


def test_the_gpu_memory_path_is_chosen_per_container() -> None:
    opts = ann.parse(a(gpu_memory="storage"))
    assert opts.gpu_memory == "storage"
    assert opts.apply(Settings()).gpu_memory == "storage"
    assert ann.parse(a(sequential="true")).apply(Settings(gpu_memory="auto")).gpu_memory == "auto"
    with pytest.raises(UsageError, match="gpu-memory"):
        ann.parse(a(gpu_memory="disk"))
