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

BlockHash = bytes

# Where the blocks live, in vLLM's words.
MEDIUM_GPU = "GPU"
MEDIUM_CPU = "CPU"


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


class BlockRemoved(msgspec.Struct, omit_defaults=True, gc=False, tag=True):
    """These hashes no longer name any cached block of the group (evicted)."""

    block_hashes: list[BlockHash]
    medium: str | None
    group_idx: int | None = None


class AllBlocksCleared(msgspec.Struct, omit_defaults=True, gc=False, tag=True):
    """The whole prefix cache was reset."""


KVCacheEvent = BlockStored | BlockRemoved | AllBlocksCleared


class KVEventBatch(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    """One step's events. Applied in order they give the core's cached hashes; the step's
    evictions come last, unless a hash was evicted and then cached again in the step."""

    ts: float
    events: list[KVCacheEvent]
    data_parallel_rank: int | None = None


# The replay socket's end-of-stream marker (sequence -1), as vLLM sends it.
END_OF_REPLAY = (-1).to_bytes(8, "big", signed=True)
