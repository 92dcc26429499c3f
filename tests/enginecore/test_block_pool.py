"""enginecore/block_pool.py: block 0 is never handed out, freed blocks are reused in the
promised order (unhashed first, cached ones least recently freed first), a cached block
stays findable until it is reused, and the events say what was stored and evicted."""

from __future__ import annotations

import pytest

from enginecore.block_pool import BlockPool
from enginecore.request import Request
from protocol.block_hash import BlockHasher
from protocol.kv_events import AllBlocksCleared, BlockRemoved, BlockStored

BS = 4


def _cached_request(pool: BlockPool, name: str, token_ids: list[int]) -> list:
    """A request whose full blocks are now cached; returns its blocks (still held)."""
    r = Request(name, token_ids, BlockHasher(BS))
    blocks = pool.get_new_blocks(len(token_ids) // BS)
    pool.cache_full_blocks(r, blocks, 0, len(blocks), BS, 0)
    return blocks


def test_block_0_is_the_null_block_and_is_never_handed_out() -> None:
    pool = BlockPool(5)
    assert pool.null_block.block_id == 0
    assert pool.num_usable_blocks == pool.get_num_free_blocks() == 4
    assert [b.block_id for b in pool.get_new_blocks(4)] == [1, 2, 3, 4]
    assert pool.get_usage() == 1.0
    with pytest.raises(ValueError, match="cannot get 1 blocks: 0 free"):
        pool.get_new_blocks(1)


def test_freed_unhashed_blocks_are_reused_first_and_cached_ones_last() -> None:
    pool = BlockPool(7)
    cached = _cached_request(pool, "c", list(range(8)))  # blocks 1, 2
    plain = pool.get_new_blocks(2)  # blocks 3, 4
    pool.free_blocks(cached)
    pool.free_blocks(plain)
    assert pool.get_usage() == 0.0
    # Free queue: 3, 4 at the front (no hash), then 5, 6 never used, then 1, 2 (cached).
    assert [b.block_id for b in pool.get_new_blocks(6)] == [3, 4, 5, 6, 1, 2]


def test_a_freed_cached_block_hits_until_reused_and_its_eviction_is_announced() -> None:
    pool = BlockPool(3, enable_kv_events=True)
    r = Request("r", list(range(4)), BlockHasher(BS))
    [block] = _cached_request(pool, "r", list(range(4)))
    [stored] = pool.take_events()
    assert isinstance(stored, BlockStored)
    assert stored.block_hashes == r.block_hashes and stored.token_ids == [0, 1, 2, 3]
    pool.free_blocks([block])
    assert pool.get_cached_block(r.block_hashes[0], 0, r.block_hash_inputs[0]) is block
    pool.get_new_blocks(2)  # the free block 2 first, then the cached block 1 is reused
    assert pool.get_cached_block(r.block_hashes[0], 0) is None
    assert block.block_hash is None
    assert pool.take_events() == [BlockRemoved([r.block_hashes[0]], "GPU", 0)]
    assert pool.take_events() == []


def test_a_hash_found_with_other_content_is_a_miss() -> None:
    pool = BlockPool(3)
    r = Request("r", list(range(4)), BlockHasher(BS))
    _cached_request(pool, "r", list(range(4)))
    assert pool.get_cached_block(r.block_hashes[0], 0, b"some other bytes") is None
    assert pool.get_cached_block(r.block_hashes[0], 0, r.block_hash_inputs[0]) is not None


def test_touching_a_free_cached_block_takes_it_off_the_free_queue() -> None:
    pool = BlockPool(3)
    blocks = _cached_request(pool, "r", list(range(4)))
    pool.free_blocks(blocks)
    assert pool.get_num_free_blocks() == 2
    pool.touch([*blocks, pool.null_block])  # the null block is never counted
    assert blocks[0].ref_cnt == 1 and pool.null_block.ref_cnt == 0
    assert pool.get_num_free_blocks() == 1


def test_reset_is_refused_while_a_block_is_held_and_clears_every_hash_after() -> None:
    pool = BlockPool(4, enable_kv_events=True)
    blocks = _cached_request(pool, "r", list(range(8)))
    pool.take_events()
    assert pool.reset_prefix_cache() is False
    pool.free_blocks(blocks)
    assert pool.reset_prefix_cache() is True
    assert all(b.block_hash is None for b in pool.blocks)
    assert list(pool.cached_entries(0)) == []
    assert pool.take_events() == [AllBlocksCleared()]


def test_bad_pool_shapes_are_refused() -> None:
    with pytest.raises(ValueError, match="num_blocks must be >= 2"):
        BlockPool(1)
    with pytest.raises(ValueError, match="num_groups must be >= 1"):
        BlockPool(4, num_groups=0)
    with pytest.raises(ValueError, match="describes 1 groups, the pool has 2"):
        BlockPool(4, num_groups=2, event_group_info=[("full_attention", None)])
