"""enginecore/runner_output.py: a worker's output must answer the oldest step in flight
with one in-vocabulary token per request due; prompt logprobs gather across chunks; a
first token carries its queue time, prompt logprobs and embedding."""

from __future__ import annotations

from collections import deque

import pytest

from enginecore.request import Request
from enginecore.runner_output import (
    attach_first_token_extras,
    check_runner_output,
    take_prompt_logprobs,
)
from protocol.engine import Logprobs, RequestOutput
from protocol.worker import (
    CachedRequestData,
    ModelRunnerOutput,
    PromptEmbedding,
    PromptLogprobs,
    SchedulerOutput,
)

VOCAB = 100


def _step(step_id: int) -> SchedulerOutput:
    return SchedulerOutput(step_id, [], CachedRequestData([], [], [], [], []), [], 0, [], [])


def _lp(x: float) -> Logprobs:
    return Logprobs(x, [], [])


def test_an_output_answering_the_oldest_step_pops_it() -> None:
    due = deque([(3, 2), (4, 1)])
    check_runner_output(_step(3), ModelRunnerOutput(3, ["a", "b"], [5, 99]), due, VOCAB)
    assert list(due) == [(4, 1)]


@pytest.mark.parametrize(
    ("output", "message"),
    [
        (ModelRunnerOutput(4, ["a", "b"], [1, 2]), "output of step 4 does not answer step 3"),
        (ModelRunnerOutput(3, ["a"], [1]), "1 requests and 1 tokens .* but 2 requests were due"),
        (ModelRunnerOutput(3, ["a", "b"], [1, 100]), "token id 100 is outside the vocabulary"),
        (ModelRunnerOutput(3, ["a", "b"], [-1, 2]), "token id -1 is outside the vocabulary"),
        (ModelRunnerOutput(3, ["a", "b"], [1, 2], [_lp(0.0)]), "logprobs for 1 of 2"),
    ],
)
def test_a_wrong_output_is_refused_with_the_reason(output: ModelRunnerOutput, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        check_runner_output(_step(3), output, deque([(3, 2)]), VOCAB)


def test_an_output_with_no_step_in_flight_is_refused() -> None:
    with pytest.raises(ValueError, match="does not answer"):
        check_runner_output(_step(3), ModelRunnerOutput(3, [], []), deque(), VOCAB)


def test_prompt_logprobs_complete_over_chunks_and_a_repeat_adds_nothing() -> None:
    r = Request("r", [1, 2, 3, 4, 5], wants_prompt_logprobs=True)  # 4 logprobs due
    requests = {"r": r}
    first = PromptLogprobs("r", 1, [_lp(-1.0), _lp(-2.0)])
    assert take_prompt_logprobs(requests, [first]) == {}
    # Chunk from token 2 again (a recompute) overlaps one already held.
    done = take_prompt_logprobs(requests, [PromptLogprobs("r", 2, [_lp(-9.0), _lp(-3.0)])])
    assert done == {}
    done = take_prompt_logprobs(requests, [PromptLogprobs("r", 4, [_lp(-4.0)])])
    assert [x.logprob for x in done["r"]] == [-1.0, -2.0, -3.0, -4.0]
    assert r.prompt_logprobs is None  # answered: later chunks are ignored
    assert take_prompt_logprobs(requests, [PromptLogprobs("r", 1, [_lp(0.0)])]) == {}


def test_a_prompt_logprob_chunk_that_skips_tokens_is_refused() -> None:
    r = Request("r", [1, 2, 3, 4, 5], wants_prompt_logprobs=True)
    with pytest.raises(ValueError, match="tokens 3 to 3, but token 1 is due"):
        take_prompt_logprobs({"r": r}, [PromptLogprobs("r", 3, [_lp(0.0)])])


def test_first_token_extras_go_to_their_own_request_only() -> None:
    outputs = [RequestOutput("a", [7]), RequestOutput("b", [8])]
    queue_times = {"a": 0.25, "gone": 1.0}
    output = ModelRunnerOutput(1, ["a", "b"], [7, 8], embeddings=[PromptEmbedding("b", b"\0" * 4)])
    got = attach_first_token_extras(outputs, queue_times, {"b": [_lp(-1.0)]}, output)
    assert got[0] == RequestOutput("a", [7], queued_s=0.25)
    assert got[1] == RequestOutput("b", [8], prompt_logprobs=[_lp(-1.0)], embedding=b"\0" * 4)
    assert queue_times == {"gone": 1.0}  # a's was taken


def test_a_step_without_extras_returns_its_outputs_unchanged() -> None:
    outputs = [RequestOutput("a", [7])]
    assert attach_first_token_extras(outputs, {}, None, ModelRunnerOutput(1, ["a"], [7])) == [
        RequestOutput("a", [7])
    ]
