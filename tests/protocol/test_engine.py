"""protocol/engine.py: sampling parameters resolve their unset fields from the model's
defaults and refuse a bad field by name; the client and core messages round-trip on the
wire; a priority needs the priority policy; truncation takes >= 1 or -1."""

from __future__ import annotations

import math

import msgspec
import pytest

from protocol.engine import (
    AbortRequests,
    AddRequest,
    ClientMessage,
    CoreMessage,
    EngineDead,
    EngineOutputs,
    EngineReady,
    Logprobs,
    Rejection,
    RequestOutput,
    ResetPrefixCache,
    SamplingDefaults,
    SamplingParams,
    SchedulerStats,
    ShutdownCore,
    StructuredOutputs,
    priority_error,
    truncation_error,
)


def test_unset_fields_take_the_model_s_defaults_and_a_tiny_temperature_is_greedy() -> None:
    model = SamplingDefaults(temperature=0.7, top_p=0.9, top_k=40, min_p=0.05)
    resolved = SamplingParams(top_k=5).resolve(model)
    assert (resolved.temperature, resolved.top_p, resolved.top_k, resolved.min_p) == (
        0.7,
        0.9,
        5,
        0.05,
    )
    assert SamplingParams(temperature=1e-9).resolve().temperature == 0.0
    full = SamplingParams(temperature=0.5, top_p=1.0, top_k=0, min_p=0.0)
    assert full.resolve(model) is full  # nothing to change: no copy


@pytest.mark.parametrize(
    ("params", "message"),
    [
        (SamplingParams(max_tokens=0), "max_tokens must be in"),
        (SamplingParams(temperature=math.nan), "temperature must be >= 0, got nan"),
        (SamplingParams(top_p=0.0), r"top_p must be in \(0, 1\]"),
        (
            SamplingParams(stop_token_ids=[100]),
            r"stop token id 100 is outside the vocabulary \[0, 100\)",
        ),
        (SamplingParams(n=17), r"n must be in \[1, 16\]"),
        (SamplingParams(stop=[""]), "stop strings must not be empty"),
        (SamplingParams(max_tokens=2, min_tokens=3), "min_tokens must be in"),
        (SamplingParams(repetition_penalty=0.0), "repetition_penalty must be > 0"),
        (SamplingParams(logprobs=21), r"logprobs must be in \[0, 20\]"),
        (SamplingParams(logit_bias={3: 101.0}), r"logit_bias for token 3 must be in \[-100, 100\]"),
        (SamplingParams(allowed_token_ids=[]), "allowed_token_ids must not be empty"),
        (SamplingParams(bad_words_token_ids=[[]]), "each sequence holds 1 to 32 tokens"),
        (SamplingParams(truncate_prompt_tokens=0), "truncate_prompt_tokens must be >= 1"),
        (
            SamplingParams(structured_outputs=StructuredOutputs(regex="a", choice=["b"])),
            "exactly one of .* \\(got regex, choice\\)",
        ),
        (
            SamplingParams(structured_outputs=StructuredOutputs(json_object=True), ignore_eos=True),
            "ignore_eos cannot be combined with structured_outputs",
        ),
    ],
)
def test_a_bad_field_is_named(params: SamplingParams, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        params.validate(vocab_size=100)


def test_good_parameters_pass_and_penalties_are_noticed() -> None:
    params = SamplingParams(
        max_tokens=5,
        temperature=0.0,
        stop_token_ids=[99],
        logit_bias={0: -100.0},
        structured_outputs=StructuredOutputs(choice=["yes", "no"]),
    )
    params.validate(vocab_size=100)
    assert params.structured_outputs is not None
    assert params.structured_outputs.kind() == "choice"
    assert not params.has_penalties
    assert SamplingParams(frequency_penalty=0.5).has_penalties


def test_client_messages_round_trip() -> None:
    messages = [
        AddRequest("r", [1, 2], SamplingParams(max_tokens=3, seed=4), cache_salt="s", priority=-1),
        AbortRequests(["r"]),
        ResetPrefixCache(),
        ShutdownCore(),
    ]
    for m in messages:
        assert msgspec.msgpack.decode(msgspec.msgpack.encode(m), type=ClientMessage) == m


def test_core_messages_round_trip() -> None:
    lp = Logprobs(-0.5, [3, 4], [-0.5, -1.5])
    messages = [
        EngineOutputs(
            [RequestOutput("r", [3], "stop", 2, logprobs=[lp], queued_s=0.1)],
            SchedulerStats(1, 0, 0.5, 10, 4, 0, 7),
            [Rejection("r", "already open")],
        ),
        EngineReady(10, 16, 2048, 100, [2], SamplingDefaults(temperature=0.6)),
        EngineDead("worker rank 0 failed"),
    ]
    for m in messages:
        assert msgspec.msgpack.decode(msgspec.msgpack.encode(m), type=CoreMessage) == m


def test_a_priority_needs_the_priority_policy() -> None:
    assert priority_error(0, "fcfs") is None and priority_error(-3, "priority") is None
    assert "needs the priority scheduling policy" in (priority_error(1, "fcfs") or "")
    assert priority_error(True, "priority") == "priority must be an integer, not True"


def test_truncation_takes_a_positive_count_or_minus_one() -> None:
    for ok in (None, 1, 500, -1):
        assert truncation_error(ok) is None
    for bad in (0, -2, 1.5, True):
        assert truncation_error(bad) is not None
