"""The C element-wise kernels (pagedkernels.cpu_elementwise) against the torch layers they
stand in for (worker.layers), on the strided views the stacked products hand them."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from pagedkernels import cpu_elementwise
from pagedkernels.cpu_elementwise import CpuElementwise
from worker.layers import GatedMLP, RMSNorm, apply_rotary

ROWS = (1, 7, 64, 300)  # below and above the kernels' threshold for threads


@pytest.fixture(scope="module")
def native() -> CpuElementwise:
    kernels = cpu_elementwise.load()
    if kernels is None:
        pytest.fail("the native CPU library did not build: a C compiler is part of the setup")
    return kernels


def _norm(dim: int) -> RMSNorm:
    norm = RMSNorm(dim, 1e-5, torch.float32, torch.device("cpu"))
    norm.weight.data.normal_()
    return norm


@pytest.mark.parametrize("rows", ROWS)
def test_rms_norm_equals_the_torch_layer(native: CpuElementwise, rows: int) -> None:
    torch.manual_seed(rows)
    norm = _norm(576)
    x = torch.randn(rows, 576) * 3
    got = native.rms_norm(x, norm.weight, norm.eps, None)
    torch.testing.assert_close(got, norm(x), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("rows", ROWS)
def test_add_then_norm_sums_into_x_and_leaves_the_residual(
    native: CpuElementwise, rows: int
) -> None:
    torch.manual_seed(rows)
    norm = _norm(576)
    x, residual = torch.randn(rows, 576), torch.randn(rows, 576) * 2
    want_sum, kept = residual + x, residual.clone()
    want = norm(want_sum)
    norm.native = native
    got, summed = norm.add_forward(x, residual)
    assert summed.data_ptr() == x.data_ptr()
    torch.testing.assert_close(summed, want_sum, rtol=0, atol=0)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    assert torch.equal(residual, kept)


@pytest.mark.parametrize("rows", ROWS)
def test_rope_on_a_strided_slice_of_a_stacked_product(native: CpuElementwise, rows: int) -> None:
    torch.manual_seed(rows)
    heads, kv_heads, d = 9, 3, 64
    qkv = torch.randn(rows, (heads + 2 * kv_heads) * d)
    q, k, _ = qkv.split((heads * d, kv_heads * d, kv_heads * d), dim=-1)
    q, k = q.view(rows, heads, d), k.view(rows, kv_heads, d)
    angles = torch.randn(rows, d // 2) * 10
    cos, sin = torch.cat((angles, angles), -1).cos(), torch.cat((angles, angles), -1).sin()
    want_q, want_k = apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)
    untouched = qkv[:, (heads + kv_heads) * d :].clone()
    native.rope_(q, cos, sin)
    native.rope_(k, cos, sin)
    torch.testing.assert_close(q, want_q, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(k, want_k, rtol=1e-5, atol=1e-5)
    assert torch.equal(qkv[:, (heads + kv_heads) * d :], untouched)  # v is not rotated


@pytest.mark.parametrize("rows", ROWS)
def test_silu_mul_from_the_halves_of_a_stacked_product(native: CpuElementwise, rows: int) -> None:
    torch.manual_seed(rows)
    both = torch.randn(rows, 2 * 1536) * 4
    gate, up = both[:, :1536], both[:, 1536:]
    want = F.silu(gate) * up
    got = native.silu_mul(gate, up, torch.empty(rows, 1536))
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_a_fused_mlp_equals_the_unfused_one(native: CpuElementwise) -> None:
    torch.manual_seed(0)
    mlp = GatedMLP(64, 160, False, torch.float32, torch.device("cpu"))
    for p in mlp.parameters():
        p.data.normal_(std=0.2)
    x = torch.randn(33, 64)
    want = mlp(x)
    mlp.native = native
    mlp.fuse_projections()
    assert mlp.gate_up_proj is not None and not hasattr(mlp, "gate_proj")
    torch.testing.assert_close(mlp(x), want, rtol=1e-5, atol=1e-5)
