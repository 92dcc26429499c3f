"""Output processing: one prompt's n core requests (names, seeds), the tokens whose text
is output, and a sequence's outputs merged into one."""

from __future__ import annotations

from launch.client.output_processor import SequenceOutput, fan_out, merge, text_token_ids
from protocol.engine import SamplingParams


def test_one_copy_keeps_the_request_id_and_n_copies_are_numbered() -> None:
    params = SamplingParams(stop=["x"], bad_words=["y"])
    ((rid, one),) = fan_out("r", params)
    # Stop strings and bad words are the client's: the core gets neither.
    assert rid == "r" and one.n == 1 and one.stop == [] and one.bad_words == []
    copies = fan_out("r", SamplingParams(n=3))
    assert [rid for rid, _ in copies] == ["r-0", "r-1", "r-2"]
    assert all(p.seed is None and p.n == 1 for _, p in copies)


def test_seeded_copies_differ_by_their_index() -> None:
    copies = fan_out("r", SamplingParams(n=3, seed=2**63 - 2))
    assert [p.seed for _, p in copies] == [2**63 - 2, 2**63 - 1, 0]


def test_the_token_that_stopped_a_request_has_no_text_unless_asked() -> None:
    assert text_token_ids([4, 5, 2], "stop", keep_stop=False) == [4, 5]
    assert text_token_ids([4, 5, 2], "stop", keep_stop=True) == [4, 5, 2]
    assert text_token_ids([4, 5, 2], "length", keep_stop=False) == [4, 5, 2]


def test_later_outputs_of_a_sequence_fold_into_the_first() -> None:
    first = SequenceOutput([1], "a", 1, None, None, None, prompt_logprobs=[None])
    merge(first, SequenceOutput([2, 3], "bc", 3, "length", None, None, embedding=[0.5]))
    assert first.new_token_ids == [1, 2, 3] and first.text == "abc"
    assert first.num_output_tokens == 3 and first.finish_reason == "length"
    assert first.prompt_logprobs == [None] and first.embedding == [0.5]
