"""The sampling options clients send, end to end: stop strings, logprobs, penalties, logit
biases, min_tokens, n and seeds, through LLM, AsyncLLM and the OpenAI server (real
processes).

Oracles are independent: transformers' logits of the same random checkpoint with the
penalties and masks written out here in plain torch, a log-softmax of those logits for
logprobs, and plain string search for stop strings.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from pathlib import Path

import openai
import pytest
import torch
import transformers

from launch import LLM, AsyncLLM, SamplingParams
from launch.client.async_llm import run
from tests.helpers.cli_helpers import CPU
from tests.helpers.hf_checkpoints import MIN_GREEDY_MARGIN
from tests.helpers.model_files import copy_model
from tests.helpers.server import MODEL_NAME, Server, post, start_server
from worker.sampler import PenaltyTensors, apply_penalties

os.environ["PAGEDSERVE_CHECK_INVARIANTS"] = "1"
PROMPT = [11, 12, 13, 14, 15, 16, 17]
STEPS = 12


# -- references -------------------------------------------------------------------
def penalized(logits: torch.Tensor, prompt: list[int], out: list[int], p: SamplingParams):
    """The logit bias, then the penalties, as their definitions read, one token at a time."""
    logits = logits.clone()
    for t, bias in (p.logit_bias or {}).items():
        logits[t] += bias
    for t in set(prompt) | set(out):  # repetition (HF): prompt and generated tokens
        v = float(logits[t])
        logits[t] = v / p.repetition_penalty if v > 0 else v * p.repetition_penalty
    for t in set(out):  # OpenAI: generated tokens only
        logits[t] -= p.frequency_penalty * out.count(t) + p.presence_penalty
    return logits


class HFReference:
    """transformers' next-token logits of the checkpoint, and greedy runs over them."""

    def __init__(self, model_dir: Path) -> None:
        self.model = transformers.AutoModelForCausalLM.from_pretrained(
            model_dir, attn_implementation="eager", torch_dtype=torch.float32
        ).eval()

    def logits(self, ids: list[int]) -> torch.Tensor:
        with torch.no_grad():
            return self.model(torch.tensor([ids])).logits[0, -1].float()

    def greedy(self, prompt: list[int], params: SamplingParams, banned: list[int] = ()) -> list:
        """Greedy tokens with penalties, and `banned` masked below min_tokens."""
        out: list[int] = []
        for _ in range(params.max_tokens):
            logits = penalized(self.logits(prompt + out), prompt, out, params)
            if len(out) < params.min_tokens:
                logits[list(banned)] = float("-inf")
            top2 = logits.topk(2).values
            assert top2[0] - top2[1] >= MIN_GREEDY_MARGIN, "oracle too close to call"
            out.append(int(logits.argmax()))
        return out


@pytest.fixture(scope="module")
def hf(llama_dir: Path) -> HFReference:
    return HFReference(llama_dir)


@pytest.fixture(scope="module")
def llm(llama_dir: Path) -> Iterator[LLM]:
    with LLM(str(llama_dir), device=CPU) as engine:
        yield engine


# -- the engine -------------------------------------------------------------------------
def test_logprobs_are_a_log_softmax_of_the_model_s_logits(llm: LLM, hf: HFReference) -> None:
    # Sampled with a temperature and penalties: logprobs stay the model's raw ones.
    params = SamplingParams(
        max_tokens=STEPS, temperature=0.8, seed=3, presence_penalty=1.0, logprobs=5
    )
    (out,) = llm.generate([PROMPT], params, use_tqdm=False)
    assert out.logprobs is not None and len(out.logprobs) == len(out.token_ids) == STEPS
    for i, (token, lp) in enumerate(zip(out.token_ids, out.logprobs)):
        want = torch.log_softmax(hf.logits(PROMPT + out.token_ids[:i]), -1)
        assert lp.logprob == pytest.approx(float(want[token]), abs=1e-4)
        assert lp.top_logprobs == pytest.approx(want.topk(5).values.tolist(), abs=1e-4)
        assert lp.top_token_ids == want.topk(5).indices.tolist()
    # logprobs=0: the chosen token's only; not asked: none, in the same batch.
    chosen, plain = llm.generate(
        [PROMPT, PROMPT],
        [SamplingParams(max_tokens=3, temperature=0, logprobs=0), SamplingParams(max_tokens=3)],
        use_tqdm=False,
    )
    assert [lp.top_token_ids for lp in chosen.logprobs or []] == [[], [], []]
    assert plain.logprobs is None


def test_prompt_logprobs_are_a_log_softmax_at_every_prompt_position(
    llama_dir: Path, hf: HFReference
) -> None:
    """Each prompt token's logprob given the tokens before it (and the top alternatives),
    against one transformers forward over the prompt, through a prefill chunked in
    16-token steps; a second request with the same prompt recomputes it rather than
    reading the prefix cache (a cached token has no logits), so it gets the same."""
    prompt = [(7 * i + 3) % 100 + 1 for i in range(40)]
    params = SamplingParams(max_tokens=2, temperature=0, ignore_eos=True, prompt_logprobs=3)
    with LLM(str(llama_dir), device=CPU, max_num_batched_tokens=16) as llm:
        first, plain, one = llm.generate(
            [prompt, prompt[:5], [9]],
            [params, SamplingParams(max_tokens=2), params],
            use_tqdm=False,
        )
        (again,) = llm.generate([prompt], params, use_tqdm=False)
    with torch.no_grad():
        logits = hf.model(torch.tensor([prompt])).logits[0].float()
    want = torch.log_softmax(logits, -1)
    got = first.prompt_logprobs
    assert got is not None and len(got) == len(prompt) and got[0] is None
    for i in range(1, len(prompt)):
        lp = got[i]
        assert lp is not None
        assert lp.logprob == pytest.approx(float(want[i - 1, prompt[i]]), abs=1e-4), i
        assert lp.top_token_ids == want[i - 1].topk(3).indices.tolist(), i
        assert lp.top_logprobs == pytest.approx(want[i - 1].topk(3).values.tolist(), abs=1e-4)
    assert first.token_ids == hf.greedy(prompt, SamplingParams(max_tokens=2, temperature=0))
    assert again.num_cached_tokens == 0 and again.prompt_logprobs is not None
    assert [lp.logprob for lp in again.prompt_logprobs[1:]] == pytest.approx(
        [lp.logprob for lp in got[1:]], abs=1e-5
    )
    assert plain.prompt_logprobs is None and one.prompt_logprobs == [None]


@pytest.mark.parametrize(
    "penalty",
    [
        {"presence_penalty": 1.5},
        {"presence_penalty": -0.7},
        {"frequency_penalty": 0.9},
        {"repetition_penalty": 1.8},
        {"repetition_penalty": 0.6},
        {"presence_penalty": 0.5, "frequency_penalty": 0.5, "repetition_penalty": 1.3},
    ],
    ids=["presence", "negative-presence", "frequency", "repetition", "rep-below-1", "all"],
)
def test_penalties_equal_a_reference(llm: LLM, hf: HFReference, penalty: dict) -> None:
    params = SamplingParams(max_tokens=STEPS, temperature=0, ignore_eos=True, **penalty)
    plain = SamplingParams(max_tokens=STEPS, temperature=0, ignore_eos=True)
    # A neighbour without penalties shares the batch and keeps its plain greedy tokens.
    got, neighbour = llm.generate([PROMPT, PROMPT[:4]], [params, plain], use_tqdm=False)
    assert got.token_ids == hf.greedy(PROMPT, params)
    assert neighbour.token_ids == hf.greedy(PROMPT[:4], plain)
    assert got.token_ids != hf.greedy(PROMPT, plain)  # the penalty did something


def test_a_logit_bias_moves_greedy_tokens_as_a_reference_says(llm: LLM, hf: HFReference) -> None:
    """OpenAI's logit_bias: added before the penalties; -100 keeps a token out, a large
    bias forces one; logprobs stay the model's own; a neighbour is untouched."""
    plain = SamplingParams(max_tokens=STEPS, temperature=0, ignore_eos=True)
    first = hf.greedy(PROMPT, plain)
    # Ban the plain run's first two tokens, lift another one, with a penalty on top.
    bias = {first[0]: -100.0, first[1]: -100.0, 7: 3.0}
    biased = SamplingParams(
        max_tokens=STEPS,
        temperature=0,
        ignore_eos=True,
        logit_bias=bias,
        frequency_penalty=0.4,
        logprobs=2,
    )
    forced = SamplingParams(max_tokens=4, temperature=0, ignore_eos=True, logit_bias={9: 100.0})
    got, neighbour, always = llm.generate(
        [PROMPT, PROMPT[:4], PROMPT], [biased, plain, forced], use_tqdm=False
    )
    assert got.token_ids == hf.greedy(PROMPT, biased)
    assert got.token_ids != first and first[0] not in got.token_ids
    assert neighbour.token_ids == hf.greedy(PROMPT[:4], plain)
    assert always.token_ids == [9] * 4
    assert got.logprobs is not None
    for i, lp in enumerate(got.logprobs):
        raw = torch.log_softmax(hf.logits(PROMPT + got.token_ids[:i]), -1)
        assert lp.logprob == pytest.approx(float(raw[got.token_ids[i]]), abs=1e-4)


def test_a_frequency_penalty_grows_with_each_repetition(llm: LLM, hf: HFReference) -> None:
    """A logit bias makes the plain run's first token come back again and again; the
    frequency penalty (per occurrence, OpenAI's) pushes it down further each time, which a
    penalty per distinct token would not (the greedy run above never repeats a token)."""
    first = hf.greedy(PROMPT, SamplingParams(max_tokens=1, temperature=0))[0]
    params = SamplingParams(
        max_tokens=STEPS,
        temperature=0,
        ignore_eos=True,
        logit_bias={first: 4.0},
        frequency_penalty=0.9,
    )
    want = hf.greedy(PROMPT, params)
    assert want.count(first) >= 3  # the case this test is about
    (got,) = llm.generate([PROMPT], params, use_tqdm=False)
    assert got.token_ids == want


def test_batched_penalties_equal_the_definitions() -> None:
    import numpy as np

    gen = torch.Generator().manual_seed(0)
    vocab, rows = 30, 5
    logits = torch.randn(rows, vocab, generator=gen) * 3
    prompts = [[1, 2, 2, 3], [4], [5, 5, 6, 7, 8], [9, 1], [2]]
    outs = [[3, 3, 10, 11, 3], [], [5, 12], [13, 13, 13], [2, 2]]
    params = [
        SamplingParams(presence_penalty=0.5, frequency_penalty=0.25, repetition_penalty=1.5),
        SamplingParams(repetition_penalty=2.0),
        SamplingParams(frequency_penalty=-1.0),
        SamplingParams(),  # a neutral row comes out bit-identical
        SamplingParams(presence_penalty=2.0, repetition_penalty=0.5),
    ]
    width = max(len(p) + len(o) for p, o in zip(prompts, outs)) + 2
    tokens = np.full((rows, width), 29, dtype=np.int32)  # garbage past each row's end
    for r, (p, o) in enumerate(zip(prompts, outs)):
        tokens[r, : len(p) + len(o)] = p + o
    penalties = PenaltyTensors.build(
        tokens,
        np.array([len(p) for p in prompts], dtype=np.int32),
        np.array([len(p) + len(o) for p, o in zip(prompts, outs)], dtype=np.int32),
        np.array([p.presence_penalty for p in params], dtype=np.float32),
        np.array([p.frequency_penalty for p in params], dtype=np.float32),
        np.array([p.repetition_penalty for p in params], dtype=np.float32),
        vocab,
        "cpu",
    )
    got = apply_penalties(logits, penalties)
    for r in range(rows):
        want = penalized(logits[r], prompts[r], outs[r], params[r])
        assert torch.allclose(got[r], want, atol=1e-6), r
    assert torch.equal(got[3], logits[3])


@pytest.fixture(scope="module")
def eos_first(llama_dir: Path, tmp_path_factory: pytest.TempPathFactory, hf: HFReference):
    """A copy of the checkpoint whose EOS is the token greedy decoding picks first."""
    first = hf.greedy(PROMPT, SamplingParams(max_tokens=1, temperature=0))[0]
    model = copy_model(llama_dir, tmp_path_factory.mktemp("eos") / "m", {"eos_token_id": first})
    return model, first


def test_min_tokens_keeps_eos_back(eos_first: tuple[Path, int], hf: HFReference) -> None:
    model, eos = eos_first
    with LLM(str(model), device=CPU) as llm:
        assert eos in llm.eos_token_ids
        params = [
            SamplingParams(max_tokens=STEPS, temperature=0),
            SamplingParams(max_tokens=STEPS, temperature=0, min_tokens=6),
            SamplingParams(max_tokens=STEPS, temperature=0, min_tokens=6, stop_token_ids=[3]),
        ]
        at_once, held, with_stop = llm.generate([PROMPT] * 3, params, use_tqdm=False)
    assert (at_once.token_ids, at_once.finish_reason) == ([eos], "stop")
    # The worker masks EOS (and stop tokens) below min_tokens, so the tokens equal the
    # reference's, and the core stops on them only from there on.
    for out, stops in ((held, [eos]), (with_stop, [eos, 3])):
        want = hf.greedy(PROMPT, params[1], banned=stops)
        ends = [i for i, t in enumerate(want) if t in stops and i >= 6]
        if ends:
            assert (out.token_ids, out.finish_reason) == (want[: ends[0] + 1], "stop")
        else:
            assert (out.token_ids, out.finish_reason) == (want, "length")
    assert eos in held.token_ids  # the case really arises


def test_min_tokens_ends_exactly_where_eos_is_first_allowed(llm: LLM) -> None:
    """EOS made the likeliest token everywhere (a +100 logit bias): the request ends on
    it at the first position min_tokens allows, not one sooner or later."""
    eos = llm.eos_token_ids[0]
    for k in (0, 1, 3):
        params = SamplingParams(max_tokens=10, temperature=0, min_tokens=k, logit_bias={eos: 100.0})
        (out,) = llm.generate([PROMPT], params, use_tqdm=False)
        assert out.token_ids[-1] == eos and len(out.token_ids) == k + 1, (k, out.token_ids)
        assert eos not in out.token_ids[:-1] and out.finish_reason == "stop"


def test_the_core_stops_on_eos_only_after_min_tokens() -> None:
    # The core's own rule, fed tokens directly: it holds even if a worker let EOS through.
    from enginecore.kv_cache_config import make_kv_cache_config
    from enginecore.request import Request
    from enginecore.scheduler import Scheduler
    from protocol.kv_cache import FullAttentionSpec
    from protocol.worker import ModelRunnerOutput
    from tests.helpers.kv_helpers import sched_config

    config = make_kv_cache_config({"l0": FullAttentionSpec(16, 1, 8, "float32")}, 1 << 20)
    sched = Scheduler(sched_config(64), config, 100, [2])
    params = SamplingParams(max_tokens=10, min_tokens=2, stop_token_ids=[9])
    req = Request("r", [5, 6, 7], sched.kv_cache_manager.block_hasher, sampling_params=params)
    assert sched.add_request(req) is None
    reasons = []
    for token in (2, 9, 2):
        so = sched.schedule()
        (out,) = sched.update_from_output(so, ModelRunnerOutput(so.step_id, ["r"], [token]))
        reasons.append(out.finish_reason)
    assert reasons == [None, None, "stop"]  # tokens 1 and 2 may not stop it; token 3 does


def msgspec_replace(params: SamplingParams, **changes: object) -> SamplingParams:
    import msgspec

    return msgspec.structs.replace(params, **changes)


def test_seeded_sampling_is_reproducible_and_ignores_its_neighbours(llm: LLM) -> None:
    seeded = SamplingParams(max_tokens=STEPS, temperature=1.0, seed=42, ignore_eos=True)
    (alone,) = llm.generate([PROMPT], seeded, use_tqdm=False)
    noisy = SamplingParams(max_tokens=STEPS, temperature=1.0, ignore_eos=True)
    crowd = llm.generate(
        [[5, 6]] * 3 + [PROMPT] + [[7]] * 3, [noisy] * 3 + [seeded] + [noisy] * 3, use_tqdm=False
    )
    assert crowd[3].token_ids == alone.token_ids
    other = msgspec_replace(seeded, seed=43)
    assert llm.generate([PROMPT], other, use_tqdm=False)[0].token_ids != alone.token_ids


def test_min_p_one_is_greedy_and_a_small_one_only_trims(llm: LLM, hf: HFReference) -> None:
    """min_p 1 leaves only the likeliest token, so hot sampling is greedy (transformers'
    tokens); a tiny min_p leaves a seeded sample as it was."""
    greedy = hf.greedy(PROMPT, SamplingParams(max_tokens=STEPS, temperature=0))
    hot = SamplingParams(max_tokens=STEPS, temperature=3.0, min_p=1.0, ignore_eos=True, seed=1)
    seeded = SamplingParams(max_tokens=STEPS, temperature=0.8, seed=9, ignore_eos=True)
    trimmed = msgspec_replace(seeded, min_p=1e-9)
    outs = llm.generate([PROMPT] * 3, [hot, seeded, trimmed], use_tqdm=False)
    assert outs[0].token_ids == greedy
    assert outs[1].token_ids == outs[2].token_ids != greedy


def test_llm_generate_n_gives_n_outputs_per_prompt_sharing_its_blocks(llm: LLM) -> None:
    prompt = list(range(11, 11 + 40))  # 2 full blocks of 16 and 8 tokens
    params = SamplingParams(max_tokens=STEPS, temperature=1.0, seed=7, n=3, ignore_eos=True)
    one = SamplingParams(max_tokens=STEPS, temperature=0, ignore_eos=True)
    llm.reset_prefix_cache()
    outs = llm.generate([prompt, [5, 6]], [params, one], use_tqdm=False)
    # Prompt-major: the first prompt's three sequences, then the second's one.
    assert [(o.index, o.seq_index) for o in outs] == [(0, 0), (0, 1), (0, 2), (1, 0)]
    assert all(o.prompt_token_ids == prompt and len(o.token_ids) == STEPS for o in outs[:3])
    assert sorted(o.num_cached_tokens for o in outs[:3]) == [0, 32, 32]
    assert len({tuple(o.token_ids) for o in outs[:3]}) == 3  # seeds 7, 8, 9 differ
    again = llm.generate([prompt], params, use_tqdm=False)
    assert [o.token_ids for o in again] == [o.token_ids for o in outs[:3]]
    (copy_2,) = llm.generate([prompt], msgspec_replace(params, n=1, seed=9), use_tqdm=False)
    assert copy_2.token_ids == outs[2].token_ids  # copy i is the request seeded 7 + i


# -- AsyncLLM: n copies and stop strings on a word tokenizer ----------------------------------
def test_n_copies_share_the_prompt_s_blocks_and_seeds_differ(chat_model: Path) -> None:
    prompt = list(range(11, 11 + 40))  # 2 full blocks of 16 and 8 tokens

    async def main() -> None:
        engine = await AsyncLLM.create(str(chat_model), device=CPU)
        try:
            params = SamplingParams(max_tokens=STEPS, temperature=1.0, seed=7, n=4, ignore_eos=True)
            tokens: dict[int, list[int]] = {i: [] for i in range(4)}
            cached: dict[int, int] = {}
            async for out in engine.generate(prompt, params, "fan"):
                tokens[out.index] += out.new_token_ids
                if out.finish_reason is not None:
                    cached[out.index] = out.num_cached_tokens
            assert engine.num_open_requests == 0
            # All four were admitted together; three found the first's prompt blocks.
            assert sorted(cached.values()) == [0, 32, 32, 32]
            assert len({tuple(t) for t in tokens.values()}) == 4  # seeds 7..10 differ
            for i in (0, 3):  # copy i is the request with seed 7 + i
                one = msgspec_replace(params, n=1, seed=7 + i)
                alone = [t async for out in engine.generate(prompt, one) for t in out.new_token_ids]
                assert alone == tokens[i]
        finally:
            await engine.aclose()

    run(main())


def test_stop_strings_through_async_llm_end_the_request(chat_model: Path) -> None:
    async def text_of(engine: AsyncLLM, params: SamplingParams) -> tuple[str, list, object]:
        text, ids, last = "", [], None
        async for out in engine.generate("What is 2 + 2 ?", params):
            text += out.text
            ids += out.new_token_ids
            last = out
        return text, ids, last

    async def main() -> None:
        engine = await AsyncLLM.create(str(chat_model), device=CPU)
        try:
            base = SamplingParams(max_tokens=30, temperature=0, ignore_eos=True)
            full, full_ids, _ = await text_of(engine, base)
            words = full.split(" ")
            # A stop string over two tokens, found after a few words.
            stop = f"{words[3]} {words[4]}"
            want = full[: full.index(stop)]
            text, ids, last = await text_of(engine, msgspec_replace(base, stop=["zzz", stop]))
            assert text == want and last.finish_reason == "stop" and last.stop_reason == stop
            assert ids == full_ids[: len(ids)] and len(ids) < len(full_ids)
            # With include_stop_str_in_output the text runs to the stop string's end.
            kept = msgspec_replace(base, stop=[stop], include_stop_str_in_output=True)
            text, _, last = await text_of(engine, kept)
            assert text == want + stop and last.stop_reason == stop
            # The abort reached the core: a later request's steps see an empty pool.
            await text_of(engine, msgspec_replace(base, max_tokens=2))
            assert engine.stats is not None and engine.stats.kv_cache_usage == 0.0
            with pytest.raises(ValueError, match="at most 4"):
                engine.generate("x", msgspec_replace(base, stop=["a", "b", "c", "d", "e"]))
        finally:
            await engine.aclose()

    run(main())


# -- the OpenAI server ---------------------------------------------------------------------
@pytest.fixture(scope="module")
def server(chat_model: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    s = start_server(chat_model, tmp_path_factory.mktemp("server"))
    yield s
    s.stop()


@pytest.fixture
def client(server: Server) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key="none", max_retries=0)


def test_openai_client_stop_logprobs_and_n(client: openai.OpenAI, chat_model: Path) -> None:
    extra = {"ignore_eos": True, "return_token_ids": True}
    kw = dict(model=MODEL_NAME, prompt="What is 2 + 2 ?", max_tokens=20, temperature=0)
    full = client.completions.create(**kw, extra_body=extra).choices[0]
    stop = " ".join(full.text.split(" ")[2:4])
    cut = client.completions.create(**kw, stop=[stop], extra_body=extra).choices[0]
    assert cut.text == full.text[: full.text.index(stop)] and cut.finish_reason == "stop"
    assert cut.model_extra["stop_reason"] == stop
    streamed = client.completions.create(**kw, stop=stop, stream=True, extra_body=extra)
    chunks = list(streamed)
    assert "".join(c.choices[0].text for c in chunks) == cut.text
    assert chunks[-1].choices[0].finish_reason == "stop"

    # Logprobs equal LLM.generate's (the engine's own, checked against transformers above).
    with LLM(str(chat_model), device=CPU) as llm:
        (ref,) = llm.generate(
            ["What is 2 + 2 ?"],
            SamplingParams(max_tokens=5, temperature=0, ignore_eos=True, logprobs=3),
            use_tqdm=False,
        )
    assert ref.logprobs is not None
    lp = client.completions.create(**{**kw, "max_tokens": 5}, logprobs=3, extra_body=extra)
    got = lp.choices[0].logprobs
    assert lp.choices[0].model_extra["token_ids"] == ref.token_ids
    assert got.token_logprobs == pytest.approx([x.logprob for x in ref.logprobs], abs=1e-5)
    # Keyed by token text (OpenAI's shape): ids outside the word vocabulary share "".
    for top, want in zip(got.top_logprobs, ref.logprobs):
        assert max(top.values()) == pytest.approx(want.top_logprobs[0], abs=1e-5)
        assert 1 <= len(top) <= 4
    assert got.text_offset[0] == 0 and len(got.tokens) == 5
    chat = client.chat.completions.create(
        model=MODEL_NAME,
        messages=[{"role": "user", "content": "What is 2 + 2 ?"}],
        max_tokens=4,
        temperature=0,
        logprobs=True,
        top_logprobs=2,
        extra_body={"ignore_eos": True},
    )
    content = chat.choices[0].logprobs.content
    assert len(content) == 4 and all(len(c.top_logprobs) == 2 for c in content)
    assert all(c.top_logprobs[0].logprob >= c.logprob for c in content)
    events = client.chat.completions.create(
        model=MODEL_NAME,
        messages=[{"role": "user", "content": "What is 2 + 2 ?"}],
        max_tokens=4,
        temperature=0,
        logprobs=True,
        stream=True,
        extra_body={"ignore_eos": True},
    )
    streamed_lps = [
        c for e in events for ch in e.choices if ch.logprobs for c in ch.logprobs.content
    ]
    assert [c.logprob for c in streamed_lps] == pytest.approx([c.logprob for c in content])

    # logit_bias as the client sends it (token ids as strings): +100 forces a token.
    forced = client.completions.create(
        **{**kw, "max_tokens": 3}, logit_bias={"9": 100}, extra_body=extra
    )
    assert forced.choices[0].model_extra["token_ids"] == [9, 9, 9]

    # n: four choices, seeded copies differing, the prompt counted once.
    many = client.completions.create(**{**kw, "temperature": 1.0}, n=4, seed=5, extra_body=extra)
    assert sorted(c.index for c in many.choices) == [0, 1, 2, 3]
    assert len({tuple(c.model_extra["token_ids"]) for c in many.choices}) == 4
    assert many.usage.completion_tokens == 4 * 20
    again = client.completions.create(**{**kw, "temperature": 1.0}, n=4, seed=5, extra_body=extra)
    assert [c.text for c in again.choices] == [c.text for c in many.choices]
    # top_k 1 is greedy: n > 1 at temperature 0 is refused, as vLLM refuses it.
    stream_n = client.completions.create(
        **{**kw, "max_tokens": 3, "temperature": 1.0}, n=3, stream=True, extra_body={"top_k": 1}
    )
    per_index: dict[int, str] = {}
    for chunk in stream_n:
        for c in chunk.choices:
            per_index[c.index] = per_index.get(c.index, "") + c.text
    assert sorted(per_index) == [0, 1, 2] and len(set(per_index.values())) == 1  # greedy


def test_prompt_logprobs_and_echo_with_logprobs_through_the_server(
    server: Server, client: openai.OpenAI, chat_model: Path
) -> None:
    """vLLM's prompt_logprobs (per prompt token: null first, then the token's own and the
    likeliest ids) and OpenAI's echo + logprobs (the prompt's tokens first in the legacy
    shape), both equal to LLM.generate's prompt logprobs (checked against transformers
    above)."""
    ids = [11, 12, 13, 14, 15, 16]
    with LLM(str(chat_model), device=CPU) as llm:
        (ref,) = llm.generate(
            [ids],
            SamplingParams(max_tokens=2, temperature=0, ignore_eos=True, prompt_logprobs=2),
            use_tqdm=False,
        )
    assert ref.prompt_logprobs is not None and ref.prompt_logprobs[0] is None
    want = [lp.logprob for lp in ref.prompt_logprobs[1:]]  # type: ignore[union-attr]
    kw = dict(model=MODEL_NAME, prompt=ids, max_tokens=2, temperature=0)
    extra = {"ignore_eos": True, "prompt_logprobs": 2}
    got = client.completions.create(**kw, extra_body=extra).choices[0]
    entries = got.model_extra["prompt_logprobs"]
    assert entries[0] is None and len(entries) == len(ids)
    assert [e[str(t)]["logprob"] for e, t in zip(entries[1:], ids[1:])] == pytest.approx(want)
    for e, t, lp in zip(entries[1:], ids[1:], ref.prompt_logprobs[1:]):
        assert lp is not None  # the prompt's own token, then the two likeliest
        assert set(e) == {str(t), *map(str, lp.top_token_ids)}
    streamed = list(client.completions.create(**kw, stream=True, extra_body=extra))
    firsts = [c.choices[0].model_extra.get("prompt_logprobs") for c in streamed]
    assert firsts[0] == entries and not any(firsts[1:])
    chat = client.chat.completions.create(
        model=MODEL_NAME,
        messages=[{"role": "user", "content": "What"}],
        max_tokens=1,
        extra_body={"prompt_logprobs": 0},
    )
    assert chat.model_extra["prompt_logprobs"][0] is None
    # echo + logprobs: the prompt's tokens, then the completion's.
    echoed = client.completions.create(
        **kw, echo=True, logprobs=1, extra_body={"ignore_eos": True, "return_token_ids": True}
    )
    lp = echoed.choices[0].logprobs
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    assert lp.token_logprobs[1 : len(ids)] == pytest.approx(want)
    assert len(lp.tokens) == len(ids) + 2 and lp.text_offset[0] == 0
    assert all(x <= 0 for x in lp.token_logprobs[len(ids) :])
    assert echoed.choices[0].model_extra["token_ids"] == ref.token_ids
    # max_tokens 0 with echo: scoring a text, the prompt's logprobs alone.
    scored = client.completions.create(
        **{**kw, "max_tokens": 0},
        echo=True,
        logprobs=1,
        extra_body={"ignore_eos": True, "return_token_ids": True},
    )
    lp = scored.choices[0].logprobs
    assert lp.token_logprobs[0] is None and lp.token_logprobs[1:] == pytest.approx(want)
    assert len(lp.tokens) == len(ids) and scored.choices[0].model_extra["token_ids"] == []
    # The one token generated and left out still counts in usage, as vLLM counts it.
    assert scored.usage.completion_tokens == 1 and scored.choices[0].finish_reason == "length"
    for body, param in (
        ({"prompt": ids, "echo": True, "max_tokens": 0, "stream": True}, "max_tokens"),
        ({"prompt": ids, "max_tokens": 0}, "max_tokens"),
    ):
        status, answer = post(f"{server.url}/v1/completions", body)
        assert status == 400 and answer["error"]["param"] == param, answer


@pytest.mark.parametrize(
    ("extra", "param"),
    [
        ({"n": 17}, "n"),
        ({"n": 0}, "n"),
        ({"presence_penalty": 2.5}, "presence_penalty"),
        ({"frequency_penalty": -3}, "frequency_penalty"),
        ({"repetition_penalty": 0}, "repetition_penalty"),
        ({"min_tokens": 9}, "min_tokens"),
        ({"logprobs": 21}, "logprobs"),
        ({"stop": ["a", "b", "c", "d", "e"]}, "stop"),
        ({"stop": ["a", ""]}, "stop"),
        ({"seed": -1}, "seed"),
        ({"prompt_logprobs": 21}, "prompt_logprobs"),
        ({"logit_bias": {"3": 101}}, "logit_bias"),
        ({"logit_bias": {"999999": 1.0}}, "logit_bias"),
        ({"logit_bias": {"x": 1.0}}, "logit_bias"),
        ({"logit_bias": {str(i): 1.0 for i in range(1025)}}, "logit_bias"),
        ({"min_p": 1.5}, "min_p"),
        ({"min_p": -0.1}, "min_p"),
        ({"allowed_token_ids": []}, "allowed_token_ids"),
        ({"allowed_token_ids": [10**6]}, "allowed_token_ids"),
        ({"bad_words": [" "]}, "bad_words"),
        ({"bad_words": ["x"] * 129}, "bad_words"),
    ],
    ids=lambda v: json.dumps(v) if isinstance(v, dict) else v,
)
def test_bad_sampling_options_are_400s(server: Server, extra: dict, param: str) -> None:
    body = {"model": MODEL_NAME, "prompt": "What", "max_tokens": 8, **extra}
    status, answer = post(f"{server.url}/v1/completions", body)
    assert status == 400, answer
    assert answer["error"]["param"] == param, answer


def test_chat_top_logprobs_need_logprobs(server: Server) -> None:
    body = {"model": MODEL_NAME, "messages": [{"role": "user", "content": "What"}]}
    status, answer = post(f"{server.url}/v1/chat/completions", {**body, "top_logprobs": 2})
    assert status == 400 and answer["error"]["param"] == "top_logprobs", answer
    body = {**body, "logprobs": True, "top_logprobs": 21, "max_tokens": 2}
    status, answer = post(f"{server.url}/v1/chat/completions", body)
    assert status == 400 and answer["error"]["param"] == "top_logprobs", answer


def test_special_tokens_are_left_out_of_the_text_unless_asked_for(chat_model: Path) -> None:
    """A +100 bias makes every token <|im_start|> (a special token of the word tokenizer):
    by default it decodes to nothing, with skip_special_tokens false as `tokenizers`
    decodes it, streamed (AsyncLLM) and not (LLM), and through a stop string."""
    from tokenizers import Tokenizer

    want = Tokenizer.from_file(str(chat_model / "tokenizer.json")).decode(
        [3, 3, 3], skip_special_tokens=False
    )
    assert want.count("<|im_start|>") == 3
    base = SamplingParams(max_tokens=3, temperature=0, ignore_eos=True, logit_bias={3: 100.0})
    shown = msgspec_replace(base, skip_special_tokens=False)
    with LLM(str(chat_model), device=CPU) as llm:
        hidden, kept = llm.generate(["What", "What"], [base, shown], use_tqdm=False)
        (cut,) = llm.generate(["What"], msgspec_replace(shown, stop=["start|> <|im"]))
    assert hidden.token_ids == kept.token_ids == [3, 3, 3]
    assert hidden.text == "" and kept.text == want
    assert cut.text == "<|im_" and cut.finish_reason == "stop"

    async def streamed() -> str:
        engine = await AsyncLLM.create(str(chat_model), device=CPU)
        try:
            return "".join([o.text async for o in engine.generate("What", shown)])
        finally:
            await engine.aclose()

    assert run(streamed()) == want


def test_the_token_that_stops_a_request_is_not_in_its_text(chat_model: Path) -> None:
    """A stop token id's text, and EOS's with special tokens shown, end the text unless
    include_stop_str_in_output (vLLM's rule); the token id is in token_ids either way."""
    what, eos = 8, 2  # "What", "</s>" in the word tokenizer
    stop = SamplingParams(
        max_tokens=3, temperature=0, logit_bias={what: 100.0}, stop_token_ids=[what]
    )
    end = SamplingParams(
        max_tokens=3, temperature=0, logit_bias={eos: 100.0}, skip_special_tokens=False
    )
    with LLM(str(chat_model), device=CPU) as llm:
        outs = llm.generate(
            ["is"] * 4,
            [
                stop,
                msgspec_replace(stop, include_stop_str_in_output=True),
                end,
                msgspec_replace(end, include_stop_str_in_output=True),
            ],
            use_tqdm=False,
        )
    assert [(o.token_ids, o.finish_reason) for o in outs] == [
        ([what], "stop"),
        ([what], "stop"),
        ([eos], "stop"),
        ([eos], "stop"),
    ]
    assert [o.text for o in outs] == ["", "What", "", "</s>"]

    async def streamed() -> list[str]:
        engine = await AsyncLLM.create(str(chat_model), device=CPU)
        try:
            texts = []
            for params in (stop, end):
                texts.append("".join([o.text async for o in engine.generate("is", params)]))
            return texts
        finally:
            await engine.aclose()

    assert run(streamed()) == ["", ""]


def _masked_greedy(hf: HFReference, prompt: list[int], steps: int, ok) -> list[int]:
    """Greedy over transformers' logits, a token at a time, among those ok(out, t) allows."""
    out: list[int] = []
    for _ in range(steps):
        logits = hf.logits(prompt + out)
        banned = [t for t in range(len(logits)) if not ok(out, t)]
        logits[banned] = float("-inf")
        top2 = logits.topk(2).values
        assert top2[0] - top2[1] >= MIN_GREEDY_MARGIN, "oracle too close to call"
        out.append(int(logits.argmax()))
    return out


def test_allowed_token_ids_and_bad_words_equal_a_reference(
    llm: LLM, hf: HFReference, chat_model: Path
) -> None:
    """Greedy under allowed_token_ids (only those) and bad-word token sequences (a
    sequence's last token never completes it) equals transformers' greedy with the same
    tokens masked; a neighbour without them is unchanged."""
    free = SamplingParams(max_tokens=STEPS, temperature=0, ignore_eos=True)
    base = hf.greedy(PROMPT, free)
    allowed = sorted(set(base[1::2]) | {3, 40})  # not the greedy pick at every step
    bad = [[base[0], base[1]], [base[4]]]  # a two-token sequence, and a token anywhere
    outs = llm.generate(
        [PROMPT] * 3,
        [
            msgspec_replace(free, allowed_token_ids=allowed),
            msgspec_replace(free, bad_words_token_ids=bad),
            free,
        ],
        use_tqdm=False,
    )
    assert outs[0].token_ids == _masked_greedy(hf, PROMPT, STEPS, lambda _o, t: t in allowed)
    assert outs[0].token_ids != base

    def no_bad_word(out: list[int], t: int) -> bool:
        return all(not (seq[:-1] == out[len(out) - len(seq) + 1 :] and t == seq[-1]) for seq in bad)

    assert outs[1].token_ids == _masked_greedy(hf, PROMPT, STEPS, no_bad_word)
    assert outs[1].token_ids != base and outs[2].token_ids == base


def test_bad_words_are_texts_tokenized_by_the_client(chat_model: Path) -> None:
    """bad_words (texts) through LLM and the JSONL lines: the word never appears in the
    output, with or without a space before it; the ids stay as they were until then."""
    base = SamplingParams(max_tokens=20, temperature=0, ignore_eos=True)
    with LLM(str(chat_model), device=CPU) as llm:
        (full,) = llm.generate(["What is 2 + 2 ?"], base, use_tqdm=False)
        word = full.text.split()[2]
        (clean,) = llm.generate(
            ["What is 2 + 2 ?"], msgspec_replace(base, bad_words=[word]), use_tqdm=False
        )
        with pytest.raises(ValueError, match="bad_words"):
            llm.generate(["x"], msgspec_replace(base, bad_words=["  "]), use_tqdm=False)
    assert word not in clean.text.split(), (word, clean.text)
    first = full.text.split().index(word)
    assert clean.text.split()[:first] == full.text.split()[:first]


def test_prompts_truncated_to_their_last_tokens(llm: LLM, client: openai.OpenAI) -> None:
    """truncate_prompt_tokens keeps a prompt's last k tokens (LLM and the server); every
    streamed chunk carries the usage so far with continuous_usage_stats."""
    params = SamplingParams(max_tokens=4, temperature=0, ignore_eos=True)
    cut, short = llm.generate(
        [PROMPT, PROMPT[-3:]], [msgspec_replace(params, truncate_prompt_tokens=3), params]
    )
    assert cut.prompt_token_ids == PROMPT[-3:] and cut.token_ids == short.token_ids
    (whole,) = llm.generate([PROMPT], msgspec_replace(params, truncate_prompt_tokens=100))
    assert whole.prompt_token_ids == PROMPT
    extra = {"ignore_eos": True, "return_token_ids": True, "truncate_prompt_tokens": 2}
    chunks = list(
        client.completions.create(
            model=MODEL_NAME,
            prompt=[5, 6, 7, 8],
            max_tokens=3,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True, "continuous_usage_stats": True},
            extra_body=extra,
        )
    )
    plain = client.completions.create(
        model=MODEL_NAME, prompt=[5, 6, 7, 8], max_tokens=1, extra_body=extra
    )
    assert plain.choices[0].prompt_token_ids == [7, 8]  # type: ignore[attr-defined]
    counts = [c.usage.completion_tokens for c in chunks if c.choices]  # type: ignore[union-attr]
    assert counts == sorted(counts) and counts[-1] == 3 and len(counts) >= 3
    assert all(c.usage is not None and c.usage.prompt_tokens == 2 for c in chunks)
    for bad in (0, -2):
        with pytest.raises(openai.BadRequestError, match="truncate_prompt_tokens"):
            client.completions.create(
                model=MODEL_NAME, prompt="What", extra_body={"truncate_prompt_tokens": bad}
            )
