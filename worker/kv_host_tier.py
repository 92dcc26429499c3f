"""HostKVTier: a rank's share of the second KV tier, its host-memory and disk levels.

The core decides every transfer (enginecore/kv_tier.py); this only moves bytes, before
the step's forward: stores (device block -> host slot, device block -> disk queue),
then loads (host slot -> device block, disk file -> device block). A disk load that
cannot be read or verified is reported, and the step recomputes that block
(worker/kv_tier_recompute.py).
"""

from __future__ import annotations

import time

import msgspec
import torch

from protocol.config import WorkerConfig
from protocol.kv_cache import FullAttentionSpec
from protocol.worker import (
    KVTierOps,
    ModelRunnerOutput,
    RestoredBlock,
    SchedulerOutput,
    TierOutput,
    TierStep,
    WorkerConfigure,
)
from worker.kv_disk_tier import DiskKVTier, fingerprint
from worker.kv_tier_recompute import recompute_failed, recompute_failed_groups
from worker.parallel import TPContext

KVCaches = list[tuple[torch.Tensor, torch.Tensor]]
STAGING_BYTES = 64 << 20  # the disk load buffer's bound; reused from step to step


class HostKVTier:
    def __init__(self, kv_caches: KVCaches, num_slots: int, tp: TPContext | None = None) -> None:
        if num_slots < 0:
            raise ValueError(f"a KV tier's host level needs >= 0 slots, got {num_slots}")
        self.num_slots = num_slots
        self.num_blocks = kv_caches[0][0].shape[0]
        self.block_size = kv_caches[0][0].shape[1]
        self._device_caches = kv_caches
        self.tp = tp or TPContext()
        pin = kv_caches[0][0].device.type == "cuda"
        # Per layer [2, num_slots, block_size, heads, head_dim]: K then V, like the device.
        # torch.empty leaves the pages untouched: memory is taken as slots fill.
        self._host = [
            torch.empty((2, num_slots, *k.shape[1:]), dtype=k.dtype, pin_memory=pin)
            for k, _ in kv_caches
            if num_slots
        ]
        self.stored_bytes = self.loaded_bytes = 0
        # A block's bytes, layer after layer, K then V: a disk file's payload.
        self.layer_bytes = [2 * k[0].numel() * k.element_size() for k, _ in kv_caches]
        self.block_bytes = sum(self.layer_bytes)
        self.disk: DiskKVTier | None = None
        # Disk loads stage at most this many blocks at once (about 64 MiB).
        self._staging = torch.empty((0, self.block_bytes), dtype=torch.uint8)
        self._chunk_blocks = max(1, STAGING_BYTES // max(self.block_bytes, 1))
        # Reported with the next answer (TierOutput), then reset.
        self.load_seconds = 0.0
        self.failed_disk_slots: list[int] = []
        # Several KV cache groups: per group None for full attention, else its sliding
        # window in tokens (recompute_failed_groups); None: one full-attention group.
        self.windows: list[int | None] | None = None

    def close(self) -> None:
        if self.disk is not None:
            self.disk.close()

    def run_step(self, so: TierStep) -> SchedulerOutput:
        """Run the step's transfers; the step to plan (the same, unless a disk load
        failed: then its requests recompute from that block)."""
        failed = self.apply(so.kv_tier)
        if not failed:
            return so
        if self.windows is not None:
            ops = so.kv_tier
            loaded = {*ops.load_block_ids, *ops.disk_load_block_ids}
            return recompute_failed_groups(so, failed, loaded, self.block_size, self.windows)
        return recompute_failed(so, failed, self.block_size)

    def answer(self, out: ModelRunnerOutput) -> ModelRunnerOutput:
        """out, with the loads' report since the last answer when there is one."""
        if not self.load_seconds and not self.failed_disk_slots:
            return out
        tagged = TierOutput(
            *msgspec.structs.astuple(out), self.load_seconds, self.failed_disk_slots
        )
        self.load_seconds, self.failed_disk_slots = 0.0, []
        return tagged

    def apply(self, ops: KVTierOps) -> set[int]:
        """Run a step's transfers, stores first (a store's block may be a load's target);
        the device blocks whose disk load failed."""
        self._check(ops)
        if ops.store_block_ids:
            self._move(ops.store_block_ids, ops.store_slots, to_host=True)
            self.stored_bytes += len(ops.store_slots) * self.block_bytes
        if ops.disk_store_block_ids:
            self._write_disk(ops)
        if not (ops.load_block_ids or ops.disk_load_block_ids):
            return set()
        start = time.perf_counter()
        if ops.load_block_ids:
            self._move(ops.load_block_ids, ops.load_slots, to_host=False)
            self.loaded_bytes += len(ops.load_slots) * self.block_bytes
        failed = self._read_disk(ops) if ops.disk_load_block_ids else set()
        self.load_seconds += time.perf_counter() - start
        return failed

    @torch.inference_mode()
    def _move(self, block_ids: list[int], slot_ids: list[int], to_host: bool) -> None:
        device = self._device_caches[0][0].device
        if device.type == "cpu":
            runs = _runs(slot_ids, block_ids) if to_host else _runs(block_ids, slot_ids)
            for (key, value), host in zip(self._device_caches, self._host, strict=True):
                for i, cache in enumerate((key, value)):
                    _copy_runs(host[i], cache, runs) if to_host else _copy_runs(
                        cache, host[i], runs
                    )
            return
        blocks = torch.tensor(block_ids, dtype=torch.int64, device=device)
        slots = torch.tensor(slot_ids, dtype=torch.int64)
        for (key, value), host in zip(self._device_caches, self._host, strict=True):
            for i, cache in enumerate((key, value)):
                if to_host:
                    host[i].index_copy_(0, slots, cache.index_select(0, blocks).cpu())
                else:
                    cache.index_copy_(0, blocks, host[i].index_select(0, slots).to(device))

    def _rows(self, staging: torch.Tensor) -> list[torch.Tensor]:
        """Per layer, staging's bytes as [n, 2, block_size, heads, head_dim] of its dtype."""
        out, offset = [], 0
        for (key, _), size in zip(self._device_caches, self.layer_bytes):
            part = staging[:, offset : offset + size].view(key.dtype)
            out.append(part.view(staging.shape[0], 2, *key.shape[1:]))
            offset += size
        return out

    @torch.inference_mode()
    def _write_disk(self, ops: KVTierOps) -> None:
        """Copy the evicted blocks off the device (one gather per layer) and queue them
        for the writer thread; the step goes on."""
        disk = self.disk
        if disk is None or not disk.enabled:
            return
        n = len(ops.disk_store_block_ids)
        device = self._device_caches[0][0].device
        staging = torch.empty((n, self.block_bytes), dtype=torch.uint8)
        if device.type == "cpu":
            runs = _runs(list(range(n)), ops.disk_store_block_ids)
            for (key, value), rows in zip(self._device_caches, self._rows(staging)):
                _copy_runs(rows[:, 0], key, runs)
                _copy_runs(rows[:, 1], value, runs)
        else:
            blocks = torch.tensor(ops.disk_store_block_ids, dtype=torch.int64, device=device)
            for (key, value), rows in zip(self._device_caches, self._rows(staging)):
                rows[:, 0].copy_(key.index_select(0, blocks))
                rows[:, 1].copy_(value.index_select(0, blocks))
        data = staging.numpy()
        for j, (slot, h, hash_input) in enumerate(
            zip(ops.disk_store_slots, ops.store_hashes, ops.store_inputs, strict=True)
        ):
            disk.write(slot, h, hash_input, memoryview(data[j]))

    def _read_disk(self, ops: KVTierOps) -> set[int]:
        """Load the disk slots in chunks of a bounded staging buffer; the device blocks
        whose read failed on any rank."""
        failed: set[int] = set()
        step = self._chunk_blocks
        for i in range(0, len(ops.disk_load_slots), step):
            j = i + step
            failed |= self._read_chunk(
                ops.disk_load_slots[i:j], ops.disk_load_hashes[i:j], ops.disk_load_block_ids[i:j]
            )
        return failed

    @torch.inference_mode()
    def _read_chunk(self, slots: list[int], hashes: list[bytes], block_ids: list[int]) -> set[int]:
        """Read each slot into a staging row, verified, then one scatter per layer; a
        block that fails on any rank fails on all (the ranks must run the same step)."""
        n = len(slots)
        if self._staging.shape[0] < n:
            self._staging = torch.empty((n, self.block_bytes), dtype=torch.uint8)
        staging = self._staging[:n]
        data = staging.numpy()
        disk = self.disk
        views = [memoryview(data[j]) for j in range(n)]
        read = disk.read_many(slots, hashes, views) if disk is not None else [False] * n
        bad = torch.tensor([0 if r else 1 for r in read], dtype=torch.int32)
        self.tp.all_reduce(bad)
        flags = bad.tolist()
        good = [j for j, b in enumerate(flags) if not b]
        device = self._device_caches[0][0].device
        if device.type == "cpu":
            runs = _runs([block_ids[j] for j in good], good)
            for (key, value), rows in zip(self._device_caches, self._rows(staging)):
                _copy_runs(key, rows[:, 0], runs)
                _copy_runs(value, rows[:, 1], runs)
        else:
            ok = torch.tensor(good, dtype=torch.int64)
            blocks = torch.tensor([block_ids[j] for j in good], dtype=torch.int64, device=device)
            for (key, value), rows in zip(self._device_caches, self._rows(staging)):
                key.index_copy_(0, blocks, rows[ok, 0].to(device))
                value.index_copy_(0, blocks, rows[ok, 1].to(device))
        self.loaded_bytes += len(good) * self.block_bytes
        failed = [j for j, b in enumerate(flags) if b]
        self.failed_disk_slots += [slots[j] for j in failed]
        return {block_ids[j] for j in failed}

    def _check(self, ops: KVTierOps) -> None:
        """A malformed frame fails the step with its reason, before any byte moves."""
        disk_slots = self.disk.num_slots if self.disk is not None else 0
        for name, blocks, slots, num_slots in (
            ("store", ops.store_block_ids, ops.store_slots, self.num_slots),
            ("load", ops.load_block_ids, ops.load_slots, self.num_slots),
            ("disk store", ops.disk_store_block_ids, ops.disk_store_slots, disk_slots),
            ("disk load", ops.disk_load_block_ids, ops.disk_load_slots, disk_slots),
        ):
            if len(blocks) != len(slots):
                raise ValueError(f"KV tier {name}s: {len(blocks)} blocks but {len(slots)} slots")
            if blocks and not (min(blocks) > 0 and max(blocks) < self.num_blocks):
                raise ValueError(f"KV tier {name}s name a block outside 1..{self.num_blocks - 1}")
            if slots and not (min(slots) >= 0 and max(slots) < num_slots):
                raise ValueError(f"KV tier {name}s name a slot outside 0..{num_slots - 1}")
        for name, slots in (("stores", ops.store_slots), ("disk stores", ops.disk_store_slots)):
            if len(set(slots)) != len(slots):
                raise ValueError(f"KV tier {name} name a slot twice in one step")
        n = len(ops.disk_store_slots)
        if len(ops.store_hashes) != n or len(ops.store_inputs) != n:
            raise ValueError("KV tier disk stores: hashes and inputs do not match the slots")
        if len(ops.disk_load_hashes) != len(ops.disk_load_slots):
            raise ValueError("KV tier disk loads: hashes do not match the slots")


def make_kv_tier(
    msg: WorkerConfigure, kv_caches: KVCaches, config: WorkerConfig, tp: TPContext
) -> tuple[HostKVTier | None, list[RestoredBlock]]:
    """The rank's tier as WorkerConfigure asks (None: no tier), and what its disk level
    holds from earlier runs."""
    if not msg.kv_tier_slots and msg.kv_tier_dir is None:
        return None, []
    buffers = shared_buffers(kv_caches)
    tier = HostKVTier(buffers, msg.kv_tier_slots, tp)
    groups = msg.kv_cache_config.kv_cache_groups
    hybrid = len(groups) > 1 or not isinstance(groups[0].kv_cache_spec, FullAttentionSpec)
    if hybrid:
        tier.windows = [
            None if isinstance(spec, FullAttentionSpec) else spec.sliding_window
            for spec in (g.kv_cache_spec for g in groups)
        ]
    if msg.kv_tier_dir is None:
        return tier, []
    # A block's shape, not the pool's: a restart with another pool size keeps its blocks.
    layout: list[object] = [(tuple(k.shape[1:]), str(k.dtype)) for k, _ in buffers]
    if hybrid:  # which layers a slot's bytes are, in which group (one group: as before)
        layout.append([(g.layer_names, g.kv_cache_spec) for g in groups])
    fp = fingerprint(
        config.model, layout, config.rank, config.world_size, msg.kv_tier_key, tier.block_bytes
    )
    if msg.kv_tier_dir_slots < 1:
        raise ValueError("a KV tier directory needs kv_tier_dir_slots >= 1")
    disk = DiskKVTier(msg.kv_tier_dir, config.rank, fp, msg.kv_tier_dir_slots, tier.block_bytes)
    tier.disk = disk
    return tier, [RestoredBlock(*entry) for entry in disk.restore()]


def shared_buffers(kv_caches: KVCaches) -> KVCaches:
    """The distinct buffers behind the layers' caches, in layer order. Layers of several
    KV cache groups share them (buffer k serves layer k of each group) and a block id
    belongs to one group at a time, so block B of every buffer is exactly its group's
    layers: a tier slot holds one group's layers, whatever the group. One group: one
    buffer per layer, as before."""
    seen: set[int] = set()
    out: KVCaches = []
    for key, value in kv_caches:
        if key.data_ptr() not in seen:
            seen.add(key.data_ptr())
            out.append((key, value))
    return out


def _runs(dst: list[int], src: list[int]) -> list[tuple[int, int, int]]:
    """(dst start, src start, length) of each stretch where both indices go up by one:
    on the CPU a slice copy per stretch is a memcpy, several times faster than
    index_copy_, and a tier's slots and blocks mostly come in stretches."""
    runs: list[tuple[int, int, int]] = []
    i, n = 0, len(dst)
    while i < n:
        j = i + 1
        while j < n and dst[j] == dst[j - 1] + 1 and src[j] == src[j - 1] + 1:
            j += 1
        runs.append((dst[i], src[i], j - i))
        i = j
    return runs


def _copy_runs(dst: torch.Tensor, src: torch.Tensor, runs: list[tuple[int, int, int]]) -> None:
    for d, s, n in runs:
        dst[d : d + n].copy_(src[s : s + n])
