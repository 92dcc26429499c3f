"""The torch reference kernels against a naive dense attention written out per position."""

from __future__ import annotations

import math

import pytest
import torch

from pagedkernels.reference import paged_attention, write_kv_cache

HEAD_DIM = 8


def _make_batch(
    gen: torch.Generator,
    seq_lens: list[int],
    query_lens: list[int],
    block_size: int,
    num_kv_heads: int,
    dtype: torch.dtype = torch.float32,
):
    """Random per-request K/V written through write_kv_cache into shuffled blocks."""
    blocks_per_req = [math.ceil(s / block_size) for s in seq_lens]
    max_blocks = max(blocks_per_req) + 1  # a spare column, as a real table has
    num_blocks = sum(blocks_per_req) + 3  # block 0 and a couple never handed out
    ids = (torch.randperm(num_blocks - 1, generator=gen) + 1).tolist()
    block_table = torch.zeros(len(seq_lens), max_blocks, dtype=torch.int32)
    for b, n in enumerate(blocks_per_req):
        block_table[b, :n] = torch.tensor([ids.pop() for _ in range(n)], dtype=torch.int32)

    shape = (num_blocks, block_size, num_kv_heads, HEAD_DIM)
    key_cache = torch.full(shape, float("nan"), dtype=dtype)  # unread slots stay NaN
    value_cache = torch.full(shape, float("nan"), dtype=dtype)
    keys = [torch.randn(s, num_kv_heads, HEAD_DIM, generator=gen).to(dtype) for s in seq_lens]
    values = [torch.randn(s, num_kv_heads, HEAD_DIM, generator=gen).to(dtype) for s in seq_lens]
    for b, s in enumerate(seq_lens):
        slots = torch.tensor(
            [int(block_table[b, p // block_size]) * block_size + p % block_size for p in range(s)]
        )
        write_kv_cache(keys[b], values[b], key_cache, value_cache, slots)

    query_start_loc = torch.tensor([0, *torch.tensor(query_lens).cumsum(0).tolist()]).int()
    return keys, values, key_cache, value_cache, block_table, query_start_loc


def _naive_attention(
    query: torch.Tensor,
    keys: list[torch.Tensor],
    values: list[torch.Tensor],
    seq_lens: list[int],
    query_lens: list[int],
    scale: float,
    window: int | None,
    soft_cap: float | None,
) -> torch.Tensor:
    num_q_heads = query.shape[1]
    num_kv_heads = keys[0].shape[1]
    out = torch.zeros(query.shape, dtype=torch.float32)
    row = 0
    for b, (seq_len, n) in enumerate(zip(seq_lens, query_lens)):
        for i in range(n):
            pos = seq_len - n + i
            allowed = [k for k in range(pos + 1) if window is None or pos - k < window]
            for h in range(num_q_heads):
                kv_h = h // (num_q_heads // num_kv_heads)
                q = query[row, h].float()
                logits = torch.stack([q @ keys[b][k, kv_h].float() * scale for k in allowed])
                if soft_cap is not None:
                    logits = soft_cap * torch.tanh(logits / soft_cap)
                w = torch.softmax(logits, 0)
                out[row, h] = sum(w[j] * values[b][k, kv_h].float() for j, k in enumerate(allowed))
            row += 1
    return out


@pytest.mark.parametrize("block_size", [4, 16])
@pytest.mark.parametrize("gqa", [1, 4])
@pytest.mark.parametrize("window", [None, 5])
@pytest.mark.parametrize("soft_cap", [None, 2.0])
def test_mixed_batch_matches_naive(
    block_size: int, gqa: int, window: int | None, soft_cap: float | None
) -> None:
    gen = torch.Generator().manual_seed(block_size * 100 + gqa * 10 + (window or 0))
    # decode, prefill from scratch, extend after a cached prefix, decode, short prefill
    seq_lens = [23, 9, 37, 1, 18]
    query_lens = [1, 9, 6, 1, 18]
    num_kv_heads = 2
    keys, values, kc, vc, table, qsl = _make_batch(gen, seq_lens, query_lens, block_size, 2)
    query = torch.randn(sum(query_lens), num_kv_heads * gqa, HEAD_DIM, generator=gen)
    scale = HEAD_DIM**-0.5
    got = paged_attention(
        query, kc, vc, table, qsl, torch.tensor(seq_lens).int(), scale, window, soft_cap
    )
    want = _naive_attention(query, keys, values, seq_lens, query_lens, scale, window, soft_cap)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


def test_half_precision_returns_query_dtype_and_padding_rows_are_zero() -> None:
    gen = torch.Generator().manual_seed(7)
    seq_lens, query_lens = [12, 5], [3, 5]
    keys, values, kc, vc, table, qsl = _make_batch(gen, seq_lens, query_lens, 4, 1, torch.float16)
    query = torch.randn(sum(query_lens) + 2, 2, HEAD_DIM, generator=gen).half()  # 2 pad rows
    got = paged_attention(query, kc, vc, table, qsl, torch.tensor(seq_lens).int(), 0.3)
    assert got.dtype == torch.float16
    want = _naive_attention(query[:-2], keys, values, seq_lens, query_lens, 0.3, None, None)
    torch.testing.assert_close(got[:-2].float(), want, atol=2e-3, rtol=2e-3)
    assert torch.all(got[-2:] == 0)


def test_window_skips_released_blocks() -> None:
    # The scheduler may point out-of-window blocks at the null block; they must not be read.
    gen = torch.Generator().manual_seed(3)
    seq_lens, query_lens = [20], [1]
    keys, values, kc, vc, table, qsl = _make_batch(gen, seq_lens, query_lens, 4, 1)
    table[0, :3] = 0  # positions 0..11 released; block 0 is all NaN
    query = torch.randn(1, 1, HEAD_DIM, generator=gen)
    got = paged_attention(query, kc, vc, table, qsl, torch.tensor(seq_lens).int(), 0.5, 8)
    want = _naive_attention(query, keys, values, seq_lens, query_lens, 0.5, 8, None)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


def test_write_kv_cache_skips_padding_slots() -> None:
    num_blocks, block_size, heads = 5, 4, 2
    key_cache = torch.zeros(num_blocks, block_size, heads, HEAD_DIM)
    value_cache = torch.zeros_like(key_cache)
    key = torch.randn(6, heads, HEAD_DIM)
    value = torch.randn(6, heads, HEAD_DIM)
    slots = torch.tensor([13, -1, 2, 7, -1, 19])
    write_kv_cache(key, value, key_cache, value_cache, slots)

    want_k = torch.zeros_like(key_cache)
    want_v = torch.zeros_like(value_cache)
    for t, s in enumerate(slots.tolist()):
        if s >= 0:
            want_k[s // block_size, s % block_size] = key[t]
            want_v[s // block_size, s % block_size] = value[t]
    assert torch.equal(key_cache, want_k)
    assert torch.equal(value_cache, want_v)


def test_write_kv_cache_into_strided_view() -> None:
    # K and V of one layer may be interleaved per block in one buffer (non-contiguous views).
    buffer = torch.zeros(3, 2, 4, 1, HEAD_DIM)
    key = torch.randn(2, 1, HEAD_DIM)
    write_kv_cache(key, -key, buffer[:, 0], buffer[:, 1], torch.tensor([5, 11]))
    assert torch.equal(buffer[1, 0, 1], key[0]) and torch.equal(buffer[1, 1, 1], -key[0])
    assert torch.equal(buffer[2, 0, 3], key[1]) and torch.equal(buffer[2, 1, 3], -key[1])
    assert torch.count_nonzero(buffer) == 4 * HEAD_DIM
