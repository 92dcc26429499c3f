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
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from enginecore.errors import ConfigError
from enginecore.kv_cache_block import KVCacheBlock
from enginecore.kv_tier_groups import longest_boundary, split_key, tier_key
from enginecore.kv_tier_level import NO_ROOM, TierLevel
from enginecore.request import Request
from protocol.config import EngineCoreConfig
from protocol.engine import KVTierStats
from protocol.kv_cache import KVCacheConfig
from protocol.kv_events import MEDIUM_CPU, MEDIUM_DISK, BlockRemoved, BlockStored, KVCacheEvent
from protocol.worker import KVTierOps, RestoredBlock, TierOutput

log = logging.getLogger("pagedserve.core")


@dataclass(frozen=True)
class TierSettings:
    """What the core tells the workers about the tier (WorkerConfigure's kv_tier_*)."""

    kv_tier_slots: int = 0
    kv_tier_dir: str | None = None
    kv_tier_dir_slots: int = 0
    kv_tier_key: str = ""


# The disk level's size per worker when --kv-cache-dir-size is not given.
DEFAULT_DISK_BYTES = 16 << 30


def tier_settings(config: EngineCoreConfig, kv_cache_config: KVCacheConfig) -> TierSettings:
    """The tier's levels in blocks from the flags (ConfigError when they make no sense):
    host memory (--kv-offload-memory) and disk (--kv-cache-dir, its own capacity)."""
    memory, directory = config.kv_offload_memory, config.kv_cache_dir
    if memory is None and directory is None:
        return TierSettings()
    block_bytes = max(
        sum(t.size for t in kv_cache_config.kv_cache_tensors) // max(kv_cache_config.num_blocks, 1),
        1,
    )
    slots = 0 if memory is None else memory // block_bytes
    if memory is not None and slots < 1:
        raise ConfigError(
            f"--kv-offload-memory {memory} bytes holds no KV block ({block_bytes} bytes "
            "each per worker): give more"
        )
    if directory is None:
        return TierSettings(slots)
    size = config.kv_cache_dir_size or DEFAULT_DISK_BYTES
    dir_slots = size // block_bytes
    if dir_slots < 1:
        raise ConfigError(
            f"--kv-cache-dir-size {size} bytes holds no KV block ({block_bytes} bytes "
            "each per worker): give more"
        )
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
    return TierSettings(slots, directory, dir_slots, key)


@dataclass
class KVTierCounts:
    """Tier lookups in blocks (asked after a device miss, once per admitted request),
    and transfers in blocks."""

    queries: int = 0
    hits: int = 0
    stored: int = 0
    loaded: int = 0
    disk_loaded: int = 0  # of loaded: read from the disk level
    failed: int = 0  # disk loads a worker could not verify (recomputed instead)
    dropped: int = 0  # stores skipped: every slot was in use by this step's transfers
    load_seconds: float = 0.0  # rank 0's time in loads
    promoted: int = 0  # blocks loaded from disk and copied into host memory


class KVTier:
    """Two levels behind the device pool: host memory (num_slots) and disk (disk_slots),
    either may be absent. A stored block goes to both (the disk is written through), so
    a block pushed out of host memory stays loadable from disk. A lookup matches a block
    only if its hash and its exact content (the hash input) are equal, as on the device;
    host memory is asked first."""

    def __init__(
        self,
        num_slots: int,
        block_size: int,
        block_bytes: int = 0,
        disk_slots: int = 0,
        windows: Sequence[int | None] = (None,),
    ) -> None:
        if num_slots < 1 and disk_slots < 1:
            raise ValueError(f"a KV tier needs at least one slot, got {num_slots}")
        self.block_size = block_size
        # Per KV cache group: None for full attention, else the blocks its sliding window
        # reads before a boundary (enginecore/kv_tier_groups.py). One full-attention
        # group keeps plain hashes as keys, and the lookup of one group.
        self.windows = list(windows)
        self.hybrid = self.windows != [None]
        # Sliding-window blocks worth storing when evicted: those in the window before
        # their request's prompt end or where it stopped (KVCacheManager marks them);
        # a block released behind a window mid-request is read again by no likely
        # boundary. A hint only: a stale id costs one store, never a wrong load.
        self.window_keep: set[int] = set()
        # Blocks a disk level restores at most in one step (the scheduler's budget less
        # one token, whole blocks; 0: no cap): a sliding window keeps the blocks before
        # each multiple of it too, where such a restore stops.
        self.cap_blocks = 0
        self.block_bytes = block_bytes  # per worker, for the stats
        self.host = TierLevel(num_slots, self._removed_host) if num_slots else None
        self.disk = TierLevel(disk_slots, self._removed_disk) if disk_slots else None
        self.num_slots = num_slots
        self._store_blocks: list[int] = []
        self._store_slots: list[int] = []
        self._load_slots: list[int] = []
        self._load_blocks: list[int] = []
        # The disk level's transfers; stores carry each block's hash and hash input (a
        # restart rebuilds the index from them), loads the hash the file must hold.
        self._disk_store_blocks: list[int] = []
        self._disk_store_slots: list[int] = []
        self._store_hashes: list[bytes] = []
        self._store_inputs: list[bytes] = []
        self._disk_load_slots: list[int] = []
        self._disk_load_blocks: list[int] = []
        self._disk_load_hashes: list[bytes] = []
        # The last lookup's blocks until load_found: (key, slot, from disk, group,
        # position); and the block positions it covers.
        self._found: list[tuple[bytes, int, bool, int, int]] = []
        self._hit_blocks = 0
        self._queried = 0
        # Tokens of the last lookup from its first disk block on: a disk load may fail,
        # and then it and every block after it are computed (0: host memory only).
        self.reserve = 0
        self.persist = self.disk is not None
        self.stats = KVTierCounts()
        # KV events for tier blocks (set by the KV cache manager when events are on): a
        # router counts tier hits too. root: the hash chain's root (a first block's parent).
        self.emit: Callable[[KVCacheEvent], None] | None = None
        self.medium = MEDIUM_CPU
        self.root = b""

    def _removed_host(self, key: bytes) -> None:
        self._removed(key, self.medium)

    def _removed_disk(self, key: bytes) -> None:
        self._removed(key, MEDIUM_DISK)

    def _removed(self, key: bytes, medium: str) -> None:
        if self.emit is None:
            return
        if self.hybrid:
            block_hash, group = split_key(key)
            self.emit(BlockRemoved([block_hash], medium, group))
        else:
            self.emit(BlockRemoved([key], medium))

    def _stored(self, key: bytes, hash_input: bytes, medium: str) -> None:
        """Announce a block now in a level; its parent and tokens are read back from the
        bytes its hash was computed from (parent hash, uint32 token ids, extra keys)."""
        assert self.emit is not None
        block_hash, group = split_key(key) if self.hybrid else (key, None)
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
                medium,
                None,
                group_idx=group,
            )
        )

    def restore(self, ranks: Sequence[Sequence[RestoredBlock]]) -> int:
        """Index the disk slots every rank found at start-up with equal content (a rank
        that lost its shard of a block makes it a miss); how many."""
        if self.disk is None:
            return 0
        common = {(b.slot, b.block_hash, b.hash_input) for b in ranks[0]} if ranks else set()
        for blocks in ranks[1:]:
            common &= {(b.slot, b.block_hash, b.hash_input) for b in blocks}
        taken = self.disk.restore(common)
        if self.emit is not None:
            for block_hash, hash_input in taken:
                self._stored(block_hash, hash_input, MEDIUM_DISK)
        return len(taken)

    def wire_stats(self) -> KVTierStats:
        """The counts for SchedulerStats, lookups in tokens."""
        c, bs = self.stats, self.block_size
        return KVTierStats(
            c.queries * bs,
            c.hits * bs,
            c.stored,
            c.loaded,
            self.block_bytes,
            c.disk_loaded,
            c.failed,
            c.load_seconds,
            c.promoted,
        )

    def __len__(self) -> int:
        return len(self.host or ()) + len(self.disk or ())

    # -- stores -----------------------------------------------------------------------
    def on_evict(self, block: KVCacheBlock) -> None:
        """The block pool is about to hand out `block`, still holding its cached content:
        keep a copy in each level (unless it is there already)."""
        block_hash, hash_input = block.block_hash, block.hash_input
        assert block_hash is not None and hash_input is not None
        if self.hybrid:
            group = block.group_id
            keep = block.block_id in self.window_keep
            self.window_keep.discard(block.block_id)
            if self.windows[group] is not None and not keep:
                return  # behind a window: no likely boundary reads it again
            block_hash = tier_key(block_hash, group)
        stored = False
        if self.host is not None:
            slot = self.host.offer(block_hash, hash_input)
            if slot >= 0:
                self._store_blocks.append(block.block_id)
                self._store_slots.append(slot)
                if self.emit is not None:
                    self._stored(block_hash, hash_input, self.medium)
                stored = True
            elif slot == NO_ROOM:
                self.stats.dropped += 1
        if self.disk is not None:
            slot = self.disk.offer(block_hash, hash_input)
            if slot >= 0:
                self._disk_store_blocks.append(block.block_id)
                self._disk_store_slots.append(slot)
                self._store_hashes.append(block_hash)
                self._store_inputs.append(hash_input)
                if self.emit is not None:
                    self._stored(block_hash, hash_input, MEDIUM_DISK)
                stored = True
            elif slot == NO_ROOM:
                self.stats.dropped += 1
        if stored:
            self.stats.stored += 1

    # -- loads ------------------------------------------------------------------------
    def lookup(self, request: Request, num_hit_tokens: int, budget: int = 1 << 62) -> int:
        """Tokens past the device's num_hit_tokens (block-aligned) that the tier holds,
        leaving the last prompt token to compute; their slots are held for load_found.
        Disk tokens stay below budget (self.reserve: from the first disk block on)."""
        bs = self.block_size
        first = num_hit_tokens // bs
        last = (request.num_tokens - 1) // bs
        found = self._found
        found.clear()
        self.reserve = 0
        self._queried = max(last - first, 0)
        self._hit_blocks = 0
        if first >= last:
            return 0
        hashes, inputs = request.block_hashes, request.block_hash_inputs
        host, disk = self.host, self.disk
        room = budget - 1
        for i in range(first, min(last, len(hashes))):
            block_hash, hash_input = hashes[i], inputs[i]
            # Held busy now: the allocation that follows may evict device blocks into
            # the tier, and must not take these slots.
            # After a disk block, a host block counts in the reserve too: a failed read
            # reruns every block after it.
            if (
                host is not None
                and (not self.reserve or self.reserve + bs <= room)
                and (slot := host.find(block_hash, hash_input)) >= 0
            ):
                host.busy.add(slot)
                found.append((block_hash, slot, False, 0, i))
                if self.reserve:
                    self.reserve += bs
            elif (
                disk is not None
                and self.reserve + bs <= room
                and (slot := disk.find(block_hash, hash_input)) >= 0
            ):
                disk.busy.add(slot)
                found.append((block_hash, slot, True, 0, i))
                self.reserve += bs
            else:
                break
        self._hit_blocks = len(found)
        return len(found) * bs

    def lookup_groups(
        self, request: Request, num_hit_tokens: int, device: int, budget: int = 1 << 62
    ) -> tuple[int, int]:
        """lookup for several groups: (tokens restored past num_hit_tokens, of those the
        blocks full attention takes from the device) at the longest boundary every group
        restores from the device and the tier (kv_tier_groups.longest_boundary; device:
        the full-attention groups' cached device blocks in a row). A hybrid request's
        failed disk read is recomputed from its device boundary (worker/
        kv_tier_recompute.py), where its windows must hold real blocks: with any disk
        block, only the device hits count as the device, and all its restored tokens
        stay below budget and are reserved."""
        bs = self.block_size
        first = num_hit_tokens // bs
        hashes, inputs = request.block_hashes, request.block_hash_inputs
        last = min((request.num_tokens - 1) // bs, len(hashes))
        self._found.clear()
        self.reserve = self._hit_blocks = 0
        self._queried = max(last - first, 0)
        if first >= last:
            return 0, 0
        host, disk = self.host, self.disk

        def find(group: int, i: int) -> tuple[int, bool] | None:
            key = tier_key(hashes[i], group)
            if host is not None and (slot := host.find(key, inputs[i])) >= 0:
                return slot, False
            if disk is not None and (slot := disk.find(key, inputs[i])) >= 0:
                return slot, True
            return None

        b, loads = longest_boundary(first, last, self.windows, find, device)
        on_disk = any(d for *_, d in loads)
        if on_disk:
            room = (budget - 1) // bs
            b, loads = longest_boundary(first, min(last, first + room), self.windows, find)
            device = first
        if not loads:
            return 0, 0
        for group, i, slot, from_disk in loads:
            # Held busy now, as in lookup.
            (disk if from_disk else host).busy.add(slot)  # type: ignore[union-attr]
            self._found.append((tier_key(hashes[i], group), slot, from_disk, group, i))
        if on_disk:
            self.reserve = (b - first) * bs
        self._hit_blocks = b - first
        return (b - first) * bs, max(0, min(device, b) - first)

    def load_found(self, block_ids: Sequence[Sequence[int]], num_hit_tokens: int) -> None:
        """The request is admitted: load the last lookup's slots into its blocks after
        its device hits (block_ids: its whole table per group); they become the most
        recently used. Its lookup counts here, once, however often it waited for room."""
        for block_hash, slot, on_disk, group, i in self._found:
            # Still indexed: their slots were held busy since the lookup.
            if on_disk:
                assert self.disk is not None
                self._disk_load_slots.append(slot)
                self._disk_load_blocks.append(block_ids[group][i])
                self._disk_load_hashes.append(block_hash)
                self.disk.touch(block_hash)
                self.stats.disk_loaded += 1
            else:
                assert self.host is not None
                self._load_slots.append(slot)
                self._load_blocks.append(block_ids[group][i])
                self.host.touch(block_hash)
        self.stats.queries += self._queried
        self.stats.hits += self._hit_blocks
        self.stats.loaded += len(self._found)
        self._found = []
        self._queried = self._hit_blocks = 0

    def answered(self, output: TierOutput) -> None:
        """A worker's report: time in loads, and disk slots it could not verify (their
        blocks were recomputed; forgotten here, stored again when evicted again)."""
        self.stats.load_seconds += output.load_seconds
        failed = output.failed_disk_slots
        if failed and self.disk is not None:
            self.stats.failed += len(failed)
            self.disk.drop_slots(failed)

    # -- per step ---------------------------------------------------------------------
    def take_ops(self) -> KVTierOps | None:
        """This step's transfers for the SchedulerOutput (None: none)."""
        if self.host is not None:
            self.host.busy.clear()
        if self.disk is not None:
            self.disk.busy.clear()
        if not (
            self._store_blocks
            or self._load_blocks
            or self._disk_store_blocks
            or self._disk_load_blocks
        ):
            return None
        ops = KVTierOps(
            self._store_blocks,
            self._store_slots,
            self._load_slots,
            self._load_blocks,
            self._store_hashes,
            self._store_inputs,
            self._disk_store_blocks,
            self._disk_store_slots,
            self._disk_load_slots,
            self._disk_load_blocks,
            self._disk_load_hashes,
        )
        self._store_blocks, self._store_slots = [], []
        self._load_slots, self._load_blocks = [], []
        if self.disk is not None:
            self._store_hashes, self._store_inputs = [], []
            self._disk_store_blocks, self._disk_store_slots = [], []
            self._disk_load_slots, self._disk_load_blocks, self._disk_load_hashes = [], [], []
        return ops

    def check_invariants(self) -> None:
        """Debugging and tests: every slot of each level is free or indexed once."""
        for level in (self.host, self.disk):
            if level is not None:
                level.check_invariants()

    # -- two-phase loads and promotion (enginecore/kv_tier_loads.py) ----------------
    def take_found(self) -> list[tuple[bytes, int, bool, int, int]]:
        """The last lookup's (hash, slot, from disk) for a request admitted to load over
        later steps; its lookup counts here, once."""
        found = self._found
        self.stats.queries += self._queried
        self.stats.hits += self._hit_blocks
        for block_hash, _, on_disk, *_ in found:
            level = self.disk if on_disk else self.host
            assert level is not None
            level.touch(block_hash)
        self._found = []
        self._queried = self._hit_blocks = 0
        return found

    def queue_load(self, block_hash: bytes, slot: int, on_disk: bool, block_id: int) -> None:
        """Load slot into block_id with this step (the slot was held since the lookup)."""
        if on_disk:
            self._disk_load_slots.append(slot)
            self._disk_load_blocks.append(block_id)
            self._disk_load_hashes.append(block_hash)
            self.stats.disk_loaded += 1
        else:
            self._load_slots.append(slot)
            self._load_blocks.append(block_id)
        self.stats.loaded += 1

    def promote(self, block_id: int, block_hash: bytes) -> bool:
        """Copy a device block loaded from disk into host memory with this step, so the
        next hit is a host hit; whether a store was queued."""
        if self.host is None or self.disk is None:
            return False
        entry = self.disk.index.get(block_hash)
        if entry is None:
            return False  # its read failed (forgotten) or it left the disk level
        slot = self.host.offer(block_hash, entry[1])
        if slot < 0:
            return False
        self._store_blocks.append(block_id)
        self._store_slots.append(slot)
        if self.emit is not None:
            self._stored(block_hash, entry[1], self.medium)
        self.stats.promoted += 1
        return True
