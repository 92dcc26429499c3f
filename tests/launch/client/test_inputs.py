"""Input processing: a request is checked once, at the client boundary, before anything is
sent; a refusal names the request, the field at fault (param) and the fault (reason)."""

from __future__ import annotations

from pathlib import Path

import pytest

from launch.client.inputs import (
    InputProcessor,
    Prompt,
    RequestError,
    RequestLimits,
    check_priority,
    check_stream_interval,
    check_truncation,
    checked_params,
    truncated,
)
from protocol.engine import SamplingParams

FCFS = RequestLimits(vocab_size=256, max_model_len=64, scheduling_policy="fcfs")


@pytest.fixture(scope="module")
def inputs(chat_model: Path) -> InputProcessor:
    return InputProcessor.load(str(chat_model))


@pytest.mark.parametrize(
    ("params", "param", "reason"),
    [
        (SamplingParams(max_tokens=0), "max_tokens", "max_tokens must be in [1, 2**63), got 0"),
        (SamplingParams(top_p=2.0), "top_p", "top_p must be in (0, 1], got 2.0"),
        (SamplingParams(logprobs=-1), "logprobs", "logprobs must be in [0, "),
    ],
)
def test_bad_sampling_params_name_the_request_and_the_field(
    params: SamplingParams, param: str, reason: str
) -> None:
    with pytest.raises(RequestError) as caught:
        checked_params(params, "prompt 3", vocab_size=256)
    error = caught.value
    assert isinstance(error, ValueError)  # callers that catch ValueError still do
    assert error.param == param and error.reason.startswith(reason)
    assert str(error) == f"prompt 3: {error.reason}"


def test_params_of_the_wrong_type_are_a_type_error() -> None:
    with pytest.raises(TypeError, match="prompt 0: SamplingParams: Expected `int`, got `float`"):
        checked_params(SamplingParams(max_tokens=8.0), "prompt 0", 256)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="must be a SamplingParams, got dict"):
        checked_params({"max_tokens": 4}, "prompt 0", 256)


def test_priority_stream_interval_and_truncation_are_checked_with_their_param() -> None:
    assert check_priority(0, "fcfs") == 0 and check_priority(-3, "priority") == -3
    with pytest.raises(RequestError, match="request r: priority 2 needs the priority") as p:
        check_priority(2, "fcfs", "request r")
    assert p.value.param == "priority"
    assert check_stream_interval(4, "stream_interval") == 4
    with pytest.raises(RequestError, match="stream_interval must be an integer >= 1") as s:
        check_stream_interval(True, "stream_interval")
    assert s.value.param == "stream_interval"
    assert check_truncation(None) is None and check_truncation(-1) == -1
    with pytest.raises(RequestError, match="truncate_prompt_tokens must be >= 1") as t:
        check_truncation(0)
    assert t.value.param == "truncate_prompt_tokens"


def test_truncation_keeps_the_last_tokens() -> None:
    assert truncated([1, 2, 3, 4], 2, 64) == [3, 4]
    assert truncated([1, 2, 3, 4], -1, 3) == [2, 3, 4]
    assert truncated([1, 2], None, 1) == [1, 2]


def test_prepare_takes_the_call_s_params_over_the_prompt_s(inputs: InputProcessor) -> None:
    own = SamplingParams(max_tokens=5)
    call = SamplingParams(max_tokens=7, truncate_prompt_tokens=2)
    p = Prompt(prompt_token_ids=[1, 2, 3], sampling_params=own, cache_salt="s", priority=0)
    one = inputs.prepare(p, call, FCFS, "request r")
    assert one.params.max_tokens == 7 and one.ids == [2, 3] and one.cache_salt == "s"
    assert inputs.prepare(p, None, FCFS, "request r").params == own
    assert inputs.prepare(Prompt(prompt_token_ids=[1]), None, FCFS, "r").params == SamplingParams()


def test_prepare_refuses_before_reading_the_prompt(inputs: InputProcessor) -> None:
    p = Prompt(prompt_token_ids=[1], priority=1)
    with pytest.raises(RequestError, match="request r: priority 1 needs") as caught:
        inputs.prepare(p, None, FCFS, "request r")
    assert caught.value.param == "priority"
    with pytest.raises(ValueError, match=r"token id 999 is outside the vocabulary \[0, 256\)"):
        inputs.prepare(Prompt(prompt_token_ids=[999]), None, FCFS, "request r")
