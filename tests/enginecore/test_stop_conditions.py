"""enginecore/stop_conditions.py: EOS and stop token ids end a request once min_tokens
outputs are behind it, the length limit always does, and the quick set holds exactly the
ids that may stop it."""

from __future__ import annotations

from enginecore.request import Request
from enginecore.stop_conditions import stop_reason, stop_token_set
from protocol.engine import SamplingParams

EOS = frozenset({2})
PROMPT = [10, 11, 12, 13]  # 4 prompt tokens


def _request(**params: object) -> Request:
    return Request("r", PROMPT, sampling_params=SamplingParams(**params))


def test_eos_stops_a_request_and_a_plain_token_does_not() -> None:
    r = _request(max_tokens=8)
    assert stop_reason(r, 2, 5, EOS) == "stop"  # EOS as the first output token
    assert stop_reason(r, 7, 5, EOS) is None


def test_eos_is_ignored_when_asked_but_a_stop_token_id_still_stops() -> None:
    r = _request(max_tokens=8, ignore_eos=True, stop_token_ids=[9])
    assert stop_reason(r, 2, 5, EOS) is None
    assert stop_reason(r, 9, 5, EOS) == "stop"


def test_min_tokens_outputs_come_before_eos_can_stop() -> None:
    r = _request(max_tokens=8, min_tokens=2)
    # Output tokens 1 and 2 (num_tokens 5, 6) are below min_tokens; the third may stop.
    assert stop_reason(r, 2, 5, EOS) is None
    assert stop_reason(r, 2, 6, EOS) is None
    assert stop_reason(r, 2, 7, EOS) == "stop"


def test_the_length_limit_ends_at_prompt_plus_max_tokens() -> None:
    r = _request(max_tokens=3)
    assert r.max_num_tokens == 7
    assert stop_reason(r, 5, 6, EOS) is None
    assert stop_reason(r, 5, 7, EOS) == "length"
    # EOS on the last allowed token is a stop, not a length.
    assert stop_reason(r, 2, 7, EOS) == "stop"


def test_the_stop_token_set_is_eos_unless_ignored_plus_the_stop_ids() -> None:
    assert stop_token_set(SamplingParams(), EOS) == {2}
    assert stop_token_set(SamplingParams(stop_token_ids=[5, 6]), EOS) == {2, 5, 6}
    assert stop_token_set(SamplingParams(ignore_eos=True), EOS) == frozenset()
    assert stop_token_set(SamplingParams(ignore_eos=True, stop_token_ids=[5]), EOS) == {5}
