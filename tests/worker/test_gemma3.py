"""Gemma 3's sliding-window layers free their KV blocks: on a decode far past the window,
the blocks a request holds in each of the five sliding groups stay bounded by the window
while the full-attention group grows with the sequence, and greedy tokens still equal
transformers'.

The 5:1 checkpoint makes six KV cache groups of one layer each; the real Scheduler and
ModelRunner run one step at a time in this process, every message through the wire codec.
"""

from __future__ import annotations

import random
from pathlib import Path

from enginecore.kv_cache_config import make_kv_cache_config, with_num_blocks
from enginecore.request import Request
from enginecore.scheduler import Scheduler
from enginecore.single_type_kv_cache_manager import FullAttentionManager, SlidingWindowManager
from launch.client.engine_args import EngineArgs, runner_config
from protocol.codec import Codec
from protocol.engine import SamplingParams
from protocol.worker import CoreToWorker, WorkerConfigure
from tests.helpers.cli_helpers import CPU
from tests.helpers.hf_checkpoints import VOCAB, hf_greedy, save_checkpoint
from tests.helpers.kv_helpers import sched_config
from worker.model_runner import ModelRunner

BLOCK_SIZE = 4
MAX_MODEL_LEN = 160
BUDGET = 8  # tokens per step: the 30-token prompt is prefilled in chunks
DECODE = 96  # 16 windows of 6 tokens
NUM_BLOCKS = 120


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


def test_sliding_groups_hold_a_bounded_number_of_blocks_over_a_long_decode(tmp_path: Path) -> None:
    hf_model = save_checkpoint("gemma3", tmp_path)
    runner = ModelRunner(
        runner_config(EngineArgs(model=str(tmp_path), block_size=BLOCK_SIZE, device=CPU))
    )
    groups = make_kv_cache_config(runner.kv_cache_specs(), 1 << 30).kv_cache_groups
    kv_config = with_num_blocks(groups, NUM_BLOCKS)
    scheduler = Scheduler(
        sched_config(MAX_MODEL_LEN, max_num_batched_tokens=BUDGET, max_num_seqs=4),
        kv_config,
        runner.model_config.vocab_size,
    )
    runner.initialize(WorkerConfigure(kv_config, 4, MAX_MODEL_LEN, BUDGET))
    kv = scheduler.kv_cache_manager
    managers = kv.coordinator.managers
    sliding = [m for m in managers if isinstance(m, SlidingWindowManager)]
    (full,) = [m for m in managers if isinstance(m, FullAttentionManager)]
    assert len(sliding) == 5 and {m.sliding_window for m in sliding} == {6}
    window = sliding[0].sliding_window
    pool = kv.block_pool

    rng = random.Random(11)
    prompts = {"short": 9, "long": 30}
    requests = {}
    for rid, n in prompts.items():
        prompt = [rng.randrange(3, VOCAB) for _ in range(n)]
        params = SamplingParams(max_tokens=DECODE, temperature=0, ignore_eos=True)
        requests[rid] = Request(rid, prompt, kv.block_hasher, sampling_params=params)
        assert scheduler.add_request(requests[rid]) is None

    codec = Codec(CoreToWorker, "core->worker")
    # Per step and request: (tokens allocated, non-null blocks per sliding group, full
    # group's blocks); and the pool's blocks in use.
    held: dict[str, list[tuple[int, list[int], int]]] = {rid: [] for rid in prompts}
    in_use: list[int] = []
    steps = 0
    while scheduler.has_unfinished_requests():
        steps += 1
        assert steps < 400
        so = scheduler.schedule()
        for request in scheduler.running:
            rid = request.request_id
            live = [sum(b is not pool.null_block for b in m.req_to_blocks[rid]) for m in sliding]
            held[rid].append((request.num_computed_tokens, live, len(full.req_to_blocks[rid])))
        in_use.append(pool.num_usable_blocks - pool.get_num_free_blocks())
        out = runner.execute(codec.decode(codec.encode(so)))
        if out is not None:
            scheduler.update_from_output(so, out)
        kv.check_invariants(scheduler.requests)
    runner.execute(codec.decode(codec.encode(scheduler.schedule())))  # deliver the finishes

    assert scheduler.num_preemptions == 0
    for rid, request in requests.items():
        prompt = request.prompt_token_ids
        tokens = request.all_token_ids[len(prompt) :]
        assert tokens == hf_greedy(hf_model, prompt, DECODE), rid
        for allocated, live, full_blocks in held[rid]:
            # The full group keeps every block of the sequence...
            assert full_blocks == cdiv(allocated, BLOCK_SIZE), rid
            # ...a sliding group only those its next queries' windows reach: w - 1 old keys
            # plus a step's BUDGET new ones, one more block for misalignment.
            assert max(live) <= cdiv(window - 1 + BUDGET, BLOCK_SIZE) + 1, (rid, allocated)
        # Over the decode's second half (one token a step) the sequence grows by 12
        # blocks; the sliding groups' holding does not.
        last = held[rid][-DECODE // 2 :]
        assert last[-1][2] - last[0][2] >= DECODE // 2 // BLOCK_SIZE - 1
        assert max(max(live) for _, live, _ in last) <= cdiv(window, BLOCK_SIZE) + 1

    # The pool agrees: at the end both requests hold ~65 blocks, not the 6 x 34 + 6 x 32
    # that keeping every sliding block would take (more than the pool has).
    longest = max(len(r.all_token_ids) for r in requests.values())
    assert max(in_use) <= 2 * (cdiv(longest, BLOCK_SIZE) + 5 * (cdiv(window, BLOCK_SIZE) + 2))
    assert 6 * 2 * cdiv(longest - 1, BLOCK_SIZE) > NUM_BLOCKS
    assert pool.get_num_free_blocks() == pool.num_usable_blocks
