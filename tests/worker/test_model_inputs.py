"""worker/model_inputs.py: one step's flat inputs from the persistent batch, every array
checked against values worked out by hand for a chunked prefill, a decode and padding."""

from __future__ import annotations

import numpy as np
import pytest

from protocol.engine import SamplingParams
from protocol.worker import CachedRequestData, NewRequestData, SchedulerOutput
from worker.input_batch import InputBatch
from worker.model_inputs import prepare_inputs

BLOCK = 4
A_PROMPT = [10, 11, 12, 13, 14]
B_PROMPT = [20, 21]


def _first_step(batch: InputBatch) -> SchedulerOutput:
    """A's first 3 of 5 prompt tokens (a chunk), all of B's 2."""
    new = [
        NewRequestData("A", A_PROMPT, SamplingParams(), [[3, 4]], 0),
        NewRequestData("B", B_PROMPT, SamplingParams(), [[7]], 0),
    ]
    so = SchedulerOutput(0, new, CachedRequestData([], [], [], [], []), [3, 2], 5, [], [])
    batch.apply(so)
    return so


def _ints(a: np.ndarray) -> list[int]:
    return [int(x) for x in a]


def test_a_chunked_prefill_lays_out_tokens_slots_and_only_the_finished_prompt_samples() -> None:
    batch = InputBatch(4, 32, [BLOCK])
    inputs = prepare_inputs(batch, _first_step(batch))
    assert inputs.req_ids == ["A", "B"] and inputs.num_tokens == 5
    assert _ints(inputs.input_ids) == [10, 11, 12, 20, 21]
    assert _ints(inputs.positions) == [0, 1, 2, 0, 1]
    assert _ints(inputs.query_start_loc) == [0, 3, 5]
    assert _ints(inputs.seq_lens) == [3, 2] and _ints(inputs.num_computed_tokens) == [0, 0]
    # slot = block id * block size + position within the block
    assert _ints(inputs.slot_mappings[0]) == [12, 13, 14, 28, 29]
    rows = _ints(inputs.block_table_rows)
    assert _ints(inputs.req_rows) == [rows[0]] * 3 + [rows[1]] * 2
    # A is mid-prompt: only B, whose last token is B's final one, samples.
    assert inputs.sampling_req_ids == ["B"] and _ints(inputs.logits_indices) == [4]
    assert _ints(inputs.sampling_rows) == [rows[1]]
    assert (inputs.max_query_len, inputs.max_seq_len) == (3, 3)


def test_the_next_step_continues_at_each_request_s_computed_position() -> None:
    batch = InputBatch(4, 32, [BLOCK])
    _first_step(batch)
    batch.append_sampled(["B"], [22])
    cached = CachedRequestData(["A", "B"], [None, None], [3, 2], [False, False], [None, None])
    so = SchedulerOutput(1, [], cached, [2, 1], 3, [], [])
    batch.apply(so)
    inputs = prepare_inputs(batch, so)
    assert _ints(inputs.input_ids) == [13, 14, 22]
    assert _ints(inputs.positions) == [3, 4, 2]
    assert _ints(inputs.slot_mappings[0]) == [3 * BLOCK + 3, 4 * BLOCK + 0, 7 * BLOCK + 2]
    assert _ints(inputs.seq_lens) == [5, 3]
    assert inputs.sampling_req_ids == ["A", "B"] and _ints(inputs.logits_indices) == [1, 2]


def test_padding_tokens_have_no_row_and_no_slot() -> None:
    batch = InputBatch(4, 32, [BLOCK])
    inputs = prepare_inputs(batch, _first_step(batch), pad_to=8)
    assert inputs.num_tokens == 5 and inputs.num_padded_tokens == 8
    assert _ints(inputs.input_ids[5:]) == [0, 0, 0] and _ints(inputs.positions[5:]) == [0, 0, 0]
    assert _ints(inputs.req_rows[5:]) == [-1, -1, -1]
    assert _ints(inputs.slot_mappings[0][5:]) == [-1, -1, -1]


def test_token_ids_can_be_gathered_later_from_the_batch() -> None:
    batch = InputBatch(4, 32, [BLOCK])
    inputs = prepare_inputs(batch, _first_step(batch), token_ids=False)
    assert _ints(inputs.input_ids) == [0] * 5
    inputs.gather_token_ids(batch)
    assert _ints(inputs.input_ids) == [10, 11, 12, 20, 21]


def test_a_step_with_more_tokens_than_the_batch_knows_is_refused() -> None:
    batch = InputBatch(4, 32, [BLOCK])
    _first_step(batch)  # B has 2 known tokens and none sampled yet
    cached = CachedRequestData(["B"], [None], [2], [False], [None])
    so = SchedulerOutput(1, [], cached, [1], 1, [], [])
    batch.apply(so)
    with pytest.raises(ValueError, match="'B' is scheduled up to position 2 but the worker"):
        prepare_inputs(batch, so)
