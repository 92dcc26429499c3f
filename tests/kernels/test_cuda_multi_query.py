"""The CUDA attention kernel (pagedkernels/cuda/paged_attention.cu) on speculative verifies: a
request's last token and its drafts (q_len 2..33) are consecutive rows of one tile, K/V
loaded once for all of them, beside one-query decodes in the same launch, against the torch
reference. On the CPU through pagedkernels.cuda_emulator (every CI run); on a CUDA GPU
through CuPy, skipped only when no CUDA GPU is present."""

from __future__ import annotations

import random
from collections.abc import Callable

import pytest
import torch

from pagedkernels import reference
from pagedkernels.cuda_kernels import plan_attention
from pagedkernels.testing import random_paged_batch

TOLERANCE = {
    torch.float16: {"atol": 3e-3, "rtol": 3e-3},
    torch.bfloat16: {"atol": 2e-2, "rtol": 2e-2},
}


def _emulator():
    from pagedkernels import cuda_emulator

    if cuda_emulator.compiler() is None:
        pytest.fail(cuda_emulator.MISSING_COMPILER)
    return cuda_emulator


def _cuda_or_skip():
    if not torch.cuda.is_available():
        pytest.skip("no CUDA GPU present: the CuPy kernels run only on a GPU")
    from pagedkernels import cuda_kernels

    return cuda_kernels


def _compare(
    attention: Callable[..., torch.Tensor],
    device: str,
    seq_lens: list[int],
    query_lens: list[int],
    heads: tuple[int, int],
    *,
    block_size: int = 16,
    dtype: torch.dtype = torch.float16,
    window: int | None = None,
    seed: int = 0,
) -> None:
    gen = torch.Generator().manual_seed(seed)
    query, kc, vc, table, qsl, lens = random_paged_batch(
        gen, seq_lens, query_lens, block_size, heads[1], heads[0], 64, dtype, device,
        released_window=window,
    )  # fmt: skip
    got = attention(query, kc, vc, table, qsl, lens, 0.125, window, None)
    want = reference.paged_attention(query, kc, vc, table, qsl, lens, 0.125, window, None)
    assert torch.isfinite(got.float()).all()
    torch.testing.assert_close(got.float().cpu(), want.float().cpu(), **TOLERANCE[dtype])


def _verify_batch(seed: int) -> tuple[list[int], list[int]]:
    """Decodes and verifies of 1..8 drafts, contexts not multiples of the block size."""
    rng = random.Random(seed)
    query_lens = [rng.randint(1, 9) for _ in range(6)] + [1]
    return [q + rng.randint(3, 90) for q in query_lens], query_lens


# 9/3: SmolLM2 (a 5-query verify fills 15 rows, the kernel's key mode; 9 queries 27 rows,
# its warp mode); 8/8: one head per kv head; 16/2: a group of 8, rows past one tile.
@pytest.mark.parametrize("heads", [(9, 3), (8, 8), (16, 2)])
@pytest.mark.parametrize("window", [None, 3])
def test_emulated_verifies_mixed_with_decodes(heads: tuple[int, int], window: int | None) -> None:
    emu = _emulator()
    _compare(emu.paged_attention, "cpu", *_verify_batch(heads[0]), heads, window=window, seed=1)


def test_emulated_verifies_split_over_long_contexts() -> None:
    # Long contexts on the emulator's 8 SMs: each verify's keys split (flash-decoding),
    # some splits holding keys that the verify's first queries may not see.
    emu = _emulator()
    seq_lens, query_lens = [700, 517, 300], [5, 9, 1]
    plan = plan_attention(15, 3, 9, 3, 64, 45 * 16, None, emu.EMULATED_RESIDENT_CTAS)
    assert plan.num_splits > 1  # the case this test is for
    _compare(emu.paged_attention, "cpu", seq_lens, query_lens, (9, 3), dtype=torch.bfloat16)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_cuda_verifies_mixed_with_decodes(dtype: torch.dtype) -> None:
    kernels = _cuda_or_skip()
    for seed in range(4):
        seq_lens, query_lens = _verify_batch(seed)
        seq_lens = [n + 400 * (seed % 2) for n in seq_lens]  # some long enough to split
        _compare(
            kernels.paged_attention, "cuda", seq_lens, query_lens, (9, 3),
            dtype=dtype, window=[None, 3][seed % 2], seed=seed,
        )  # fmt: skip
