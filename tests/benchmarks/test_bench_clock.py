"""The benchmarks' forward skips for the worker (benchmarks/bench_clock.py): skipped
attention answers zeros and keeps the cache writer; skipped layers pass their input
through; both say so in the kernels' name; a bad setting is refused."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from benchmarks import bench_clock
from pagedkernels import reference
from pagedkernels.selection import AttentionKernels


class Attention:
    def __init__(self) -> None:
        self.kernels = AttentionKernels(
            "torch reference", reference.write_kv_cache, reference.paged_attention
        )


class Layer(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.self_attn = Attention()

    def forward(self, x: torch.Tensor, *_args: object) -> torch.Tensor:
        return x + 1


def test_skipped_attention_answers_zeros_and_keeps_the_cache_writer() -> None:
    layers = [Layer(), Layer()]
    bench_clock.skip("attention", layers)
    query = torch.randn(5, 4, 8)
    for layer in layers:
        kernels = layer.self_attn.kernels
        assert kernels.name == "torch reference, attention skipped"
        assert kernels.write_kv_cache is reference.write_kv_cache
        out = kernels.paged_attention(query, None, None, None, None, None, 0.5)
        assert out.shape == query.shape and not out.any()
        assert torch.equal(layer(query, None, None, None, None), query + 1)


def test_skipped_layers_pass_their_input_through() -> None:
    layers = [Layer(), Layer()]
    bench_clock.skip("layers", layers)
    x = torch.randn(5, 16)
    for layer in layers:
        assert layer.self_attn.kernels.name == "torch reference, layers skipped"
        assert layer(x, None, None, None, None) is x


@pytest.mark.parametrize(
    ("value", "skipped"), [("", None), ("attention", "attention"), ("layers", "layers")]
)
def test_the_setting_is_read(
    monkeypatch: pytest.MonkeyPatch, value: str, skipped: str | None
) -> None:
    monkeypatch.setenv(bench_clock.SKIP_ENV, value)
    assert bench_clock.skip_requested() == skipped


def test_a_bad_setting_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(bench_clock.SKIP_ENV, "1")
    with pytest.raises(ValueError, match="must be one of attention, layers"):
        bench_clock.skip_requested()
    with pytest.raises(ValueError, match="cannot skip 'mlp'"):
        bench_clock.skip("mlp", [Layer()])
