"""The CUDA kernels against the torch reference (pagedkernels.reference).

Two runners for the same comparisons:
- on a CUDA GPU, pagedkernels.cuda_kernels (CuPy); skipped when no CUDA GPU is present;
- on the CPU, pagedkernels.cuda_emulator, which builds the same .cu sources as C++ and runs
  every CTA thread by thread through the same launchers: indexing, masking, GQA packing,
  the split-K reduction and the cache write are checked here on every CI run (only speed
  and the hardware's own behaviour need the GPU).
"""

from __future__ import annotations

import math
from collections.abc import Callable

import pytest
import torch

from pagedkernels import reference
from pagedkernels.cuda_kernels import choose_splits, plan_attention, supports
from pagedkernels.testing import random_paged_batch

HAS_CUDA = torch.cuda.is_available()


def _emulator():
    """The emulator; a machine without a C++ compiler is broken, as one without NVRTC is:
    the tests fail there, saying what to install, instead of skipping."""
    from pagedkernels import cuda_emulator

    if cuda_emulator.compiler() is None:
        pytest.fail(cuda_emulator.MISSING_COMPILER)
    return cuda_emulator


def _cuda_or_skip():
    if not HAS_CUDA:
        pytest.skip("no CUDA GPU present: the CuPy kernels run only on a GPU")
    from pagedkernels import cuda_kernels

    return cuda_kernels


make_batch = random_paged_batch


def _tolerance(dtype: torch.dtype) -> dict[str, float]:
    return {"atol": 2e-2, "rtol": 2e-2} if dtype == torch.bfloat16 else {"atol": 3e-3, "rtol": 3e-3}


def _compare_attention(
    attention: Callable[..., torch.Tensor],
    device: str,
    seq_lens: list[int],
    query_lens: list[int],
    *,
    block_size: int = 16,
    num_kv_heads: int = 2,
    group: int = 4,
    head_dim: int = 64,
    dtype: torch.dtype = torch.float16,
    window: int | None = None,
    soft_cap: float | None = None,
    pad_rows: int = 0,
    release_out_of_window: bool = False,
    seed: int = 0,
) -> None:
    gen = torch.Generator().manual_seed(seed)
    query, kc, vc, table, qsl, lens = make_batch(
        gen,
        seq_lens,
        query_lens,
        block_size,
        num_kv_heads,
        num_kv_heads * group,
        head_dim,
        dtype,
        device,
        pad_rows,
        window if release_out_of_window else None,
    )
    scale = head_dim**-0.5
    got = attention(query, kc, vc, table, qsl, lens, scale, window, soft_cap)
    want = reference.paged_attention(query, kc, vc, table, qsl, lens, scale, window, soft_cap)
    assert got.dtype == dtype and got.shape == query.shape
    assert not torch.isnan(got).any()
    torch.testing.assert_close(got.float(), want.float(), **_tolerance(dtype))
    if pad_rows:
        assert torch.all(got[-pad_rows:] == 0)


# Batches: decode, prefill from scratch, extend after a cached prefix, odd lengths.
MIXED = ([23, 9, 37, 1, 18, 70], [1, 9, 6, 1, 18, 33])
DECODE_LONG = ([700, 310, 65], [1, 1, 1])  # long enough to split on 8 emulated SMs


# -- plan (pure Python) -----------------------------------------------------------------


H100_RESIDENT = 132 * 2  # head_dim 128: two CTAs' shared memory fit one SM


def test_plan_splits_small_batches_and_not_large_ones() -> None:
    one = plan_attention(1, 1, 32, 8, 128, 32768, None, H100_RESIDENT)
    assert one.num_splits > 8 and one.grid == (1, 8, one.num_splits)
    big = plan_attention(256, 256, 32, 8, 128, 32768, None, H100_RESIDENT)
    assert big.num_splits == 1 and big.grid == (256, 8, 1)
    short = plan_attention(1, 1, 32, 8, 128, 200, None, H100_RESIDENT)
    assert short.num_splits == 1  # 200 keys are not worth splitting
    window = plan_attention(1, 1, 32, 8, 128, 32768, 512, H100_RESIDENT)
    assert window.num_splits <= math.ceil((512 + window.tokens_per_tile) / 256)
    forced = plan_attention(256, 256, 32, 8, 128, 32768, None, H100_RESIDENT, num_splits=3)
    assert forced.num_splits == 3 and forced.grid[2] == 3
    with pytest.raises(ValueError, match="num_splits"):
        plan_attention(1, 1, 32, 8, 128, 4096, None, H100_RESIDENT, num_splits=0)


def test_split_choice_fills_whole_waves() -> None:
    # 16 decodes x 8 kv heads = 128 CTAs on 264 slots: 2 splits make one nearly full wave;
    # 5 (four CTAs per SM, as if shared memory allowed it) would leave a last wave 42% full.
    assert choose_splits(128, H100_RESIDENT, 16) == 2
    # One long decode (8 CTAs): enough splits to cover most of a wave.
    assert 8 * choose_splits(8, H100_RESIDENT, 64) >= 0.85 * H100_RESIDENT
    # A grid that already fills most of a wave stays whole; so does a short context.
    assert choose_splits(230, H100_RESIDENT, 16) == 1
    assert choose_splits(8, H100_RESIDENT, 1) == 1

    # In a model where a step lasts (waves, rounded up) x (work per CTA = 1 / splits), the
    # choice is never more than 1/0.85 of the best split count's time.
    def step_time(ctas: int, splits: int) -> float:
        return math.ceil(ctas * splits / H100_RESIDENT) / splits

    for ctas in range(1, 212):  # below 80% of a wave
        splits = choose_splits(ctas, H100_RESIDENT, 32)
        best = min(step_time(ctas, s) for s in range(1, 33))
        assert 1 <= splits <= 32 and step_time(ctas, splits) <= best / 0.85 + 1e-9


def test_plan_packs_gqa_groups_into_tiles() -> None:
    plan = plan_attention(100, 1, 28, 4, 128, 4096, None, H100_RESIDENT)  # group of 7
    assert plan.heads_per_cta == 7 and plan.tokens_per_tile == 9 and plan.head_chunks == 1
    assert plan.grid[0] == math.ceil(100 / 9)
    wide = plan_attention(10, 2, 96, 1, 64, 4096, None, H100_RESIDENT)  # group of 96
    assert wide.heads_per_cta == 64 and wide.head_chunks == 2 and wide.tokens_per_tile == 1


def test_supports() -> None:
    assert supports(torch.bfloat16, 128) and supports(torch.float16, 64)
    assert supports(torch.bfloat16, 16) and supports(torch.float16, 80)
    # 72 and 112 would compile, but CI does not check those builds: the reference runs them.
    assert not supports(torch.float32, 128) and not supports(torch.float16, 72)
    assert not supports(torch.bfloat16, 112) and not supports(torch.half, 512)


def test_cupy_argument_conversion() -> None:
    # What CupyBackend hands CuPy: numpy scalars of the kernel's C types. (The signatures
    # themselves are checked by the emulated tests: the emulator reads each argument at
    # the C type the kernel declares.)
    import numpy as np

    from pagedkernels.cuda_kernels import _numpy_converters

    t = torch.zeros(4)
    converters = _numpy_converters("pilf")
    values = [convert(v) for convert, v in zip(converters, (t, -3, 2**40, 0.25))]
    assert [type(v) for v in values] == [np.uint64, np.int32, np.int64, np.float32]
    assert values[0] == t.data_ptr() and values[1:] == [-3, 2**40, 0.25]
    assert converters[0](None) == 0
    with pytest.raises(OverflowError):
        converters[1](2**31)


def test_kernel_switch(monkeypatch: pytest.MonkeyPatch) -> None:
    from pagedkernels.selection import KERNELS_ENV, select_kernels

    cpu = torch.device("cpu")
    assert select_kernels(cpu, torch.bfloat16, 128).name.startswith("torch cpu (batched)")
    monkeypatch.setenv(KERNELS_ENV, "reference")
    assert select_kernels(cpu, torch.bfloat16, 128).name == "torch reference"
    monkeypatch.setenv(KERNELS_ENV, "emulated")
    assert select_kernels(cpu, torch.bfloat16, 128).name == "CUDA sources on the CPU emulator"
    with pytest.raises(ValueError, match="float16/bfloat16 and their head sizes"):
        select_kernels(cpu, torch.float32, 128)
    with pytest.raises(ValueError, match="float16/bfloat16 and their head sizes"):
        select_kernels(cpu, torch.bfloat16, 72)
    monkeypatch.setenv(KERNELS_ENV, "cuda")
    with pytest.raises(ValueError, match="needs a CUDA device"):
        select_kernels(cpu, torch.bfloat16, 128)
    monkeypatch.setenv(KERNELS_ENV, "fast")
    with pytest.raises(ValueError, match="must be one of auto, cpu, reference, cuda, emulated"):
        select_kernels(cpu, torch.bfloat16, 128)


# -- emulated on the CPU ----------------------------------------------------------------


@pytest.mark.parametrize("block_size", [16, 32])
@pytest.mark.parametrize("group", [1, 4, 7])
@pytest.mark.parametrize("window", [None, 5])
def test_emulated_attention_mixed_batch(block_size: int, group: int, window: int | None) -> None:
    emu = _emulator()
    _compare_attention(
        emu.paged_attention,
        "cpu",
        *MIXED,
        block_size=block_size,
        group=group,
        window=window,
        release_out_of_window=True,
        seed=block_size + group,
    )


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_emulated_attention_soft_cap_and_padding_rows(dtype: torch.dtype) -> None:
    emu = _emulator()
    _compare_attention(
        emu.paged_attention, "cpu", *MIXED, dtype=dtype, soft_cap=2.0, pad_rows=3, seed=5
    )


@pytest.mark.parametrize("window", [None, 300])
@pytest.mark.parametrize("pad_rows", [0, 2])
def test_emulated_split_k_decode(window: int | None, pad_rows: int) -> None:
    emu = _emulator()
    plan = plan_attention(3 + pad_rows, 3, 8, 2, 64, 45 * 16, window, emu.EMULATED_RESIDENT_CTAS)
    assert plan.num_splits > 1  # the case this test is for
    _compare_attention(
        emu.paged_attention,
        "cpu",
        *DECODE_LONG,
        window=window,
        pad_rows=pad_rows,
        release_out_of_window=True,
        seed=11,
    )


def test_emulated_split_k_extend_with_bf16() -> None:
    # Chunks where some rows of a tile see no key at all (causal), merged by the reduction.
    emu = _emulator()
    _compare_attention(
        emu.paged_attention, "cpu", [600, 40], [150, 1], group=8, num_kv_heads=1,
        dtype=torch.bfloat16, seed=3,
    )  # fmt: skip


def test_emulated_split_where_a_row_sees_no_key() -> None:
    # 2 tokens x 8 heads = 16 rows (key mode); 769 keys in splits of 256: the last split
    # holds only the newest key, which the first token may not see.
    emu = _emulator()
    plan = plan_attention(2, 1, 8, 1, 64, 50 * 16, None, emu.EMULATED_RESIDENT_CTAS)
    assert plan.num_splits == 4
    _compare_attention(
        emu.paged_attention, "cpu", [769], [2], num_kv_heads=1, group=8, seed=4
    )  # fmt: skip


@pytest.mark.parametrize("block_size", [1, 12, 24])
def test_emulated_attention_block_sizes_that_are_not_powers_of_two(block_size: int) -> None:
    # The kernel shifts for power-of-two block sizes and divides for the others.
    emu = _emulator()
    _compare_attention(
        emu.paged_attention, "cpu", *DECODE_LONG, block_size=block_size, seed=block_size
    )
    _compare_attention(emu.paged_attention, "cpu", *MIXED, block_size=block_size, window=5)


@pytest.mark.parametrize("head_dim", [16, 32, 80, 96, 128, 256])
def test_emulated_attention_head_dims(head_dim: int) -> None:
    emu = _emulator()
    _compare_attention(
        emu.paged_attention, "cpu", [40, 5, 90], [3, 5, 1], head_dim=head_dim, seed=head_dim
    )


def test_emulated_attention_on_strided_cache_views() -> None:
    # K and V of a layer interleaved per block in one buffer: non-contiguous cache views.
    emu = _emulator()
    gen = torch.Generator().manual_seed(9)
    query, kc, vc, table, qsl, lens = make_batch(gen, [30, 17], [4, 17], 16, 2, 4, 64, torch.half)
    buffer = torch.stack([kc, vc], dim=1)  # [NB, 2, BS, H, D]
    k_view, v_view = buffer[:, 0], buffer[:, 1]
    assert not k_view.is_contiguous()
    got = emu.paged_attention(query, k_view, v_view, table, qsl, lens, 0.125)
    want = reference.paged_attention(query, kc, vc, table, qsl, lens, 0.125)
    torch.testing.assert_close(got.float(), want.float(), **_tolerance(torch.half))


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
def test_emulated_write_kv_cache(dtype: torch.dtype) -> None:
    emu = _emulator()
    gen = torch.Generator().manual_seed(1)
    key = torch.randn(7, 2, 64, generator=gen).to(dtype)
    value = torch.randn(7, 2, 64, generator=gen).to(dtype)
    slots = torch.tensor([13, -1, 2, 7, -1, 19, 40], dtype=torch.int64)
    got_k, got_v = torch.zeros(3, 16, 2, 64, dtype=dtype), torch.zeros(3, 16, 2, 64, dtype=dtype)
    want_k, want_v = got_k.clone(), got_v.clone()
    emu.write_kv_cache(key, value, got_k, got_v, slots)
    reference.write_kv_cache(key, value, want_k, want_v, slots)
    assert torch.equal(got_k, want_k) and torch.equal(got_v, want_v)


def test_emulated_write_kv_cache_into_interleaved_views_and_int32_slots() -> None:
    emu = _emulator()
    buffer = torch.zeros(3, 2, 4, 1, 8, dtype=torch.half)  # head_dim 8: 16-byte rows
    key = torch.randn(2, 1, 8).half()
    emu.write_kv_cache(key, -key, buffer[:, 0], buffer[:, 1], torch.tensor([5, 11]).int())
    assert torch.equal(buffer[1, 0, 1], key[0]) and torch.equal(buffer[1, 1, 1], -key[0])
    assert torch.equal(buffer[2, 0, 3], key[1]) and torch.equal(buffer[2, 1, 3], -key[1])
    assert torch.count_nonzero(buffer) == 4 * 8


# -- on a CUDA GPU ----------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("head_dim", [64, 128, 256])
@pytest.mark.parametrize("group", [1, 4, 8])
@pytest.mark.parametrize("window", [None, 7])
def test_cuda_attention_mixed_batch(
    dtype: torch.dtype, head_dim: int, group: int, window: int | None
) -> None:
    kernels = _cuda_or_skip()
    _compare_attention(
        kernels.paged_attention,
        "cuda",
        *MIXED,
        head_dim=head_dim,
        group=group,
        dtype=dtype,
        window=window,
        pad_rows=2,
        release_out_of_window=True,
        seed=head_dim + group,
    )


@pytest.mark.parametrize("block_size", [16, 32])
@pytest.mark.parametrize("window", [None, 1000])
def test_cuda_split_k_long_contexts(block_size: int, window: int | None) -> None:
    kernels = _cuda_or_skip()
    _compare_attention(
        kernels.paged_attention,
        "cuda",
        [5000, 1, 3000, 17],
        [1, 1, 64, 17],
        block_size=block_size,
        num_kv_heads=8,
        group=4,
        head_dim=128,
        dtype=torch.bfloat16,
        window=window,
        soft_cap=30.0,
        release_out_of_window=True,
        seed=block_size,
    )


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_cuda_write_kv_cache(dtype: torch.dtype) -> None:
    kernels = _cuda_or_skip()
    key = torch.randn(9, 8, 128, device="cuda").to(dtype)
    value = torch.randn(9, 8, 128, device="cuda").to(dtype)
    slots = torch.tensor([13, -1, 2, 7, -1, 19, 40, 0, 63], device="cuda")
    got_k = torch.zeros(4, 16, 8, 128, dtype=dtype, device="cuda")
    got_v = torch.zeros_like(got_k)
    want_k, want_v = got_k.clone(), got_v.clone()
    kernels.write_kv_cache(key, value, got_k, got_v, slots)
    reference.write_kv_cache(key, value, want_k, want_v, slots)
    assert torch.equal(got_k, want_k) and torch.equal(got_v, want_v)


def test_cuda_runs_on_the_current_stream() -> None:
    kernels = _cuda_or_skip()
    gen = torch.Generator().manual_seed(2)
    tensors = make_batch(gen, [300, 20], [1, 20], 16, 2, 8, 128, torch.half, "cuda")
    side = torch.cuda.Stream()
    with torch.cuda.stream(side):
        got = kernels.paged_attention(*tensors, 0.1)
    side.synchronize()
    torch.testing.assert_close(
        got.float(), reference.paged_attention(*tensors, 0.1).float(), **_tolerance(torch.half)
    )
