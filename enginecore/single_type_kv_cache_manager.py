"""One KV cache group's request -> blocks tables, and how many blocks its rule keeps.

Full attention keeps every block of a request; a sliding window replaces blocks that no
future query can read with the null block and frees them.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence

from enginecore.block_pool import BlockPool
from enginecore.kv_cache_block import KVCacheBlock
from enginecore.request import Request
from protocol.kv_cache import FullAttentionSpec, KVCacheSpec, SlidingWindowSpec


class SingleTypeKVCacheManager:
    """Blocks of each request in one group; the pool below is shared by all groups."""

    def __init__(
        self, spec: KVCacheSpec, block_pool: BlockPool, group_id: int, hash_block_size: int
    ) -> None:
        if spec.block_size % hash_block_size:
            raise ValueError(
                f"group {group_id}: block size {spec.block_size} is not a multiple of the "
                f"hash block size {hash_block_size}"
            )
        self.spec = spec
        self.block_size = spec.block_size
        self.block_pool = block_pool
        self.group_id = group_id
        # A group block spans `hash_stride` hash blocks; its hash is the last of them.
        self.hash_stride = spec.block_size // hash_block_size
        self.null_block = block_pool.null_block
        self.req_to_blocks: dict[str, list[KVCacheBlock]] = {}
        self.num_cached_block: dict[str, int] = {}

    # -- planning (no state changes) --------------------------------------------------
    def get_num_blocks_to_allocate(
        self, request_id: str, num_tokens: int, new_computed_blocks: Sequence[KVCacheBlock]
    ) -> int:
        """New blocks to cover num_tokens, plus hit blocks that touching takes off the queue."""
        held = self.req_to_blocks.get(request_id)
        num_held = len(held) if held is not None else 0
        num_new = -(-num_tokens // self.block_size) - len(new_computed_blocks) - num_held
        if num_new < 0:
            num_new = 0
        null = self.null_block
        for block in new_computed_blocks:
            if block.ref_cnt == 0 and block is not null:
                num_new += 1
        return num_new

    def find_longest_cache_hit(
        self, block_hashes: Sequence[bytes], hash_inputs: Sequence[bytes], max_length: int
    ) -> list[KVCacheBlock]:
        """Hits match a block's hash and the exact bytes it was hashed from."""
        raise NotImplementedError

    def _hash_input(self, hash_inputs: Sequence[bytes], i: int) -> bytes:
        """What group block i was hashed from (stride hash blocks joined)."""
        stride = self.hash_stride
        if stride == 1:
            return hash_inputs[i]
        return b"".join(hash_inputs[i * stride : (i + 1) * stride])

    def max_blocks_held(self, num_tokens: int, max_chunk: int) -> int:
        """The most blocks a request of num_tokens tokens holds at once in this group,
        when the scheduler computes at most max_chunk tokens of it per step."""
        return -(-num_tokens // self.block_size)

    # -- commit -----------------------------------------------------------------------
    def save_new_computed_blocks(
        self, request_id: str, new_computed_blocks: Sequence[KVCacheBlock]
    ) -> None:
        """Own the prefix hits of a request that holds nothing yet in this group."""
        if request_id in self.req_to_blocks:
            raise ValueError(f"request {request_id} already holds blocks: no prefix hits now")
        self.block_pool.touch(new_computed_blocks)
        self.req_to_blocks[request_id] = list(new_computed_blocks)
        self.num_cached_block[request_id] = len(new_computed_blocks)

    def allocate_new_blocks(self, request_id: str, num_tokens: int) -> list[KVCacheBlock]:
        blocks = self.req_to_blocks.get(request_id)
        if blocks is None:
            blocks = self.req_to_blocks[request_id] = []
            self.num_cached_block[request_id] = 0
        num_new = -(-num_tokens // self.block_size) - len(blocks)
        if num_new <= 0:
            return []
        new_blocks = self.block_pool.get_new_blocks(num_new)
        blocks.extend(new_blocks)
        return new_blocks

    def cache_blocks(self, request: Request, num_tokens: int) -> None:
        """Publish full blocks up to num_tokens (callers cap it at request.num_tokens)."""
        rid = request.request_id
        num_full = num_tokens // self.block_size
        num_hashed = len(request.block_hashes) // self.hash_stride
        if num_full > num_hashed:
            num_full = num_hashed
        num_cached = self.num_cached_block[rid]
        if num_full <= num_cached:
            return
        self.block_pool.cache_full_blocks(
            request,
            self.req_to_blocks[rid],
            num_cached,
            num_full,
            self.block_size,
            self.group_id,
            self.hash_stride,
        )
        self.num_cached_block[rid] = num_full

    def remove_skipped_blocks(self, request_id: str, num_computed_tokens: int) -> None:
        """Free blocks no future query can read; full attention keeps everything."""

    def free(self, request_id: str) -> None:
        # Reverse order: a chain's tail is evicted before its more widely shared head.
        blocks = self.req_to_blocks.pop(request_id)
        del self.num_cached_block[request_id]
        blocks.reverse()
        self.block_pool.free_blocks(blocks)

    def free_tail(self, request_id: str, num_tokens: int) -> None:
        """Free the blocks past num_tokens slots (rejected drafts' lookahead); they hold
        no verified token, so none is hashed."""
        blocks = self.req_to_blocks[request_id]
        keep = -(-num_tokens // self.block_size)
        if len(blocks) > keep:
            tail = blocks[keep:]
            del blocks[keep:]
            tail.reverse()
            self.block_pool.free_blocks(tail)


class FullAttentionManager(SingleTypeKVCacheManager):
    def find_longest_cache_hit(
        self, block_hashes: Sequence[bytes], hash_inputs: Sequence[bytes], max_length: int
    ) -> list[KVCacheBlock]:
        """Consecutive hits from the first block, at most max_length tokens."""
        stride = self.hash_stride
        num_blocks = min(max_length // self.block_size, len(block_hashes) // stride)
        want = (
            hash_inputs.__getitem__
            if stride == 1
            else functools.partial(self._hash_input, hash_inputs)
        )
        return self.block_pool.find_cached_prefix(
            self.group_id, block_hashes, stride, num_blocks, want
        )


class SlidingWindowManager(SingleTypeKVCacheManager):
    def __init__(
        self, spec: SlidingWindowSpec, block_pool: BlockPool, group_id: int, hash_block_size: int
    ) -> None:
        super().__init__(spec, block_pool, group_id, hash_block_size)
        self.sliding_window = spec.sliding_window
        # A query at token L reads L - window + 1 .. L - 1 from the cache.
        self._blocks_needed = -(-(spec.sliding_window - 1) // self.block_size)
        self.blocks_needed = self._blocks_needed  # for the KV tier's loads
        # Requests whose leading null blocks grew since the last SchedulerOutput, with
        # the new count: the worker's table must forget those block ids too.
        self.skipped_changed: dict[str, int] = {}

    def find_longest_cache_hit(
        self, block_hashes: Sequence[bytes], hash_inputs: Sequence[bytes], max_length: int
    ) -> list[KVCacheBlock]:
        """The longest boundary L <= max_length whose window before L is all cached.

        Positions before the window are the null block. Scans backwards for a run of
        cached blocks long enough to fill the window; a run starting at block 0 also counts.
        """
        stride = self.hash_stride
        num_blocks = min(max_length // self.block_size, len(block_hashes) // stride)
        pool = self.block_pool
        group = self.group_id
        null = self.null_block
        needed = self._blocks_needed
        hits = [null] * num_blocks
        if needed == 0:  # a window of one token reads nothing from the cache
            return hits
        run = 0
        for i in range(num_blocks - 1, -1, -1):
            block = pool.get_cached_block(
                block_hashes[(i + 1) * stride - 1], group, self._hash_input(hash_inputs, i)
            )
            if block is None:
                run = 0
                continue
            hits[i] = block
            run += 1
            if run >= needed:
                del hits[i + needed :]
                return hits
        del hits[run:]
        return hits

    def max_blocks_held(self, num_tokens: int, max_chunk: int) -> int:
        # Blocks behind the window are freed before each step's allocation, judged on the
        # tokens already computed: a step holds the window before its chunk plus the chunk,
        # and one more where they straddle a block boundary.
        window_and_chunk = -(-(self.sliding_window - 1 + max_chunk) // self.block_size) + 1
        return min(-(-num_tokens // self.block_size), window_and_chunk)

    def remove_skipped_blocks(self, request_id: str, num_computed_tokens: int) -> None:
        blocks = self.req_to_blocks.get(request_id)
        if blocks is None:
            return
        first_useful = num_computed_tokens - self.sliding_window + 1
        if first_useful <= 0:
            return
        null = self.null_block
        removed = []
        for i in range(first_useful // self.block_size - 1, -1, -1):
            if blocks[i] is null:
                break  # everything before was skipped earlier
            removed.append(blocks[i])
            blocks[i] = null
        if removed:
            self.block_pool.free_blocks(removed)
            self.skipped_changed[request_id] = first_useful // self.block_size

    def free(self, request_id: str) -> None:
        self.skipped_changed.pop(request_id, None)
        super().free(request_id)


_MANAGERS: dict[type, type[SingleTypeKVCacheManager]] = {
    FullAttentionSpec: FullAttentionManager,
    SlidingWindowSpec: SlidingWindowManager,
}


def make_single_type_manager(
    spec: KVCacheSpec, block_pool: BlockPool, group_id: int, hash_block_size: int
) -> SingleTypeKVCacheManager:
    try:
        cls = _MANAGERS[type(spec)]
    except KeyError:
        raise ValueError(f"no KV cache manager for spec {type(spec).__name__}") from None
    return cls(spec, block_pool, group_id, hash_block_size)
