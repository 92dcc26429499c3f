"""A rank's KV tier bytes: stores run before loads, a malformed frame moves nothing, and
the disk mirror reads back only whole, verified blocks of its own fingerprint."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from protocol.engine import SamplingParams
from protocol.worker import CachedRequestData, KVTierOps, NewRequestData, SchedulerOutput
from worker.kv_disk_tier import DiskKVTier
from worker.kv_host_tier import HostKVTier
from worker.kv_tier_recompute import recompute_failed


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


def test_the_disk_indexes_whole_files_and_verifies_each_block_as_it_reads_it(
    tmp_path: Path,
) -> None:
    disk = DiskKVTier(str(tmp_path), 0, b"f" * 32, num_slots=4, block_bytes=8)
    for slot in range(4):
        disk.write(slot, bytes([slot]) * 16, b"input%d" % slot, memoryview(bytes([slot]) * 8))
    disk.close()
    files = tmp_path / "rank0"
    data = bytearray((files / "slot1.kv").read_bytes())
    data[-1] ^= 1
    (files / "slot1.kv").write_bytes(bytes(data))
    (files / "slot2.kv").write_bytes(data[:10])
    again = DiskKVTier(str(tmp_path), 0, b"f" * 32, 4, 8)
    # Start-up reads headers only: the truncated file is out, the flipped byte not yet.
    restored = again.restore()
    assert [(s, h[0], i) for s, h, i in restored] == [
        (0, 0, b"input0"),
        (1, 1, b"input1"),
        (3, 3, b"input3"),
    ]
    out = bytearray(8)
    assert again.read_into(0, bytes(16), memoryview(out)) and out == bytes(8)
    assert not again.read_into(1, bytes([1]) * 16, memoryview(out))  # its checksum
    assert not again.read_into(3, bytes([2]) * 16, memoryview(out))  # another block
    assert again.read_into(3, bytes([3]) * 16, memoryview(out)) and out == bytes([3]) * 8
    # Another fingerprint: nothing of this deployment.
    assert DiskKVTier(str(tmp_path), 0, b"g" * 32, 4, 8).restore() == []


def test_a_disk_only_tier_stores_device_blocks_and_loads_them_back_verified(
    tmp_path: Path,
) -> None:
    caches = _caches()
    tier = HostKVTier(caches, num_slots=0)
    tier.disk = DiskKVTier(str(tmp_path), 0, b"f" * 32, num_slots=3, block_bytes=tier.block_bytes)
    hashes = [bytes([b]) * 16 for b in range(6)]

    def store(block: int, slot: int) -> KVTierOps:
        return KVTierOps([], [], [], [], [hashes[block]], [b"in"], [block], [slot])

    def load(slot: int, block: int, h: bytes) -> KVTierOps:
        return KVTierOps(
            [],
            [],
            [],
            [],
            disk_load_slots=[slot],
            disk_load_block_ids=[block],
            disk_load_hashes=[h],
        )

    assert tier.apply(store(2, 0)) == set()
    # Loaded in the next step, before or after its file is written: the same bytes.
    assert tier.apply(load(0, 4, hashes[2])) == set()
    assert torch.equal(caches[1][1][4], caches[1][1][2])
    tier.apply(store(3, 1))
    tier.disk.flush()
    assert tier.apply(load(1, 5, hashes[3])) == set()
    assert float(caches[0][0][5].flatten()[0]) == 3.0
    # A byte flipped in the file while serving: that load fails, the block is untouched.
    path = tmp_path / "rank0" / "slot1.kv"
    data = bytearray(path.read_bytes())
    data[-3] ^= 0x40
    path.write_bytes(bytes(data))
    before = caches[0][0][1].clone()
    assert tier.apply(load(1, 1, hashes[3])) == {1}
    assert torch.equal(caches[0][0][1], before) and tier.failed_disk_slots == [1]
    # Read in chunks of one block: the good one lands, the damaged one is reported.
    tier._chunk_blocks = 1
    ops = KVTierOps(
        [],
        [],
        [],
        [],
        disk_load_slots=[1, 0],
        disk_load_block_ids=[1, 3],
        disk_load_hashes=[hashes[3], hashes[2]],
    )
    assert tier.apply(ops) == {1}
    assert torch.equal(caches[1][1][3], caches[1][1][2])
    tier.close()


def test_a_step_with_a_failed_load_recomputes_its_request_from_that_block() -> None:
    new = NewRequestData("a", list(range(20)), SamplingParams(), [[7, 8, 9, 10, 11]], 12)
    other = NewRequestData("b", list(range(9)), SamplingParams(), [[1, 2, 3]], 8)
    so = SchedulerOutput(3, [new, other], CachedRequestData([], [], [], [], []), [8, 1], 9, [], [])
    # Block 9 (tokens 8..11) failed; blocks 7 and 8 were device hits or good loads.
    out = recompute_failed(so, {9}, 4)
    assert [r.num_computed_tokens for r in out.new_reqs] == [8, 8]
    assert out.num_scheduled_tokens == [12, 1] and out.total_num_scheduled_tokens == 13


def test_scattered_blocks_and_slots_move_to_the_right_places() -> None:
    # Stretches and strays: blocks 1, 2 and 4 into slots 0, 1 and 3, back into 5, 3, 1.
    caches = _caches(num_blocks=8)
    original = [k.clone() for k, _ in caches]
    tier = HostKVTier(caches, num_slots=4)
    tier.apply(KVTierOps([1, 2, 4], [0, 1, 3], [], []))
    tier.apply(KVTierOps([], [], [3, 0, 1], [5, 3, 1]))
    for (key, _), before in zip(caches, original):
        assert [float(key[b].flatten()[0]) for b in (5, 3, 1)] == [
            float(before[b].flatten()[0]) for b in (4, 1, 2)
        ]
