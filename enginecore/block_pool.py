"""BlockPool: every KVCacheBlock, the free queue, the prefix-cache index, KV events."""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator, Sequence

from enginecore.errors import InvariantViolation
from enginecore.kv_cache_block import FreeKVCacheBlockQueue, KVCacheBlock
from enginecore.request import Request
from protocol.kv_cache import NULL_BLOCK_ID
from protocol.kv_events import (
    MEDIUM_GPU,
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    KVCacheEvent,
)

# One entry of the prefix-cache index: a block, or several blocks holding the same content
# (two requests can fill equal blocks before either is cached; neither table is rewritten).
_CacheEntry = KVCacheBlock | dict[int, KVCacheBlock]


class BlockPool:
    """Owns all num_blocks blocks; block 0 is the permanent null block.

    Freed blocks stay findable by hash until get_new_blocks hands them out again: free
    is not evict.
    """

    def __init__(
        self,
        num_blocks: int,
        num_groups: int = 1,
        enable_caching: bool = True,
        enable_kv_events: bool = False,
        event_medium: str = MEDIUM_GPU,
        event_group_info: Sequence[tuple[str, int | None]] | None = None,
    ) -> None:
        if num_blocks < 2:
            raise ValueError(
                f"num_blocks must be >= 2 (block 0 is the null block), got {num_blocks}"
            )
        if num_groups < 1:
            raise ValueError(f"num_groups must be >= 1, got {num_groups}")
        self.num_groups = num_groups
        self.num_blocks = num_blocks
        self.enable_caching = enable_caching
        self.enable_kv_events = enable_kv_events
        self.blocks = [KVCacheBlock(i) for i in range(num_blocks)]
        self.free_block_queue = FreeKVCacheBlockQueue(self.blocks)
        # Stands for positions a sliding window skipped: never counted, hashed or freed.
        self.null_block = self.free_block_queue.popleft()
        assert self.null_block.block_id == NULL_BLOCK_ID  # the id the workers reserve too
        # cached_block_hash_to_block[group][hash]; one dict per group avoids a key tuple.
        self.cached_block_hash_to_block: list[dict[bytes, _CacheEntry]] = [
            {} for _ in range(num_groups)
        ]
        self.num_evictions = 0
        # Drained every step by the core (take_events), so it holds one step's events.
        self._events: list[KVCacheEvent] = []
        # Hashes evicted this step and not yet in _events, per group (a dict: ordered, and
        # "is it pending" in O(1)). One BlockRemoved per group at the end of the step names
        # them all; only a hash cached again first must be announced removed before that
        # store. A subscriber applying the step in order ends with the core's index.
        self._removed: list[dict[bytes, None]] = [{} for _ in range(num_groups)]
        self.event_medium = event_medium  # where the workers keep KV, named for subscribers
        # Per group: (kv_cache_spec_kind, kv_cache_spec_sliding_window) for stored events.
        if event_group_info is None:
            event_group_info = [("full_attention", None)] * num_groups
        if len(event_group_info) != num_groups:
            raise ValueError(
                f"event_group_info describes {len(event_group_info)} groups, "
                f"the pool has {num_groups}"
            )
        self._event_group_info = list(event_group_info)
        # Called with each cached block get_new_blocks is about to evict (a second KV
        # tier keeps a copy); None: evicted content is gone.
        self.on_evict: Callable[[KVCacheBlock], None] | None = None

    # -- capacity ---------------------------------------------------------------------
    def get_num_free_blocks(self) -> int:
        return self.free_block_queue.num_free_blocks

    @property
    def num_usable_blocks(self) -> int:
        return self.num_blocks - 1

    def get_usage(self) -> float:
        """Fraction of usable blocks held by requests (free cached blocks count as free)."""
        return 1.0 - self.free_block_queue.num_free_blocks / (self.num_blocks - 1)

    # -- lookup -----------------------------------------------------------------------
    def get_cached_block(
        self, block_hash: bytes, group_id: int, hash_input: bytes | None = None
    ) -> KVCacheBlock | None:
        """The cached block with this hash in this group; with hash_input, only one whose
        content (what its hash was computed from) is exactly that: a digest collision,
        crafted or not, is a miss."""
        entry = self.cached_block_hash_to_block[group_id].get(block_hash)
        if entry is None:
            return None
        if entry.__class__ is KVCacheBlock:
            if hash_input is None or entry.hash_input == hash_input:
                return entry
            return None
        for block in entry.values():
            if hash_input is None or block.hash_input == hash_input:
                return block
        return None

    def find_cached_prefix(
        self,
        group_id: int,
        block_hashes: Sequence[bytes],
        stride: int,
        num_blocks: int,
        hash_input_at: Callable[[int], bytes],
    ) -> list[KVCacheBlock]:
        """The cached blocks of the longest run of group blocks 0, 1, ... (at most
        num_blocks) found by hash and exact content: group block i is hash block
        (i + 1) * stride - 1, hashed from hash_input_at(i)."""
        index = self.cached_block_hash_to_block[group_id]
        hits: list[KVCacheBlock] = []
        for i in range(num_blocks):
            entry = index.get(block_hashes[(i + 1) * stride - 1])
            if entry is None:
                break
            want = hash_input_at(i)
            if entry.__class__ is KVCacheBlock:
                if entry.hash_input != want:
                    break  # same digest, other content: a collision is a miss
            else:
                entry = next((b for b in entry.values() if b.hash_input == want), None)
                if entry is None:
                    break
            hits.append(entry)
        return hits

    def cached_entries(self, group_id: int) -> Iterator[tuple[bytes, list[KVCacheBlock]]]:
        """Debugging and tests: every indexed hash of the group and the blocks under it."""
        for block_hash, entry in self.cached_block_hash_to_block[group_id].items():
            if entry.__class__ is KVCacheBlock:
                yield block_hash, [entry]
            else:
                yield block_hash, list(entry.values())

    # -- allocation -------------------------------------------------------------------
    def get_new_blocks(self, num_blocks: int) -> list[KVCacheBlock]:
        """Pop blocks from the front; a cached one loses its hash before it is handed out."""
        if num_blocks > self.free_block_queue.num_free_blocks:
            raise ValueError(
                f"cannot get {num_blocks} blocks: {self.free_block_queue.num_free_blocks} free"
            )
        blocks = self.free_block_queue.popleft_n(num_blocks)
        for block in blocks:
            if block.block_hash is not None:
                if self.on_evict is not None:
                    self.on_evict(block)
                self._evict(block)
            block.ref_cnt = 1
        return blocks

    def touch(self, blocks: Iterable[KVCacheBlock]) -> None:
        """Take a reference on prefix-hit blocks, pulling free ones out of the queue."""
        null = self.null_block
        queue = self.free_block_queue
        for block in blocks:
            if block is null:
                continue
            if block.ref_cnt == 0:
                queue.remove(block)
            block.ref_cnt += 1

    def free_blocks(self, ordered_blocks: Sequence[KVCacheBlock]) -> None:
        """Drop one reference each; the first block given is the first to be reused.

        Blocks reaching zero references join the free queue: without a hash at the front
        (they can never hit, so reuse them first), with a hash at the back (LRU).
        """
        null = self.null_block
        # Drop every reference first, so a list naming a block more often than it is
        # referenced is caught whole (and undone) before the free queue changes. (A list
        # naming a block twice that holds two references is not caught: no manager builds
        # one, a request's table names each block once; check_invariants would see it.)
        for i, block in enumerate(ordered_blocks):
            if block is null:
                continue
            block.ref_cnt -= 1
            if block.ref_cnt < 0:
                for undo in ordered_blocks[: i + 1]:
                    if undo is not null:
                        undo.ref_cnt += 1
                raise InvariantViolation(f"block {block.block_id} freed more often than referenced")
        front: list[KVCacheBlock] = []
        back: list[KVCacheBlock] = []
        for block in ordered_blocks:
            if block.ref_cnt == 0 and block is not null:
                (front if block.block_hash is None else back).append(block)
        if front:
            self.free_block_queue.prepend_n(front)
        if back:
            self.free_block_queue.append_n(back)

    # -- prefix cache -----------------------------------------------------------------
    def cache_full_blocks(
        self,
        request: Request,
        blocks: Sequence[KVCacheBlock],
        num_cached_blocks: int,
        num_full_blocks: int,
        block_size: int,
        group_id: int,
        stride: int = 1,
    ) -> None:
        """Make blocks[num_cached_blocks:num_full_blocks] findable by their chained hash.

        Hashes come from request.block_hashes; a group whose block is `stride` hash blocks
        long uses the hash of its last one (the chain makes it name the whole prefix).
        """
        hashes = request.block_hashes
        inputs = request.block_hash_inputs
        index = self.cached_block_hash_to_block[group_id]
        null = self.null_block
        events = self.enable_kv_events
        run_start = num_cached_blocks  # first block of the current run of newly findable hashes
        for i in range(num_cached_blocks, num_full_blocks):
            block = blocks[i]
            if block is null or block.block_hash is not None:
                # A stored event names consecutive blocks: one that is skipped (a window's
                # null block, or cached already) ends the run, so the event's token ids
                # and parent always match its hashes.
                if events and run_start < i:
                    self._emit_stored(request, run_start, i, block_size, stride, group_id)
                run_start = i + 1
                continue
            block_hash = hashes[(i + 1) * stride - 1]
            block.block_hash = block_hash
            block.hash_input = (
                inputs[i] if stride == 1 else b"".join(inputs[i * stride : (i + 1) * stride])
            )
            block.group_id = group_id
            entry = index.get(block_hash)
            if entry is None:
                index[block_hash] = block
                continue
            # Equal content already findable under this hash: subscribers know it.
            if entry.__class__ is KVCacheBlock:
                index[block_hash] = {entry.block_id: entry, block.block_id: block}
            else:
                entry[block.block_id] = block
            if events and run_start < i:
                self._emit_stored(request, run_start, i, block_size, stride, group_id)
            run_start = i + 1
        if events and run_start < num_full_blocks:
            self._emit_stored(request, run_start, num_full_blocks, block_size, stride, group_id)

    def _emit_stored(
        self,
        request: Request,
        first: int,
        last: int,
        block_size: int,
        stride: int,
        group_id: int,
    ) -> None:
        """One event for blocks first..last-1 of the request's table in this group."""
        hashes = request.block_hashes
        extra = None
        if request.has_extra_keys:
            extra = [
                request.extra_keys(i * block_size, (i + 1) * block_size) or None
                for i in range(first, last)
            ]
        if stride == 1:
            block_hashes = hashes[first:last]
            parent = hashes[first - 1] if first else None
        else:
            block_hashes = [hashes[(i + 1) * stride - 1] for i in range(first, last)]
            parent = hashes[first * stride - 1] if first else None
        removed = self._removed[group_id]
        if removed and not removed.keys().isdisjoint(block_hashes):
            # Content evicted earlier in this step and stored again: subscribers must see
            # the removal first. Checked per event, in C, not per block in the store loop
            # (a hash is rarely both, and a per-block test slows every store).
            self._flush_removed()
        kind, window = self._event_group_info[group_id]
        self._events.append(
            BlockStored(
                block_hashes,
                parent,
                request.all_token_ids[first * block_size : last * block_size],
                block_size,
                None,  # lora_id
                self.event_medium,
                None,  # lora_name
                extra,
                group_id,
                kind,
                window,
            )
        )

    def _evict(self, block: KVCacheBlock) -> None:
        block_hash = block.block_hash
        group_id = block.group_id
        index = self.cached_block_hash_to_block[group_id]
        entry = index[block_hash]
        gone = True
        if entry is block:
            del index[block_hash]
        else:
            del entry[block.block_id]
            if len(entry) == 1:
                index[block_hash] = next(iter(entry.values()))
            gone = False
        block.block_hash = None
        block.hash_input = None
        block.group_id = -1
        self.num_evictions += 1
        if gone and self.enable_kv_events:
            self._removed[group_id][block_hash] = None

    def evict_cached_blocks(self, blocks: Iterable[KVCacheBlock]) -> None:
        """Forget the cached content of free blocks (for example, KV found corrupt or
        offloaded): they lose their hash and move to the front of the free queue."""
        queue = self.free_block_queue
        blocks = list(blocks)
        for block in blocks:
            if block.ref_cnt > 0 or block is self.null_block:
                raise InvariantViolation(
                    f"block {block.block_id} is in use; only free blocks evict"
                )
        for block in blocks:
            if block.block_hash is not None:
                self._evict(block)
                queue.remove(block)
                queue.appendleft(block)

    def reset_prefix_cache(self) -> bool:
        """Forget every cached hash; refused (False) while any block is in use."""
        if self.free_block_queue.num_free_blocks != self.num_blocks - 1:
            return False
        for index in self.cached_block_hash_to_block:
            index.clear()
        for block in self.blocks:
            block.block_hash = None
            block.hash_input = None
            block.group_id = -1
        if self.enable_kv_events:
            for removed in self._removed:
                removed.clear()  # the clear announces them too
            self._events.append(AllBlocksCleared())
        return True

    # -- events -----------------------------------------------------------------------
    def _flush_removed(self) -> None:
        medium = self.event_medium
        for group_id, removed in enumerate(self._removed):
            if removed:
                self._events.append(BlockRemoved(list(removed), medium, group_id))
                removed.clear()

    def add_event(self, event: KVCacheEvent) -> None:
        """An event of another medium (the KV tier), in order with the pool's."""
        self._events.append(event)

    def take_events(self) -> list[KVCacheEvent]:
        self._flush_removed()
        events = self._events
        if not events:
            return events  # most steps: nothing happened, nothing to allocate
        self._events = []
        return events
