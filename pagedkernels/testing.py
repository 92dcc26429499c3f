"""Random paged batches for checking kernels against the torch reference (tests, GPU check
and the attention benchmark all draw their inputs here)."""

from __future__ import annotations

import itertools
import math

import torch


def random_paged_batch(
    gen: torch.Generator,
    seq_lens: list[int],
    query_lens: list[int],
    block_size: int,
    num_kv_heads: int,
    num_q_heads: int,
    head_dim: int,
    dtype: torch.dtype,
    device: str | torch.device = "cpu",
    pad_rows: int = 0,
    released_window: int | None = None,
    poison_tails: bool = False,
) -> tuple[torch.Tensor, ...]:
    """(query, key_cache, value_cache, block_table, query_start_loc, seq_lens) on device.

    Each request's pages are shuffled block ids; block 0 is a NaN null block no request
    owns and one more block is never referenced, so a kernel that reads outside its pages
    shows up as NaN. With released_window W, blocks that no query's window of W keys
    reaches point at the null block, as the scheduler may leave them. With poison_tails,
    the slots of each request's last block past its keys hold NaN and inf (what a previous
    owner of the block may have left), which no output may depend on. Large caches are
    drawn on the device itself, seeded from gen."""
    device = torch.device(device)
    blocks = [math.ceil(s / block_size) for s in seq_lens]
    num_blocks = sum(blocks) + 2
    ids = (torch.randperm(num_blocks - 1, generator=gen) + 1).tolist()
    table = torch.zeros(len(seq_lens), max(blocks) + 1, dtype=torch.int32)
    for b, n in enumerate(blocks):
        table[b, :n] = torch.tensor([ids.pop() for _ in range(n)], dtype=torch.int32)
        if released_window is not None:
            first_key = max(0, seq_lens[b] - query_lens[b] - released_window + 1)
            table[b, : first_key // block_size] = 0
    dev_gen = gen
    if device.type != "cpu":
        seed = int(torch.randint(2**62, (1,), generator=gen))
        dev_gen = torch.Generator(device=device).manual_seed(seed)
    shape = (num_blocks, block_size, num_kv_heads, head_dim)
    key_cache = torch.randn(shape, generator=dev_gen, device=device).to(dtype)
    value_cache = torch.randn(shape, generator=dev_gen, device=device).to(dtype)
    key_cache[0] = float("nan")
    value_cache[0] = float("nan")
    if poison_tails:
        for b, n in enumerate(seq_lens):
            if n % block_size:
                last = int(table[b, (n - 1) // block_size])
                key_cache[last, n % block_size :] = float("inf")
                value_cache[last, n % block_size :] = float("nan")
    rows = sum(query_lens) + pad_rows
    query = torch.randn(rows, num_q_heads, head_dim, generator=dev_gen, device=device).to(dtype)
    qsl = torch.tensor([0, *itertools.accumulate(query_lens)], dtype=torch.int32)
    lens = torch.tensor(seq_lens, dtype=torch.int32)
    return query, key_cache, value_cache, table.to(device), qsl.to(device), lens.to(device)
