"""KVTier: the second tier of the prefix cache, an index the core owns (hash -> slot).

The workers own the bytes (worker/kv_host_tier.py); the core decides every transfer and
sends it with the step. A cached device block about to be evicted is stored into a
tier slot; a request whose prefix misses on the device but hits in the tier gets fresh
device blocks and loads into them. Workers run a step's stores, then its loads, before
its forward, so a store reads an evicted block before anything writes it again, and a
load lands before the step reads it.
"""

from __future__ import annotations

import hashlib
import logging
import os
from array import array
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from enginecore.errors import ConfigError
from enginecore.kv_cache_block import KVCacheBlock
from enginecore.request import Request
from protocol.config import EngineCoreConfig
from protocol.engine import KVTierStats
from protocol.kv_cache import KVCacheConfig
from protocol.kv_events import MEDIUM_CPU, BlockRemoved, BlockStored, KVCacheEvent
from protocol.worker import KVTierOps, RestoredBlock

log = logging.getLogger("pagedserve.core")


@dataclass(frozen=True)
class TierSettings:
    """What the core tells the workers about the tier (WorkerConfigure's kv_tier_*)."""

    kv_tier_slots: int = 0
    kv_tier_dir: str | None = None
    kv_tier_dir_slots: int = 0
    kv_tier_key: str = ""


def tier_settings(config: EngineCoreConfig, kv_cache_config: KVCacheConfig) -> TierSettings:
    """The tier's size in blocks from the flags (ConfigError when they make no sense)."""
    memory = config.kv_offload_memory
    if memory is None:
        if config.kv_cache_dir is not None:
            raise ConfigError("--kv-cache-dir persists the host tier: give --kv-offload-memory")
        return TierSettings()
    block_bytes = sum(t.size for t in kv_cache_config.kv_cache_tensors) // max(
        kv_cache_config.num_blocks, 1
    )
    slots = memory // max(block_bytes, 1)
    if slots < 1:
        raise ConfigError(
            f"--kv-offload-memory {memory} bytes holds no KV block ({block_bytes} bytes "
            "each per worker): give more"
        )
    if config.kv_cache_dir is None:
        return TierSettings(slots)
    dir_slots = 0
    if config.kv_cache_dir_size is not None:
        dir_slots = min(slots, config.kv_cache_dir_size // block_bytes)
        if dir_slots < 1:
            raise ConfigError("--kv-cache-dir-size holds no KV block: give more")
    seed = config.prefix_cache_hash_seed
    if seed is None:
        log.warning(
            "--kv-cache-dir without --prefix-cache-hash-seed-file: block hashes change at "
            "every start, so blocks stored now are never found after a restart"
        )
    # The workers compare this digest, never the seed itself.
    key = hashlib.blake2b(
        f"{config.hash_algo}:{seed if seed is not None else os.urandom(16).hex()}".encode(),
        digest_size=16,
    ).hexdigest()
    return TierSettings(slots, config.kv_cache_dir, dir_slots, key)


@dataclass
class KVTierCounts:
    """Tier lookups in blocks (asked after a device miss), and transfers in blocks."""

    queries: int = 0
    hits: int = 0
    stored: int = 0
    loaded: int = 0
    dropped: int = 0  # stores skipped: every slot was in use by this step's transfers


class KVTier:
    """Slots 0..num_slots-1, an LRU over their content; a lookup matches a block only if
    its hash and its exact content (the hash input) are equal, as on the device."""

    def __init__(self, num_slots: int, block_size: int, block_bytes: int = 0) -> None:
        if num_slots < 1:
            raise ValueError(f"a KV tier needs at least one slot, got {num_slots}")
        self.num_slots = num_slots
        self.block_size = block_size
        self.block_bytes = block_bytes  # per worker, for the stats
        # hash -> (slot, hash input); first = least recently stored or loaded.
        self._index: OrderedDict[bytes, tuple[int, bytes]] = OrderedDict()
        self._free = list(range(num_slots - 1, -1, -1))
        # Slots this step already stores into or loads from: never reused within the
        # step, so the workers' order (stores, then loads) reads what the core meant.
        self._busy: set[int] = set()
        self._store_blocks: list[int] = []
        self._store_slots: list[int] = []
        self._load_slots: list[int] = []
        self._load_blocks: list[int] = []
        self._found: list[bytes] = []  # hashes of the last lookup, until load_found
        # With a disk tier, stores carry each block's hash and hash input to the workers.
        self.persist = False
        self._store_hashes: list[bytes] = []
        self._store_inputs: list[bytes] = []
        self.stats = KVTierCounts()
        # KV events for tier blocks (set by the KV cache manager when events are on): a
        # router counts tier hits too. root: the hash chain's root (a first block's parent).
        self.emit: Callable[[KVCacheEvent], None] | None = None
        self.medium = MEDIUM_CPU
        self.root = b""

    def _stored(self, block_hash: bytes, hash_input: bytes) -> None:
        """Announce a block now in the tier; its parent and tokens are read back from the
        bytes its hash was computed from (parent hash, uint32 token ids, extra keys)."""
        assert self.emit is not None
        n, width = len(block_hash), 4 * self.block_size
        parent = hash_input[:n]
        tokens = array("I", hash_input[n : n + width]).tolist()
        self.emit(
            BlockStored(
                [block_hash],
                None if parent == self.root else parent,
                tokens,
                self.block_size,
                None,
                self.medium,
                None,
            )
        )

    def restore(self, ranks: Sequence[Sequence[RestoredBlock]]) -> int:
        """Persist from now on, and index the slots every rank read back from its disk
        tier with equal content (a rank that lost its shard of a block makes it a miss);
        how many."""
        self.persist = True
        common = {(b.slot, b.block_hash, b.hash_input) for b in ranks[0]} if ranks else set()
        for blocks in ranks[1:]:
            common &= {(b.slot, b.block_hash, b.hash_input) for b in blocks}
        for slot, block_hash, hash_input in sorted(common):
            if slot < self.num_slots and block_hash not in self._index:
                self._index[block_hash] = (slot, hash_input)
                if self.emit is not None:
                    self._stored(block_hash, hash_input)
        used = {slot for slot, _ in self._index.values()}
        self._free = [s for s in range(self.num_slots - 1, -1, -1) if s not in used]
        return len(self._index)

    def wire_stats(self) -> KVTierStats:
        """The counts for SchedulerStats, lookups in tokens."""
        c, bs = self.stats, self.block_size
        return KVTierStats(c.queries * bs, c.hits * bs, c.stored, c.loaded, self.block_bytes)

    def __len__(self) -> int:
        return len(self._index)

    # -- stores -----------------------------------------------------------------------
    def on_evict(self, block: KVCacheBlock) -> None:
        """The block pool is about to hand out `block`, still holding its cached content:
        keep a copy in the tier (unless it is there already)."""
        block_hash = block.block_hash
        assert block_hash is not None and block.hash_input is not None
        entry = self._index.get(block_hash)
        if entry is not None:
            if entry[1] == block.hash_input:
                self._index.move_to_end(block_hash)
            return  # equal content kept, or a digest collision: keep the first
        slot = self._take_slot()
        if slot < 0:
            self.stats.dropped += 1
            return
        self._index[block_hash] = (slot, block.hash_input)
        self._busy.add(slot)
        self._store_blocks.append(block.block_id)
        self._store_slots.append(slot)
        if self.persist:
            self._store_hashes.append(block_hash)
            self._store_inputs.append(block.hash_input)
        if self.emit is not None:
            self._stored(block_hash, block.hash_input)
        self.stats.stored += 1

    def _take_slot(self) -> int:
        if self._free:
            return self._free.pop()
        busy = self._busy
        for block_hash, (slot, _) in self._index.items():  # oldest first
            if slot not in busy:
                del self._index[block_hash]
                if self.emit is not None:
                    self.emit(BlockRemoved([block_hash], self.medium))
                return slot
        return -1

    # -- loads ------------------------------------------------------------------------
    def lookup(self, request: Request, num_hit_tokens: int) -> int:
        """Tokens past the device's num_hit_tokens (block-aligned) that the tier holds,
        leaving the last prompt token to compute; their slots are held for load_found."""
        bs = self.block_size
        first = num_hit_tokens // bs
        last = (request.num_tokens - 1) // bs
        found = self._found
        found.clear()
        if first >= last:
            return 0
        hashes, inputs = request.block_hashes, request.block_hash_inputs
        index = self._index
        for i in range(first, min(last, len(hashes))):
            entry = index.get(hashes[i])
            if entry is None or entry[1] != inputs[i]:
                break
            found.append(hashes[i])
            # Held now: the allocation that follows may evict device blocks into the tier.
            self._busy.add(entry[0])
        self.stats.queries += last - first
        return len(found) * bs

    def load_found(self, block_ids: Sequence[int], num_hit_tokens: int) -> None:
        """Load the last lookup's slots into the request's blocks after its device hits
        (block_ids: its whole table); they become the most recently used."""
        first = num_hit_tokens // self.block_size
        index = self._index
        # Still indexed: their slots were held busy since the lookup.
        for k, block_hash in enumerate(self._found):
            self._load_slots.append(index[block_hash][0])
            self._load_blocks.append(block_ids[first + k])
            index.move_to_end(block_hash)
        self.stats.hits += len(self._found)
        self.stats.loaded += len(self._found)
        self._found = []

    # -- per step ---------------------------------------------------------------------
    def take_ops(self) -> KVTierOps | None:
        """This step's transfers for the SchedulerOutput (None: none)."""
        self._busy.clear()
        if not self._store_blocks and not self._load_blocks:
            return None
        ops = KVTierOps(
            self._store_blocks,
            self._store_slots,
            self._load_slots,
            self._load_blocks,
            self._store_hashes,
            self._store_inputs,
        )
        self._store_blocks, self._store_slots = [], []
        if self.persist:
            self._store_hashes, self._store_inputs = [], []
        self._load_slots, self._load_blocks = [], []
        return ops

    def check_invariants(self) -> None:
        """Debugging and tests: every slot is free or indexed once."""
        used = [slot for slot, _ in self._index.values()]
        if len(set(used)) != len(used):
            raise AssertionError("a tier slot is indexed twice")
        if set(used) & set(self._free) or len(used) + len(self._free) != self.num_slots:
            raise AssertionError("tier slots are lost or both free and indexed")
