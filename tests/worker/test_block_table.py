"""Invariant 5: after every step, the worker's block table rows equal the core's block ids
for every running request, and rows of finished or moved requests are cleared.

The real Scheduler and the real ModelRunner run one step at a time in this process; every
SchedulerOutput and ModelRunnerOutput goes through the wire codecs, so the worker sees
exactly the bytes it would see over ZeroMQ. BlockTable alone (slot mapping, the device
copy, every row edit against a dict of lists) is checked first.
"""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, rule

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
from worker.block_table import BATCHED_APPEND_MIN, BlockTable, MultiGroupBlockTable
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


# -- BlockTable alone -------------------------------------------------------------------


def test_slot_mapping_checks_rows() -> None:
    t = BlockTable(4, 2, 3)
    t.add_row([7, 8], 0)
    out = np.empty(4, dtype=np.int64)
    t.compute_slot_mapping(
        np.array([0, 0, -1, 0], np.int32), np.array([0, 7, 5, -1], np.int64), out
    )
    assert out.tolist() == [28, 35, -1, -1]
    with pytest.raises(ValueError, match="row 0 position 8 needs block 2 but the row has 2"):
        t.compute_slot_mapping(np.array([0], np.int32), np.array([8], np.int64), out[:1])
    with pytest.raises(ValueError, match="row 1 position 0"):
        t.compute_slot_mapping(np.array([1], np.int32), np.array([0], np.int64), out[:1])
    with pytest.raises(ValueError, match="same length"):
        t.compute_slot_mapping(np.array([0], np.int32), np.array([0], np.int64), out)
    with pytest.raises(ValueError, match="row 0: 4 blocks exceed max_num_blocks_per_req=3"):
        t.add_row([1, 2, 3, 4], 0)


def test_multi_group_commit_copies_live_rows() -> None:
    m = MultiGroupBlockTable([4, 16], max_num_reqs=3, max_model_len=33)
    assert [t.max_num_blocks_per_req for t in m.tables] == [9, 3]
    m.add_row([[1, 2], [3]], 0)
    m.add_row([[4], [5, 6]], 1)
    m.add_row([[7], [8]], 2)
    device = m.commit(2)
    assert [d.tolist() for d in device] == [
        [[1, 2, 0, 0, 0, 0, 0, 0, 0], [4, 0, 0, 0, 0, 0, 0, 0, 0]],
        [[3, 0, 0], [5, 6, 0]],
    ]
    # The persistent tensor is reused, and rows past num_rows are left alone.
    assert device[0].data_ptr() == m[0].device_table.data_ptr()
    assert not m[0].device_table[2].any()
    with pytest.raises(ValueError, match="2 KV cache groups, got 1"):
        m.append_row([[1]], 0)


# -- BlockTable against a dict of lists ------------------------------------------------

ROWS, WIDTH, BS = 4, 5, 3
IDS = st.lists(st.integers(1, 50), max_size=WIDTH + 1)
ROW = st.integers(0, ROWS - 1)


class BlockTableMachine(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.table = BlockTable(BS, ROWS, WIDTH)
        self.model: dict[int, list[int]] = {}

    @rule(row=ROW, ids=IDS)
    def add_row(self, row: int, ids: list[int]) -> None:
        if len(ids) > WIDTH:
            with pytest.raises(ValueError, match=f"row {row}"):
                self.table.add_row(ids, row)
            return
        self.table.add_row(ids, row)
        self.model[row] = list(ids)

    @rule(row=ROW, ids=IDS)
    def append_row(self, row: int, ids: list[int]) -> None:
        have = self.model.get(row, [])
        if len(have) + len(ids) > WIDTH:
            with pytest.raises(ValueError, match=f"row {row}: appending"):
                self.table.append_row(ids, row)
            return
        self.table.append_row(ids, row)
        self.model[row] = have + ids

    @rule(
        rows=st.lists(ROW, min_size=1, max_size=ROWS, unique=True),
        one_each=st.booleans(),
        data=st.data(),
    )
    def append_rows(self, rows: list[int], one_each: bool, data: st.DataObject) -> None:
        # One block per row for every row is the batched write; anything else goes row
        # by row. Both must equal appending to each row alone.
        ids = [[data.draw(st.integers(1, 50))] if one_each else data.draw(IDS) for _ in rows]
        if any(len(self.model.get(r, [])) + len(i) > WIDTH for r, i in zip(rows, ids)):
            if one_each and len(rows) >= BATCHED_APPEND_MIN:
                with pytest.raises(ValueError, match="appending 1 blocks"):
                    self.table.append_rows(rows, ids)  # checked before any write
            return
        self.table.append_rows(rows, ids)
        for r, i in zip(rows, ids):
            self.model[r] = self.model.get(r, []) + i

    @rule(src=ROW, dst=ROW)
    def move_row(self, src: int, dst: int) -> None:
        self.table.move_row(src, dst)
        if src != dst:
            self.model[dst] = self.model.pop(src, [])

    @rule(row=ROW)
    def clear_row(self, row: int) -> None:
        self.table.clear_row(row)
        self.model.pop(row, None)

    @rule(
        tokens=st.lists(
            st.tuples(st.integers(-1, ROWS - 1), st.integers(-1, WIDTH * BS - 1)), max_size=12
        )
    )
    def slot_mapping(self, tokens: list[tuple[int, int]]) -> None:
        rows = np.array([r for r, _ in tokens], dtype=np.int32)
        positions = np.array([p for _, p in tokens], dtype=np.int64)
        out = np.full(len(tokens), 12345, dtype=np.int64)
        expected = []
        for r, p in tokens:
            if r < 0 or p < 0:
                expected.append(-1)
            elif p // BS >= len(self.model.get(r, [])):
                with pytest.raises(ValueError, match=f"row {r} position {p}"):
                    self.table.compute_slot_mapping(rows, positions, out)
                return
            else:
                expected.append(self.model[r][p // BS] * BS + p % BS)
        self.table.compute_slot_mapping(rows, positions, out)
        assert out.tolist() == expected

    @rule(n=st.integers(0, ROWS))
    def commit(self, n: int) -> None:
        assert self.table.commit(n).tolist() == self.table.table[:n].tolist()

    @invariant()
    def matches_model(self) -> None:
        for row in range(ROWS):
            ids = self.model.get(row, [])
            assert self.table.num_blocks_per_row[row] == len(ids)
            assert self.table.table[row].tolist() == ids + [0] * (WIDTH - len(ids))


TestBlockTableMachine = BlockTableMachine.TestCase
TestBlockTableMachine.settings = settings(max_examples=60, stateful_step_count=25, deadline=None)
