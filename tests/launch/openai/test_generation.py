"""launch/openai/generation.py: a Choice grows from its engine outputs as the answers read
it: token ids, text deltas, logprobs, the reasoning told apart, how it finished. The
Generation around it streams from an engine (test_serving_chat.py and the others)."""

from __future__ import annotations

from launch.client.request_stream import StreamOutput
from launch.openai.generation import Choice
from protocol.engine import Logprobs


def _out(ids: list[int], text: str, **fields: object) -> StreamOutput:
    return StreamOutput("req", ids, text, 0, **fields)  # type: ignore[arg-type]


def test_outputs_add_up_to_the_choice_s_tokens_text_and_finish() -> None:
    lp = [Logprobs(-0.1, [5], [-0.1]), Logprobs(-0.2, [6], [-0.2]), Logprobs(-0.3, [7], [-0.3])]
    choice = Choice(prompt=1, logprobs=True)
    choice.add(_out([5, 6], "He", logprobs=lp[:2]))
    assert choice.finish is None and choice.ids == [5, 6]
    choice.add(
        _out([7], "llo", logprobs=lp[2:], finish_reason="stop", stop_reason=7, num_cached_tokens=4)
    )
    assert choice.ids == [5, 6, 7] and "".join(choice.texts) == "Hello"
    assert choice.logprobs == lp
    assert (choice.finish, choice.stop_reason, choice.num_cached) == ("stop", 7, 4)
    assert choice.prompt == 1 and choice.split is None and choice.thoughts == []


def test_without_logprobs_asked_none_are_kept() -> None:
    choice = Choice(prompt=0, logprobs=False)
    choice.add(_out([5], "x", logprobs=[Logprobs(-0.1, [], [])]))
    assert choice.logprobs is None


def test_prompt_logprobs_come_once_and_are_kept() -> None:
    choice = Choice(prompt=0, logprobs=False)
    first = [None, Logprobs(-1.0, [], [])]
    choice.add(_out([5], "a", prompt_logprobs=first))
    choice.add(_out([6], "b"))
    assert choice.prompt_logprobs == first


def test_a_reasoning_parser_tells_the_thought_from_the_answer_as_it_streams() -> None:
    choice = Choice(prompt=0, logprobs=False, reasoning="qwen3")
    for ids, text in (([1], "<think>"), ([2], "two plus two"), ([3], "</think>"), ([4], "\n4")):
        choice.add(_out(ids, text))
    choice.add(_out([5], "!", finish_reason="length"))
    assert "".join(choice.thoughts) == "two plus two"
    assert "".join(choice.texts) == "4!"
    assert choice.split is not None and choice.split.reasoning_tokens == 3
    assert choice.finish == "length"
