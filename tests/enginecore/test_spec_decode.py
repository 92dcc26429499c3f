"""Speculative decoding in the core: the n-gram and suffix drafters, and the scheduler's
rules for drafts. Drafts ride in lookahead slots inside the token budget and the
request's remaining length; no block holding an unverified token is ever hashed; the
accepted tokens are applied in order, each checked for a stop (tokens after a stop are
dropped); the blocks of rejected drafts go back to the pool; a wrong answer fails."""

from __future__ import annotations

import pytest

from enginecore.kv_cache_config import with_num_blocks
from enginecore.request import Request
from enginecore.scheduler import Scheduler
from enginecore.spec_decode.ngram import NgramIndex
from enginecore.spec_decode.suffix import SuffixCache
from protocol.engine import Logprobs, SamplingParams, StructuredOutputs
from protocol.kv_cache import KVCacheGroupSpec
from protocol.speculative import SpeculativeConfig
from protocol.worker import ModelRunnerOutput, SchedulerOutput
from tests.helpers.kv_helpers import SCHEDULER_VOCAB, full, sched_config, window

NGRAM = {
    "method": "ngram",
    "num_speculative_tokens": 3,
    "prompt_lookup_min": 2,
    "prompt_lookup_max": 3,
}
# A prompt whose tail (4 5 6) occurred before, followed by 7 8 9 10.
PROMPT = [3, 4, 5, 6, 7, 8, 9, 10, 11, 4, 5, 6]


def test_ngram_proposes_what_followed_the_longest_earlier_match() -> None:
    index = NgramIndex(1, 3)
    assert index.propose(PROMPT, 3) == [7, 8, 9]
    assert index.match_length == 3
    assert index.propose(PROMPT, 2) == [7, 8]
    assert index.propose([3, 4, 5, 6], 3) == []  # 6 never occurred before
    # Tokens arriving later are indexed incrementally.
    assert index.propose([*PROMPT, 7, 8, 12, 4, 5], 2) == [6, 7]


def test_ngram_respects_the_shortest_lookup() -> None:
    assert NgramIndex(2, 3).propose([1, 2, 9, 5, 2], 2) == []  # only 1 token matches
    assert NgramIndex(1, 3).propose([1, 2, 9, 5, 2], 2) == [9, 5]


def test_suffix_drafts_from_a_finished_requests_output_and_forgets_the_oldest() -> None:
    config = SpeculativeConfig(
        method="suffix", num_speculative_tokens=4, suffix_decoding_max_cached_requests=1
    )
    cache = SuffixCache(config)
    cache.finish("a", [1, 1, 20, 21, 22, 23, 24], num_prompt=2)
    assert cache.propose("b", [5, 6, 20, 21], num_prompt=2, k=4) == [22, 23]  # 2 matched
    cache.finish("c", [1, 30, 31, 32], num_prompt=1)  # evicts a's output
    assert cache.propose("d", [5, 6, 20, 21], num_prompt=2, k=4) == []
    assert cache.propose("e", [7, 30, 31], num_prompt=1, k=4) == [32]


def make_spec_scheduler(
    num_blocks: int = 40, chunk: int = 64, specs: tuple = (), spec: dict = NGRAM
) -> Scheduler:
    groups = [KVCacheGroupSpec([f"l{i}"], s) for i, s in enumerate(specs or (full(),))]
    config = sched_config(64, max_num_batched_tokens=chunk, max_num_seqs=8, speculative_config=spec)
    return Scheduler(config, with_num_blocks(groups, num_blocks), SCHEDULER_VOCAB)


def add(sched: Scheduler, rid: str, prompt: list[int], **params: object) -> Request:
    sp = SamplingParams(**{"max_tokens": 20, "ignore_eos": True, **params})  # type: ignore[arg-type]
    request = sched.new_request(rid, prompt, sp)
    assert sched.add_request(request) is None
    return request


def answer(sched: Scheduler, so: SchedulerOutput, tokens: dict[str, list[int]]) -> list:
    """Answer the step: each due request's emitted tokens (the first, then the rest)."""
    rids = list(tokens)
    spec = [tokens[r][1:] for r in rids] if so.spec_token_ids else []
    out = ModelRunnerOutput(so.step_id, rids, [tokens[r][0] for r in rids], spec_token_ids=spec)
    outputs = sched.update_from_output(so, out)
    sched.check_invariants()
    return outputs


def held(sched: Scheduler, rid: str) -> list[int]:
    return [len(ids) for ids in sched.kv_cache_manager.get_block_ids(rid)]


def cached_tokens(sched: Scheduler) -> int:
    """Tokens covered by published (hashed) blocks of group 0."""
    return sum(len(b) for _, b in sched.kv_cache_manager.block_pool.cached_entries(0)) * 4


def test_drafts_take_lookahead_slots_and_only_verified_tokens_are_cached() -> None:
    sched = make_spec_scheduler()
    request = add(sched, "a", PROMPT)
    so = sched.schedule()
    assert not so.spec_token_ids  # a prefill drafts nothing
    answer(sched, so, {"a": [7]})
    so = sched.schedule()
    # Tail 5 6 7 matched earlier: 8 9 10 follow. The last token plus three drafts run.
    assert so.spec_token_ids == {"a": [8, 9, 10]}
    assert so.num_scheduled_tokens == [4]
    assert request.num_computed_tokens == 13  # the drafts are not computed yet
    assert held(sched, "a") == [4]  # slots for 16 tokens: 13 + 3 lookahead
    assert cached_tokens(sched) <= 12  # block 3 holds drafts: never hashed
    sched.check_invariants()
    # Two drafts accepted, the third rejected: 8 9, then the target's 42.
    outputs = answer(sched, so, {"a": [8, 9, 42]})
    assert outputs[0].new_token_ids == [8, 9, 42]
    assert request.all_token_ids[-4:] == [7, 8, 9, 42]
    assert request.num_computed_tokens == 15
    assert held(sched, "a") == [4]  # 16 tokens fill four blocks
    stats = sched.stats().spec_decode
    assert stats is not None
    assert (stats.num_drafts, stats.num_draft_tokens, stats.num_accepted_tokens) == (1, 3, 2)
    assert stats.accepted_per_pos == [1, 1, 0]


def test_rejected_drafts_blocks_go_back_to_the_pool() -> None:
    sched = make_spec_scheduler()
    prompt = [3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 5, 6]
    add(sched, "a", prompt)  # 15 tokens: tail 5 6 matched, 7 8 9 follow
    answer(sched, sched.schedule(), {"a": [7]})  # 16 tokens, 4 blocks
    so = sched.schedule()
    assert so.spec_token_ids == {"a": [8, 9, 10]}
    assert held(sched, "a") == [5]  # 19 slots
    free = sched.kv_cache_manager.num_free_blocks
    answer(sched, so, {"a": [50]})  # every draft rejected
    assert held(sched, "a") == [5]  # 17 tokens: the fifth block holds the last one
    assert sched.kv_cache_manager.num_free_blocks == free


def test_a_block_holding_only_rejected_drafts_is_freed() -> None:
    sched = make_spec_scheduler()
    add(sched, "a", PROMPT[:-2])  # 10 tokens
    answer(sched, sched.schedule(), {"a": [5]})  # 11 tokens: tail 4 5 matched earlier
    so = sched.schedule()
    assert so.spec_token_ids == {"a": [6, 7, 8]}
    assert held(sched, "a") == [4]  # slots for 11 + 3 = 14 tokens
    free = sched.kv_cache_manager.num_free_blocks
    answer(sched, so, {"a": [60]})  # all rejected: 12 tokens fill three blocks
    assert held(sched, "a") == [3]
    assert sched.kv_cache_manager.num_free_blocks == free + 1
    sched.schedule()  # the 12th token's slot is in the third block: nothing new
    assert held(sched, "a") == [3]


@pytest.mark.parametrize(
    ("params", "emitted", "kept", "reason"),
    [
        ({"stop_token_ids": [9]}, [8, 9, 10], [8, 9], "stop"),  # dropped after a stop
        ({"max_tokens": 3}, [8, 9], [8, 9], "length"),  # drafts capped by the length
    ],
)
def test_accepted_tokens_are_checked_for_stops_in_order(
    params: dict, emitted: list[int], kept: list[int], reason: str
) -> None:
    sched = make_spec_scheduler()
    add(sched, "a", PROMPT, **params)
    answer(sched, sched.schedule(), {"a": [7]})
    so = sched.schedule()
    assert so.spec_token_ids["a"][: len(emitted) - 1] == emitted[:-1]
    outputs = answer(sched, so, {"a": emitted})
    assert outputs[0].new_token_ids == kept
    assert outputs[0].finish_reason == reason
    assert not sched.has_unfinished_requests()
    sched.check_invariants()  # every block back in the pool


def due(sched: Scheduler, so: SchedulerOutput) -> list[str]:
    rids = [r.req_id for r in so.new_reqs] + list(so.cached_reqs.req_ids)
    return [r for r in rids if sched.requests[r].num_pending_tokens]


def test_drafts_stay_inside_the_token_budget_and_leave_later_requests_a_token() -> None:
    sched = make_spec_scheduler(chunk=5)
    a = add(sched, "a", PROMPT)
    add(sched, "b", [*PROMPT[:-1], 99])  # 99 never occurred: b never drafts
    cycle = [7, 8, 9, 10, 11, 4, 5, 6]  # a's tokens go on repeating its pattern
    for _ in range(6):  # prefill both (5 tokens a step), then decode
        so = sched.schedule()
        assert so.total_num_scheduled_tokens <= 5
        rids = due(sched, so)
        if "b" in rids and len(so.spec_token_ids.get("a", [])) == 3:
            # a took 5 - 2 = 3 drafts: one token stays for b.
            assert so.num_scheduled_tokens == [4, 1]
            return
        n = len(a.all_token_ids) - len(PROMPT)
        truth = [cycle[(n + j) % len(cycle)] for j in range(4)]
        answer(sched, so, {r: truth[: len(so.spec_token_ids.get(r, [])) + 1] for r in rids})
    raise AssertionError("a never drafted beside b")


def test_a_request_with_structured_outputs_does_not_draft_and_penalties_do() -> None:
    # A grammar would have to advance through unverified drafts; penalties, biases and
    # logprobs are applied per verified position by the workers.
    sched = make_spec_scheduler()
    add(sched, "a", PROMPT, ignore_eos=False, structured_outputs=StructuredOutputs(regex="[a-z]+"))
    add(sched, "b", PROMPT, presence_penalty=0.5, logprobs=1, logit_bias={3: 1.0})
    answer(sched, sched.schedule(), {"a": [7], "b": [7]})
    assert list(sched.schedule().spec_token_ids) == ["b"]


def test_logprobs_of_accepted_tokens_must_match_them() -> None:
    sched = make_spec_scheduler()
    add(sched, "a", PROMPT, logprobs=0)
    lp = Logprobs(-0.5, [], [])
    first = sched.schedule()
    sched.update_from_output(first, ModelRunnerOutput(first.step_id, ["a"], [7], [lp]))
    so = sched.schedule()
    drafts = so.spec_token_ids["a"]
    out = ModelRunnerOutput(
        so.step_id, ["a"], [drafts[0]], [lp], spec_token_ids=[[drafts[1]]], spec_logprobs=[[]]
    )
    with pytest.raises(ValueError, match="no logprobs for its accepted tokens"):
        sched.update_from_output(so, out)


def test_an_answer_that_does_not_match_the_drafts_fails() -> None:
    sched = make_spec_scheduler()
    add(sched, "a", PROMPT)
    answer(sched, sched.schedule(), {"a": [7]})
    so = sched.schedule()
    out = ModelRunnerOutput(so.step_id, ["a"], [8], spec_token_ids=[[55, 1]])
    with pytest.raises(ValueError, match="differ from its drafts"):
        sched.update_from_output(so, out)


def test_sliding_window_groups_keep_the_window_of_verified_tokens() -> None:
    sched = make_spec_scheduler(specs=(full(), window(6)))
    request = add(sched, "a", PROMPT)
    answer(sched, sched.schedule(), {"a": [7]})
    for _ in range(3):
        so = sched.schedule()
        drafts = so.spec_token_ids.get("a", [])
        answer(sched, so, {"a": [*drafts[:1], 77][: len(drafts) + 1] if drafts else [77]})
    assert len(request.all_token_ids) > len(PROMPT) + 2
