"""HostKVTier: a rank's share of the second KV tier, slots of KV blocks in host memory.

The core decides every transfer (enginecore/kv_tier.py); this only moves bytes: a step's
stores (device block -> slot) run before its loads (slot -> device block), and both
before its forward.
"""

from __future__ import annotations

import torch

from protocol.config import WorkerConfig
from protocol.worker import KVTierOps, RestoredBlock, WorkerConfigure
from worker.kv_disk_tier import DiskKVTier, fingerprint


class HostKVTier:
    def __init__(self, kv_caches: list[tuple[torch.Tensor, torch.Tensor]], num_slots: int) -> None:
        if num_slots < 1:
            raise ValueError(f"a KV tier needs at least one slot, got {num_slots}")
        self.num_slots = num_slots
        self.num_blocks = kv_caches[0][0].shape[0]
        self._device_caches = kv_caches
        pin = kv_caches[0][0].device.type == "cuda"
        # Per layer [2, num_slots, block_size, heads, head_dim]: K then V, like the device.
        # torch.empty leaves the pages untouched: memory is taken as slots fill.
        self._host = [
            torch.empty((2, num_slots, *k.shape[1:]), dtype=k.dtype, pin_memory=pin)
            for k, _ in kv_caches
        ]
        self.stored_bytes = self.loaded_bytes = 0
        self.block_bytes = sum(2 * k[0].numel() * k.element_size() for k, _ in kv_caches)
        self.disk: DiskKVTier | None = None

    def persist(self, disk: DiskKVTier) -> list[tuple[int, bytes, bytes]]:
        """Mirror every store to disk, after reading back what it holds: (slot, hash,
        hash input) of each slot restored."""
        self.disk = disk
        return disk.restore(self._put)

    def close(self) -> None:
        if self.disk is not None:
            self.disk.close()

    def _put(self, slot: int, payload: memoryview) -> None:
        data = torch.frombuffer(payload, dtype=torch.uint8)
        offset = 0
        for host in self._host:
            view = host[:, slot]
            n = view.numel() * view.element_size()
            view.copy_(data[offset : offset + n].view(host.dtype).view(view.shape))
            offset += n

    def _payload(self, slot: int) -> bytes:
        return b"".join(host[:, slot].contiguous().numpy().tobytes() for host in self._host)

    def apply(self, ops: KVTierOps) -> None:
        """Run a step's transfers: stores first (a store's block may be a load's target)."""
        self._check(ops)
        if ops.store_block_ids:
            self._move(ops.store_block_ids, ops.store_slots, to_host=True)
            self.stored_bytes += len(ops.store_slots) * self.block_bytes
            disk = self.disk
            if disk is not None and disk.enabled:
                for slot, h, hash_input in zip(ops.store_slots, ops.store_hashes, ops.store_inputs):
                    disk.write(slot, h, hash_input, self._payload(slot))
        if ops.load_block_ids:
            self._move(ops.load_block_ids, ops.load_slots, to_host=False)
            self.loaded_bytes += len(ops.load_slots) * self.block_bytes

    @torch.inference_mode()
    def _move(self, block_ids: list[int], slot_ids: list[int], to_host: bool) -> None:
        device = self._device_caches[0][0].device
        blocks = torch.tensor(block_ids, dtype=torch.int64, device=device)
        slots = torch.tensor(slot_ids, dtype=torch.int64)
        for (key, value), host in zip(self._device_caches, self._host, strict=True):
            for i, cache in enumerate((key, value)):
                if to_host:
                    host[i].index_copy_(0, slots, cache.index_select(0, blocks).cpu())
                else:
                    cache.index_copy_(0, blocks, host[i].index_select(0, slots).to(device))

    def _check(self, ops: KVTierOps) -> None:
        """A malformed frame fails the step with its reason, before any byte moves."""
        for name, blocks, slots in (
            ("store", ops.store_block_ids, ops.store_slots),
            ("load", ops.load_block_ids, ops.load_slots),
        ):
            if len(blocks) != len(slots):
                raise ValueError(f"KV tier {name}s: {len(blocks)} blocks but {len(slots)} slots")
            if blocks and not (min(blocks) > 0 and max(blocks) < self.num_blocks):
                raise ValueError(f"KV tier {name}s name a block outside 1..{self.num_blocks - 1}")
            if slots and not (min(slots) >= 0 and max(slots) < self.num_slots):
                raise ValueError(f"KV tier {name}s name a slot outside 0..{self.num_slots - 1}")
        if len(set(ops.store_slots)) != len(ops.store_slots):
            raise ValueError("KV tier stores name a slot twice in one step")


def make_kv_tier(
    msg: WorkerConfigure,
    kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
    config: WorkerConfig,
) -> tuple[HostKVTier | None, list[RestoredBlock]]:
    """The rank's tier as WorkerConfigure asks (None: no tier), and what its disk tier
    restored."""
    if not msg.kv_tier_slots:
        return None, []
    tier = HostKVTier(kv_caches, msg.kv_tier_slots)
    if msg.kv_tier_dir is None:
        return tier, []
    layout = [(tuple(k.shape), str(k.dtype)) for k, _ in kv_caches]
    fp = fingerprint(
        config.model, layout, config.rank, config.world_size, msg.kv_tier_key, tier.block_bytes
    )
    slots = msg.kv_tier_dir_slots or msg.kv_tier_slots
    disk = DiskKVTier(msg.kv_tier_dir, config.rank, fp, slots, tier.block_bytes)
    return tier, [RestoredBlock(*entry) for entry in tier.persist(disk)]
