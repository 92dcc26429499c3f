"""KV-cache events the core publishes for external routers (prefix-aware placement).

Every event carries a sequence number, increasing by one per event from 0, so a
subscriber can tell a gap (a lost message) from quiet.
"""

from __future__ import annotations

import msgspec

# A block hash: 16 bytes (xxh3-128) or 32 bytes (sha256), the same in every process.
BlockHash = bytes


class BlockStored(msgspec.Struct, frozen=True, tag="block_stored"):
    """Consecutive full blocks of one request became findable by prefix."""

    seq: int
    block_hashes: list[BlockHash]
    parent_block_hash: BlockHash | None
    token_ids: list[int]
    block_size: int
    extra_keys: list[tuple] | None
    group_id: int


class BlockRemoved(msgspec.Struct, frozen=True, tag="block_removed"):
    """These hashes no longer name any cached block of the group (evicted)."""

    seq: int
    block_hashes: list[BlockHash]
    group_id: int


class AllBlocksCleared(msgspec.Struct, frozen=True, tag="all_blocks_cleared"):
    """The whole prefix cache was reset."""

    seq: int


KVCacheEvent = BlockStored | BlockRemoved | AllBlocksCleared
