"""The KV tier beside the KV cache manager for several groups: which layouts it takes,
and which sliding-window blocks are worth storing (enginecore/kv_tier_groups.py)."""

from __future__ import annotations

from collections.abc import Sequence

from enginecore.errors import ConfigError
from enginecore.kv_tier import KVTier
from enginecore.kv_tier_groups import window_blocks
from enginecore.request import Request
from enginecore.single_type_kv_cache_manager import SingleTypeKVCacheManager, SlidingWindowManager
from protocol.kv_cache import KVCacheConfig, SlidingWindowSpec


def tier_windows(config: KVCacheConfig, with_disk: bool) -> list[int | None]:
    """Per group, None for full attention, else the blocks its window reads before a
    boundary; ConfigError for layouts the tier cannot keep."""
    groups = config.kv_cache_groups
    specs = [g.kv_cache_spec for g in groups]
    sizes = sorted({s.block_size for s in specs})
    if len(sizes) != 1:
        raise ConfigError(
            "the KV tier (--kv-offload-memory, --kv-cache-dir) needs one block size for "
            f"every KV cache group, this model's groups have {sizes}"
        )
    if len({s.page_size_bytes for s in specs}) != 1:
        # A tier slot is one block of every shared buffer (worker/kv_host_tier.py).
        raise ConfigError(
            "the KV tier (--kv-offload-memory, --kv-cache-dir) needs KV cache groups of one "
            "page size (layers of equal heads, head size and dtype), this model's differ"
        )
    windows = [
        window_blocks(s.sliding_window, s.block_size) if isinstance(s, SlidingWindowSpec) else None
        for s in specs
    ]
    if with_disk and None not in windows:
        # A failed disk read of a hybrid request is recomputed from its device boundary,
        # found from a full-attention group's table (worker/kv_tier_recompute.py).
        raise ConfigError(
            "--kv-cache-dir needs a full-attention layer: this model has sliding-window "
            "layers only (--kv-offload-memory alone works)"
        )
    return windows


def mark_window_blocks(
    tier: KVTier,
    managers: Sequence[SingleTypeKVCacheManager],
    request: Request,
    prompt_end: bool,
) -> None:
    """Mark the request's sliding-window blocks worth storing when evicted: prompt_end,
    the window before its prompt's end (a repeated prompt or a longer conversation
    restores there, one block more for a prompt ending inside a block) and before each
    multiple of a disk level's cap; when it stops (not prompt_end), where it stopped."""
    keep = tier.window_keep
    rid = request.request_id
    for m in managers:
        if not isinstance(m, SlidingWindowManager):
            continue
        blocks = m.req_to_blocks.get(rid)
        if not blocks:
            continue
        null = m.null_block
        prompt, bs = request.num_prompt_tokens, m.block_size
        need = tier.windows[m.group_id] or 0
        if prompt_end and request.num_computed_tokens > prompt + m.sliding_window + bs:
            continue  # those blocks were released and marked already
        # The prompt's end, and where a disk level's one-step cap stops a restore from
        # the start (KVTier.cap_blocks); when it stops, where it stopped too.
        ends = [prompt // bs]
        if tier.cap_blocks:
            ends += range(tier.cap_blocks, prompt // bs, tier.cap_blocks)
        if not prompt_end:
            ends.append(request.num_computed_tokens // bs)
        for end in ends:
            for b in blocks[max(0, end - 1 - need) : end]:
                if b is not null:
                    keep.add(b.block_id)
