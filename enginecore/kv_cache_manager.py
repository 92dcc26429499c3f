"""KVCacheManager: the Scheduler's request-level API over the coordinator and block pool."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from math import gcd

from enginecore.block_pool import BlockPool
from enginecore.errors import ConfigError, InvariantViolation
from enginecore.kv_cache_block import KVCacheBlock
from enginecore.kv_cache_coordinator import KVCacheBlocks, make_kv_cache_coordinator
from enginecore.kv_invariants import check_invariants
from enginecore.kv_tier import KVTier
from enginecore.kv_tier_windows import mark_window_blocks, tier_windows
from enginecore.request import Request
from protocol.block_hash import BlockHasher, HashAlgo
from protocol.kv_cache import KVCacheConfig
from protocol.kv_events import MEDIUM_CPU, MEDIUM_GPU, KVCacheEvent, group_event_info
from protocol.worker import KVTierOps


@dataclass
class PrefixCacheStats:
    """Prefix-cache lookups, in tokens; lookups of preempted requests counted apart."""

    requests: int = 0
    queries: int = 0
    hits: int = 0
    preempted_requests: int = 0
    preempted_queries: int = 0
    preempted_hits: int = 0

    @property
    def hit_rate(self) -> float:
        return self.hits / self.queries if self.queries else 0.0


class KVCacheManager:
    """Plans before it acts: allocate_slots either changes nothing or does it all."""

    def __init__(
        self,
        kv_cache_config: KVCacheConfig,
        max_model_len: int,
        enable_caching: bool = True,
        hash_algo: HashAlgo = "xxh3_128",
        enable_kv_events: bool = False,
        kv_events_medium: str = MEDIUM_GPU,
        hash_seed: bytes | None = None,
        kv_tier_slots: int = 0,
        kv_tier_disk_slots: int = 0,
    ) -> None:
        if max_model_len < 1:
            raise ValueError(f"max_model_len must be >= 1, got {max_model_len}")
        groups = kv_cache_config.kv_cache_groups
        self.max_model_len = max_model_len
        self.enable_caching = enable_caching
        self.block_pool = BlockPool(
            kv_cache_config.num_blocks,
            len(groups),
            enable_caching,
            enable_kv_events,
            kv_events_medium,
            [group_event_info(g.kv_cache_spec) for g in groups],
        )
        hash_block_size = 0
        for group in groups:
            hash_block_size = gcd(hash_block_size, group.kv_cache_spec.block_size)
        self.block_hasher = (
            BlockHasher(hash_block_size, hash_algo, hash_seed) if enable_caching else None
        )
        # The first group's cache index is keyed by the requests' own block hashes when its
        # blocks are the hashing unit (uncached_prompt_tokens reads it).
        self._hash_index = (
            self.block_pool.cached_block_hash_to_block[0]
            if enable_caching and groups[0].kv_cache_spec.block_size == hash_block_size
            else None
        )
        self.coordinator = make_kv_cache_coordinator(
            kv_cache_config, self.block_pool, hash_block_size, enable_caching
        )
        self.empty_blocks = self.coordinator.empty_blocks
        self.prefix_cache_stats = PrefixCacheStats()
        self.has_sliding_window = self.coordinator.has_sliding_window
        self._running_fast_path = self.coordinator.has_running_fast_path
        # Full attention's cached device blocks the last tier lookup restores with
        # (lookup_tier), per group; taken by the allocation that follows it.
        self._tier_device: dict[int, list[KVCacheBlock]] = {}
        self.tier = (
            self._make_tier(kv_cache_config, kv_tier_slots, kv_tier_disk_slots)
            if kv_tier_slots or kv_tier_disk_slots
            else None
        )

    def _make_tier(self, kv_cache_config: KVCacheConfig, num_slots: int, disk_slots: int) -> KVTier:
        """A second tier behind the pool: evicted cached blocks are stored into it."""
        if not self.enable_caching:
            raise ConfigError("a KV tier keeps prefix-cache blocks: enable prefix caching")
        windows = tier_windows(kv_cache_config, disk_slots > 0)
        block_bytes = sum(t.size for t in kv_cache_config.kv_cache_tensors)
        tier = KVTier(
            num_slots,
            kv_cache_config.kv_cache_groups[0].kv_cache_spec.block_size,
            block_bytes // kv_cache_config.num_blocks,
            disk_slots,
            windows,
        )
        self.block_pool.on_evict = tier.on_evict
        if self.block_pool.enable_kv_events:
            tier.emit = self.block_pool.add_event
            # The device's medium on a CPU worker is "CPU" already: the tier names itself.
            tier.medium = MEDIUM_CPU if self.block_pool.event_medium == MEDIUM_GPU else "CPU_TIER"
            assert self.block_hasher is not None
            tier.root = self.block_hasher.root
        return tier

    # -- lookup -----------------------------------------------------------------------
    def uncached_prompt_tokens(self, request: Request, shared: set[bytes]) -> int:
        """The tokens a prefill of request would compute: those past its longest prefix of
        blocks that are cached or in `shared` (blocks that requests ahead of it compute
        first), to which its own blocks are then added. An estimate for planning (nothing
        is touched; the cache may evict before the request is admitted)."""
        hashes = request.block_hashes
        if self.block_hasher is None or not hashes:
            return request.num_tokens
        index = self._hash_index
        size = self.block_hasher.block_size
        hit = 0
        for block_hash in hashes:
            if block_hash not in shared and (index is None or block_hash not in index):
                break
            hit += 1
        shared.update(hashes)
        # As get_computed_blocks: the last token always runs, so its whole block does.
        return request.num_tokens - min(hit, (request.num_tokens - 1) // size) * size

    def get_computed_blocks(self, request: Request) -> tuple[KVCacheBlocks, int]:
        """The prefix already cached, block-aligned and at most num_tokens - 1 tokens (the
        last token always runs, to produce logits). Changes no pool state."""
        if not self.enable_caching or request.skip_reading_prefix_cache:
            return self.empty_blocks, 0
        hits, num_hit_tokens = self.coordinator.find_longest_cache_hit(
            request.block_hashes, request.block_hash_inputs, request.num_tokens - 1
        )
        stats = self.prefix_cache_stats
        if request.num_preemptions:
            stats.preempted_requests += 1
            stats.preempted_queries += request.num_tokens
            stats.preempted_hits += num_hit_tokens
        else:
            stats.requests += 1
            stats.queries += request.num_tokens
            stats.hits += num_hit_tokens
        return hits, num_hit_tokens

    def lookup_tier(self, request: Request, num_hit_tokens: int, budget: int) -> int:
        """After the device lookup: the tokens past num_hit_tokens that the KV tier
        restores. With several groups full attention may take some of them from its
        own cached device blocks (KVTier.lookup_groups), kept for allocate_slots."""
        tier = self.tier
        assert tier is not None
        if not tier.hybrid:
            return tier.lookup(request, num_hit_tokens, budget)
        full = self.coordinator.full_attention_prefix(request)
        device = min((len(blocks) for blocks in full.values()), default=0)
        num_tier, num_device = tier.lookup_groups(request, num_hit_tokens, device, budget)
        first = num_hit_tokens // tier.block_size
        self._tier_device = {g: blocks[first : first + num_device] for g, blocks in full.items()}
        return num_tier

    # -- allocation -------------------------------------------------------------------
    def allocate_slots(
        self,
        request: Request,
        num_new_tokens: int,
        num_new_computed_tokens: int = 0,
        new_computed_blocks: KVCacheBlocks | None = None,
        num_lookahead_tokens: int = 0,
        num_external_computed_tokens: int = 0,
        delay_cache_blocks: bool = False,
        num_in_flight_tokens: int = 0,
    ) -> KVCacheBlocks | None:
        """Slots for the request's next tokens; the new blocks per group, or None when the
        pool is short, in which case nothing changed.

        Token space: | computed | new local hits | external computed | new | lookahead |.
        num_in_flight_tokens are computed tokens a step still in flight may be reading:
        sliding-window blocks are freed only behind the committed ones.
        """
        # A running request's next tokens, no hits, lookahead or external KV: the
        # coordinator's short path when it has one. Everything else (new requests, bad
        # arguments, sliding windows, hybrid groups) takes the general path below.
        if (
            self._running_fast_path
            and request.holds_kv_blocks
            and num_new_tokens > 0
            and not (
                num_new_computed_tokens or num_lookahead_tokens or num_external_computed_tokens
            )
        ):
            total = request.num_computed_tokens + num_new_tokens
            if (
                total <= len(request.all_token_ids) + request.num_pending_tokens
                and total <= self.max_model_len
            ):
                return self.coordinator.allocate_running_slots(request, total, delay_cache_blocks)
        return self._allocate_slots(
            request,
            num_new_tokens,
            num_new_computed_tokens,
            new_computed_blocks,
            num_lookahead_tokens,
            num_external_computed_tokens,
            delay_cache_blocks,
            num_in_flight_tokens,
        )

    def _allocate_slots(
        self,
        request: Request,
        num_new_tokens: int,
        num_new_computed_tokens: int,
        new_computed_blocks: KVCacheBlocks | None,
        num_lookahead_tokens: int,
        num_external_computed_tokens: int,
        delay_cache_blocks: bool,
        num_in_flight_tokens: int,
    ) -> KVCacheBlocks | None:
        rid = request.request_id
        is_new = not request.holds_kv_blocks
        self._check_allocation(
            request,
            is_new,
            num_new_tokens,
            num_new_computed_tokens,
            new_computed_blocks,
            num_lookahead_tokens,
            num_external_computed_tokens,
            num_in_flight_tokens,
        )
        if new_computed_blocks is None:
            new_computed_blocks = self.empty_blocks
        coordinator = self.coordinator
        num_computed = request.num_computed_tokens + num_new_computed_tokens
        pads = None
        if is_new and num_external_computed_tokens and self.has_sliding_window:
            # Tokens loaded from the KV tier: a sliding window holds only the blocks it
            # reads before their end (KVCacheCoordinator.window_for_loads).
            new_computed_blocks, pads = coordinator.window_for_loads(
                new_computed_blocks,
                num_computed + num_external_computed_tokens,
                self.tier is not None and self.tier.reserve > 0,
                self._tier_device,
            )
        if not is_new:
            if self.tier is not None and self.tier.hybrid:
                mark_window_blocks(self.tier, coordinator.managers, request, prompt_end=True)
            # Frees only what is unreadable whatever this step does (committed tokens).
            # The scheduler's async mode passes no in-flight tokens: a step still in
            # flight may read blocks freed here, but workers run steps in order, so a
            # block handed to another request is only written by a later step.
            coordinator.remove_skipped_blocks(
                rid, request.num_computed_tokens - num_in_flight_tokens
            )
        num_tokens_needing_slots = min(
            num_computed + num_external_computed_tokens + num_new_tokens + num_lookahead_tokens,
            self.max_model_len,
        )
        needed = coordinator.get_num_blocks_to_allocate(
            rid, num_tokens_needing_slots, new_computed_blocks
        )
        if pads is not None:
            needed -= pads.num_saved
        if needed > self.block_pool.get_num_free_blocks():
            return None
        # Commit: every group's hits are owned before any group takes new blocks, so no
        # allocation can evict a hit of another group.
        if is_new:
            request.holds_kv_blocks = True
            coordinator.save_new_computed_blocks(rid, new_computed_blocks)
            if pads is not None:
                coordinator.pad_for_loads(rid, pads)
                self._tier_device = {}
        new_blocks = coordinator.allocate_new_blocks(rid, num_tokens_needing_slots)
        if self.enable_caching and not delay_cache_blocks:
            # Lookahead (draft) slots are never published: cap at the real tokens.
            coordinator.cache_blocks(
                request,
                min(
                    num_computed + num_external_computed_tokens + num_new_tokens, request.num_tokens
                ),
            )
        return new_blocks

    def _check_allocation(
        self,
        request: Request,
        is_new: bool,
        num_new_tokens: int,
        num_new_computed_tokens: int,
        new_computed_blocks: KVCacheBlocks | None,
        num_lookahead_tokens: int,
        num_external_computed_tokens: int,
        num_in_flight_tokens: int,
    ) -> None:
        rid = request.request_id
        if self.coordinator.holds_blocks(rid) == is_new:
            if is_new:
                raise InvariantViolation(
                    f"duplicate request id {rid!r}: another request holds blocks"
                )
            raise InvariantViolation(f"request {rid!r} holds blocks of another KV cache")
        for name, value in (
            ("num_new_tokens", num_new_tokens),
            ("num_new_computed_tokens", num_new_computed_tokens),
            ("num_lookahead_tokens", num_lookahead_tokens),
            ("num_external_computed_tokens", num_external_computed_tokens),
            ("num_in_flight_tokens", num_in_flight_tokens),
        ):
            if value < 0:
                raise ValueError(f"request {rid}: {name} must be >= 0, got {value}")
        if num_new_tokens == 0 and num_external_computed_tokens == 0:
            raise ValueError(f"request {rid}: nothing to allocate (num_new_tokens is 0)")
        if num_new_computed_tokens or (
            new_computed_blocks is not None and any(new_computed_blocks)
        ):
            if not is_new:
                raise ValueError(f"request {rid} already holds blocks: no prefix hits now")
            if new_computed_blocks is None:
                raise ValueError(f"request {rid}: prefix hits must list every KV cache group")
            self.coordinator.check_hits(rid, new_computed_blocks, num_new_computed_tokens)
        end = (
            request.num_computed_tokens
            + num_new_computed_tokens
            + num_external_computed_tokens
            + num_new_tokens
        )
        # Pending tokens (a step in flight samples them) get slots before their ids arrive.
        pending = request.num_pending_tokens
        if end > request.num_tokens + pending:
            raise ValueError(
                f"request {rid}: slots up to token {end} asked, but it has {request.num_tokens}"
                + (f" (+{pending} pending)" if pending else "")
            )
        if end > self.max_model_len:
            raise ValueError(
                f"request {rid}: {end} tokens exceed max_model_len {self.max_model_len}"
            )
        if num_in_flight_tokens > request.num_computed_tokens:
            raise ValueError(f"request {rid}: more tokens in flight than computed")

    def cache_blocks(self, request: Request, num_computed_tokens: int) -> None:
        """Publish blocks whose caching was delayed (their external KV has now arrived)."""
        if self.enable_caching:
            self._known(request)
            self.coordinator.cache_blocks(request, min(num_computed_tokens, request.num_tokens))

    def free(self, request: Request) -> None:
        """Release every block of the request, each group's in reverse order."""
        self._known(request)
        request.holds_kv_blocks = False
        if self.tier is not None and self.tier.hybrid:
            mark_window_blocks(self.tier, self.coordinator.managers, request, prompt_end=False)
        self.coordinator.free(request.request_id)

    def free_lookahead(self, request: Request) -> None:
        """Give back the blocks past the request's tokens: the slots of drafts it did not
        accept (the workers cut their tables the same way, docs/protocol.md)."""
        self._known(request)
        self.coordinator.free_tail(request.request_id, request.num_tokens)

    def _known(self, request: Request) -> None:
        rid = request.request_id
        if not self.coordinator.holds_blocks(rid):
            raise KeyError(f"unknown request id {rid!r}: it holds no KV cache blocks")
        if not request.holds_kv_blocks:
            raise InvariantViolation(f"request id {rid!r} belongs to another request object")

    def flush_to_tier(self) -> KVTierOps | None:
        """Stores of every cached device block into a persisting tier (before the workers
        stop: a restart then finds the hottest blocks too); None without one."""
        tier = self.tier
        if tier is None or not tier.persist:
            return None
        for block in self.block_pool.blocks:
            if block.block_hash is not None:
                tier.on_evict(block)
        return tier.take_ops()

    # -- whole cache ------------------------------------------------------------------
    def reset_prefix_cache(self) -> bool:
        return self.block_pool.reset_prefix_cache()

    def max_blocks_held(self, num_tokens: int, max_chunk: int) -> int:
        """The most blocks one request of num_tokens tokens holds at once (alone, at most
        max_chunk tokens per step): above num_usable_blocks it can never run."""
        return self.coordinator.max_blocks_held(num_tokens, max_chunk)

    def capacity_error(self, max_len: int, max_chunk: int) -> str | None:
        """Why one request of max_len tokens can never run in this pool, or None."""
        need = self.max_blocks_held(max_len, max_chunk)
        if need <= self.num_usable_blocks:
            return None
        fits = self.longest_request(max_len, max_chunk)
        return (
            f"the KV cache holds {self.num_usable_blocks} blocks, but one request of "
            f"max_model_len {max_len} tokens needs {need}: "
            "raise --num-gpu-blocks or --kv-cache-memory, or lower --max-model-len"
            + (f" (at most {fits} fits)" if fits else "")
        )

    def longest_request(self, limit: int, max_chunk: int) -> int:
        """The most tokens (at most limit) one request can hold alone in this pool, 0 if
        not even one token fits. max_blocks_held grows with the length: bisect."""
        usable = self.num_usable_blocks
        lo, hi = 0, limit
        while lo < hi:
            mid = (lo + hi + 1) // 2
            if self.coordinator.max_blocks_held(mid, max_chunk) <= usable:
                lo = mid
            else:
                hi = mid - 1
        return lo

    @property
    def num_usable_blocks(self) -> int:
        """Blocks requests can hold (all but the null block)."""
        return self.block_pool.num_usable_blocks

    @property
    def num_free_blocks(self) -> int:
        return self.block_pool.get_num_free_blocks()

    @property
    def usage(self) -> float:
        """Fraction of usable blocks held by requests."""
        return self.block_pool.get_usage()

    def token_usage(self, requests: Mapping[str, Request]) -> float:
        """Like usage, but counting only slots holding tokens (partial tail blocks count by
        their filled part; skipped sliding-window positions hold none). requests: every
        request holding blocks, by id."""
        pool = self.block_pool
        used = pool.num_usable_blocks - pool.get_num_free_blocks()
        empty = self.coordinator.num_empty_slots({rid: r.num_tokens for rid, r in requests.items()})
        return max(0.0, used - empty) / pool.num_usable_blocks

    def num_live_blocks_per_group(self) -> list[int]:
        return self.coordinator.num_live_blocks_per_group()

    def get_block_ids(self, request_id: str) -> tuple[list[int], ...]:
        return self.coordinator.get_block_ids(request_id)

    def take_skipped_blocks(self) -> dict[str, list[int]]:
        """Sliding-window releases since the last call (KVCacheCoordinator)."""
        return self.coordinator.take_skipped_blocks()

    def take_events(self) -> list[KVCacheEvent]:
        return self.block_pool.take_events()

    def check_invariants(self, requests: Mapping[str, Request]) -> None:
        """Debugging and tests: every KV rule (kv_invariants). requests: every request
        holding blocks, by id (more may be listed)."""
        check_invariants(self.block_pool, self.coordinator.managers, requests)
        if self.tier is not None:
            self.tier.check_invariants()
