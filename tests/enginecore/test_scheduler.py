"""The Scheduler's boundaries. Capacity: a request that can never fit the pool fails at
once and alone, and the requests around it run exactly as they would without it; a pool
that cannot hold max_model_len refuses to start. The wire: a ModelRunnerOutput must
answer its step with exactly the requests that were due to sample and token ids in the
vocabulary; else the step fails with a reason (the engine then stops, naming the rank),
nothing hangs."""

from __future__ import annotations

import pytest

from enginecore.request import Request
from enginecore.scheduler import Scheduler
from protocol.engine import Logprobs, SamplingParams
from protocol.worker import ModelRunnerOutput, PromptLogprobs
from tests.helpers.kv_helpers import SCHEDULER_VOCAB, full, make_scheduler, window


def run(sched: Scheduler, prompts: dict[str, tuple[int, int]]) -> tuple[dict, dict[str, int]]:
    """Add (prompt length, max_tokens) requests, step to the end sampling token 7; the
    error outputs of add_request, and the step at which each request finished."""
    errors = {}
    for rid, (n, max_tokens) in prompts.items():
        params = SamplingParams(max_tokens=max_tokens, ignore_eos=True)
        req = Request(rid, [5] * n, sched.kv_cache_manager.block_hasher, sampling_params=params)
        out = sched.add_request(req)
        if out is not None:
            errors[rid] = out
    finished: dict[str, int] = {}
    while sched.has_unfinished_requests():
        so = sched.schedule()
        rids = [r.req_id for r in so.new_reqs] + list(so.cached_reqs.req_ids)
        due = [
            r for r in rids if sched.requests[r].num_computed_tokens >= sched.requests[r].num_tokens
        ]
        out = ModelRunnerOutput(so.step_id, due, [7] * len(due))
        for o in sched.update_from_output(so, out):
            if o.finish_reason:
                finished[o.request_id] = so.step_id
    return errors, finished


def test_a_request_that_can_never_fit_fails_at_once_and_alone() -> None:
    # 8 blocks of 4 tokens, 7 usable (28 tokens); L needs 40 + 4 tokens: 11 blocks.
    with_l = make_scheduler(8)
    errors, finished = run(with_l, {"A": (20, 4), "L": (40, 4), "C": (4, 4)})
    assert set(errors) == {"L"} and errors["L"].finish_reason == "error"
    assert "44 tokens (prompt + max_tokens) need 11 blocks, the cache has 7" in errors["L"].error
    without_l = make_scheduler(8)
    _, alone = run(without_l, {"A": (20, 4), "C": (4, 4)})
    assert finished == alone  # nobody waited or was preempted for L
    assert with_l.num_preemptions == without_l.num_preemptions


def test_max_tokens_is_capped_at_max_model_len_before_judging() -> None:
    # 24 tokens fit (6 blocks of 7); prompt 10 + max_tokens 1000 is capped at 24.
    errors, finished = run(make_scheduler(8, max_model_len=24), {"A": (10, 1000)})
    assert not errors and "A" in finished


@pytest.mark.parametrize(
    ("specs", "chunk", "blocks"),
    [
        ((full(),), 64, 16),  # 64 tokens / 4
        ((window(8),), 64, 16),  # the window plus a 64-token chunk covers everything
        ((window(8),), 4, 4),  # ceil((8 - 1 + 4) / 4) + 1
        ((full(), window(8)), 4, 20),  # groups share the pool: their needs add up
    ],
)
def test_start_refuses_a_pool_that_cannot_hold_max_model_len(specs, chunk: int, blocks: int):
    fits = make_scheduler(blocks + 1, *specs, chunk=chunk)
    fits.check_capacity()
    short = make_scheduler(blocks, *specs, chunk=chunk)
    with pytest.raises(
        ValueError,
        match=f"holds {blocks - 1} blocks, but one request of "
        f"max_model_len 64 tokens needs {blocks}",
    ):
        short.check_capacity()


def two_due_and_one_chunking():
    """Step 1 completes a's and b's prompts (both due) and only starts c's (not due). c is
    long enough that a and b do not wait for it (no wave of WAVE_DEFER_STEPS steps)."""
    sched = make_scheduler(64, chunk=12)
    params = SamplingParams(max_tokens=4, ignore_eos=True)
    for rid, n in (("a", 4), ("b", 4), ("c", 56)):
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
        (
            ["a", "b"],
            [7, SCHEDULER_VOCAB],
            1,
            f"sampled token id {SCHEDULER_VOCAB} is outside the vocabulary",
        ),
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


def _lp(i: int) -> Logprobs:
    return Logprobs(-float(i), [], [])


def _prompt_logprobs_request() -> tuple:
    """A 12-token prompt asking for prompt logprobs, prefilled in chunks of 8: step 1
    (positions 0..7) yields tokens 1..8's, step 2 tokens 9..11's and samples."""
    sched = make_scheduler(64, chunk=8)
    params = SamplingParams(max_tokens=4, ignore_eos=True, prompt_logprobs=0)
    req = sched.new_request("p", list(range(1, 13)), params)
    assert sched.add_request(req) is None
    so1 = sched.schedule()
    assert so1.num_scheduled_tokens == [8]
    out1 = sched.update_from_output(
        so1,
        ModelRunnerOutput(1, [], [], [], [PromptLogprobs("p", 1, [_lp(i) for i in range(1, 9)])]),
    )
    assert out1 == []  # no token yet: the prompt logprobs wait for it
    return sched, sched.schedule()


def test_prompt_logprobs_arrive_whole_with_the_first_token() -> None:
    sched, so2 = _prompt_logprobs_request()
    # A chunk repeating tokens the core has (a prompt recomputed after a preemption) adds
    # nothing; the new ones complete the prompt.
    chunks = [
        PromptLogprobs("p", 1, [_lp(1), _lp(2)]),
        PromptLogprobs("p", 9, [_lp(i) for i in (9, 10, 11)]),
    ]
    (out,) = sched.update_from_output(so2, ModelRunnerOutput(2, ["p"], [7], [], chunks))
    assert out.new_token_ids == [7]
    assert out.prompt_logprobs == [_lp(i) for i in range(1, 12)]
    # Sent once: a later chunk for the same request is ignored.
    so3 = sched.schedule()
    (later,) = sched.update_from_output(
        so3, ModelRunnerOutput(3, ["p"], [7], [], [PromptLogprobs("p", 1, [_lp(1)])])
    )
    assert later.prompt_logprobs is None


@pytest.mark.parametrize(
    ("start", "count", "message"),
    [
        (10, 2, "tokens 10 to 11, but token 9 is due"),
        (9, 4, "tokens 9 to 12, but token 9 is due and the prompt has 12"),
    ],
)
def test_prompt_logprobs_that_skip_or_overrun_the_prompt_are_refused(start, count, message) -> None:
    sched, so2 = _prompt_logprobs_request()
    chunk = PromptLogprobs("p", start, [_lp(i) for i in range(count)])
    with pytest.raises(ValueError, match=message):
        sched.update_from_output(so2, ModelRunnerOutput(2, ["p"], [7], [], [chunk]))
