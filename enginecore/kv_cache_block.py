"""KVCacheBlock metadata and the intrusive free queue that doubles as the eviction order.

Blocks are created once by the BlockPool; every operation here only relinks them, so the
hot path allocates no Python objects.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

from enginecore.errors import InvariantViolation


class KVCacheBlock:
    """Metadata of one physical KV block (the K/V themselves live on the workers)."""

    __slots__ = (
        "block_hash",
        "block_id",
        "group_id",
        "hash_input",
        "next_free",
        "prev_free",
        "ref_cnt",
    )

    def __init__(self, block_id: int) -> None:
        self.block_id = block_id
        self.ref_cnt = 0
        # Set only while the block is findable in the prefix cache; (hash, group) is its key.
        self.block_hash: bytes | None = None
        # The bytes block_hash was computed from (parent hash, tokens, extra keys): a hit
        # must match them too, so a digest collision can never serve another's KV.
        self.hash_input: bytes | None = None
        self.group_id = -1
        # Owned by FreeKVCacheBlockQueue; None on both means "not in the queue".
        self.prev_free: KVCacheBlock | None = None
        self.next_free: KVCacheBlock | None = None

    def __repr__(self) -> str:
        h = self.block_hash.hex()[:8] if self.block_hash is not None else None
        return f"KVCacheBlock(id={self.block_id}, ref={self.ref_cnt}, hash={h})"


class FreeKVCacheBlockQueue:
    """Doubly linked list threaded through the blocks, between two sentinel blocks.

    The front is taken first: blocks that can never hit are pushed there, cached blocks
    go to the back and so are evicted in LRU order. Removing a block from the middle (a
    prefix hit on a free cached block) is O(1), which a deque cannot do.
    """

    __slots__ = ("_head", "_tail", "num_free_blocks")

    def __init__(self, blocks: Sequence[KVCacheBlock]) -> None:
        self._head = KVCacheBlock(-1)
        self._tail = KVCacheBlock(-1)
        self.num_free_blocks = 0
        self._head.next_free = self._tail
        self._tail.prev_free = self._head
        self.append_n(blocks)

    def __len__(self) -> int:
        return self.num_free_blocks

    def popleft(self) -> KVCacheBlock:
        block = self._head.next_free
        if block is self._tail:
            raise InvariantViolation("no free KV cache blocks")
        nxt = block.next_free
        self._head.next_free = nxt
        nxt.prev_free = self._head
        block.prev_free = block.next_free = None
        self.num_free_blocks -= 1
        return block

    def popleft_n(self, n: int) -> list[KVCacheBlock]:
        if n > self.num_free_blocks:
            raise InvariantViolation(
                f"asked for {n} free KV cache blocks, only {self.num_free_blocks}"
            )
        out = []
        block = self._head.next_free
        for _ in range(n):
            out.append(block)
            nxt = block.next_free
            block.prev_free = block.next_free = None
            block = nxt
        self._head.next_free = block
        block.prev_free = self._head
        self.num_free_blocks -= n
        return out

    def remove(self, block: KVCacheBlock) -> None:
        prev, nxt = block.prev_free, block.next_free
        if prev is None or nxt is None:
            raise InvariantViolation(f"block {block.block_id} is not in the free queue")
        prev.next_free = nxt
        nxt.prev_free = prev
        block.prev_free = block.next_free = None
        self.num_free_blocks -= 1

    def append(self, block: KVCacheBlock) -> None:
        self._link_after(self._tail.prev_free, (block,))

    def append_n(self, blocks: Iterable[KVCacheBlock]) -> None:
        self._link_after(self._tail.prev_free, blocks)

    def appendleft(self, block: KVCacheBlock) -> None:
        self._link_after(self._head, (block,))

    def prepend_n(self, blocks: Iterable[KVCacheBlock]) -> None:
        """Put blocks at the front, keeping their order (the first is taken first)."""
        self._link_after(self._head, blocks)

    def _link_after(self, prev: KVCacheBlock, blocks: Iterable[KVCacheBlock]) -> None:
        after = prev.next_free
        n = 0
        for block in blocks:
            if block.prev_free is not None:
                raise InvariantViolation(f"block {block.block_id} is already in the free queue")
            block.prev_free = prev
            prev.next_free = block
            prev = block
            n += 1
        prev.next_free = after
        after.prev_free = prev
        self.num_free_blocks += n

    def __iter__(self):
        block = self._head.next_free
        while block is not self._tail:
            yield block
            block = block.next_free

    def block_ids(self) -> list[int]:
        """The queue front to back, for tests and debugging."""
        return [b.block_id for b in self]
