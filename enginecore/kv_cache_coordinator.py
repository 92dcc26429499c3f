"""Coordinates the groups of one pool: a hit must hold in every group, and allocation
is all or nothing across groups (touch every group's hits before any group allocates).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from enginecore.block_pool import BlockPool
from enginecore.kv_cache_block import KVCacheBlock
from enginecore.request import Request
from enginecore.single_type_kv_cache_manager import (
    FullAttentionManager,
    SingleTypeKVCacheManager,
    SlidingWindowManager,
    make_single_type_manager,
)
from protocol.kv_cache import KVCacheConfig

# Blocks of one request, outer index = KV cache group.
KVCacheBlocks = tuple[Sequence[KVCacheBlock], ...]


@dataclass
class LoadPads:
    """Per group, table positions between a new request's device hits and the blocks
    its KV tier loads land in (KVCacheCoordinator.window_for_loads)."""

    counts: list[int]  # sliding windows
    real: bool  # fresh blocks there, never published; else null blocks
    device: dict[int, Sequence[KVCacheBlock]]  # full attention: cached device blocks

    @property
    def num_saved(self) -> int:
        """New blocks the pads spare: null ones, and device ones already held."""
        null = 0 if self.real else sum(self.counts)
        held = sum(1 for blocks in self.device.values() for b in blocks if b.ref_cnt)
        return null + held


class KVCacheCoordinator:
    def __init__(
        self,
        config: KVCacheConfig,
        block_pool: BlockPool,
        hash_block_size: int,
        enable_caching: bool,
    ) -> None:
        self.block_pool = block_pool
        self.enable_caching = enable_caching
        self.managers: list[SingleTypeKVCacheManager] = [
            make_single_type_manager(group.kv_cache_spec, block_pool, i, hash_block_size)
            for i, group in enumerate(config.kv_cache_groups)
        ]
        self.empty_blocks: KVCacheBlocks = tuple(() for _ in self.managers)
        self._sliding = [
            (g, m) for g, m in enumerate(self.managers) if isinstance(m, SlidingWindowManager)
        ]
        self.has_sliding_window = bool(self._sliding)
        # Whether allocate_running_slots may serve a running request's next tokens.
        self.has_running_fast_path = False

    def holds_blocks(self, request_id: str) -> bool:
        """Whether the id has a table (every group's tables come and go together)."""
        return request_id in self.managers[0].req_to_blocks

    def allocate_running_slots(
        self, request: Request, num_tokens: int, delay_cache_blocks: bool
    ) -> KVCacheBlocks | None:
        """Only where has_running_fast_path is set (UnitaryKVCacheCoordinator)."""
        raise NotImplementedError

    def get_num_blocks_to_allocate(
        self, request_id: str, num_tokens: int, new_computed_blocks: KVCacheBlocks
    ) -> int:
        return sum(
            m.get_num_blocks_to_allocate(request_id, num_tokens, hits)
            for m, hits in zip(self.managers, new_computed_blocks)
        )

    def max_blocks_held(self, num_tokens: int, max_chunk: int) -> int:
        """The most blocks one request of num_tokens tokens holds at once, all groups."""
        return sum(m.max_blocks_held(num_tokens, max_chunk) for m in self.managers)

    def check_hits(self, request_id: str, hits: KVCacheBlocks, num_tokens: int) -> None:
        """Prefix hits must list every group, each covering exactly num_tokens."""
        if len(hits) != len(self.managers):
            raise ValueError(f"request {request_id}: prefix hits must list every KV cache group")
        for m, group_hits in zip(self.managers, hits):
            if len(group_hits) * m.block_size != num_tokens:
                raise ValueError(
                    f"request {request_id}: group {m.group_id} hits cover "
                    f"{len(group_hits) * m.block_size} tokens, not {num_tokens}"
                )

    def save_new_computed_blocks(self, request_id: str, new_computed_blocks: KVCacheBlocks) -> None:
        for m, hits in zip(self.managers, new_computed_blocks):
            m.save_new_computed_blocks(request_id, hits)

    def full_attention_prefix(self, request: Request) -> dict[int, list[KVCacheBlock]]:
        """Per full-attention group, its cached device blocks from the first, in a row
        (at most the prompt less its last token), whatever the other groups hold."""
        return {
            m.group_id: m.find_longest_cache_hit(
                request.block_hashes, request.block_hash_inputs, request.num_tokens - 1
            )
            for m in self.managers
            if isinstance(m, FullAttentionManager)
        }

    def window_for_loads(
        self,
        hits: KVCacheBlocks,
        end: int,
        real: bool,
        device: dict[int, Sequence[KVCacheBlock]],
    ) -> tuple[KVCacheBlocks, LoadPads]:
        """A new request restores KV tier blocks up to token `end`: a sliding-window group
        holds only the blocks its window reads before `end` (the tier loads those). Its
        device hits before that window are dropped (null, not taken) and the positions
        between hits and window padded (pad_for_loads): with null blocks, or with
        fresh ones never published when real (a failed disk read is then recomputed
        from the device boundary, worker/kv_tier_recompute.py, and needs them). A
        full-attention group first takes `device`, its cached blocks after its hits."""
        out = list(hits) if hits else [[] for _ in self.managers]
        counts = [0] * len(self.managers)
        null = self.block_pool.null_block
        for g, m in self._sliding:
            start = max(0, end // m.block_size - m.blocks_needed)
            group_hits = out[g]
            counts[g] = max(0, start - len(group_hits))
            if not real and start > 0:
                out[g] = [null] * min(start, len(group_hits)) + list(group_hits[start:])
        return tuple(out), LoadPads(counts, real, device)

    def pad_for_loads(self, request_id: str, pads: LoadPads) -> None:
        """Extend the tables by their pads after save_new_computed_blocks; padded
        positions are never published (the published count skips them)."""
        null = self.block_pool.null_block
        for g, blocks in pads.device.items():
            if blocks:
                self.block_pool.touch(blocks)
                self.managers[g].req_to_blocks[request_id].extend(blocks)
                self.managers[g].num_cached_block[request_id] += len(blocks)
        for g, m in self._sliding:
            n = pads.counts[g]
            if not n:
                continue
            blocks = m.req_to_blocks[request_id]
            blocks.extend(self.block_pool.get_new_blocks(n) if pads.real else [null] * n)
            m.num_cached_block[request_id] = len(blocks)

    def allocate_new_blocks(self, request_id: str, num_tokens: int) -> KVCacheBlocks:
        return tuple(m.allocate_new_blocks(request_id, num_tokens) for m in self.managers)

    def cache_blocks(self, request: Request, num_tokens: int) -> None:
        for m in self.managers:
            m.cache_blocks(request, num_tokens)

    def remove_skipped_blocks(self, request_id: str, num_computed_tokens: int) -> None:
        for m in self.managers:
            m.remove_skipped_blocks(request_id, num_computed_tokens)

    def free(self, request_id: str) -> None:
        for m in self.managers:
            m.free(request_id)

    def free_tail(self, request_id: str, num_tokens: int) -> None:
        for m in self.managers:
            m.free_tail(request_id, num_tokens)

    def get_block_ids(self, request_id: str) -> tuple[list[int], ...]:
        return tuple(
            [b.block_id for b in m.req_to_blocks.get(request_id, ())] for m in self.managers
        )

    def take_skipped_blocks(self) -> dict[str, list[int]]:
        """Requests whose sliding-window groups replaced leading blocks with the null
        block since the last call: request id -> leading null blocks per group (0 for
        groups without a change)."""
        changed: dict[str, list[int]] = {}
        num_groups = len(self.managers)
        for g, m in self._sliding:
            skipped = m.skipped_changed
            if not skipped:
                continue
            for rid, count in skipped.items():
                changed.setdefault(rid, [0] * num_groups)[g] = count
            skipped.clear()
        return changed

    def num_empty_slots(self, num_tokens: dict[str, int]) -> float:
        """Blocks' worth of slots held but holding no token (the unfilled tails), given
        each holding request's token count."""
        empty = 0.0
        for m in self.managers:
            bs = m.block_size
            for rid, blocks in m.req_to_blocks.items():
                slack = len(blocks) * bs - num_tokens[rid]
                if slack > 0:
                    empty += slack / bs
        return empty

    def num_live_blocks_per_group(self) -> list[int]:
        """Distinct real blocks each group holds (a prefix block shared by several
        requests counts once; released window slots hold the null block, not counted)."""
        null = self.block_pool.null_block
        return [
            len(
                {b.block_id for blocks in m.req_to_blocks.values() for b in blocks if b is not null}
            )
            for m in self.managers
        ]

    def find_longest_cache_hit(
        self, block_hashes: Sequence[bytes], hash_inputs: Sequence[bytes], max_length: int
    ) -> tuple[KVCacheBlocks, int]:
        raise NotImplementedError


class UnitaryKVCacheCoordinator(KVCacheCoordinator):
    """One group: its hit is the hit. A full-attention group also serves running requests'
    next tokens on a short path (allocate_running_slots)."""

    def __init__(
        self,
        config: KVCacheConfig,
        block_pool: BlockPool,
        hash_block_size: int,
        enable_caching: bool,
    ) -> None:
        super().__init__(config, block_pool, hash_block_size, enable_caching)
        manager = self.managers[0]
        self._manager = manager
        self._req_to_blocks = manager.req_to_blocks
        self._block_size = manager.block_size
        self.has_running_fast_path = isinstance(manager, FullAttentionManager)

    def allocate_running_slots(
        self, request: Request, num_tokens: int, delay_cache_blocks: bool
    ) -> KVCacheBlocks | None:
        """Slots up to num_tokens for a request that holds blocks, when full attention
        frees nothing and has no hits to touch: the new blocks, or None (nothing changed)
        when the pool is short. The caller has checked num_tokens. Publishes a block that
        filled, unless caching is off or delayed.

        Per running request per step: a lookup and a few comparisons, a manager call
        only when a block starts or fills."""
        blocks = self._req_to_blocks[request.request_id]
        bs = self._block_size
        if len(blocks) * bs < num_tokens:
            if -(-num_tokens // bs) - len(blocks) > self.block_pool.get_num_free_blocks():
                return None
            allocated: KVCacheBlocks = (
                self._manager.allocate_new_blocks(request.request_id, num_tokens),
            )
        else:
            allocated = self.empty_blocks
        if (
            num_tokens // bs != request.num_computed_tokens // bs
            and self.enable_caching
            and not delay_cache_blocks
        ):
            self._manager.cache_blocks(request, num_tokens)
        return allocated

    def find_longest_cache_hit(
        self, block_hashes: Sequence[bytes], hash_inputs: Sequence[bytes], max_length: int
    ) -> tuple[KVCacheBlocks, int]:
        manager = self.managers[0]
        hits = manager.find_longest_cache_hit(block_hashes, hash_inputs, max_length)
        return (hits,), len(hits) * manager.block_size


class HybridKVCacheCoordinator(KVCacheCoordinator):
    """Several groups: the longest boundary every group can restore.

    A sliding-window group's hits are not closed downwards (a shorter boundary may lack
    its window), so each group is asked again under the shrunken bound until all agree.
    """

    def __init__(
        self,
        config: KVCacheConfig,
        block_pool: BlockPool,
        hash_block_size: int,
        enable_caching: bool,
    ) -> None:
        super().__init__(config, block_pool, hash_block_size, enable_caching)
        # Full attention first: its answer is the cheapest tight bound for the others.
        self._lookup_order = sorted(
            range(len(self.managers)),
            key=lambda g: not isinstance(self.managers[g], FullAttentionManager),
        )

    def find_longest_cache_hit(
        self, block_hashes: Sequence[bytes], hash_inputs: Sequence[bytes], max_length: int
    ) -> tuple[KVCacheBlocks, int]:
        managers = self.managers
        hits: list[list[KVCacheBlock]] = [[] for _ in managers]
        bound = max_length
        while True:
            for g in self._lookup_order:
                m = managers[g]
                hits[g] = m.find_longest_cache_hit(block_hashes, hash_inputs, bound)
                bound = min(bound, len(hits[g]) * m.block_size)
            # A pass that did not shrink the bound left every group at exactly the bound;
            # otherwise ask again, and the bound strictly shrinks, so this ends.
            if all(len(h) * m.block_size == bound for h, m in zip(hits, managers)):
                return tuple(hits), bound


def make_kv_cache_coordinator(
    config: KVCacheConfig, block_pool: BlockPool, hash_block_size: int, enable_caching: bool
) -> KVCacheCoordinator:
    cls = (
        UnitaryKVCacheCoordinator if len(config.kv_cache_groups) == 1 else HybridKVCacheCoordinator
    )
    return cls(config, block_pool, hash_block_size, enable_caching)
