"""A rank's KV tier bytes: stores run before loads, a malformed frame moves nothing, and
the disk mirror reads back only whole, verified blocks of its own fingerprint."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from protocol.engine import SamplingParams
from protocol.worker import CachedRequestData, KVTierOps, NewRequestData, SchedulerOutput
from worker.kv_disk_tier import DiskKVTier
from worker.kv_host_tier import HostKVTier, shared_buffers
from worker.kv_tier_recompute import recompute_failed, recompute_failed_groups


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


def test_a_request_holding_another_s_failed_load_as_a_hit_does_not_rerun_it() -> None:
    # "a" loaded blocks 9 and 10 and is admitted first; "b" found them as device hits.
    # Only "a" reruns them (from block 9): its rerun writes them in this step, and "b"
    # reads them after; rerunning "b" too would exceed the budget the core kept.
    a = NewRequestData("a", list(range(13)), SamplingParams(), [[7, 8, 9, 10]], 12)
    b = NewRequestData("b", list(range(14)), SamplingParams(), [[7, 8, 9, 10]], 13)
    so = SchedulerOutput(3, [a, b], CachedRequestData([], [], [], [], []), [1, 1], 2, [], [])
    out = recompute_failed(so, {9, 10}, 4)
    assert [r.num_computed_tokens for r in out.new_reqs] == [8, 13]
    assert out.total_num_scheduled_tokens == 6


def test_a_hybrid_request_reruns_from_its_device_boundary_where_its_windows_are_real() -> None:
    # Groups: a 6-token window (2 blocks of 4 before a boundary), full attention. "a"
    # had 2 device blocks and loaded 3 (full: 9, 10, 11; window: 21, 22 before its
    # boundary, 20 a real pad), and reruns from token 8 when any of them fails. "b" hit
    # a's blocks (never its pad) and holds null blocks before its window: it reruns nothing.
    windows = [6, None]
    a = NewRequestData(
        "a", list(range(21)), SamplingParams(), [[5, 6, 20, 21, 22], [7, 8, 9, 10, 11]], 20
    )
    b = NewRequestData(
        "b", list(range(21)), SamplingParams(), [[0, 0, 0, 21, 22], [7, 8, 9, 10, 11]], 20
    )
    so = SchedulerOutput(3, [a, b], CachedRequestData([], [], [], [], []), [1, 1], 2, [], [])
    loaded = {9, 10, 11, 21, 22}
    out = recompute_failed_groups(so, {22}, loaded, 4, windows)
    assert [r.num_computed_tokens for r in out.new_reqs] == [8, 20]
    assert out.num_scheduled_tokens == [13, 1]
    # No failed block among its tables: nothing changes.
    out = recompute_failed_groups(so, {99}, loaded, 4, windows)
    assert out.total_num_scheduled_tokens == 2


def test_groups_sharing_buffers_give_one_slot_buffer_per_shared_buffer() -> None:
    # Three groups of two layers on two buffers (buffer k serves layer k of each
    # group), as the core plans them: a slot is one block of each buffer.
    buffers = [torch.zeros(2, 6, 2, 1, 3) for _ in range(2)]
    layers = [(buffers[k][0], buffers[k][1]) for _ in range(3) for k in range(2)]
    shared = shared_buffers(layers)
    assert len(shared) == 2
    assert [k.data_ptr() for k, _ in shared] == [b[0].data_ptr() for b in buffers]
    tier = HostKVTier(shared, num_slots=2)
    assert tier.block_bytes == 2 * 2 * 2 * 3 * 4
    buffers[1][0][3].fill_(5.0)
    tier.apply(KVTierOps([3], [0], [0], [4]))
    assert float(buffers[1][0][4].flatten()[0]) == 5.0
