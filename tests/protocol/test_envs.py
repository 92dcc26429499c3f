"""protocol/envs.py: each PAGEDSERVE_* reader's default, its parsed value, and the
error naming the variable and its choices when the value is not one of them."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from protocol import envs

NAMES = [value for name, value in vars(envs).items() if name.isupper() and isinstance(value, str)]


@pytest.fixture(autouse=True)
def clean(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in NAMES:
        monkeypatch.delenv(name, raising=False)


def test_every_variable_is_documented_in_the_module_docstring() -> None:
    assert len(NAMES) == 15
    doc = envs.__doc__ or ""
    for name in NAMES:
        assert re.search(rf"\b{name}\b", doc), name


def test_defaults_when_nothing_is_set() -> None:
    assert envs.attention() == "auto" and envs.cpu_gemm() == "auto"
    assert envs.native_kernels() is True
    assert envs.check_invariants() is False
    for reader in (
        envs.dist_init,
        envs.worker_hooks,
        envs.cache_dir,
        envs.api_key,
        envs.prefix_cache_hash_seed,
        envs.zmq_curve_keys,
    ):
        assert reader() is None
    assert envs.spin_us() is None and envs.bench_step_delay_ms() is None
    assert envs.bench_skip() is None and envs.bench_worker_timing() is None
    assert envs.cache_root() == Path.home() / ".cache" / "pagedserve"


def test_set_values_are_parsed(monkeypatch: pytest.MonkeyPatch) -> None:
    for name, value in [
        (envs.ATTENTION, "reference"),
        (envs.CPU_GEMM, "torch"),
        (envs.NATIVE_KERNELS, "0"),
        (envs.CHECK_INVARIANTS, "1"),
        (envs.SPIN_US, "2.5"),
        (envs.BENCH_STEP_DELAY_MS, "3"),
        (envs.BENCH_SKIP, "layers"),
        (envs.CACHE, "/tmp/ps"),
        (envs.DIST_INIT, ""),  # empty means unset
    ]:
        monkeypatch.setenv(name, value)
    assert envs.attention() == "reference" and envs.cpu_gemm() == "torch"
    assert envs.native_kernels() is False and envs.check_invariants() is True
    assert envs.spin_us() == 2.5 and envs.bench_step_delay_ms() == 3.0
    assert envs.bench_skip() == "layers" and envs.cache_root() == Path("/tmp/ps")
    assert envs.dist_init() is None


@pytest.mark.parametrize(
    ("name", "value", "reader", "message"),
    [
        (envs.ATTENTION, "fast", envs.attention, "PAGEDSERVE_ATTENTION must be one of auto, cpu"),
        (envs.CPU_GEMM, "mkl", envs.cpu_gemm, "PAGEDSERVE_CPU_GEMM must be one of auto, onednn"),
        (envs.NATIVE_KERNELS, "yes", envs.native_kernels, "must be 0 or 1, not 'yes'"),
        (envs.SPIN_US, "fast", envs.spin_us, "must be a number of microseconds, got 'fast'"),
        (envs.BENCH_STEP_DELAY_MS, "-1", envs.bench_step_delay_ms, "must be >= 0, got '-1'"),
        (envs.BENCH_STEP_DELAY_MS, "nan", envs.bench_step_delay_ms, "must be >= 0, got 'nan'"),
        (envs.BENCH_SKIP, "all", envs.bench_skip, "must be one of attention, layers or empty"),
    ],
)
def test_a_bad_value_is_refused_naming_the_variable(
    monkeypatch: pytest.MonkeyPatch, name: str, value: str, reader: object, message: str
) -> None:
    monkeypatch.setenv(name, value)
    with pytest.raises(ValueError, match=message):
        reader()  # type: ignore[operator]
