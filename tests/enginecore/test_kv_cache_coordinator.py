"""Hybrid KV cache groups: one hit for all groups, and all-or-nothing allocation."""

from __future__ import annotations

from enginecore import Request
from tests.helpers.kv_helpers import admit, check, full, make_manager, snapshot, tokens, window


def test_hit_is_the_boundary_every_group_can_restore() -> None:
    """Full attention restores 2048 tokens, the sliding window only 1536: the hit is 1536."""
    bs, w = 16, 128
    m = make_manager(600, full(bs), window(w, bs))
    prompt = list(range(5000, 5000 + 2048 + 16))
    a = Request("A", prompt, m.block_hasher)
    admit(m, a)
    fa_blocks = list(m.coordinator.managers[0].req_to_blocks["A"])
    sw_blocks = list(m.coordinator.managers[1].req_to_blocks["A"])
    m.free(a)
    # The window group loses the cached content of positions 1536..2047 (blocks 96..127).
    m.block_pool.evict_cached_blocks(sw_blocks[96:128])
    check(m, a)

    b = Request("B", prompt, m.block_hasher)
    full_only = m.coordinator.managers[0].find_longest_cache_hit(
        b.block_hashes, b.block_hash_inputs, b.num_tokens - 1
    )
    assert len(full_only) * bs == 2048
    hits, num_hit = m.get_computed_blocks(b)
    assert num_hit == 1536
    assert hits[0] == fa_blocks[:96]
    needed = -(-(w - 1) // bs)  # blocks the window before token 1536 reads
    null = m.block_pool.null_block
    assert list(hits[1]) == [null] * (96 - needed) + sw_blocks[96 - needed : 96]
    m.allocate_slots(b, b.num_tokens - num_hit, num_hit, hits)
    b.num_computed_tokens = b.num_tokens
    check(m, a, b)
    m.free(b)
    check(m, a, b)


def test_groups_with_different_block_sizes_agree_on_a_common_boundary() -> None:
    m = make_manager(200, full(8), window(12, 4))
    prompt = list(range(100, 100 + 61))
    a = Request("A", prompt, m.block_hasher)
    admit(m, a)
    m.free(a)
    b = Request("B", [*prompt[:45], 7, 7, 7], m.block_hasher)
    hits, num_hit = m.get_computed_blocks(b)
    # 45 shared tokens: full blocks of 8 give 40, and the window group agrees at 40.
    assert num_hit == 40
    assert len(hits[0]) == 5 and len(hits[1]) == 10
    admit_new = m.allocate_slots(b, b.num_tokens - num_hit, num_hit, hits)
    assert admit_new is not None
    b.num_computed_tokens = b.num_tokens
    check(m, a, b)


def test_hit_at_the_queue_head_survives_another_groups_allocation() -> None:
    """Every group's hits are touched before any group takes new blocks: the window
    group's hit (block 3) sits right behind the full group's at the queue head, and the
    full group's new block must not take it."""
    m = make_manager(9, full(4), window(8, 4))
    a = Request("A", tokens("ABCDE"), m.block_hasher)
    admit(m, a)
    assert m.get_block_ids("A") == ([1, 2], [3, 4])
    m.free(a)
    c = Request("C", list(range(200, 212)), m.block_hasher)
    admit(m, c)
    m.free(c)
    assert m.block_pool.free_block_queue.block_ids()[:2] == [1, 3]

    b = Request("B", tokens("ABCDZ"), m.block_hasher)
    hits, num_hit = m.get_computed_blocks(b)
    assert num_hit == 4
    assert [x.block_id for x in hits[0]] == [1] and [x.block_id for x in hits[1]] == [3]
    new = m.allocate_slots(b, 1, num_hit, hits)
    assert new is not None
    full_ids, window_ids = m.get_block_ids("B")
    assert full_ids[0] == 1 and window_ids[0] == 3
    assert 3 not in full_ids and 1 not in window_ids
    check(m, a, b, c)


def test_hybrid_allocation_failure_changes_nothing() -> None:
    m = make_manager(7, full(4), window(8, 4))
    a = Request("A", list(range(12)), m.block_hasher)
    admit(m, a)  # 3 blocks per group = all 6
    b = Request("B", list(range(50, 54)), m.block_hasher)
    before = snapshot(m)
    assert admit(m, b) is None
    assert snapshot(m) == before
    check(m, a, b)


def test_sliding_window_frees_blocks_behind_the_committed_window() -> None:
    w, bs = 8, 4
    m = make_manager(64, full(bs), window(w, bs))
    r = Request("R", list(range(300, 310)), m.block_hasher)
    admit(m, r)
    for t in range(40):
        r.append_output_token_ids(1000 + t)
        assert m.allocate_slots(r, 1) is not None
        r.num_computed_tokens += 1
        check(m, r)
        full_ids, window_ids = m.get_block_ids("R")
        live = [i for i in window_ids if i != 0]
        # The window group holds the blocks the window reads plus the one being written.
        assert len(live) <= -(-w // bs) + 1
        assert len(full_ids) == -(-r.num_tokens // bs)
    # Blocks still read by a step in flight are not freed: with 8 tokens in flight the
    # window is judged 8 tokens earlier.
    r2 = Request("R2", list(range(400, 430)), m.block_hasher)
    admit(m, r2)
    r2.append_output_token_ids(5)
    m.allocate_slots(r2, 1, num_in_flight_tokens=8)
    window_ids = m.get_block_ids("R2")[1]
    first_readable = (r2.num_computed_tokens - 8 - w + 1) // bs
    assert all(i != 0 for i in window_ids[first_readable:])
    r2.num_computed_tokens += 1
    m.free(r)
    m.free(r2)
    check(m, r, r2)
    assert m.block_pool.get_num_free_blocks() == m.block_pool.num_usable_blocks
