"""Beam search: LLM.beam_search, AsyncLLM.beam_search and use_beam_search in the OpenAI
server (real processes).

Oracles: transformers' own beam search (generate with num_beams) of the same random
checkpoint, and hand-made next-token distributions for the rules transformers does not
share with vLLM's search (which end-of-sequence extensions finish, how a length penalty
ranks sequences of different lengths, what a finished sequence's token ids hold).
"""

from __future__ import annotations

import asyncio
import math
import os
from collections.abc import Iterator
from pathlib import Path

import openai
import pytest
import torch
import transformers

from launch import LLM, AsyncLLM
from launch.client.async_llm import run
from launch.client.beam_search import MAX_BEAM_WIDTH, BeamSearch, BeamSearchParams
from protocol.engine import Logprobs
from tests.helpers.cli_helpers import CPU
from tests.helpers.server import MODEL_NAME, Server, metrics, post, start_server

os.environ["PAGEDSERVE_CHECK_INVARIANTS"] = "1"
PROMPTS = [[11, 12, 13, 14, 15, 16, 17], [40, 41, 42, 43, 44]]
WIDTH, STEPS = 4, 6


def hf_beam_search(model_dir: Path, prompt: list[int]) -> list[tuple[list[int], float]]:
    """transformers' beam search: WIDTH sequences of STEPS tokens, best first, with their
    summed logprobs (no end-of-sequence token, no length penalty)."""
    model = transformers.AutoModelForCausalLM.from_pretrained(
        model_dir, attn_implementation="eager", dtype=torch.float32
    ).eval()
    model.generation_config.eos_token_id = None  # every beam runs STEPS tokens
    with torch.no_grad():
        out = model.generate(
            torch.tensor([prompt]),
            num_beams=WIDTH,
            num_return_sequences=WIDTH,
            do_sample=False,
            max_new_tokens=STEPS,
            length_penalty=0.0,
            pad_token_id=0,
            output_scores=True,
            return_dict_in_generate=True,
        )
    return [
        (seq[len(prompt) :].tolist(), float(score))
        for seq, score in zip(out.sequences, out.sequences_scores)
    ]


def test_llm_beam_search_matches_transformers(llama_dir: Path) -> None:
    params = BeamSearchParams(WIDTH, STEPS, ignore_eos=True, length_penalty=0.0)
    with LLM(str(llama_dir), device=CPU) as llm:
        found = llm.beam_search(PROMPTS, params)
        # A beam's prompt is its parent's: each round but the first hits the cache.
        assert llm.last_summary.stats is not None
    assert [len(f.sequences) for f in found] == [WIDTH, WIDTH]
    for prompt, result in zip(PROMPTS, found):
        want = hf_beam_search(llama_dir, prompt)
        assert [s.token_ids for s in result.sequences] == [ids for ids, _ in want]
        got_scores = [s.cum_logprob for s in result.sequences]
        assert got_scores == pytest.approx([score for _, score in want], abs=1e-3)
        for s in result.sequences:
            assert s.tokens == prompt + s.token_ids and s.finish_reason == "length"
            assert len(s.logprobs) == STEPS
            assert sum(lp.logprob for lp in s.logprobs) == pytest.approx(s.cum_logprob)
        assert result.num_cached_tokens == 0  # a fresh engine: the first round computed it


def test_async_beam_search_equals_llm(llama_dir: Path) -> None:
    params = BeamSearchParams(3, 5, ignore_eos=True)
    with LLM(str(llama_dir), device=CPU) as llm:
        (want,) = llm.beam_search([PROMPTS[0]], params)

    async def main() -> None:
        engine = await AsyncLLM.create(str(llama_dir), device=CPU)
        try:
            got = await engine.beam_search(PROMPTS[0], params)
            assert [s.token_ids for s in got.sequences] == [s.token_ids for s in want.sequences]
            assert engine.num_open_requests == 0
            # The prompt's full blocks, cached by the first search, serve the second.
            long = list(range(20, 60))
            first = await engine.beam_search(long, params)
            again = await engine.beam_search(long, params)
            assert (first.num_cached_tokens, again.num_cached_tokens) == (0, 32)
            assert [s.token_ids for s in again.sequences] == [s.token_ids for s in first.sequences]
            # A tenant's search neither reads nor feeds another's cache (cache_salt).
            salted = await engine.beam_search(long, params, cache_salt="tenant-a")
            salted_again = await engine.beam_search(long, params, cache_salt="tenant-a")
            assert (salted.num_cached_tokens, salted_again.num_cached_tokens) == (0, 32)
            # Cancelled mid-search: the round in flight is aborted, and no round follows.
            task = asyncio.create_task(engine.beam_search(long, BeamSearchParams(4, 200)))
            for _ in range(100_000):
                if engine.num_open_requests:
                    break
                await asyncio.sleep(0.001)
            task.cancel()
            with pytest.raises(asyncio.CancelledError):
                await task
            assert engine.num_open_requests == 0
            with pytest.raises(ValueError, match="beam_width"):
                await engine.beam_search(PROMPTS[0], BeamSearchParams(MAX_BEAM_WIDTH + 1, 5))
        finally:
            await engine.aclose()

    run(main())


# -- the rules, on hand-made distributions -----------------------------------------------
EOS = 2


def lp(
    sampled: int, tops: dict[int, float], sampled_logprob: float | None = None
) -> tuple[int, Logprobs]:
    """A round's result for one beam: the sampled token (its logprob: tops', unless it is
    not among them) and the best tokens' logprobs."""
    ids = sorted(tops, key=lambda t: -tops[t])
    own = tops[sampled] if sampled_logprob is None else sampled_logprob
    return sampled, Logprobs(own, ids, [tops[t] for t in ids])


def test_end_of_sequence_finishes_and_length_penalty_ranks() -> None:
    prompt = [7, 8, 9, 10]
    params = BeamSearchParams(2, 3, length_penalty=1.0, include_stop_str_in_output=True)
    s = BeamSearch(prompt, params, [EOS])
    # Round 1: EOS is the likeliest, so it finishes a sequence of prompt length 4 + 0.
    s.advance([lp(EOS, {EOS: -0.5, 20: -1.0, 21: -1.2, 22: -3.0})])
    assert [b.tokens[4:] for b in s.beams] == [[20], [21]]
    assert [b.tokens[4:] for b in s.finished] == [[EOS]]
    # Round 2: from [20] and [21]; the best two of the four are 20,30 and 21,31.
    s.advance(
        [
            lp(30, {30: -0.1, 31: -2.0, EOS: -4.0, 33: -5.0}),
            lp(31, {31: -0.2, 30: -3.0, 32: -3.5, 33: -6.0}),
        ]
    )
    assert [b.tokens[4:] for b in s.beams] == [[20, 30], [21, 31]]
    # A sampled token outside the best ones (temperature > 0) is a candidate too: here
    # an EOS, which finishes a sequence whatever its rank.
    s.advance(
        [
            lp(EOS, {40: -0.05, 41: -0.3, 42: -0.4, 43: -0.5}, sampled_logprob=-6.0),
            lp(51, {51: -1.0, 52: -1.1, 53: -1.2, 54: -1.3}),
        ]
    )
    assert s.done
    assert [b.tokens[4:] for b in s.finished] == [[EOS], [20, EOS], [20, 30, EOS]]
    best = s.result(None).sequences
    # Scores: cum_logprob / length ** 1, length counting the prompt, not the EOS.
    scores = {
        (EOS,): -0.5 / 4,
        (20, EOS): (-1.0 - 4.0) / 5,
        (20, 30, EOS): (-1.0 - 0.1 - 6.0) / 6,
        (20, 30, 40): (-1.0 - 0.1 - 0.05) / 7,
        (20, 30, 41): (-1.0 - 0.1 - 0.3) / 7,
    }
    want = sorted(scores, key=lambda k: -scores[k])[:2]
    assert [tuple(x.token_ids) for x in best] == want == [(EOS,), (20, 30, 40)]
    assert best[0].finish_reason == "stop" and best[0].stop_reason == EOS
    assert best[0].cum_logprob == pytest.approx(-0.5)
    assert best[1].finish_reason == "length" and best[1].stop_reason is None
    # Without include_stop_str_in_output the EOS is not among the token ids.
    plain = BeamSearch(prompt, BeamSearchParams(2, 1), [EOS])
    plain.advance([lp(EOS, {EOS: -0.1, 20: -3.0, 21: -3.1, 22: -3.2})])
    first = plain.result(None).sequences[0]
    assert first.token_ids == [] and first.tokens == prompt and first.finish_reason == "stop"
    # The length of a finished sequence leaves its EOS out: here that ranks it below a
    # less likely but longer live one (-0.9 / 1 against -1.2 / 2).
    short = BeamSearch([7], BeamSearchParams(1, 1), [EOS])
    short.advance([lp(EOS, {EOS: -0.9, 20: -1.2, 21: -3.0})])
    assert [x.token_ids for x in short.result(None).sequences] == [[20]]
    # ignore_eos: EOS is one more token.
    free = BeamSearch(prompt, BeamSearchParams(2, 1, ignore_eos=True), [EOS])
    free.advance([lp(EOS, {EOS: -0.1, 20: -3.0, 21: -3.1, 22: -3.2})])
    assert [x.token_ids for x in free.result(None).sequences] == [[EOS], [20]]


@pytest.mark.parametrize(
    ("params", "match"),
    [
        (BeamSearchParams(0, 4), "beam_width"),
        (BeamSearchParams(MAX_BEAM_WIDTH + 1, 4), "beam_width"),
        (BeamSearchParams(2, 0), "max_tokens"),
        (BeamSearchParams(2, 4, temperature=-1.0), "temperature"),
        (BeamSearchParams(2, 4, length_penalty=math.nan), "length_penalty"),
    ],
)
def test_bad_params_are_refused(params: BeamSearchParams, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        params.validate()


# -- the OpenAI server ---------------------------------------------------------------------
@pytest.fixture(scope="module")
def server(chat_model: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    s = start_server(chat_model, tmp_path_factory.mktemp("server"))
    yield s
    s.stop()


def test_openai_use_beam_search(server: Server, chat_model: Path) -> None:
    client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="none", max_retries=0)
    prompt = "What is 2 + 2 ?"
    with LLM(str(chat_model), device=CPU) as llm:
        ids = llm.inputs.encode(prompt)
        (want,) = llm.beam_search([ids], BeamSearchParams(3, 6, length_penalty=0.5))
    extra = {"use_beam_search": True, "length_penalty": 0.5, "return_token_ids": True}
    kw = dict(model=MODEL_NAME, prompt=prompt, max_tokens=6, n=3, temperature=0)
    answer = client.completions.create(**kw, logprobs=2, extra_body=extra)
    choices = sorted(answer.choices, key=lambda c: c.index)
    assert [c.model_extra["token_ids"] for c in choices] == [s.token_ids for s in want.sequences]
    assert [c.text for c in choices] == [s.text for s in want.sequences]
    assert [c.finish_reason for c in choices] == [s.finish_reason for s in want.sequences]
    for c, s in zip(choices, want.sequences):
        assert c.logprobs.token_logprobs == pytest.approx([x.logprob for x in s.logprobs])
        assert all(len(top) <= 2 for top in c.logprobs.top_logprobs)
    assert answer.usage.completion_tokens == sum(len(s.token_ids) for s in want.sequences)
    # Streamed: the same texts, each choice finished once.
    chunks = list(client.completions.create(**kw, stream=True, extra_body=extra))
    texts = ["", "", ""]
    finishes = []
    for chunk in chunks:
        for c in chunk.choices:
            texts[c.index] += c.text
            if c.finish_reason is not None:
                finishes.append(c.index)
    assert texts == [s.text for s in want.sequences] and sorted(finishes) == [0, 1, 2]
    # Chat: the conversation's beams, as many as n.
    chat = client.chat.completions.create(
        model=MODEL_NAME,
        messages=[{"role": "user", "content": prompt}],
        max_tokens=4,
        n=2,
        extra_body={"use_beam_search": True},
    )
    assert sorted(c.index for c in chat.choices) == [0, 1]
    assert all(c.message.role == "assistant" for c in chat.choices)
    # What beam search cannot honour is refused by name, and the server serves on.
    for body, param in [
        ({"stop": ["4"]}, "stop"),
        ({"n": MAX_BEAM_WIDTH + 1}, "n"),
        ({"presence_penalty": 0.5}, "presence_penalty"),
        ({"response_format": {"type": "json_object"}}, "response_format"),
        ({"prompt_logprobs": 1}, "prompt_logprobs"),
    ]:
        status, err = post(
            f"{server.url}/v1/completions",
            {"model": MODEL_NAME, "prompt": prompt, "max_tokens": 4, "use_beam_search": True}
            | body,
        )
        assert status == 400 and err["error"]["param"] == param, err
        assert "use_beam_search" in err["error"]["message"] or param == "n", err
    m = metrics(server.url)
    assert m["vllm:kv_cache_usage_perc"] == 0.0 and m["vllm:num_requests_running"] == 0
