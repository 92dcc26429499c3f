"""The core's KV tier index (enginecore/kv_tier.py) under the real Scheduler, against a
simulated worker that runs every step's stores, loads and token writes on labelled
slots: whatever the pool size, tier size, sharing and chunking, every position a step
reads holds the KV of exactly the request's tokens, and no referenced block is lost."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from enginecore.errors import ConfigError
from enginecore.kv_cache_block import KVCacheBlock
from enginecore.kv_cache_config import with_num_blocks
from enginecore.kv_tier import KVTier
from enginecore.request import Request
from enginecore.scheduler import Scheduler
from protocol.engine import SamplingParams
from protocol.kv_cache import FullAttentionSpec, KVCacheGroupSpec
from protocol.kv_events import BlockRemoved, BlockStored
from protocol.worker import (
    ModelRunnerOutput,
    SchedulerOutput,
    TierOutput,
    TierStep,
    is_answered,
)
from tests.helpers.kv_helpers import SCHEDULER_VOCAB, full, sched_config, window
from worker.kv_tier_recompute import recompute_failed, recompute_failed_groups

BS = 4
PREFIXES = [[10 + p * 7 + i for i in range(12)] for p in range(3)]  # 3 blocks each
DOC_A, DOC_B = PREFIXES[0] + [1, 2, 3, 4], PREFIXES[1] + PREFIXES[2]

# The KV of one position: the tokens up to and including it.
Label = tuple[int, ...]


# Hybrid layouts (tier_scheduler's windows): a window per group, None for full attention.
FULL_ONLY: tuple[int | None, ...] = (None,)
INTERLEAVED = (6, None)  # Qwen2's interleaved sliding window
FIVE_TO_ONE = (6, 6, 6, 6, 6, None)  # Gemma 3's 5:1 mix, a group per layer


def tier_scheduler(
    num_blocks: int,
    slots: int,
    chunk: int = 64,
    events: bool = False,
    disk: int = 0,
    windows: tuple[int | None, ...] = FULL_ONLY,
) -> Scheduler:
    groups = [
        KVCacheGroupSpec([f"l{i}"], full(BS) if w is None else window(w, BS))
        for i, w in enumerate(windows)
    ]
    config = sched_config(
        48, max_num_batched_tokens=chunk, max_num_seqs=4, enable_prefix_caching=True
    )
    tier = {"kv_tier_slots": slots, "kv_tier_disk_slots": disk, "enable_kv_events": events}
    config = type(config)(**{**config.__dict__, **tier})
    return Scheduler(config, with_num_blocks(groups, num_blocks), SCHEDULER_VOCAB)


class SimWorker:
    """Block contents as labels; stores, loads and writes exactly as a worker runs them."""

    def __init__(self, fail_every: int = 0, windows: tuple[int | None, ...] = FULL_ONLY) -> None:
        self.device: dict[int, list[Label | None]] = {}
        self.tier: dict[int, list[Label | None]] = {}
        self.disk: dict[int, list[Label | None]] = {}
        self.tables: dict[str, list[list[int]]] = {}  # per group
        self.windows = windows
        self.loaded = 0
        self.fail_every = fail_every  # every n-th disk read fails (a damaged file)
        self.disk_reads = 0

    def run(self, so: SchedulerOutput, sched: Scheduler) -> list[int]:
        """Run the step; the disk slots it could not read (the answer reports them)."""
        failed_slots: list[int] = []
        if isinstance(so, TierStep):
            ops = so.kv_tier
            for block, slot in zip(ops.store_block_ids, ops.store_slots):
                self.tier[slot] = list(self.device.get(block, [None] * BS))
            for block, slot in zip(ops.disk_store_block_ids, ops.disk_store_slots):
                self.disk[slot] = list(self.device.get(block, [None] * BS))
            for slot, block in zip(ops.load_slots, ops.load_block_ids):
                self.device[block] = list(self.tier[slot])
                self.loaded += 1
            failed, failed_slots = set(), []
            for slot, block in zip(ops.disk_load_slots, ops.disk_load_block_ids):
                self.disk_reads += 1
                if self.fail_every and self.disk_reads % self.fail_every == 0:
                    failed.add(block)
                    failed_slots.append(slot)
                    self.device[block] = [None] * BS
                else:
                    self.device[block] = list(self.disk[slot])
                    self.loaded += 1
            if failed and self.windows != FULL_ONLY:  # from the device boundary
                loaded = {*ops.load_block_ids, *ops.disk_load_block_ids}
                so = recompute_failed_groups(so, failed, loaded, BS, self.windows)
            elif failed:  # as the worker does: its requests recompute from that block
                so = recompute_failed(so, failed, BS)
            assert so.total_num_scheduled_tokens <= sched.config.max_num_batched_tokens
        for rid in [*so.finished_req_ids, *so.preempted_req_ids]:
            self.tables.pop(rid, None)
        for new in so.new_reqs:
            self.tables[new.req_id] = [list(t) for t in new.block_ids]
        cached = so.cached_reqs
        for rid, ids, resumed in zip(cached.req_ids, cached.new_block_ids, cached.resumed):
            if resumed:
                self.tables[rid] = [list(t) for t in ids]  # type: ignore[union-attr]
            elif ids is not None:
                for table, more in zip(self.tables[rid], ids):
                    table.extend(more)
        starts = [n.num_computed_tokens for n in so.new_reqs] + list(cached.num_computed_tokens)
        rids = [n.req_id for n in so.new_reqs] + list(cached.req_ids)
        steps = list(zip(rids, starts, so.num_scheduled_tokens))
        # Each layer writes the step's new KV before attention reads: a request may read
        # positions another request of the same step writes. Block 0 is the null block:
        # never written, never read.
        for rid, start, count in steps:
            tokens = sched.requests[rid].all_token_ids
            for table in self.tables[rid]:
                for p in range(start, start + count):
                    assert table[p // BS] != 0, f"{rid} writes the null block at {p}"
                    block = self.device.setdefault(table[p // BS], [None] * BS)
                    block[p % BS] = tuple(tokens[: p + 1])
        for rid, start, count in steps:
            tokens = sched.requests[rid].all_token_ids
            for table, w in zip(self.tables[rid], self.windows):
                lo = 0 if w is None else max(0, start - w + 1)
                for p in range(lo, start + count):  # what attention reads
                    assert table[p // BS] != 0, f"{rid} reads the null block at {p}"
                    got = self.device.get(table[p // BS], [None] * BS)[p % BS]
                    assert got == tuple(tokens[: p + 1]), f"{rid} reads wrong KV at {p}"
        return failed_slots


def drive(sched: Scheduler, worker: SimWorker, prompts: list[tuple[list[int], int]]) -> None:
    """Add the (prompt, max_tokens) requests and run every step to the end on worker."""
    params = [SamplingParams(max_tokens=m, ignore_eos=True, temperature=0) for _, m in prompts]
    for i, ((prompt, _), p) in enumerate(zip(prompts, params)):
        sched.add_request(
            Request(f"r{i}", prompt, sched.kv_cache_manager.block_hasher, sampling_params=p)
        )
    for _ in range(500):
        if not sched.has_unfinished_requests():
            break
        so = sched.schedule()
        failed = worker.run(so, sched)
        if not is_answered(so):
            continue
        rids = [r.req_id for r in so.new_reqs] + list(so.cached_reqs.req_ids)
        due = [
            r for r in rids if sched.requests[r].num_computed_tokens >= sched.requests[r].num_tokens
        ]
        # The "model": the next token depends on the whole sequence.
        sampled = [sum(sched.requests[r].all_token_ids) % SCHEDULER_VOCAB for r in due]
        out = ModelRunnerOutput(so.step_id, due, sampled)
        if failed:
            out = TierOutput(so.step_id, due, sampled, failed_disk_slots=failed)
        sched.update_from_output(so, out)
        sched.check_invariants()
    assert not sched.has_unfinished_requests()


def evict_and_ask_again(sched: Scheduler, worker: SimWorker | None = None) -> SimWorker:
    """doc_a (4 blocks), then doc_b (7 blocks), which evicts doc_a's, then doc_a again."""
    worker = worker or SimWorker()
    drive(sched, worker, [([*DOC_A, 5], 1)])
    drive(sched, worker, [([*DOC_B, 5], 1)])
    drive(sched, worker, [([*DOC_A, 6], 1)])
    return worker


def test_an_evicted_prefix_comes_back_from_the_tier_and_is_not_recomputed() -> None:
    # 7 usable blocks: the second request (7 blocks) evicts all four cached blocks of
    # the first, which the tier keeps; the third loads them instead of recomputing.
    sched = tier_scheduler(num_blocks=8, slots=8)
    worker = evict_and_ask_again(sched)
    tier = sched.kv_cache_manager.tier
    assert tier is not None and tier.stats.hits == 4 and worker.loaded == 4
    assert sched.num_prompt_cached_tokens == 16  # the first 16 tokens of doc_a: loaded


def test_kv_events_name_the_tier_medium_with_each_block_s_parent_and_tokens() -> None:
    sched = tier_scheduler(num_blocks=8, slots=5, events=True)
    worker = SimWorker()
    drive(sched, worker, [([*DOC_A, 5], 1)])
    sched.take_kv_events()
    drive(sched, worker, [([*DOC_B, 5], 1)])
    tier_events = [e for e in sched.take_kv_events() if e.medium == "CPU"]
    stored = [e for e in tier_events if isinstance(e, BlockStored)]
    # The chain's tail is evicted first (a request frees its blocks in reverse).
    assert [e.token_ids for e in stored] == [DOC_A[i * 4 : (i + 1) * 4] for i in (3, 2, 1, 0)]
    assert stored[-1].parent_block_hash is None
    assert stored[0].parent_block_hash == stored[1].block_hashes[0]


def test_a_block_pushed_out_of_a_full_tier_is_announced_removed() -> None:
    tier = KVTier(num_slots=2, block_size=BS)
    events: list = []
    tier.emit = events.append
    for i in range(3):  # one store per step: the third takes the least recent slot
        block = KVCacheBlock(i + 1)
        block.block_hash, block.hash_input = bytes([i]) * 16, bytes(16) + bytes(4 * BS)
        tier.on_evict(block)
        tier.take_ops()
    assert [type(e) for e in events] == [BlockStored, BlockStored, BlockRemoved, BlockStored]
    assert events[2].block_hashes == [bytes(16)] and events[2].medium == "CPU"


def test_a_tier_refuses_group_layouts_it_cannot_keep() -> None:
    config = sched_config(48, enable_prefix_caching=True)
    config = type(config)(**{**config.__dict__, "kv_tier_slots": 4})
    other_size = [KVCacheGroupSpec(["l0"], full(BS)), KVCacheGroupSpec(["l1"], window(8, 8))]
    with pytest.raises(ConfigError, match="one block size"):
        Scheduler(config, with_num_blocks(other_size, 16), SCHEDULER_VOCAB)
    wide = FullAttentionSpec(block_size=BS, num_kv_heads=2, head_size=8, dtype="float16")
    other_page = [KVCacheGroupSpec(["l0"], wide), KVCacheGroupSpec(["l1"], window(8, BS))]
    with pytest.raises(ConfigError, match="one page size"):
        Scheduler(config, with_num_blocks(other_page, 16), SCHEDULER_VOCAB)
    disk = type(config)(**{**config.__dict__, "kv_tier_disk_slots": 4})
    with pytest.raises(ConfigError, match="needs a full-attention layer"):
        Scheduler(disk, with_num_blocks([KVCacheGroupSpec(["l0"], window(8))], 16), 1000)
    # A sliding window alone, host memory only, and the hybrid mixes are kept.
    alone = with_num_blocks([KVCacheGroupSpec(["l0"], window(8))], 16)
    assert Scheduler(config, alone, SCHEDULER_VOCAB).kv_cache_manager.tier is not None


@settings(max_examples=120, deadline=None)
@given(
    requests=st.lists(
        st.tuples(st.integers(0, 2), st.lists(st.integers(1, 9), max_size=6), st.integers(1, 4)),
        min_size=1,
        max_size=8,
    ),
    rounds=st.integers(1, 3),
    num_blocks=st.integers(8, 16),
    slots=st.integers(0, 12),
    disk=st.sampled_from([0, 1, 4, 30]),
    chunk=st.sampled_from([5, 8, 64]),
    fail_every=st.sampled_from([0, 1, 3]),
    load_blocks=st.sampled_from([1, 2, 64]),
    windows=st.sampled_from([FULL_ONLY, INTERLEAVED, FIVE_TO_ONE, (2, None), (9, 5, None), (5,)]),
)
def test_device_pool_and_tier_never_serve_kv_of_other_tokens(
    requests: list[tuple[int, list[int], int]],
    rounds: int,
    num_blocks: int,
    slots: int,
    disk: int,
    chunk: int,
    fail_every: int,
    load_blocks: int,
    windows: tuple[int | None, ...],
) -> None:
    if None not in windows:  # a sliding window alone has no disk level
        disk = 0
    if not slots and not disk:
        slots = 1
    # Several groups share the pool: as many blocks per group for the same work.
    num_blocks = (num_blocks - 1) * len(windows) + 1
    sched = tier_scheduler(num_blocks, slots, chunk, disk=disk, windows=windows)
    if sched.loads is not None:  # one full-attention group: disk hits load first
        sched.loads.load_blocks = load_blocks  # over this many blocks a step
    prompts = [(PREFIXES[p] + tail, m) for p, tail, m in requests]
    worker = SimWorker(fail_every, windows)
    for _ in range(rounds):  # later rounds find earlier prefixes on the device or tier
        drive(sched, worker, prompts)


def test_a_request_waiting_for_room_counts_its_tier_lookup_once() -> None:
    # r0 holds 5 of 7 usable blocks and grows; r1 (3 blocks) waits until r0 finishes,
    # looked up at every step meanwhile: its lookup counts once, when it is admitted.
    sched = tier_scheduler(num_blocks=8, slots=8)
    drive(sched, SimWorker(), [(list(range(1, 21)), 8), (list(range(30, 39)), 1)])
    tier = sched.kv_cache_manager.tier
    assert tier is not None
    assert tier.stats.queries == (20 - 1) // BS + (9 - 1) // BS


def test_a_disk_level_keeps_blocks_the_host_level_pushed_out_and_loads_them() -> None:
    # Host memory holds 2 blocks, the disk 16: doc_a's four blocks come back, two or
    # more of them from disk, each read verified by the worker.
    sched = tier_scheduler(num_blocks=8, slots=2, disk=16)
    worker = evict_and_ask_again(sched)
    tier = sched.kv_cache_manager.tier
    assert tier is not None and tier.stats.hits == 4 and worker.loaded == 4
    assert tier.stats.disk_loaded >= 2 and worker.disk_reads == tier.stats.disk_loaded
    assert sched.num_prompt_cached_tokens == 16


def test_failed_disk_loads_are_recomputed_within_the_step_budget() -> None:
    # Disk only, 8 tokens a step, every read fails: the request loads first and is
    # computed from its verified prefix (none), within the budget (SimWorker asserts it).
    sched = tier_scheduler(num_blocks=8, slots=0, chunk=8, disk=16)
    worker = SimWorker(fail_every=1)
    evict_and_ask_again(sched, worker)
    tier = sched.kv_cache_manager.tier
    assert tier is not None and worker.disk_reads >= 1 and worker.loaded == 0
    assert tier.stats.failed == worker.disk_reads


@pytest.mark.parametrize("windows", [INTERLEAVED, FIVE_TO_ONE], ids=["interleaved", "5to1"])
@pytest.mark.parametrize("disk", [0, 64], ids=["host", "disk"])
def test_hybrid_groups_load_every_full_block_and_only_the_window_before_the_boundary(
    windows: tuple[int | None, ...], disk: int
) -> None:
    # 7 usable blocks per group: doc_b evicts doc_a's blocks of every group. The tier
    # keeps doc_a's full-attention blocks and each window's last two (a 6-token window
    # reads 2 blocks of 4 before a boundary), and the third request loads exactly those.
    groups = len(windows)
    sched = tier_scheduler(
        num_blocks=7 * groups + 1, slots=0 if disk else 64, disk=disk, windows=windows
    )
    worker = SimWorker(windows=windows)
    evict_and_ask_again(sched, worker)
    tier = sched.kv_cache_manager.tier
    assert tier is not None and tier.stats.hits == 4
    sliding = groups - 1
    assert tier.stats.loaded == worker.loaded == 4 + 2 * sliding
    assert sched.num_prompt_cached_tokens == 16
    if disk:
        assert tier.stats.disk_loaded == tier.stats.loaded


@pytest.mark.parametrize("windows", [INTERLEAVED, FIVE_TO_ONE], ids=["interleaved", "5to1"])
def test_a_hybrid_request_whose_disk_read_fails_recomputes_from_its_device_boundary(
    windows: tuple[int | None, ...],
) -> None:
    # Every disk read fails: the worker reruns the request from its first loaded block,
    # which the step's budget kept room for (SimWorker asserts both), and never reads
    # or writes a null block where a window was padded.
    sched = tier_scheduler(
        num_blocks=7 * len(windows) + 1, slots=0, chunk=20, disk=64, windows=windows
    )
    worker = SimWorker(fail_every=1, windows=windows)
    evict_and_ask_again(sched, worker)
    tier = sched.kv_cache_manager.tier
    assert tier is not None and worker.disk_reads >= 1 and worker.loaded == 0
    assert tier.stats.failed == worker.disk_reads


def test_hybrid_tier_events_name_each_block_s_group() -> None:
    # The same hash names the same tokens in every group: a subscriber tells the
    # groups' tier copies apart by group_idx, and sees only a window's blocks stored.
    sched = tier_scheduler(num_blocks=15, slots=64, events=True, windows=INTERLEAVED)
    worker = SimWorker(windows=INTERLEAVED)
    drive(sched, worker, [([*DOC_A, 5], 1)])
    sched.take_kv_events()
    drive(sched, worker, [([*DOC_B, 5], 1)])
    stored = [e for e in sched.take_kv_events() if e.medium == "CPU" and isinstance(e, BlockStored)]
    by_group: dict[int | None, list[list[int]]] = {}
    for e in stored:
        by_group.setdefault(e.group_idx, []).append(e.token_ids)
    blocks = [DOC_A[i * 4 : (i + 1) * 4] for i in range(4)]
    assert sorted(by_group[1]) == sorted(blocks)
    # The window (2 blocks) before the prompt's end, and one more for a boundary in
    # the last block: block 0 was released behind the window, never stored.
    assert sorted(by_group[0]) == sorted(blocks[1:])


# -- two-phase disk loads (enginecore/kv_tier_loads.py) -------------------------------


def disk_scheduler(load_blocks: int, slots: int = 0, chunk: int = 8) -> Scheduler:
    """Disk-heavy: 8 device blocks, a disk of 16 slots, `chunk` tokens a step, and at
    most load_blocks disk loads a step for loading requests."""
    sched = tier_scheduler(num_blocks=8, slots=slots, chunk=chunk, disk=16)
    assert sched.loads is not None
    sched.loads.load_blocks = load_blocks
    return sched


class FailAt(SimWorker):
    """Fails the disk reads numbered in `bad` (1-based) and logs each step's work."""

    def __init__(self, bad: set[int]) -> None:
        super().__init__()
        self.bad = bad
        self.log: list[tuple[int, int, int]] = []  # (step, disk loads, tokens)

    def run(self, so: SchedulerOutput, sched: Scheduler) -> list[int]:
        n = len(so.kv_tier.disk_load_slots) if isinstance(so, TierStep) else 0
        self.log.append((so.step_id, n, so.total_num_scheduled_tokens))
        self.fail_every = 0
        if any(self.disk_reads + k + 1 in self.bad for k in range(n)):
            return self._run_failing(so, sched)
        return super().run(so, sched)

    def _run_failing(self, so: SchedulerOutput, sched: Scheduler) -> list[int]:
        bad, start = self.bad, self.disk_reads
        ops = so.kv_tier  # type: ignore[attr-defined]
        failed = [
            s for k, s in enumerate(ops.disk_load_slots) if start + k + 1 in bad
        ]  # the slots whose reads fail, in order
        # Damage those slots' content for this read only: SimWorker then loads garbage,
        # which the core must never let a step read.
        saved = {s: self.disk[s] for s in failed}
        for s in failed:
            self.disk[s] = [None] * BS
        super().run(so, sched)
        self.disk.update(saved)
        return failed


def test_a_disk_hit_longer_than_the_step_budget_loads_over_steps_then_computes() -> None:
    # doc_a's 16 tokens come back from disk, twice the step budget (8), 2 blocks a step:
    # two steps of loads alone, then the request computes from token 16.
    sched = disk_scheduler(load_blocks=2)
    worker = FailAt(set())
    drive(sched, worker, [([*DOC_A, 5], 1)])
    drive(sched, worker, [([*DOC_B, 5], 1)])
    worker.log.clear()
    drive(sched, worker, [([*DOC_A, 6], 1)])
    assert [(n, t) for _, n, t in worker.log] == [(2, 0), (2, 0), (0, 1)]
    assert sched.num_prompt_cached_tokens == 16  # all of doc_a: none recomputed
    tier = sched.kv_cache_manager.tier
    assert tier is not None and tier.stats.disk_loaded >= 4 and tier.stats.failed == 0


def test_a_block_failing_in_the_middle_of_a_long_load_truncates_to_the_blocks_before() -> None:
    sched = disk_scheduler(load_blocks=1)
    worker = FailAt(set())
    drive(sched, worker, [([*DOC_A, 5], 1)])
    drive(sched, worker, [([*DOC_B, 5], 1)])
    worker.bad = {worker.disk_reads + 3}  # the third of doc_a's four blocks
    before = sched.num_prompt_cached_tokens
    drive(sched, worker, [([*DOC_A, 6], 1)])  # SimWorker asserts every KV read is right
    assert sched.num_prompt_cached_tokens - before == 2 * BS  # the two blocks before it
    tier = sched.kv_cache_manager.tier
    assert tier is not None and tier.stats.failed == 1
    assert len(tier.disk or ()) and tier.disk is not None
    tier.check_invariants()


def test_a_loading_request_is_preempted_first_and_frees_everything() -> None:
    # r0 decodes and grows while r1 loads doc_a (1 block a step): r1 is the victim,
    # loaded again later; nothing leaks (drive checks the pool at the end).
    sched = disk_scheduler(load_blocks=1, chunk=16)
    worker = FailAt(set())
    drive(sched, worker, [([*DOC_A, 5], 1)])
    drive(sched, worker, [([*DOC_B, 5], 1)])
    # r0 takes 2 blocks, r1 the other 5 to load into; r0's third block preempts r1.
    drive(sched, worker, [(list(range(40, 48)), 12), ([*DOC_A, 6], 2)])
    assert sched.num_preemptions >= 1
    assert sched.loads is not None and len(sched.loads) == 0


def test_an_aborted_loading_request_frees_its_blocks() -> None:
    sched = disk_scheduler(load_blocks=1)
    worker = FailAt(set())
    drive(sched, worker, [([*DOC_A, 5], 1)])
    drive(sched, worker, [([*DOC_B, 5], 1)])
    free = sched.kv_cache_manager.num_free_blocks
    params = SamplingParams(max_tokens=1, ignore_eos=True, temperature=0)
    hasher = sched.kv_cache_manager.block_hasher
    sched.add_request(Request("late", [*DOC_A, 6], hasher, sampling_params=params))
    so = sched.schedule()  # admitted into loading: its first load goes out
    worker.run(so, sched)
    assert sched.loads is not None and len(sched.loads) == 1
    assert sched.kv_cache_manager.num_free_blocks < free
    # Loading is waiting to users (/metrics): no token of it is computed yet.
    assert (sched.stats().num_running, sched.stats().num_waiting) == (0, 1)
    sched.update_from_output(so, ModelRunnerOutput(so.step_id, [], []))
    sched.abort_requests(["late"])
    assert len(sched.loads) == 0 and not sched.has_unfinished_requests()
    sched.check_invariants()  # every block back in the pool
    assert sched.kv_cache_manager.tier is not None
    sched.kv_cache_manager.tier.check_invariants()


def test_a_block_loaded_from_disk_is_promoted_and_next_comes_from_host_memory() -> None:
    # Host memory of 4 slots, disk 16: the blocks evicted after doc_a's push them out of
    # host memory, so doc_a loads from disk, and is copied into host memory; pushed off
    # the device again, what it does not find there comes from host memory, not disk.
    sched = disk_scheduler(load_blocks=8, slots=4, chunk=64)
    worker = FailAt(set())
    others = [[base + i for i in range(16)] for base in (40, 60, 80)]
    for doc in [DOC_A, DOC_B, others[0], others[1]]:
        drive(sched, worker, [([*doc, 5], 1)])
    tier = sched.kv_cache_manager.tier
    assert tier is not None and tier.stats.loaded == 0
    drive(sched, worker, [([*DOC_A, 6], 1)])
    assert tier.stats.disk_loaded == tier.stats.loaded == 4
    drive(sched, worker, [([*others[2], 5], 1)])  # pushes doc_a off the device
    assert tier.stats.promoted == 4  # doc_a, copied into host memory the step after
    cached = sched.num_prompt_cached_tokens
    drive(sched, worker, [([*DOC_A, 7], 1)])
    assert sched.num_prompt_cached_tokens - cached == 16
    assert tier.stats.disk_loaded == 4 and tier.stats.loaded > 4  # from host memory
    tier.check_invariants()
