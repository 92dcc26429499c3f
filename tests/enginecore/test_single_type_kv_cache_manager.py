"""enginecore/single_type_kv_cache_manager.py: full attention keeps every block and hits
the longest cached run from block 0; a sliding window swaps blocks no query can read for
the null block, frees them, and hits where the window before the boundary is cached."""

from __future__ import annotations

import pytest

from enginecore.block_pool import BlockPool
from enginecore.request import Request
from enginecore.single_type_kv_cache_manager import (
    FullAttentionManager,
    SlidingWindowManager,
    make_single_type_manager,
)
from protocol.block_hash import BlockHasher
from protocol.kv_cache import FullAttentionSpec, SlidingWindowSpec

BS = 4


def _full(pool: BlockPool) -> FullAttentionManager:
    m = make_single_type_manager(FullAttentionSpec(BS, 1, 8, "float32"), pool, 0, BS)
    assert isinstance(m, FullAttentionManager)
    return m


def _window(pool: BlockPool, window: int) -> SlidingWindowManager:
    m = make_single_type_manager(SlidingWindowSpec(BS, 1, 8, "float32", window), pool, 0, BS)
    assert isinstance(m, SlidingWindowManager)
    return m


def _computed(m: FullAttentionManager | SlidingWindowManager, r: Request) -> None:
    """Allocate and cache all of r, as a finished prefill leaves it."""
    m.allocate_new_blocks(r.request_id, r.num_tokens)
    m.cache_blocks(r, r.num_tokens)


def test_a_full_attention_hit_is_the_cached_run_from_block_0() -> None:
    pool = BlockPool(10)
    m = _full(pool)
    first = Request("a", list(range(12)), BlockHasher(BS))
    _computed(m, first)
    assert m.num_cached_block["a"] == 3
    # Same first two blocks, different third: two blocks hit.
    second = Request("b", [*range(8), 99, 99, 99, 99, 5], BlockHasher(BS))
    hits = m.find_longest_cache_hit(second.block_hashes, second.block_hash_inputs, 13)
    assert hits == m.req_to_blocks["a"][:2]
    # max_length caps the hit at whole blocks below it.
    assert len(m.find_longest_cache_hit(second.block_hashes, second.block_hash_inputs, 7)) == 1


def test_blocks_to_allocate_count_new_blocks_and_hits_taken_off_the_free_queue() -> None:
    pool = BlockPool(10)
    m = _full(pool)
    a = Request("a", list(range(8)), BlockHasher(BS))
    _computed(m, a)
    m.free("a")  # both blocks free but cached
    hits = m.find_longest_cache_hit(a.block_hashes, a.block_hash_inputs, 8)
    # 10 tokens need 3 blocks: 2 are hits, 1 new, and each free hit costs a free block.
    assert m.get_num_blocks_to_allocate("b", 10, hits) == 1 + 2
    m.save_new_computed_blocks("b", hits)
    assert [b.ref_cnt for b in hits] == [1, 1]
    with pytest.raises(ValueError, match="already holds blocks"):
        m.save_new_computed_blocks("b", hits)


def test_a_sliding_window_frees_the_blocks_behind_it() -> None:
    pool = BlockPool(10)
    m = _window(pool, 5)  # a query at p reads p - 4 .. p
    m.allocate_new_blocks("r", 16)
    free_before = pool.get_num_free_blocks()
    # Computed 11 tokens: the next query (position 11) reads from 7, so only block 0
    # (positions 0..3) is unreadable.
    m.remove_skipped_blocks("r", 11)
    table = m.req_to_blocks["r"]
    assert table[0] is pool.null_block and table[1] is not pool.null_block
    assert m.skipped_changed == {"r": 1}
    # Computed 12: the next query reads from 8, so block 1 (positions 4..7) goes too.
    m.remove_skipped_blocks("r", 12)
    assert table[1] is pool.null_block and table[2] is not pool.null_block
    assert pool.get_num_free_blocks() == free_before + 2
    assert m.skipped_changed == {"r": 2}
    m.free("r")
    assert pool.get_num_free_blocks() == pool.num_usable_blocks and not m.skipped_changed


def test_a_sliding_window_hit_needs_only_the_window_before_the_boundary() -> None:
    pool = BlockPool(10)
    m = _window(pool, 5)  # needs ceil(4 / 4) = 1 cached block before the boundary
    r = Request("r", list(range(12)), BlockHasher(BS))
    _computed(m, r)
    held = list(m.req_to_blocks["r"])
    # Evict block 0's content: block 2 alone still fills the window before token 12.
    m.free("r")
    pool.evict_cached_blocks([held[0]])
    hits = m.find_longest_cache_hit(r.block_hashes, r.block_hash_inputs, 12)
    assert hits == [pool.null_block, pool.null_block, held[2]]
    full = _full(BlockPool(10))
    assert full.find_longest_cache_hit(r.block_hashes, r.block_hash_inputs, 12) == []


def test_a_window_holds_at_most_the_window_and_a_chunk_of_blocks() -> None:
    m = _window(BlockPool(10), 5)
    # ceil((4 + 8) / 4) + 1 = 4 blocks, never more than the request has.
    assert m.max_blocks_held(100, 8) == 4
    assert m.max_blocks_held(6, 8) == 2
    assert _full(BlockPool(10)).max_blocks_held(100, 8) == 25


def test_a_block_size_not_a_multiple_of_the_hash_block_is_refused() -> None:
    with pytest.raises(ValueError, match="block size 4 is not a multiple of the hash block size 3"):
        make_single_type_manager(FullAttentionSpec(BS, 1, 8, "float32"), BlockPool(4), 0, 3)
