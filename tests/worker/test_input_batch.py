"""The worker's bookkeeping: the persistent batch and the flat model inputs.

A scripted stream of SchedulerOutputs (new requests, chunked prefill, decode with and
without new blocks, preemption, resume with a replaced table, finishes, several at once)
is applied to an InputBatch; after every step the batch and the ModelInputs are compared
with a reference written here from the wire semantics alone (dicts of lists, per-token
loops), and a few steps also spell out the expected numbers by hand. Corrupt streams
must raise. BlockTable alone, against a dict-of-lists model: test_block_table.py.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from protocol.engine import SamplingParams
from protocol.worker import CachedRequestData, NewRequestData, SchedulerOutput
from worker.block_table import BlockTable
from worker.input_batch import InputBatch
from worker.model_inputs import ModelInputs, prepare_inputs

BLOCK_SIZES = (4, 2)  # two KV groups with different block sizes
MAX_REQS = 4
MAX_LEN = 32
SP = SamplingParams(max_tokens=8, temperature=0.0)

# -- building the stream ---------------------------------------------------------------


def new(req_id: str, prompt: list[int], blocks: list[list[int]], computed: int = 0):
    return NewRequestData(req_id, prompt, SP, blocks, computed)


@dataclass
class Cached:
    req_id: str
    new_blocks: list[list[int]] | None
    computed: int
    resumed: bool = False
    skipped: list[int] | None = None


def step(
    step_id: int,
    *,
    new_reqs: tuple[tuple[NewRequestData, int], ...] = (),
    cached: tuple[tuple[Cached, int], ...] = (),
    finished: tuple[str, ...] = (),
    preempted: tuple[str, ...] = (),
) -> SchedulerOutput:
    """Each scheduled request comes with its number of scheduled tokens."""
    sched = [n for _, n in new_reqs] + [n for _, n in cached]
    return SchedulerOutput(
        step_id=step_id,
        new_reqs=[r for r, _ in new_reqs],
        cached_reqs=CachedRequestData(
            req_ids=[c.req_id for c, _ in cached],
            new_block_ids=[c.new_blocks for c, _ in cached],
            num_computed_tokens=[c.computed for c, _ in cached],
            resumed=[c.resumed for c, _ in cached],
            num_skipped_blocks=[c.skipped for c, _ in cached],
        ),
        num_scheduled_tokens=sched,
        total_num_scheduled_tokens=sum(sched),
        finished_req_ids=list(finished),
        preempted_req_ids=list(preempted),
    )


# -- the reference ---------------------------------------------------------------------


@dataclass
class RefReq:
    tokens: list[int]
    tables: list[list[int]]
    computed: int
    running: bool = True


@dataclass
class Ref:
    """The wire semantics with no rows at all."""

    reqs: dict[str, RefReq] = field(default_factory=dict)

    def apply(self, so: SchedulerOutput) -> None:
        for r in so.finished_req_ids:
            del self.reqs[r]
        for r in so.preempted_req_ids:
            self.reqs[r].running = False
            self.reqs[r].tables = [[] for _ in BLOCK_SIZES]
        for nr in so.new_reqs:
            tables = [list(b) for b in nr.block_ids]
            self.reqs[nr.req_id] = RefReq(list(nr.prompt_token_ids), tables, nr.num_computed_tokens)
        c = so.cached_reqs
        for r, blocks, computed, resumed in zip(
            c.req_ids, c.new_block_ids, c.num_computed_tokens, c.resumed
        ):
            req = self.reqs[r]
            req.computed = computed
            if resumed:
                req.running = True
                req.tables = [list(b) for b in blocks]
            elif blocks is not None:
                for t, b in zip(req.tables, blocks):
                    t.extend(b)

    def expected_inputs(self, so: SchedulerOutput, rows: dict[str, int]) -> dict[str, Any]:
        order = [r.req_id for r in so.new_reqs] + list(so.cached_reqs.req_ids)
        ids, pos, req_rows, qsl, seq_lens, logits, sampling = [], [], [], [0], [], [], []
        slots: list[list[int]] = [[] for _ in BLOCK_SIZES]
        for r, n in zip(order, so.num_scheduled_tokens):
            req = self.reqs[r]
            for p in range(req.computed, req.computed + n):
                ids.append(req.tokens[p])
                pos.append(p)
                req_rows.append(rows[r])
                for g, bs in enumerate(BLOCK_SIZES):
                    slots[g].append(req.tables[g][p // bs] * bs + p % bs)
            qsl.append(qsl[-1] + n)
            seq_lens.append(req.computed + n)
            if req.computed + n == len(req.tokens):
                logits.append(qsl[-1] - 1)
                sampling.append(r)
        return dict(
            req_ids=order,
            input_ids=ids,
            positions=pos,
            req_rows=req_rows,
            query_start_loc=qsl,
            seq_lens=seq_lens,
            slot_mappings=slots,
            logits_indices=logits,
            sampling_req_ids=sampling,
            block_table_rows=[rows[r] for r in order],
        )


def check(batch: InputBatch, ref: Ref) -> None:
    running = {r for r, q in ref.reqs.items() if q.running}
    n = batch.num_reqs
    assert set(batch.req_ids) == running
    assert sorted(batch.req_id_to_row.values()) == list(range(n)), "rows must be dense"
    assert set(batch.requests) == set(ref.reqs)
    for r, q in ref.reqs.items():
        state = batch.requests[r]
        assert state.prompt_token_ids + batch.output_token_ids(r) == q.tokens
        assert batch.num_computed_of(r) == q.computed
        if not q.running:
            with pytest.raises(ValueError, match=r):
                batch.block_ids_of(r)
            continue
        row = batch.row_of(r)
        assert batch.block_ids_of(r) == q.tables
        assert batch.token_ids[row, : len(q.tokens)].tolist() == q.tokens
        assert batch.num_tokens[row] == len(q.tokens)
        assert batch.num_computed_tokens[row] == q.computed
    # Rows past the live ones (moved-from or removed) hold nothing a kernel could follow.
    for table in batch.block_table.tables:
        assert not table.table[n:].any()
        assert not table.num_blocks_per_row[n:].any()
    assert not batch.num_tokens[n:].any()


def check_inputs(mi: ModelInputs, expected: dict[str, Any]) -> None:
    assert mi.req_ids == expected["req_ids"]
    t = mi.num_tokens
    assert mi.input_ids[:t].tolist() == expected["input_ids"]
    assert mi.positions[:t].tolist() == expected["positions"]
    assert mi.req_rows[:t].tolist() == expected["req_rows"]
    assert mi.query_start_loc.tolist() == expected["query_start_loc"]
    assert mi.seq_lens.tolist() == expected["seq_lens"]
    assert mi.block_table_rows.tolist() == expected["block_table_rows"]
    assert [s[:t].tolist() for s in mi.slot_mappings] == expected["slot_mappings"]
    assert mi.logits_indices.tolist() == expected["logits_indices"]
    assert mi.sampling_req_ids == expected["sampling_req_ids"]
    assert mi.positions.dtype == np.int64 and mi.query_start_loc.dtype == np.int32
    assert all(s.dtype == np.int64 for s in mi.slot_mappings)
    # Padding: row -1, slot -1, token 0.
    assert (mi.req_rows[t:] == -1).all() and (mi.input_ids[t:] == 0).all()
    assert all((s[t:] == -1).all() for s in mi.slot_mappings)


class Driver:
    """Applies a step to the batch and the reference, checks both, samples tokens."""

    def __init__(self) -> None:
        self.batch = InputBatch(MAX_REQS, MAX_LEN, BLOCK_SIZES)
        self.ref = Ref()
        self.next_token = 1000

    def run(self, so: SchedulerOutput, pad_to: int | None = None) -> ModelInputs:
        self.batch.apply(so)
        self.ref.apply(so)
        check(self.batch, self.ref)
        mi = prepare_inputs(self.batch, so, pad_to=pad_to)
        check_inputs(mi, self.ref.expected_inputs(so, self.batch.req_id_to_row))
        sampled = []
        for r in mi.sampling_req_ids:
            sampled.append(self.next_token)
            self.ref.reqs[r].tokens.append(self.next_token)
            self.next_token += 1
        self.batch.append_sampled(mi.sampling_req_ids, sampled)
        check(self.batch, self.ref)
        return mi


A = list(range(100, 110))  # 10 prompt tokens
B = list(range(200, 206))  # 6
C = list(range(300, 303))  # 3
D = list(range(400, 405))  # 5


def test_scripted_stream() -> None:
    d = Driver()
    b = d.batch

    # 1. Two new requests: A starts a chunked prefill, B has a 4-token prefix hit.
    mi = d.run(
        step(
            1,
            new_reqs=(
                (new("A", A, [[10, 11], [20, 21, 22, 23]]), 8),
                (new("B", B, [[12, 13], [24, 25, 26]], computed=4), 2),
            ),
        ),
        pad_to=12,
    )
    assert b.req_id_to_row == {"A": 0, "B": 1}
    assert mi.positions.tolist() == [*range(8), 4, 5, 0, 0]
    assert mi.input_ids.tolist() == [*A[:8], 204, 205, 0, 0]
    assert mi.query_start_loc.tolist() == [0, 8, 10]
    assert mi.seq_lens.tolist() == [8, 6]
    assert mi.logits_indices.tolist() == [9]  # A is mid-prefill: it does not sample
    assert mi.sampling_req_ids == ["B"]
    assert mi.slot_mappings[0].tolist() == [*range(40, 48), 13 * 4, 13 * 4 + 1, -1, -1]
    assert mi.slot_mappings[1][8:10].tolist() == [26 * 2, 26 * 2 + 1]
    assert (mi.max_query_len, mi.max_seq_len, mi.num_padded_tokens) == (8, 8, 12)
    assert b.output_token_ids("B") == [1000]

    # 2. New C, A finishes its prefill with new blocks in both groups, B decodes with a
    #    new block in group 1 only.
    mi = d.run(
        step(
            2,
            new_reqs=((new("C", C, [[15], [29, 30]]), 3),),
            cached=((Cached("A", [[14], [27]], 8), 2), (Cached("B", [[], [28]], 6), 1)),
        )
    )
    assert b.req_id_to_row == {"A": 0, "B": 1, "C": 2}
    assert mi.block_table_rows.tolist() == [2, 0, 1]  # scheduled order, not row order
    assert mi.logits_indices.tolist() == [2, 4, 5]
    assert mi.sampling_req_ids == ["C", "A", "B"]
    assert b.block_ids_of("B") == [[12, 13], [24, 25, 26, 28]]

    # 3. A finishes: C (the last row) moves into A's row, and its old row is cleared.
    mi = d.run(
        step(3, cached=((Cached("B", None, 7), 1), (Cached("C", None, 3), 1)), finished=("A",))
    )
    assert b.req_id_to_row == {"C": 0, "B": 1}
    assert b.block_table[0].num_blocks_per_row[2] == 0 and not b.block_table[1].table[2].any()
    assert mi.block_table_rows.tolist() == [1, 0]
    assert mi.input_ids.tolist() == [1003, 1001]  # B's and C's sampled tokens
    assert mi.positions.tolist() == [7, 3]

    # 4. B is preempted (keeps its 9 tokens); D takes its row.
    mi = d.run(
        step(
            4,
            new_reqs=((new("D", D, [[16, 17], [31, 32, 33]]), 5),),
            cached=((Cached("C", [[18], [34]], 4), 1),),
            preempted=("B",),
        )
    )
    assert b.req_id_to_row == {"C": 0, "D": 1}
    assert b.output_token_ids("B") == [1000, 1003, 1004]
    assert not b.block_table[0].table[2:].any() and not b.block_table[1].table[2:].any()

    # 5. C finishes while B resumes with a replaced table and a prefix hit: B recomputes
    #    its tail, prompt and sampled tokens alike.
    mi = d.run(
        step(
            5,
            cached=(
                (Cached("B", [[40, 41, 42], [50, 51, 52, 53, 54]], 4, resumed=True), 5),
                (Cached("D", None, 5), 1),
            ),
            finished=("C",),
        )
    )
    assert b.req_id_to_row == {"B": 0, "D": 1}
    assert b.block_ids_of("B") == [[40, 41, 42], [50, 51, 52, 53, 54]]
    assert mi.input_ids[:5].tolist() == [204, 205, 1000, 1003, 1004]
    assert mi.logits_indices.tolist() == [4, 5]

    # 6. Two new requests fill the batch; B and D decode.
    d.run(
        step(
            6,
            new_reqs=(
                (new("E", [1, 2, 3, 4, 5], [[60, 61], [70, 71, 72]]), 4),
                (new("F", [7, 8], [[62], [73]]), 2),
            ),
            cached=((Cached("B", None, 9), 1), (Cached("D", [[], [35]], 6), 1)),
        )
    )
    assert b.req_id_to_row == {"B": 0, "D": 1, "E": 2, "F": 3}

    # 7. Several at once: B finishes and E is preempted; F moves from row 3 into row 0,
    #    and the hole at row 2 is simply the end of the batch.
    d.run(
        step(
            7,
            cached=((Cached("D", None, 7), 1), (Cached("F", [[], [79]], 2), 1)),
            finished=("B",),
            preempted=("E",),
        )
    )
    assert b.req_id_to_row == {"F": 0, "D": 1}

    # 8. E resumes (it never finished its prompt, so it has no sampled tokens) next to
    #    a new G; then all four finish in one step.
    d.run(
        step(
            8,
            new_reqs=((new("G", [9, 9, 9], [[63], [74, 75]]), 3),),
            cached=((Cached("E", [[64, 65], [76, 77, 78]], 0, resumed=True), 5),),
        )
    )
    assert b.req_id_to_row == {"F": 0, "D": 1, "G": 2, "E": 3}
    d.run(step(9, finished=("D", "E", "F", "G")))
    assert b.num_reqs == 0 and not b.requests


def test_finish_preempted_request_and_preempt_then_resume_same_step() -> None:
    d = Driver()
    d.run(step(1, new_reqs=((new("A", [1, 2, 3], [[1], [2, 3]]), 3),)))
    d.run(step(2, new_reqs=((new("B", [4], [[4], [5]]), 1),), preempted=("A",)))
    d.run(
        step(
            3,
            cached=((Cached("B", [[6], [7]], 1), 1),),
            new_reqs=((new("C", [5, 5], [[8], [9]]), 2),),
        )
    )
    d.run(
        step(
            4,
            cached=(
                (Cached("C", [[], [10]], 2), 1),
                (Cached("B", None, 2), 1),
            ),
        )
    )
    # B is preempted and resumed in the same step, with a new table.
    d.run(
        step(
            5,
            cached=((Cached("C", None, 3), 1), (Cached("B", [[11, 12], [13, 14, 15]], 1, True), 2)),
            preempted=("B",),
        )
    )
    assert d.batch.block_ids_of("B") == [[11, 12], [13, 14, 15]]
    # A finishes while still preempted: its state goes, no row is touched.
    d.run(step(6, finished=("A", "C"), cached=((Cached("B", None, 3), 1),)))
    assert d.batch.req_ids == ["B"] and set(d.batch.requests) == {"B"}


# -- corrupt streams -------------------------------------------------------------------


def fresh() -> InputBatch:
    b = InputBatch(2, 16, BLOCK_SIZES)
    b.apply(step(1, new_reqs=((new("A", [1, 2, 3], [[1], [2, 3]]), 3),)))
    b.append_sampled(["A"], [4])
    return b


@pytest.mark.parametrize(
    ("so", "match"),
    [
        (step(2, finished=("nope",)), "'nope'"),
        (step(2, preempted=("nope",)), "'nope'"),
        (step(2, new_reqs=((new("A", [1], [[5], [6]]), 1),)), "'A' already exists"),
        (step(2, cached=((Cached("nope", None, 3), 1),)), "'nope' is unknown"),
        (step(2, cached=((Cached("nope", [[9], [9]], 0, True), 1),)), "'nope' is unknown"),
        (step(2, cached=((Cached("A", [[9], [9]], 0, True), 1),)), "'A' is already in the batch"),
        (step(2, cached=((Cached("A", [[9]], 3), 1),)), "'A': block ids for 1 KV cache groups"),
        (step(2, cached=((Cached("A", None, 7), 1),)), "'A'.*num_computed_tokens=7"),
        (step(2, new_reqs=((new("B", [1], [[5]]), 1),)), "'B': block ids for 1 KV cache groups"),
        (
            step(2, cached=((Cached("A", None, 3), 1), (Cached("A", None, 3), 1))),
            "'A' is scheduled twice",
        ),
        (
            step(
                2,
                new_reqs=(
                    (new("B", [1], [[5], [6]]), 1),
                    (new("C", [1], [[7], [8]]), 1),
                ),
            ),
            "'C'.*batch is full",
        ),
        (step(2, new_reqs=((new("B", [1] * 17, [[5], [6]]), 1),)), "'B'.*max_model_len"),
    ],
)
def test_corrupt_stream_raises(so: SchedulerOutput, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        fresh().apply(so)


def test_cached_request_out_of_batch_raises() -> None:
    b = fresh()
    b.apply(step(2, preempted=("A",)))
    with pytest.raises(ValueError, match="'A' is not in the batch"):
        b.apply(step(3, cached=((Cached("A", None, 0), 1),)))
    with pytest.raises(ValueError, match="'A' is not in the batch"):
        fresh().apply(step(2, preempted=("A", "A")))
    with pytest.raises(ValueError, match="'A' came without its block table"):
        b.apply(step(3, cached=((Cached("A", None, 0, True), 1),)))
    with pytest.raises(ValueError, match="'A' already exists"):
        b.apply(step(3, new_reqs=((new("A", [1], [[5], [6]]), 1),)))


def test_block_overflow_raises_through_apply() -> None:
    b = fresh()  # 16 tokens: group 0 holds 4 blocks of 4, group 1 holds 8 of 2
    with pytest.raises(ValueError, match=r"row 0: appending 4 blocks to 1 exceeds .*=4"):
        b.apply(step(2, cached=((Cached("A", [[5, 6, 7, 8], []], 3), 1),)))


def test_prepare_inputs_and_append_sampled_errors() -> None:
    b = fresh()  # A: 4 known tokens, 3 computed
    so = step(2, cached=((Cached("A", None, 3), 2),))
    b.apply(so)
    with pytest.raises(ValueError, match="'A' is scheduled up to position 4"):
        prepare_inputs(b, so)
    bad_total = SchedulerOutput(2, [], so.cached_reqs, [1], 5, [], [])
    with pytest.raises(ValueError, match="total_num_scheduled_tokens=5"):
        prepare_inputs(b, bad_total)
    bad_len = SchedulerOutput(2, [], so.cached_reqs, [1, 1], 2, [], [])
    with pytest.raises(ValueError, match="2 num_scheduled_tokens"):
        prepare_inputs(b, bad_len)
    ok = step(2, cached=((Cached("A", None, 3), 1),))
    with pytest.raises(ValueError, match="pad_to=0"):
        prepare_inputs(b, ok, pad_to=0)
    assert prepare_inputs(b, ok).sampling_req_ids == ["A"]
    with pytest.raises(ValueError, match="'nope'"):
        b.append_sampled(["nope"], [1])
    with pytest.raises(ValueError, match="twice"):
        b.append_sampled(["A", "A"], [1, 2])
    with pytest.raises(ValueError, match="2 tokens"):
        b.append_sampled(["A"], [1, 2])
    assert b.output_token_ids("A") == [4]  # failed calls changed nothing


# -- vectorisation sanity (no timing) --------------------------------------------------

WORKER_DIR = str(Path(__file__).resolve().parents[2] / "worker")


def count_worker_lines(fn: Callable[[], object]) -> int:
    """Python lines executed inside worker/ while fn runs: a per-token Python loop
    would make this grow with the token count."""
    count = 0

    def local(frame: Any, event: str, arg: Any) -> Any:
        nonlocal count
        if event == "line":
            count += 1
        return local

    def global_(frame: Any, event: str, arg: Any) -> Any:
        return local if frame.f_code.co_filename.startswith(WORKER_DIR) else None

    old = sys.gettrace()
    sys.settrace(global_)
    try:
        fn()
    finally:
        sys.settrace(old)
    return count


def decode_lines(num_reqs: int, tokens_per_req: int) -> int:
    """Lines to apply and prepare one step of num_reqs running requests."""
    prompt_len = 16
    b = InputBatch(num_reqs, 64, [16, 8])
    first = step(
        1,
        new_reqs=tuple(
            (new(f"r{i}", [i % 50] * prompt_len, [[i + 1], [2 * i + 1, 2 * i + 2]]), prompt_len)
            for i in range(num_reqs)
        ),
    )
    b.apply(first)
    mi = prepare_inputs(b, first)
    assert len(mi.sampling_req_ids) == num_reqs
    b.append_sampled(mi.sampling_req_ids, list(range(num_reqs)))
    for _ in range(tokens_per_req - 1):  # known tokens to schedule several per request
        b.append_sampled(mi.sampling_req_ids, list(range(num_reqs)))
    nxt = step(
        2,
        cached=tuple(
            (Cached(f"r{i}", [[1000 + i], [2000 + i]], prompt_len), tokens_per_req)
            for i in range(num_reqs)
        ),
    )

    def run() -> None:
        b.apply(nxt)
        out = prepare_inputs(b, nxt, pad_to=num_reqs * tokens_per_req + 8)
        assert out.num_tokens == num_reqs * tokens_per_req

    return count_worker_lines(run)


def test_step_is_vectorised() -> None:
    # The same 256-request step costs the same Python lines for 1 or 8 tokens each...
    decode = decode_lines(256, 1)
    assert decode_lines(256, 8) == decode
    # ...and a bounded number of lines per request.
    assert decode < 64 * 256, decode
    assert decode_lines(128, 1) < decode


@pytest.mark.skipif(
    not torch.cuda.is_available(),
    reason="no CUDA GPU present: pinned memory and device copies need one",
)
def test_cuda_commit_is_async_but_consistent() -> None:
    t = BlockTable(16, 8, 4, device="cuda")
    t.add_row([1, 2, 3], 0)
    t.add_row([4], 1)
    first = t.commit(2)
    # Editing the mirror right away must not leak into the copy already queued.
    t.add_row([9, 9, 9, 9], 0)
    assert first.cpu().tolist() == [[1, 2, 3, 0], [4, 0, 0, 0]]
    second = t.commit(1)
    assert second.data_ptr() == t.device_table.data_ptr()
    assert t.device_table.cpu().tolist()[:2] == [[9, 9, 9, 9], [4, 0, 0, 0]]
