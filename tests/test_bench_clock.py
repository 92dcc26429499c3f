"""The worker's benchmark-only attention skip: every attention layer's kernels answer
zeros and say so in their name; the cache writer is kept; a bad setting is refused."""

from __future__ import annotations

import pytest
import torch

from kernels import AttentionKernels, reference
from worker import bench_clock


class Layer:
    def __init__(self) -> None:
        self.kernels = AttentionKernels(
            "torch reference", reference.write_kv_cache, reference.paged_attention
        )


def test_skipped_attention_answers_zeros_and_keeps_the_cache_writer() -> None:
    layers = [Layer(), Layer()]
    bench_clock.skip_attention(layers)
    query = torch.randn(5, 4, 8)
    for layer in layers:
        assert layer.kernels.name == "torch reference, attention skipped"
        assert layer.kernels.write_kv_cache is reference.write_kv_cache
        out = layer.kernels.paged_attention(query, None, None, None, None, None, 0.5)
        assert out.shape == query.shape and not out.any()


@pytest.mark.parametrize(("value", "on"), [("", False), ("0", False), ("1", True)])
def test_the_setting_is_read(monkeypatch: pytest.MonkeyPatch, value: str, on: bool) -> None:
    monkeypatch.setenv(bench_clock.SKIP_ATTENTION_ENV, value)
    assert bench_clock.skip_attention_requested() is on


def test_a_bad_setting_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(bench_clock.SKIP_ATTENTION_ENV, "yes")
    with pytest.raises(ValueError, match="must be 0 or 1"):
        bench_clock.skip_attention_requested()
