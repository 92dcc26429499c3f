"""Seed 000's timeline (moments 0-6) and its capacity example, step by step.

The seed's pool has blocks 0-9 and no null block; ours keeps block 0 as the permanent
null block, so it has one more block and the seed's block k is our block k + 1.
"""

from __future__ import annotations

from enginecore import KVCacheManager, Request
from protocol.block_hash import hash_block_tokens
from tests.helpers.kv_helpers import admit, check, decode, make_manager, snapshot, tokens


def seed_block(k: int) -> int:
    return k + 1


def chain(text: str, algo: str = "xxh3_128") -> list[bytes]:
    """Reference chained hashes of the full 4-token blocks of text."""
    from protocol.block_hash import root_hash

    parent = root_hash(algo)
    out = []
    for i in range(0, len(text) // 4 * 4, 4):
        parent = hash_block_tokens(algo, parent, tokens(text[i : i + 4]))
        out.append(parent)
    return out


def index_of(manager: KVCacheManager) -> dict[bytes, int]:
    """Hash -> the one block cached under it (a hash with several blocks fails here)."""
    return {h: b.block_id for h, (b,) in manager.block_pool.cached_entries(0)}


def queue(manager: KVCacheManager) -> list[int]:
    return manager.block_pool.free_block_queue.block_ids()


def test_seed_000_timeline() -> None:
    m = make_manager(11)
    pool = m.block_pool
    a_d, a_h, a_l, a_p = chain("ABCDEFGHIJKLMNOP")

    # Moment 0: every block free in id order, nothing cached.
    assert queue(m) == [seed_block(k) for k in range(10)]
    assert index_of(m) == {}

    # Moment 1: R0 brings A-O (15 tokens) and takes 4 blocks from the front; the three
    # full ones are cached with chained hashes, the partial block 3 is not.
    r0 = Request("R0", tokens("ABCDEFGHIJKLMNO"), m.block_hasher)
    admit(m, r0)
    assert m.get_block_ids("R0") == ([1, 2, 3, 4],)
    assert queue(m) == [5, 6, 7, 8, 9, 10]
    assert [pool.blocks[i].ref_cnt for i in (1, 2, 3, 4)] == [1, 1, 1, 1]
    assert index_of(m) == {a_d: 1, a_h: 2, a_l: 3}
    check(m, r0)

    # Moment 2: P fills block 3 (now cached as A-P) without a new block; Q needs block 4.
    assert decode(m, r0, ord("P")) == ((),)
    assert index_of(m) == {a_d: 1, a_h: 2, a_l: 3, a_p: 4}
    new = decode(m, r0, ord("Q"))
    assert [b.block_id for b in new[0]] == [seed_block(4)]
    assert m.get_block_ids("R0") == ([1, 2, 3, 4, 5],)
    assert queue(m) == [6, 7, 8, 9, 10]
    assert pool.blocks[5].block_hash is None
    check(m, r0)

    # Moment 3: R0 finishes; freed in reverse, the hash-less block 4 goes to the front,
    # the cached 3, 2, 1, 0 to the back, still findable.
    m.free(r0)
    assert queue(m) == [seed_block(k) for k in (4, 5, 6, 7, 8, 9, 3, 2, 1, 0)]
    assert index_of(m) == {a_d: 1, a_h: 2, a_l: 3, a_p: 4}
    assert all(b.ref_cnt == 0 for b in pool.blocks)
    check(m, r0)

    # Moment 4: R1 shares A-L then differs; its three hits come out of the middle of the
    # queue and its suffix takes the front block.
    r1 = Request("R1", tokens("ABCDEFGHIJKLXYZ"), m.block_hasher)
    hits, num_hit = m.get_computed_blocks(r1)
    assert num_hit == 12 and [b.block_id for b in hits[0]] == [1, 2, 3]
    assert queue(m) == [5, 6, 7, 8, 9, 10, 4, 3, 2, 1]  # looking up changed nothing
    m.allocate_slots(r1, 3, num_hit, hits)
    r1.num_computed_tokens = 15
    assert m.get_block_ids("R1") == ([seed_block(k) for k in (0, 1, 2, 4)],)
    assert queue(m) == [seed_block(k) for k in (5, 6, 7, 8, 9, 3)]
    assert [pool.blocks[i].ref_cnt for i in (1, 2, 3, 5)] == [1, 1, 1, 1]
    assert index_of(m)[a_p] == seed_block(3)  # still cached, unused by R1
    check(m, r0, r1)

    # Moment 5: R2 needs 7 new blocks, 6 are free: None, and nothing moved.
    before = snapshot(m)
    r2 = Request("R2", list(range(1000, 1028)), m.block_hasher)
    assert admit(m, r2) is None
    assert snapshot(m) == before
    assert queue(m) == [6, 7, 8, 9, 10, 4]
    assert m.get_block_ids("R1") == ([1, 2, 3, 5],)
    check(m, r1, r2)

    # Moment 6: a later allocation reaches block 3; A-P loses its hash before the block
    # is handed out, while the shorter prefixes A-D, A-H, A-L stay cached.
    r3 = Request("R3", list(range(2000, 2024)), m.block_hasher)
    evictions = pool.num_evictions
    admit(m, r3)
    assert m.get_block_ids("R3") == ([6, 7, 8, 9, 10, seed_block(3)],)
    assert pool.num_evictions == evictions + 1
    cached = index_of(m)
    assert a_p not in cached
    assert (cached[a_d], cached[a_h], cached[a_l]) == (1, 2, 3)
    assert pool.blocks[seed_block(3)].block_hash != a_p
    check(m, r1, r2, r3)

    m.free(r1)
    m.free(r3)
    check(m, r1, r3)
    assert pool.get_num_free_blocks() == pool.num_usable_blocks


def test_capacity_counts_evictable_hits() -> None:
    """Seed 000: 3 free blocks, 2 of them this request's hits with ref count 0, and 2 new
    blocks needed. 2 <= 3 looks fine, but touching the hits leaves 1: must be None."""
    m = make_manager(4)  # null + 3
    r0 = Request("R0", tokens("ABCDEFGH"), m.block_hasher)
    admit(m, r0)
    m.free(r0)
    assert m.block_pool.get_num_free_blocks() == 3
    r1 = Request("R1", tokens("ABCDEFGHIJKLMNOP"), m.block_hasher)
    hits, num_hit = m.get_computed_blocks(r1)
    assert num_hit == 8 and all(b.ref_cnt == 0 for b in hits[0])
    before = snapshot(m)
    assert m.allocate_slots(r1, 8, num_hit, hits) is None
    assert snapshot(m) == before
    check(m, r0, r1)
    # With one block fewer needed it fits exactly.
    r2 = Request("R2", tokens("ABCDEFGHIJKL"), m.block_hasher)
    hits, num_hit = m.get_computed_blocks(r2)
    assert m.allocate_slots(r2, 4, num_hit, hits) is not None
    assert m.block_pool.get_num_free_blocks() == 0
    check(m, r0, r1, r2)
