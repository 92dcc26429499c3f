"""KV-cache events the core publishes for external routers (prefix-aware placement).

The layout is vLLM's, field for field, so a subscriber written for vLLM's KV events reads
ours: a batch is a msgpack array [ts, events, data_parallel_rank]; each event is a map
tagged by its class name under "type" (BlockStored, BlockRemoved, AllBlocksCleared).
Each ZeroMQ message is three frames: topic, the batch's sequence number (8 bytes,
big-endian; +1 per batch from 0, so a gap means a lost message) and the batch. See
docs/protocol.md for the sockets and the replay request.

A block hash is the raw digest (16 bytes for xxh3-128, 32 for sha256) chained from the
deployment's secret root, exactly the key the core caches blocks under.
"""

from __future__ import annotations

from typing import Any

import msgspec

from protocol.kv_cache import KVCacheSpec

BlockHash = bytes

# Where the blocks live, in vLLM's words.
MEDIUM_GPU = "GPU"
MEDIUM_CPU = "CPU"
MEDIUM_DISK = "DISK"  # the second KV tier's disk level


class BlockStored(msgspec.Struct, omit_defaults=True, gc=False, tag=True):
    """Consecutive full blocks of one request became findable by prefix: block_hashes[i]
    names token_ids[i * block_size:(i + 1) * block_size], chained from parent_block_hash
    (None: the first block of a prompt)."""

    block_hashes: list[BlockHash]
    parent_block_hash: BlockHash | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    medium: str | None
    lora_name: str | None
    # Per block: the extra keys its hash covered (cache_salt, multimodal ids), else None.
    extra_keys: list[tuple[Any, ...] | None] | None = None
    group_idx: int | None = None
    # What the group's cache is (vLLM's KVCacheSpecKind values: "full_attention",
    # "sliding_window"), so a router can tell a prefix's groups apart as it learns them.
    kv_cache_spec_kind: str | None = None
    kv_cache_spec_sliding_window: int | None = None


class BlockRemoved(msgspec.Struct, omit_defaults=True, gc=False, tag=True):
    """These hashes no longer name any cached block of the group (evicted)."""

    block_hashes: list[BlockHash]
    medium: str | None
    group_idx: int | None = None


class AllBlocksCleared(msgspec.Struct, omit_defaults=True, gc=False, tag=True):
    """The whole prefix cache was reset."""


KVCacheEvent = BlockStored | BlockRemoved | AllBlocksCleared


def group_event_info(spec: KVCacheSpec) -> tuple[str, int | None]:
    """A group's kv_cache_spec_kind and kv_cache_spec_sliding_window: the spec's wire tag
    is vLLM's kind name."""
    kind = type(spec).__struct_config__.tag
    assert isinstance(kind, str)
    return kind, getattr(spec, "sliding_window", None)


class KVEventBatch(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    """One step's events. Applied in order they give the core's cached hashes; the step's
    evictions come last, unless a hash was evicted and then cached again in the step."""

    ts: float
    events: list[KVCacheEvent]
    data_parallel_rank: int | None = None


# The replay socket's end-of-stream marker (sequence -1), as vLLM sends it.
END_OF_REPLAY = (-1).to_bytes(8, "big", signed=True)


class CachedPrefixView:
    """What a subscriber knows of one engine's prefix cache, from its events in order:
    the hashes each group holds, and what each group is. Answers how many leading blocks
    of a prompt the engine would find cached (a router's placement score)."""

    def __init__(self) -> None:
        self.groups: dict[int, set[BlockHash]] = {}
        # Sliding-window groups, as their stored events describe them: the blocks before a
        # hit's end that its window reads (cdiv(window - 1, block_size)).
        self.window_blocks: dict[int, int] = {}

    def apply(self, batch: KVEventBatch) -> None:
        for event in batch.events:
            if isinstance(event, BlockStored):
                group = event.group_idx or 0
                self.groups.setdefault(group, set()).update(event.block_hashes)
                window = event.kv_cache_spec_sliding_window
                if event.kv_cache_spec_kind == "sliding_window" and window is not None:
                    self.window_blocks[group] = -(-(window - 1) // event.block_size)
            elif isinstance(event, BlockRemoved):
                # A group is known from its stores (they say what it is): removals of
                # hashes never seen (a subscriber that joined late) change nothing.
                held = self.groups.get(event.group_idx or 0)
                if held is not None:
                    held.difference_update(event.block_hashes)
            else:
                for held in self.groups.values():
                    held.clear()

    def cached_prefix_blocks(self, block_hashes: list[BlockHash]) -> int:
        """Leading blocks of a prompt (its chained hashes) that every group can serve: a
        full-attention group must hold all of them, a sliding-window group only those its
        window reads before the hit's end. (The engine also recomputes a prompt's last
        token, so at most len(prompt) - 1 tokens hit.)"""
        if not self.groups:
            return 0  # nothing stored yet
        windows = self.window_blocks
        full = [held for g, held in self.groups.items() if g not in windows]
        bound = 0
        for h in block_hashes:
            if not all(h in held for held in full):
                break
            bound += 1
        # A window's hit does not hold for every shorter prefix (the blocks before it may
        # be gone), so ask every window group again under the shrunken bound until all
        # agree, as the engine does; the bound only shrinks, so this ends.
        while True:
            agreed = True
            for g, needed in windows.items():
                hit = _window_hit(self.groups.get(g, set()), block_hashes, bound, needed)
                if hit < bound:
                    bound, agreed = hit, False
            if agreed:
                return bound


def _window_hit(
    held: set[BlockHash], block_hashes: list[BlockHash], limit: int, needed: int
) -> int:
    """The longest L <= limit whose `needed` blocks before it are held (or all of them,
    from block 0), as the engine's sliding-window lookup finds it."""
    if needed == 0:
        return limit
    run = 0
    for i in range(limit - 1, -1, -1):
        if block_hashes[i] not in held:
            run = 0
            continue
        run += 1
        if run >= needed:
            return i + needed
    return run
