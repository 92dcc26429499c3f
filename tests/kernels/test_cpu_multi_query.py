"""The C kernel's multi-query requests (pagedkernels/csrc/paged_attention_cpu.c): a speculative
verify's last token and drafts (q_len 2..33) attended together, beside one-query decodes in
the same call, against the torch reference (pagedkernels.reference), their oracle."""

from __future__ import annotations

import ctypes
import random
from pathlib import Path

import pytest
import torch

from pagedkernels import cpu, cpu_native, reference
from pagedkernels.testing import random_paged_batch

TOLERANCE = {
    torch.float32: {"rtol": 1e-5, "atol": 1e-5},
    torch.float16: {"rtol": 2**-9, "atol": 2**-12},
    torch.bfloat16: {"rtol": 2**-6, "atol": 2**-10},
}
# The library is built with -march=native: its AVX-512 copies exist where the CPU has it.
HAS_AVX512 = " avx512f" in Path("/proc/cpuinfo").read_text()

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture
def lib(monkeypatch: pytest.MonkeyPatch) -> ctypes.CDLL:
    monkeypatch.setenv(cpu_native.NATIVE_ENV, "1")
    built = cpu_native.library()
    assert built is not None, "the C kernel did not build (a C compiler is part of the setup)"
    return built


def native_vs_reference(
    lib: ctypes.CDLL,
    seed: int,
    seq_lens: list[int],
    query_lens: list[int],
    block_size: int,
    heads: tuple[int, int],
    head_dim: int,
    dtype: torch.dtype,
    window: int | None = None,
    soft_cap: float | None = None,
    poison_tails: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Every request through the C kernel in one call, and the reference's answer."""
    gen = torch.Generator().manual_seed(seed)
    query, kc, vc, table, qsl, lens = random_paged_batch(
        gen,
        seq_lens,
        query_lens,
        block_size,
        heads[1],
        heads[0],
        head_dim,
        dtype,
        released_window=window,  # blocks no window reaches point at the NaN block
        poison_tails=poison_tails,
    )
    scale = head_dim**-0.5
    want = reference.paged_attention(query, kc, vc, table, qsl, lens, scale, window, soft_cap)
    out = torch.zeros(query.shape)
    reqs = torch.arange(len(seq_lens), dtype=torch.int32)
    cpu_native.paged_attention(
        lib, query.float(), kc, vc, table, qsl, lens, reqs, scale, window, soft_cap, out
    )
    return out.to(dtype), want


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16], ids=str)
def test_verifies_mixed_with_decodes_equal_the_reference(
    lib: ctypes.CDLL, dtype: torch.dtype
) -> None:
    # q_len 1..9 in one call, GQA groups 1/2/4/9, block sizes 1..32, context lengths that
    # are rarely a multiple of the block size, windows narrower than a verify, soft caps.
    rng = random.Random(str(dtype))
    for index in range(60):
        n = rng.randint(1, 6)
        query_lens = [rng.randint(1, 9) for _ in range(n)]
        seq_lens = [q + rng.randint(0, 150) for q in query_lens]
        heads = [(2, 2), (4, 2), (8, 2), (9, 1)][index % 4]
        block_size = [1, 5, 8, 16, 32][index % 5]
        window = rng.choice([None, None, 1, 3, 7, 40])
        soft_cap = rng.choice([None, None, 2.5])
        head_dim = [16, 32, 24][index % 3]  # 24: the copy with d a variable
        case = (seq_lens, query_lens, block_size, heads, head_dim, window, soft_cap)
        got, want = native_vs_reference(lib, index, *case[:5], dtype, window, soft_cap)
        assert torch.isfinite(got).all(), case
        torch.testing.assert_close(got, want, **TOLERANCE[dtype], msg=lambda m, c=case: f"{c}\n{m}")


@pytest.mark.parametrize("window", [None, 2, 100])
def test_long_verifies_across_tiles_and_query_groups(lib: ctypes.CDLL, window: int | None) -> None:
    # 33 queries (32 drafts) and query counts past the kernel's group of 64, over contexts
    # that cross several key tiles; SmolLM2's 9/3 heads and d 64.
    seq_lens, query_lens = [700, 300, 90, 180, 1], [33, 70, 64, 1, 1]
    got, want = native_vs_reference(
        lib, 7, seq_lens, query_lens, 16, (9, 3), 64, torch.float32, window
    )
    assert torch.isfinite(got).all()
    torch.testing.assert_close(got, want, **TOLERANCE[torch.float32])


def test_stale_slots_past_a_verify_s_keys_never_reach_its_output(lib: ctypes.CDLL) -> None:
    # The last block's slots past the request's keys hold inf keys and NaN values.
    got, want = native_vs_reference(
        lib, 3, [37, 9, 70, 23], [5, 9, 1, 3], 8, (4, 2), 16, torch.float32, poison_tails=True
    )
    assert torch.isfinite(got).all()
    torch.testing.assert_close(got, want, **TOLERANCE[torch.float32])


@pytest.mark.parametrize("head_dim", [64, 24])
def test_the_batched_path_sends_verifies_to_the_c_kernel(lib: ctypes.CDLL, head_dim: int) -> None:
    # Decodes and verifies of up to NATIVE_MAX_QUERIES queries go to the C kernel; a longer
    # prefill chunk to the gather path, unless the kernel's AVX-512 copies take the call
    # (head size 64, on a CPU with AVX-512), which then get every request. The answer is
    # the reference's either way.
    gen = torch.Generator().manual_seed(2)
    query_lens = [1, 5, cpu.NATIVE_MAX_QUERIES, cpu.NATIVE_MAX_QUERIES + 1, 1]
    args = random_paged_batch(
        gen, [40, 61, 30, 50, 17], query_lens, 16, 3, 9, head_dim, torch.float32
    )
    got = cpu.paged_attention(*args, 0.125)
    want = reference.paged_attention(*args, 0.125)
    torch.testing.assert_close(got, want, **TOLERANCE[torch.float32])
    fast = cpu_native.fast_path(lib, args[0], args[1], None)
    assert fast == (head_dim == 64 and HAS_AVX512)
    native = cpu._PLANS[0].native_reqs
    assert native is not None and native.tolist() == ([0, 1, 2, 3, 4] if fast else [0, 1, 2, 4])
    assert not cpu_native.fast_path(lib, args[0], args[1], 30.0)  # a soft cap: generic copies
