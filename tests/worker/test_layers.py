"""worker/layers.py at one rank: RMSNorm, rotary embeddings, rope frequencies and the gated
MLP against values worked out by hand or with plain complex numbers (the sharded forms
are in test_parallel.py; whole models against transformers in test_llama.py)."""

from __future__ import annotations

import cmath
import math

import torch
import torch.nn.functional as F

from worker.layers import (
    GatedMLP,
    GemmaRMSNorm,
    RMSNorm,
    RotaryEmbedding,
    apply_rotary,
    rope_inv_freq,
)
from worker.model_config import LinearRopeScaling, Llama3RopeScaling

CPU = torch.device("cpu")


def test_rmsnorm_divides_by_the_root_mean_square_then_scales() -> None:
    norm = RMSNorm(2, 0.0, torch.float32, CPU)
    norm.weight.data = torch.tensor([1.0, 10.0])
    rms = math.sqrt((3**2 + 4**2) / 2)
    got = norm(torch.tensor([[3.0, 4.0]]))
    torch.testing.assert_close(got, torch.tensor([[3 / rms, 40 / rms]]))


def test_gemma_rmsnorm_stores_its_weight_as_an_offset_from_one() -> None:
    norm = GemmaRMSNorm(2, 0.0, torch.float32, CPU)
    norm.weight.data = torch.tensor([0.0, 1.0])
    rms = math.sqrt(12.5)
    got = norm(torch.tensor([[3.0, 4.0]]))
    torch.testing.assert_close(got, torch.tensor([[3 / rms, 8 / rms]]))


def test_rope_frequencies_plain_linear_and_llama3() -> None:
    plain = [1.0, 0.1, 0.01, 0.001]  # 10000 ** (-k / 8) for k = 0, 2, 4, 6
    torch.testing.assert_close(rope_inv_freq(8, 10000.0), torch.tensor(plain))
    linear = rope_inv_freq(8, 10000.0, LinearRopeScaling(4.0))
    torch.testing.assert_close(linear, torch.tensor(plain) / 4)
    # Original context 1000: wavelengths (2 pi / f) 6.3 and 63 are below 1000 / 4 (kept),
    # 6283 is beyond 1000 (slowed by 8), 628 is in the band between (blended).
    llama3 = rope_inv_freq(8, 10000.0, Llama3RopeScaling(8.0, 1.0, 4.0, 1000))
    smooth = (1000 / (2 * math.pi / 0.01) - 1.0) / (4.0 - 1.0)
    blended = (1 - smooth) * 0.01 / 8 + smooth * 0.01
    torch.testing.assert_close(llama3, torch.tensor([1.0, 0.1, blended, 0.001 / 8]))


def test_rotary_turns_each_pair_as_a_complex_number_by_position_times_frequency() -> None:
    head_dim, theta = 4, 100.0
    rope = RotaryEmbedding(head_dim, theta, None, CPU)
    positions = torch.tensor([0, 3])
    x = torch.tensor([[[1.0, 2.0, 3.0, 4.0]], [[1.0, 2.0, 3.0, 4.0]]])  # [T=2, H=1, D=4]
    cos, sin = rope(positions, torch.float32)
    got = apply_rotary(x, cos, sin)
    freqs = [1.0, 0.1]  # 100 ** (-k / 4) for k = 0, 2
    for t, pos in enumerate(positions.tolist()):
        for i, f in enumerate(freqs):
            z = complex(x[t, 0, i].item(), x[t, 0, i + 2].item()) * cmath.exp(1j * pos * f)
            assert math.isclose(got[t, 0, i].item(), z.real, abs_tol=1e-5)
            assert math.isclose(got[t, 0, i + 2].item(), z.imag, abs_tol=1e-5)
    torch.testing.assert_close(got[0], x[0])  # position 0 turns nothing


def test_the_gated_mlp_is_down_of_act_gate_times_up() -> None:
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(3, 4, generator=gen)
    for activation, act in (("silu", F.silu), ("gelu_pytorch_tanh", _tanh_gelu)):
        mlp = GatedMLP(4, 6, True, torch.float32, CPU, activation=activation)
        for p in mlp.parameters():
            p.data = torch.randn(p.shape, generator=gen)
        g, u, d = mlp.gate_proj, mlp.up_proj, mlp.down_proj
        hidden = act(x @ g.weight.T + g.bias) * (x @ u.weight.T + u.bias)
        torch.testing.assert_close(mlp(x), hidden @ d.weight.T + d.bias)


def _tanh_gelu(x: torch.Tensor) -> torch.Tensor:
    return 0.5 * x * (1 + torch.tanh(math.sqrt(2 / math.pi) * (x + 0.044715 * x**3)))
