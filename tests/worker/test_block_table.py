"""Invariant 5: after every step, the worker's block table rows equal the core's block ids
for every running request, and rows of finished or moved requests are cleared.

The real Scheduler and the real ModelRunner run one step at a time in this process; every
SchedulerOutput and ModelRunnerOutput goes through the wire codecs, so the worker sees
exactly the bytes it would see over ZeroMQ.
"""

from __future__ import annotations

import numpy as np
import pytest

from enginecore.kv_cache_config import make_kv_cache_config, with_num_blocks
from enginecore.request import Request
from enginecore.scheduler import Scheduler
from launch.client.engine_args import EngineArgs, runner_config
from protocol.codec import Codec
from protocol.engine import SamplingParams
from protocol.worker import (
    CachedRequestData,
    CoreToWorker,
    SchedulerOutput,
    WorkerConfigure,
    WorkerToCore,
)
from tests.helpers.cli_helpers import CPU
from tests.helpers.hf_checkpoints import save_checkpoint
from tests.helpers.kv_helpers import sched_config
from worker.model_runner import ModelRunner


@pytest.fixture(scope="module")
def runner(tmp_path_factory: pytest.TempPathFactory) -> ModelRunner:
    path = tmp_path_factory.mktemp("qwen2")
    save_checkpoint("qwen2", path)
    return ModelRunner(runner_config(EngineArgs(model=str(path), block_size=4, device=CPU)))


def test_a_step_before_configure_is_refused_by_name(tmp_path) -> None:
    save_checkpoint("qwen2", tmp_path)
    fresh = ModelRunner(runner_config(EngineArgs(model=str(tmp_path), block_size=4, device=CPU)))
    step = SchedulerOutput(1, [], CachedRequestData([], [], [], [], []), [], 0, [], [])
    with pytest.raises(ValueError, match="SchedulerOutput before WorkerConfigure"):
        fresh.execute(step)
    with pytest.raises(ValueError, match="DumpBlockTables before WorkerConfigure"):
        fresh.block_tables()


def test_worker_tables_follow_the_core(runner: ModelRunner) -> None:
    specs = runner.kv_cache_specs()
    base = make_kv_cache_config(specs, 1 << 30)
    # 15 usable blocks of 4 tokens: six requests growing to ~30 tokens must preempt.
    kv_config = with_num_blocks(base.kv_cache_groups, 16)
    config = sched_config(128, max_num_batched_tokens=32, max_num_seqs=8)
    scheduler = Scheduler(config, kv_config, runner.model_config.vocab_size)
    runner.initialize(WorkerConfigure(kv_config, 8, 128, 32))
    to_worker = Codec(CoreToWorker, "core->worker")
    to_core = Codec(WorkerToCore, "worker->core")
    params = SamplingParams(max_tokens=14, temperature=0, ignore_eos=True)
    shared = [7, 8, 9, 10, 11, 12, 13, 14]
    for i in range(6):
        prompt = shared + list(range(20 + i, 20 + i + 3 + 2 * i))
        req = Request(
            f"r{i}", prompt, scheduler.kv_cache_manager.block_hasher, sampling_params=params
        )
        assert scheduler.add_request(req) is None
    seen = {"new": 0, "preempted": 0, "resumed": 0, "finished": 0}
    batch = runner.batch
    assert batch is not None
    steps = 0
    while scheduler.has_unfinished_requests():
        steps += 1
        assert steps < 500
        so = scheduler.schedule()
        kv = scheduler.kv_cache_manager
        # The core's tables for this step, before outputs may finish (and free) requests.
        core_tables = {r.request_id: kv.get_block_ids(r.request_id) for r in scheduler.running}
        seen["new"] += len(so.new_reqs)
        seen["preempted"] += len(so.preempted_req_ids)
        seen["resumed"] += sum(so.cached_reqs.resumed)
        seen["finished"] += len(so.finished_req_ids)
        out = runner.execute(to_worker.decode(to_worker.encode(so)))
        # The worker's rows are exactly the running requests, with the core's block ids.
        assert sorted(batch.req_ids) == sorted(core_tables)
        for rid, table in core_tables.items():
            assert batch.block_ids_of(rid) == [list(g) for g in table], rid
        n = batch.num_reqs
        for table in batch.block_table.tables:
            assert not table.table[n:].any() and not table.num_blocks_per_row[n:].any()
        if out is not None:
            scheduler.update_from_output(so, to_core.decode(to_core.encode(out)))
        kv.check_invariants(scheduler.requests)
    # The last finishes reach the worker with the next (empty) step.
    runner.execute(to_worker.decode(to_worker.encode(scheduler.schedule())))
    assert batch.num_reqs == 0 and not batch.requests
    pool = scheduler.kv_cache_manager.block_pool
    assert pool.get_num_free_blocks() == pool.num_usable_blocks
    assert all(seen[k] > 0 for k in ("new", "preempted", "resumed", "finished")), seen
    assert np.all(batch.block_table.tables[0].table == 0)
