"""check_invariants(): walk the pool and every table and assert the KV rules (docs/architecture.md).

A debugging and testing aid (O(blocks + tokens)); never called on the serving path.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Mapping, Sequence

from enginecore.block_pool import BlockPool
from enginecore.kv_cache_block import KVCacheBlock
from enginecore.request import Request
from enginecore.single_type_kv_cache_manager import SingleTypeKVCacheManager, SlidingWindowManager


class BrokenInvariant(AssertionError):
    """The KV bookkeeping contradicts itself: a bug, never a user error (unlike
    errors.InvariantViolation, raised before a rule would break, nothing changed)."""


def _fail(rule: int, message: str) -> None:
    raise BrokenInvariant(f"KV invariant {rule} violated: {message}")


def check_invariants(
    pool: BlockPool,
    managers: Sequence[SingleTypeKVCacheManager],
    requests: Mapping[str, Request],
) -> None:
    """Raise BrokenInvariant naming the first rule broken. requests: every request the
    managers hold blocks for, by id."""
    null = pool.null_block
    if null.block_id != 0 or null.ref_cnt != 0 or null.block_hash is not None:
        _fail(1, f"null block changed: {null!r}")
    _check_free_queue(pool, managers)
    _check_index(pool)
    for m in managers:
        for rid, blocks in m.req_to_blocks.items():
            request = requests.get(rid)
            if request is None or not request.holds_kv_blocks:
                _fail(3, f"group {m.group_id} holds blocks of unknown request {rid}")
            _check_table(m, request, blocks, null)


def _check_free_queue(pool: BlockPool, managers: Sequence[SingleTypeKVCacheManager]) -> None:
    """1 and 4: the free queue holds exactly the non-null blocks nobody references."""
    null = pool.null_block
    queued: set[int] = set()
    for block in pool.free_block_queue:
        if block.block_id in queued or len(queued) > pool.num_blocks:
            _fail(1, "free queue has a cycle or a block twice")
        queued.add(block.block_id)
    if len(queued) != pool.free_block_queue.num_free_blocks:
        _fail(
            1,
            f"free queue holds {len(queued)} blocks, counter says "
            f"{pool.free_block_queue.num_free_blocks}",
        )
    refs: Counter[int] = Counter()
    for m in managers:
        for blocks in m.req_to_blocks.values():
            refs.update(b.block_id for b in blocks if b is not null)
    for block in pool.blocks:
        if block is null:
            if block.block_id in queued:
                _fail(1, "null block is in the free queue")
            continue
        if block.ref_cnt != refs[block.block_id]:
            _fail(
                1,
                f"block {block.block_id} has ref_cnt {block.ref_cnt} but "
                f"{refs[block.block_id]} request references",
            )
        if (block.ref_cnt == 0) != (block.block_id in queued):
            _fail(
                1,
                f"block {block.block_id} ref_cnt {block.ref_cnt}, in free queue: "
                f"{block.block_id in queued}",
            )
        # 4. A block some request still reads is never a candidate for get_new_blocks.
        if block.ref_cnt > 0 and block.prev_free is not None:
            _fail(4, f"referenced block {block.block_id} is linked into the free queue")


def _check_index(pool: BlockPool) -> None:
    """2: the hash index and the blocks' own hashes agree, group included."""
    indexed: set[int] = set()
    for group_id in range(pool.num_groups):
        for block_hash, blocks in pool.cached_entries(group_id):
            if not blocks:
                _fail(2, f"empty index entry for hash {block_hash.hex()}")
            for block in blocks:
                if block.block_hash != block_hash or block.group_id != group_id:
                    _fail(
                        2,
                        f"index entry {block_hash.hex()[:12]}/{group_id} points at "
                        f"{block!r} of group {block.group_id}",
                    )
                indexed.add(block.block_id)
    for block in pool.blocks:
        if block.block_hash is not None and block.block_id not in indexed:
            _fail(2, f"block {block.block_id} carries a hash the index does not know")


def _check_table(
    m: SingleTypeKVCacheManager, request: Request, blocks: list[KVCacheBlock], null: KVCacheBlock
) -> None:
    """2, 3 and 6 for one request's table in one group."""
    rid, bs = request.request_id, m.block_size
    # 2 and 6. Cached blocks of a live request hold exactly the hashed content and lie
    # within its real tokens: never lookahead or partial blocks.
    num_cached = m.num_cached_block[rid]
    if num_cached > len(blocks) or num_cached * bs > request.num_tokens:
        _fail(
            6,
            f"request {rid} group {m.group_id}: {num_cached} blocks cached "
            f"beyond its {request.num_tokens} tokens",
        )
    for i, block in enumerate(blocks):
        if block is null or block.block_hash is None:
            continue
        if i >= num_cached:
            _fail(6, f"request {rid}: block {i} hashed past the cached boundary")
        if block.block_hash != request.block_hashes[(i + 1) * m.hash_stride - 1]:
            _fail(
                2,
                f"request {rid}: block {i} (id {block.block_id}) hash does not "
                f"match the request's content",
            )
    # 3. num_computed_tokens never runs past what this group can restore.
    computed = request.num_computed_tokens
    if computed > len(blocks) * bs:
        _fail(
            3,
            f"request {rid}: {computed} computed tokens but group "
            f"{m.group_id} holds only {len(blocks)} blocks",
        )
    first_real = 0
    if isinstance(m, SlidingWindowManager):
        first_real = max(0, computed - m.sliding_window + 1) // bs
    for i in range(first_real, len(blocks)):
        if blocks[i] is null:
            _fail(
                3,
                f"request {rid}: group {m.group_id} block {i} is the null block "
                f"inside what attention still reads",
            )
