"""Torch reference kernels: the CPU path, and the oracle that CUDA kernels are tested against.

They favour clarity over speed. The CUDA kernels keep these exact signatures, so a caller
can switch implementations without touching anything else.

Cache layout: `[num_blocks, block_size, num_kv_heads, head_dim]`; a flat slot id `s`
names block `s // block_size`, offset `s % block_size`.
"""

from __future__ import annotations

import torch


def write_kv_cache(
    key: torch.Tensor,
    value: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    """Store token t's K/V [T, Hkv, D] in flat slot slot_mapping[t]; slot -1 is padding."""
    block_size = key_cache.shape[1]
    valid = slot_mapping >= 0
    slots = slot_mapping[valid].long()
    blocks = slots // block_size
    offsets = slots % block_size
    # Indexing by (block, offset) rather than viewing the cache flat keeps this correct
    # for caches that are strided views into a larger shared buffer.
    key_cache[blocks, offsets] = key[valid].to(key_cache.dtype)
    value_cache[blocks, offsets] = value[valid].to(value_cache.dtype)


def paged_attention(
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    block_table: torch.Tensor,
    query_start_loc: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    sliding_window: int | None = None,
    soft_cap: float | None = None,
) -> torch.Tensor:
    """Causal attention of a mixed batch (decode, prefill, extend) over paged K/V.

    Request b owns query rows query_start_loc[b]:query_start_loc[b+1] (n_b rows) at
    positions seq_lens[b]-n_b .. seq_lens[b]-1, and keys 0..seq_lens[b]-1 through
    block_table[b]; the cache already holds this step's tokens. A query at p reads keys
    k <= p, and with a window W only keys with p - k < W (W keys, itself included).
    Query head h reads kv head h // (Hq // Hkv). Rows past query_start_loc[-1] (padding)
    come back as zeros.
    """
    _, num_q_heads, head_dim = query.shape
    block_size, num_kv_heads = key_cache.shape[1], key_cache.shape[2]
    if num_q_heads % num_kv_heads != 0:
        raise ValueError(f"query heads ({num_q_heads}) not a multiple of kv heads ({num_kv_heads})")
    group = num_q_heads // num_kv_heads
    device = query.device
    out = torch.zeros_like(query)
    starts = query_start_loc.tolist()
    lens = seq_lens.tolist()

    for b, seq_len in enumerate(lens):
        start, end = starts[b], starts[b + 1]
        num_queries = end - start
        if num_queries == 0:
            continue
        first_query_pos = seq_len - num_queries
        # Keys older than every query's window are never read; skipping them also keeps
        # us off blocks the scheduler already released to the null block.
        first_key = 0 if sliding_window is None else max(0, first_query_pos - sliding_window + 1)
        key_pos = torch.arange(first_key, seq_len, device=device)
        block_ids = block_table[b, key_pos // block_size].long()
        offsets = key_pos % block_size
        k = key_cache[block_ids, offsets].float()  # [S, Hkv, D]
        v = value_cache[block_ids, offsets].float()

        # Grouped heads: view the queries as [n, Hkv, group, D] instead of copying K/V.
        q = query[start:end].float().view(num_queries, num_kv_heads, group, head_dim)
        logits = torch.einsum("qhgd,khd->hgqk", q, k) * scale
        if soft_cap is not None:
            logits = soft_cap * torch.tanh(logits / soft_cap)

        query_pos = torch.arange(first_query_pos, seq_len, device=device)
        distance = query_pos[:, None] - key_pos[None, :]
        visible = distance >= 0
        if sliding_window is not None:
            visible &= distance < sliding_window
        logits = logits.masked_fill(~visible, float("-inf"))
        probs = torch.softmax(logits, dim=-1)
        attended = torch.einsum("hgqk,khd->qhgd", probs, v)
        out[start:end] = attended.reshape(num_queries, num_q_heads, head_dim).to(query.dtype)
    return out
