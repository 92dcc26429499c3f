"""Hybrid KV cache groups on a real model: the interleaved sliding/full Qwen2 checkpoint.

On a long decode, the sliding-window group's live blocks per request stay bounded by the
window (plus the step's new tokens) while the full-attention group grows; prefix hits are
limited to the boundary both groups can restore; greedy tokens equal transformers'.

The real Scheduler and the real ModelRunner run one step at a time in this process, every
message through the wire codecs (as in test_block_table.py).
"""

from __future__ import annotations

import random

import pytest
import torch

from enginecore.kv_cache_block import KVCacheBlock
from enginecore.kv_cache_config import make_kv_cache_config, with_num_blocks
from enginecore.request import Request
from enginecore.scheduler import Scheduler
from enginecore.single_type_kv_cache_manager import (
    FullAttentionManager,
    SingleTypeKVCacheManager,
    SlidingWindowManager,
)
from launch.client.engine_args import EngineArgs, runner_config
from protocol.codec import Codec
from protocol.engine import SamplingParams
from protocol.worker import CoreToWorker, SchedulerOutput, WorkerConfigure, WorkerToCore
from tests.helpers.cli_helpers import CPU
from tests.helpers.hf_checkpoints import VOCAB, hf_greedy, save_checkpoint
from tests.helpers.kv_helpers import sched_config
from worker.model_runner import ModelRunner

BLOCK_SIZE = 4
MAX_MODEL_LEN = 128
DECODE = 64
# 80 usable blocks: the first wave peaks near 70 live blocks (no preemption), but
# allocates ~125 over its life, so the sliding-window blocks it freed earliest (hashed,
# at the back of the free queue) are evicted by later allocations.
NUM_BLOCKS = 81


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> tuple[ModelRunner, torch.nn.Module]:
    path = tmp_path_factory.mktemp("qwen2_interleaved")
    hf_model = save_checkpoint("qwen2_interleaved", path)
    hf_model.generation_config.eos_token_id = None  # both sides ignore EOS
    runner = ModelRunner(
        runner_config(EngineArgs(model=str(path), block_size=BLOCK_SIZE, device=CPU))
    )
    return runner, hf_model


class Engine:
    """Core and worker in one process; every step checks the groups' tables."""

    def __init__(self, runner: ModelRunner, num_blocks: int, max_num_batched_tokens: int) -> None:
        specs = runner.kv_cache_specs()
        groups = make_kv_cache_config(specs, 1 << 30).kv_cache_groups
        kv_config = with_num_blocks(groups, num_blocks)
        # No prefill cap (nor its wave hold): every running request runs in every step,
        # which step() relies on to follow each one's window.
        config = sched_config(
            MAX_MODEL_LEN,
            max_num_batched_tokens=max_num_batched_tokens,
            max_num_seqs=8,
            prefill_tokens_per_request=0,
        )
        self.scheduler = Scheduler(config, kv_config, runner.model_config.vocab_size)
        runner.initialize(WorkerConfigure(kv_config, 8, MAX_MODEL_LEN, max_num_batched_tokens))
        self.runner = runner
        self.kv = self.scheduler.kv_cache_manager
        managers = self.kv.coordinator.managers
        (self.fa,) = [m for m in managers if isinstance(m, FullAttentionManager)]
        (self.sw,) = [m for m in managers if isinstance(m, SlidingWindowManager)]
        self.window = self.sw.sliding_window
        self.null = self.kv.block_pool.null_block
        self.to_worker = Codec(CoreToWorker, "core->worker")
        self.to_core = Codec(WorkerToCore, "worker->core")
        # Per request: full-group block counts, and sliding-window live blocks, per step.
        self.full_blocks: dict[str, list[int]] = {}
        self.window_live: dict[str, list[int]] = {}
        # (request, block index, worker's id) where the core holds the null block but the
        # worker's row still names the block it freed.

    def add(self, rid: str, prompt: list[int], max_tokens: int) -> Request:
        params = SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True)
        request = Request(rid, prompt, self.kv.block_hasher, sampling_params=params)
        assert self.scheduler.add_request(request) is None
        return request

    def run(self) -> None:
        steps = 0
        while self.scheduler.has_unfinished_requests():
            steps += 1
            assert steps < 500
            self.step()
        # The last finishes reach the worker with the next (empty) step.
        self.runner.execute(self.wire(self.scheduler.schedule()))

    def wire(self, so: SchedulerOutput) -> SchedulerOutput:
        return self.to_worker.decode(self.to_worker.encode(so))

    def step(self) -> None:
        scheduler = self.scheduler
        so = scheduler.schedule()
        scheduled = [r.req_id for r in so.new_reqs] + list(so.cached_reqs.req_ids)
        counts = dict(zip(scheduled, so.num_scheduled_tokens))
        # The budget fits every running request each step, so "tokens scheduled this
        # step" is defined for each of them.
        assert sorted(counts) == sorted(r.request_id for r in scheduler.running)
        for request in scheduler.running:
            self.check_core_tables(request, counts[request.request_id])
        core_tables = {r.request_id: self.kv.get_block_ids(r.request_id) for r in scheduler.running}
        out = self.runner.execute(self.wire(so))
        self.check_worker_tables(core_tables)
        if out is not None:
            scheduler.update_from_output(so, self.to_core.decode(self.to_core.encode(out)))
        self.kv.check_invariants(self.scheduler.requests)

    def check_core_tables(self, request: Request, num_scheduled: int) -> None:
        rid = request.request_id
        bs, w = BLOCK_SIZE, self.window
        # Progress is counted at schedule time: this step's tokens are already in it.
        allocated = request.num_computed_tokens
        committed = allocated - num_scheduled
        full = self.fa.req_to_blocks[rid]
        assert len(full) == cdiv(allocated, bs), rid
        assert self.null not in full, rid
        self.full_blocks.setdefault(rid, []).append(len(full))

        window = self.sw.req_to_blocks[rid]
        assert len(window) == cdiv(allocated, bs), rid
        # remove_skipped_blocks runs on the committed tokens c before this step allocates:
        # the first query still to run sits at c and reads keys from c - w + 1 on, so the
        # blocks before index (c - w + 1) // bs are freed (null) and every later one is
        # live. A new request gets the same shape from its prefix hit h (a multiple of
        # bs): bs-aligned h gives h // bs - cdiv(w - 1, bs) == (h - w + 1) // bs nulls.
        freed = max(0, (committed - w + 1) // bs)
        assert all(b is self.null for b in window[:freed]), (rid, freed)
        assert self.null not in window[freed:], (rid, freed)
        live = len(window) - freed
        # Bound: with c - w + 1 = f * bs + r (0 <= r < bs), live = cdiv(c + n, bs) - f
        # = cdiv(r + w - 1 + n, bs) <= cdiv(w - 1 + n, bs) + 1 (r < bs adds at most one
        # block). For c < w - 1 nothing is freed and live = cdiv(c + n, bs) is below it.
        assert live <= cdiv(w - 1 + num_scheduled, bs) + 1, (rid, live, num_scheduled)
        self.window_live.setdefault(rid, []).append(live)

    def check_worker_tables(self, core_tables: dict[str, tuple[list[int], ...]]) -> None:
        batch = self.runner.batch
        assert batch is not None
        assert sorted(batch.req_ids) == sorted(core_tables)
        fa, sw = self.fa.group_id, self.sw.group_id
        for rid, core in core_tables.items():
            worker = batch.block_ids_of(rid)
            # Invariant 5, null blocks included: the worker forgets ids the window freed.
            assert worker[fa] == list(core[fa]), rid
            assert worker[sw] == list(core[sw]), rid

    def hit_both_groups_can_restore(self, request: Request) -> tuple[int, int]:
        """(full group's own hit, the hit both groups can restore), in blocks, derived
        from which blocks each group has cached, independently of the coordinator."""
        pool = self.kv.block_pool
        hashes = request.block_hashes
        max_blocks = (request.num_tokens - 1) // BLOCK_SIZE
        fa_cached = [pool.get_cached_block(h, self.fa.group_id) is not None for h in hashes]
        sw_cached = [pool.get_cached_block(h, self.sw.group_id) is not None for h in hashes]
        full_hit = 0
        while full_hit < min(max_blocks, len(hashes)) and fa_cached[full_hit]:
            full_hit += 1
        # A boundary L needs the blocks holding keys L - w + 1 .. L - 1 in the window group.
        needed = cdiv(self.window - 1, BLOCK_SIZE)
        both = max(n for n in range(full_hit + 1) if all(sw_cached[max(0, n - needed) : n]))
        return full_hit, both

    def num_cached(self, request: Request, manager: SingleTypeKVCacheManager) -> int:
        """How many of the request's block hashes the group has cached."""
        pool = self.kv.block_pool
        return sum(
            pool.get_cached_block(h, manager.group_id) is not None for h in request.block_hashes
        )

    def check_hit(self, request: Request, expected_blocks: int) -> None:
        hits, num_hit = self.kv.get_computed_blocks(request)
        assert num_hit == expected_blocks * BLOCK_SIZE
        pool = self.kv.block_pool
        hashes = request.block_hashes[:expected_blocks]
        fa_want = [pool.get_cached_block(h, self.fa.group_id) for h in hashes]
        assert list(hits[self.fa.group_id]) == fa_want
        needed = cdiv(self.window - 1, BLOCK_SIZE)
        skipped = max(0, expected_blocks - needed)
        sw_want: list[KVCacheBlock | None] = [self.null] * skipped
        sw_want += [pool.get_cached_block(h, self.sw.group_id) for h in hashes[skipped:]]
        assert list(hits[self.sw.group_id]) == sw_want


def outputs(request: Request) -> list[int]:
    return request.all_token_ids[request.num_prompt_tokens :]


def test_window_blocks_stay_bounded_and_hits_need_both_groups(
    model: tuple[ModelRunner, torch.nn.Module],
) -> None:
    runner, hf_model = model
    engine = Engine(runner, NUM_BLOCKS, max_num_batched_tokens=24)
    assert engine.window == 6
    rng = random.Random(3)
    # Lengths 9, 17, 30 with a 24-token budget: the longest prompt is chunked.
    prompts = [[rng.randrange(3, VOCAB) for _ in range(n)] for n in (9, 17, 30)]
    first = [engine.add(f"a{i}", p, DECODE) for i, p in enumerate(prompts)]
    engine.run()
    assert engine.scheduler.num_preemptions == 0
    for request in first:
        assert outputs(request) == hf_greedy(hf_model, request.prompt_token_ids, DECODE)
        rid = request.request_id
        full = engine.full_blocks[rid]
        assert full == sorted(full)  # never shrinks
        assert full[-1] == cdiv(request.num_tokens - 1, BLOCK_SIZE)
        # Decode steps schedule one token: at most cdiv(w, bs) + 1 = 3 live window
        # blocks, while the full group holds every block of the ~70-90 token sequence.
        assert max(engine.window_live[rid][-DECODE // 2 :]) <= cdiv(engine.window, BLOCK_SIZE) + 1
        assert full[-1] - full[0] >= DECODE // BLOCK_SIZE - 1

    # 1. The window moved past a0's first blocks early in its decode; they were freed and
    # then evicted by later allocations (LRU), while its full-group blocks (freed only
    # when it finished) are still cached: the full group alone could restore 4 blocks,
    # the window group not even the first, so nothing hits.
    a0 = first[0]
    c1_prompt = [*a0.all_token_ids[: a0.num_prompt_tokens + 8], 5, 6, 7]
    c1 = Request("c1", c1_prompt, engine.kv.block_hasher)
    full_hit, both = engine.hit_both_groups_can_restore(c1)
    assert full_hit == (a0.num_prompt_tokens + 8) // BLOCK_SIZE
    assert engine.num_cached(c1, engine.sw) == 0, "a0's early window blocks were not evicted"
    assert both == 0
    engine.check_hit(c1, both)
    c1 = engine.add("c1", c1_prompt, 16)
    engine.run()
    assert c1.num_cached_tokens == both * BLOCK_SIZE
    assert outputs(c1) == hf_greedy(hf_model, c1_prompt, 16)

    # 2. A hit on all 80 computed tokens of a1 (then new ones): LRU evicted all but the
    # last window of its sliding-window blocks, and that window is all a boundary at
    # the end needs, so both groups restore the whole prefix.
    a1 = first[1]
    c2_prompt = [*a1.all_token_ids[:-1], 9, 10]  # a1's last sampled token never ran
    c2 = Request("c2", c2_prompt, engine.kv.block_hasher)
    full_hit, both = engine.hit_both_groups_can_restore(c2)
    assert full_hit == both == (a1.num_tokens - 1) // BLOCK_SIZE
    assert engine.num_cached(c2, engine.sw) == cdiv(engine.window - 1, BLOCK_SIZE)
    engine.check_hit(c2, both)
    c2 = engine.add("c2", c2_prompt, 16)
    engine.run()
    assert c2.num_cached_tokens == both * BLOCK_SIZE
    assert outputs(c2) == hf_greedy(hf_model, c2_prompt, 16)
    # A hit's window blocks plus the prompt's rest, then decode, stay bounded too.
    assert max(engine.window_live["c2"][1:]) <= cdiv(engine.window, BLOCK_SIZE) + 1

    # 3. On c1's sequence, whose window-group blocks are all still cached: evicting the
    # window group's block just before the boundary moves the common boundary back one
    # block; a hole in the middle, which no boundary near the end reads, does not.
    c3_prompt = [*c1.all_token_ids[:-1], 11, 12]
    c3 = Request("c3", c3_prompt, engine.kv.block_hasher)
    num_full = (c1.num_tokens - 1) // BLOCK_SIZE
    assert engine.num_cached(c3, engine.sw) == num_full
    pool = engine.kv.block_pool
    window_blocks = [pool.get_cached_block(h, engine.sw.group_id) for h in c3.block_hashes]
    pool.evict_cached_blocks([window_blocks[num_full - 1], window_blocks[num_full // 2]])
    engine.kv.check_invariants(engine.scheduler.requests)
    full_hit, both = engine.hit_both_groups_can_restore(c3)
    assert full_hit == num_full
    assert both == num_full - 1
    engine.check_hit(c3, both)
    c3 = engine.add("c3", c3_prompt, 16)
    engine.run()
    assert c3.num_cached_tokens == both * BLOCK_SIZE
    assert outputs(c3) == hf_greedy(hf_model, c3_prompt, 16)

    pool = engine.kv.block_pool
    assert pool.get_num_free_blocks() == pool.num_usable_blocks
