"""The core does not trust the worker's answer: a ModelRunnerOutput must answer its step
with exactly the requests that were due to sample and token ids in the vocabulary; else
the step fails with a reason (the engine then stops, naming the rank), nothing hangs."""

from __future__ import annotations

import pytest
from test_scheduler_capacity import VOCAB, scheduler

from enginecore.request import Request
from protocol.engine import SamplingParams
from protocol.worker import ModelRunnerOutput


def two_due_and_one_chunking():
    """Step 1 completes a's and b's prompts (both due) and only starts c's (not due)."""
    sched = scheduler(64, chunk=12)
    params = SamplingParams(max_tokens=4, ignore_eos=True)
    for rid, n in (("a", 4), ("b", 4), ("c", 20)):
        req = Request(rid, [5] * n, sched.kv_cache_manager.block_hasher, sampling_params=params)
        assert sched.add_request(req) is None
    so = sched.schedule()
    assert so.num_scheduled_tokens == [4, 4, 4]
    return sched, so


@pytest.mark.parametrize(
    ("req_ids", "tokens", "step", "message"),
    [
        (["a"], [7], 1, "1 requests and 1 tokens in the output of step 1, but 2 requests were due"),
        (["a", "b"], [7], 1, "1 tokens"),
        (["a", "b"], [7, 8], 2, "model output of step 2 does not answer step 1"),
        (["a", "b"], [7, VOCAB], 1, f"sampled token id {VOCAB} is outside the vocabulary"),
        (["a", "b"], [7, -1], 1, "sampled token id -1 is outside the vocabulary"),
        (["a", "a"], [7, 8], 1, "a token for request a, which was not due to sample"),
        (["a", "c"], [7, 8], 1, "a token for request c, which was not due to sample"),
    ],
)
def test_a_wrong_answer_is_refused(req_ids, tokens, step, message) -> None:
    sched, so = two_due_and_one_chunking()
    with pytest.raises(ValueError, match=message):
        sched.update_from_output(so, ModelRunnerOutput(step, req_ids, tokens))


def test_the_exact_answer_is_taken() -> None:
    sched, so = two_due_and_one_chunking()
    outs = sched.update_from_output(so, ModelRunnerOutput(1, ["b", "a"], [7, 8]))
    assert {o.request_id: o.new_token_ids for o in outs} == {"a": [8], "b": [7]}
