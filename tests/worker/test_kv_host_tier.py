"""A rank's KV tier bytes: stores run before loads, a malformed frame moves nothing, and
the disk mirror reads back only whole, verified blocks of its own fingerprint."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from protocol.worker import KVTierOps
from worker.kv_disk_tier import DiskKVTier
from worker.kv_host_tier import HostKVTier


def _caches(num_blocks: int = 6) -> list[tuple[torch.Tensor, torch.Tensor]]:
    # Two layers of [num_blocks, block_size 2, heads 1, head_dim 3]; block b holds b.
    out = []
    for layer in range(2):
        k = torch.arange(num_blocks, dtype=torch.float32).view(-1, 1, 1, 1).repeat(1, 2, 1, 3)
        out.append((k + 100 * layer, -(k + 100 * layer)))
    return out


def test_a_block_evicted_and_reloaded_in_one_step_is_stored_first() -> None:
    caches = _caches()
    tier = HostKVTier(caches, num_slots=4)
    tier.apply(KVTierOps([2], [0], [], []))
    # Block 3 is stored into slot 1 while slot 0 (block 2's content) loads into it.
    tier.apply(KVTierOps([3], [1], [0], [3]))
    assert torch.equal(caches[1][0][3], caches[1][0][2])
    tier.apply(KVTierOps([], [], [1], [5]))
    assert float(caches[0][0][5].flatten()[0]) == 3.0  # slot 1 kept block 3's old content
    assert tier.stored_bytes == 2 * tier.block_bytes and tier.loaded_bytes == 2 * tier.block_bytes


@pytest.mark.parametrize(
    ("ops", "message"),
    [
        (KVTierOps([1], [4], [], []), "slot outside"),
        (KVTierOps([0], [1], [], []), "block outside"),
        (KVTierOps([], [], [0], [9]), "block outside"),
        (KVTierOps([1, 2], [1], [], []), "2 blocks but 1 slots"),
        (KVTierOps([1, 2], [3, 3], [], []), "a slot twice"),
    ],
)
def test_a_malformed_frame_is_refused_before_any_byte_moves(ops: KVTierOps, message: str) -> None:
    caches = _caches()
    before = [k.clone() for k, _ in caches]
    tier = HostKVTier(caches, num_slots=4)
    with pytest.raises(ValueError, match=message):
        tier.apply(ops)
    assert all(torch.equal(k, b) for (k, _), b in zip(caches, before))


def test_the_disk_reads_back_only_its_own_whole_blocks(tmp_path: Path) -> None:
    disk = DiskKVTier(str(tmp_path), 0, b"f" * 32, num_slots=4, block_bytes=8)
    for slot in range(4):
        disk.write(slot, bytes([slot]) * 16, b"input%d" % slot, bytes([slot]) * 8)
    disk.close()
    files = tmp_path / "rank0"
    data = bytearray((files / "slot1.kv").read_bytes())
    data[-1] ^= 1
    (files / "slot1.kv").write_bytes(bytes(data))
    (files / "slot2.kv").write_bytes(data[:10])
    got: dict[int, bytes] = {}
    restored = DiskKVTier(str(tmp_path), 0, b"f" * 32, 4, 8).restore(
        lambda slot, data: got.__setitem__(slot, bytes(data))
    )
    assert [(s, h[0], i) for s, h, i in restored] == [(0, 0, b"input0"), (3, 3, b"input3")]
    assert got == {0: bytes(8), 3: bytes([3]) * 8}
    assert DiskKVTier(str(tmp_path), 0, b"g" * 32, 4, 8).restore(lambda s, d: None) == []
