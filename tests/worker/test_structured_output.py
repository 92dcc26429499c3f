"""Structured outputs: a request's output kept inside a JSON Schema, a regex, a choice or
a grammar, end to end (wire, boundary checks, every worker rank's masks, the server).

The oracle is transformers' own greedy generate on the built-in model (byte tokenizer:
texts are exact), each request alone, with llguidance's mask for that request applied by
a logits processor: our engine, batching constrained and free requests together, under
overlapped and serial scheduling, preemption and TP 2, must give the same tokens. The
outputs are also checked against their languages directly (json.loads, re.fullmatch).
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import numpy as np
import pytest
import torch

from launch import LLM, Prompt, SamplingParams
from launch.client.builtin_model import builtin_model_dir
from protocol.engine import StructuredOutputs
from tests.helpers.cli_helpers import CPU, generate_cli
from worker.sampler import SamplingTensors, sample, token_bans, unpack_bans
from worker.structured_output import GrammarMatchers, grammar_of, grammar_tokenizer

BOS, EOS = 256, 257  # the built-in model's byte tokenizer
SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 6},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "tags": {"type": "array", "items": {"enum": ["red", "green"]}, "maxItems": 2},
    },
    "required": ["name", "age", "tags"],
    "additionalProperties": False,
}
REGEX = r"[a-c]{3}-[0-9]{2}"
CHOICES = ["yes", "no", "maybe not"]
LARK = 'start: "(" item ("," item)* ")"\nitem: /[xyz]/ | "<" NUMBER ">"\nNUMBER: /[0-9]{1,2}/'
SPECS = {
    "json": StructuredOutputs(json=json.dumps(SCHEMA), disable_any_whitespace=True),
    "regex": StructuredOutputs(regex=REGEX),
    "choice": StructuredOutputs(choice=CHOICES),
    "grammar": StructuredOutputs(grammar=LARK),
}
PROMPTS = {
    "json": "A person, as JSON: ",
    "regex": "The code is ",
    "choice": "Answer: ",
    "grammar": "A tuple: ",
}
MAX_TOKENS = 48


def check_language(kind: str, text: str) -> None:
    if kind == "json":
        value = json.loads(text)
        assert set(value) == {"name", "age", "tags"}, text
        assert isinstance(value["name"], str) and len(value["name"]) <= 6
        assert isinstance(value["age"], int) and 0 <= value["age"] <= 120
        assert all(t in ("red", "green") for t in value["tags"]) and len(value["tags"]) <= 2
    elif kind == "regex":
        assert re.fullmatch(REGEX, text), text
    elif kind == "choice":
        assert text in CHOICES, text
    else:
        assert re.fullmatch(r"\((?:[xyz]|<[0-9]{1,2}>)(?:,(?:[xyz]|<[0-9]{1,2}>))*\)", text), text


@pytest.fixture(scope="module")
def oracle() -> dict[str, list[int]]:
    """transformers' greedy tokens for each prompt, masked by llguidance as it goes."""
    from llguidance import LLMatcher
    from llguidance.numpy import allocate_token_bitmask, fill_next_token_bitmask
    from transformers import AutoModelForCausalLM, LogitsProcessor, LogitsProcessorList

    model = AutoModelForCausalLM.from_pretrained(builtin_model_dir(), torch_dtype=torch.float32)
    tok = grammar_tokenizer(builtin_model_dir(), [EOS])

    class Masked(LogitsProcessor):
        def __init__(self, matcher: LLMatcher, prompt_len: int) -> None:
            self.matcher, self.prompt_len = matcher, prompt_len

        def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
            new = input_ids[0, self.prompt_len :].tolist()
            if new:
                assert self.matcher.consume_token(new[-1]), self.matcher.get_error()
            mask = allocate_token_bitmask(1, tok.vocab_size)
            fill_next_token_bitmask(self.matcher, mask)
            bits = np.unpackbits(mask.view(np.uint8), bitorder="little")[: scores.shape[1]]
            allowed = np.zeros(scores.shape[1], dtype=bool)
            allowed[: len(bits)] = bits.astype(bool)
            return scores.masked_fill(~torch.from_numpy(allowed)[None, :], float("-inf"))

    expected = {}
    for kind, spec in SPECS.items():
        prompt = [BOS, *PROMPTS[kind].encode()]
        ids = torch.tensor([prompt])
        with torch.no_grad():
            out = model.generate(
                ids,
                attention_mask=torch.ones_like(ids),
                do_sample=False,
                max_new_tokens=MAX_TOKENS,
                eos_token_id=EOS,
                pad_token_id=0,
                logits_processor=LogitsProcessorList(
                    [Masked(LLMatcher(tok, grammar_of(spec)), len(prompt))]
                ),
                output_scores=True,
                return_dict_in_generate=True,
            )
        top2 = torch.cat(out.scores).topk(2, dim=-1).values
        margins = (top2[:, 0] - top2[:, 1]).nan_to_num(posinf=1e9)
        assert float(margins.min()) > 1e-3, f"{kind}: the oracle is too close to call"
        expected[kind] = out.sequences[0, len(prompt) :].tolist()
    return expected


def _lines() -> list[dict]:
    lines = [
        {
            "prompt": PROMPTS[kind],
            "max_tokens": MAX_TOKENS,
            "temperature": 0,
            "structured_outputs": _body(spec),
        }
        for kind, spec in SPECS.items()
    ]
    # A free request between them: its row must stay unmasked.
    lines.insert(2, {"prompt": "free text ", "max_tokens": 20, "temperature": 0})
    return lines


def _body(spec: StructuredOutputs) -> dict:
    """spec as a client writes it (a schema as an object)."""
    return {
        name: json.loads(value) if name == "json" else value
        for name in spec.__struct_fields__
        if (value := getattr(spec, name)) not in (None, False)
    }


FLAGS = {
    "overlapped": (),
    "serial": ("--no-async-scheduling",),
    # 20 blocks of 4 tokens for 5 requests of up to 68 tokens each: some are preempted
    # and recomputed mid-output, their matchers kept.
    "preemption": ("--block-size", "4", "--num-gpu-blocks", "20", "--max-model-len", "72"),
    "tp2": ("--tensor-parallel-size", "2"),
}


@pytest.mark.parametrize("mode", list(FLAGS))
def test_constrained_greedy_equals_transformers_with_the_same_masks(
    oracle: dict[str, list[int]], mode: str, tmp_path: Path
) -> None:
    proc, results = generate_cli(None, [json.dumps(x) for x in _lines()], tmp_path, *FLAGS[mode])
    assert proc.returncode == 0, proc.stderr
    free = results.pop(2)
    assert free["finish_reason"] == "length" and len(free["token_ids"]) == 20
    for (kind, want), r in zip(oracle.items(), results):
        assert r["token_ids"] == want, f"{kind} ({mode})"
        assert r["finish_reason"] == "stop", kind
        check_language(kind, r["text"])
    if mode == "preemption":
        assert int(re.search(r"preemptions: (\d+)", proc.stderr).group(1)) > 0, proc.stderr


# -- the pieces --------------------------------------------------------------------------


def test_token_bans_are_exactly_the_clear_bits_and_the_tokens_past_them() -> None:
    gen = torch.Generator().manual_seed(0)
    words = torch.randint(-(2**31), 2**31 - 1, (3, 2), dtype=torch.int32, generator=gen)
    got = token_bans(words.numpy(), 70, torch.device("cpu"))  # 64 bits for 70 tokens
    want = torch.ones(3, 70, dtype=torch.bool)
    for k in range(3):
        for t in range(64):
            want[k, t] = not (int(words[k, t // 32]) & 0xFFFFFFFF) >> (t % 32) & 1
    assert torch.equal(got, want)
    assert torch.equal(unpack_bans(words)[:, :64], want[:, :64])  # the GPU's way
    assert torch.equal(token_bans(words.numpy(), 40, torch.device("cpu")), want[:, :40])


def test_the_sampler_masks_only_the_constrained_rows() -> None:
    gen = torch.Generator().manual_seed(1)
    logits = torch.randn(4, 50, generator=gen) * 3
    before = logits.clone()
    ok = {1: [7, 9], 2: [3], 3: [0, 10, 20, 30]}  # row 0 is free
    rows = torch.tensor(list(ok))
    banned = torch.ones(3, 50, dtype=torch.bool)
    for k, tokens in enumerate(ok.values()):
        banned[k, tokens] = False
    for temperature in (0.0, 1.5):
        params = [SamplingParams(temperature=temperature, top_k=0, top_p=1.0)] * 4
        tensors = SamplingTensors.from_params(params, "cpu")
        tensors.token_masks = (rows, banned)
        for draw in range(20):
            tokens = sample(logits, tensors, [None] * 4, torch.Generator().manual_seed(draw))
            assert all(int(tokens[r]) in allowed for r, allowed in ok.items()), tokens
            if temperature == 0.0:
                want_1 = 7 if logits[1, 7] > logits[1, 9] else 9
                assert int(tokens[0]) == int(logits[0].argmax()) and int(tokens[1]) == want_1
    assert torch.equal(logits, before)  # logprobs are taken from it after


@pytest.mark.parametrize(
    ("spec", "message"),
    [
        (StructuredOutputs(), "exactly one of"),
        (StructuredOutputs(regex="a", choice=["a"]), "got regex, choice"),
        (StructuredOutputs(choice=[]), "choice takes 1 to"),
        (StructuredOutputs(choice=["a", ""]), "must not be empty"),
        (StructuredOutputs(regex="a" * 70_000), "at most"),
        (StructuredOutputs(regex="a(b"), "unclosed group"),
        (StructuredOutputs(json='{"type": "foo"}'), "foo"),
        (StructuredOutputs(json="[1]"), "a JSON Schema is a JSON object"),
        (StructuredOutputs(json="{"), "structured_outputs json"),
        (StructuredOutputs(grammar='start: "a" | missing'), "missing"),
    ],
)
def test_a_bad_spec_is_refused_naming_what_is_wrong(spec: StructuredOutputs, message: str) -> None:
    with pytest.raises(ValueError, match="structured_outputs") as e:
        grammar_of(spec)
    assert message in str(e.value)


@pytest.mark.parametrize(
    ("params", "message"),
    [
        (dict(min_tokens=2), "min_tokens cannot be combined"),
        (dict(ignore_eos=True), "ignore_eos cannot be combined"),
    ],
)
def test_options_that_would_fight_the_language_are_refused(params: dict, message: str) -> None:
    p = SamplingParams(structured_outputs=StructuredOutputs(regex="a"), **params)
    with pytest.raises(ValueError, match=message):
        p.validate()


def _allowed(words: np.ndarray) -> list[int]:
    return np.flatnonzero(np.unpackbits(words.view(np.uint8), bitorder="little")).tolist()


def test_matchers_follow_each_request_and_a_broken_one_may_only_end(tmp_path: Path) -> None:
    grammars = GrammarMatchers(builtin_model_dir(), [EOS])
    grammars.add("a", StructuredOutputs(regex="ab"))
    # Past the boundary checks (a client of the core's protocol): ends at once, alone.
    grammars.add("bad", StructuredOutputs(regex="a(b"))
    grammars.add("c", StructuredOutputs(choice=["x", "yz"]))
    rows, words = grammars.fill_bitmask(["free", "a", "bad", "c"])
    assert rows == [1, 2, 3]
    assert [_allowed(w) for w in words] == [[ord("a")], [EOS], [ord("x"), ord("y")]]
    grammars.consume(["free", "a", "c"], [5, ord("a"), ord("y")])
    rows, words = grammars.fill_bitmask(["a", "c"])
    assert [_allowed(w) for w in words] == [[ord("b")], [ord("z")]]
    grammars.consume(["a", "c"], [ord("b"), ord("z")])
    assert [_allowed(w) for w in grammars.fill_bitmask(["a", "c"])[1]] == [[EOS], [EOS]]
    # EOS ends them; a token a planned-ahead step sampled after it changes nothing.
    grammars.consume(["a", "a"], [EOS, 7])
    assert _allowed(grammars.fill_bitmask(["a"])[1][0]) == [EOS]
    for r in ("a", "bad", "c"):
        grammars.drop(r)
    assert not grammars and grammars.fill_bitmask(["a"]) is None
    # A model without a tokenizer, or with one llguidance cannot read: every constrained
    # request may only end.
    bare = GrammarMatchers(tmp_path, [3])
    bare.add("r", StructuredOutputs(regex="ab"))
    assert _allowed(bare.fill_bitmask(["r"])[1][0]) == [3]
    (tmp_path / "tokenizer.json").write_text("{not json")
    broken = GrammarMatchers(tmp_path, [3])
    broken.add("r", StructuredOutputs(regex="ab"))
    assert _allowed(broken.fill_bitmask(["r"])[1][0]) == [3]


def test_a_language_with_start_after_waits_for_its_marker() -> None:
    """Until the output ends with the marker (a reasoning model's </think>) the request
    samples freely and its matcher sees nothing; then the language starts."""
    marker = list(b"</think>")
    grammars = GrammarMatchers(builtin_model_dir(), [EOS])
    grammars.add("r", StructuredOutputs(regex="[0-9]{2}", start_after=marker))
    grammars.add("now", StructuredOutputs(regex="[0-9]{2}"))
    rows, words = grammars.fill_bitmask(["r", "now"])
    assert rows == [1] and _allowed(words[0]) == list(b"0123456789")
    thinking = list(b"<think>a</think") + list(b"a</think")  # a partial marker first
    for token in thinking:
        grammars.consume(["r"], [token])
        assert grammars.fill_bitmask(["r"]) is None  # free
    grammars.consume(["r"], [ord(">")])
    rows, words = grammars.fill_bitmask(["r"])
    assert rows == [0] and _allowed(words[0]) == list(b"0123456789")
    grammars.consume(["r", "r"], [ord("4"), ord("2")])
    assert _allowed(grammars.fill_bitmask(["r"])[1][0]) == [EOS]
    grammars.drop("r")
    assert not grammars.waiting


def test_start_after_is_checked_at_the_boundary() -> None:
    for bad, message in (
        ([], "1 to 16"),
        (list(range(17)), "1 to 16"),
        ([300], "outside the vocabulary"),
    ):
        params = SamplingParams(structured_outputs=StructuredOutputs(regex="a", start_after=bad))
        with pytest.raises(ValueError, match=message):
            params.validate(258)


# -- the Python API and the command line --------------------------------------------------


def test_seeded_constrained_samples_repeat_whatever_shares_the_batch() -> None:
    spec = StructuredOutputs(regex="[a-z]{2,6}( [0-9]{1,3})?")
    alone = SamplingParams(max_tokens=20, temperature=1.0, seed=11, structured_outputs=spec)
    neighbour = SamplingParams(max_tokens=20, temperature=1.0, seed=5)
    chooser = SamplingParams(
        max_tokens=20, temperature=1.0, n=3, seed=2, structured_outputs=SPECS["choice"]
    )
    with LLM(device=CPU) as llm:
        (first,) = llm.generate(["Word: "], alone, use_tqdm=False)
        crowd = llm.generate(["x", "Word: ", "Pick: "], [neighbour, alone, chooser], use_tqdm=False)
    assert crowd[1].token_ids == first.token_ids and first.finish_reason == "stop"
    assert re.fullmatch("[a-z]{2,6}( [0-9]{1,3})?", first.text), first.text
    assert [o.text in CHOICES for o in crowd[2:]] == [True] * 3
    assert crowd[0].finish_reason == "length"


def test_the_boundary_refuses_bad_specs_and_models_without_a_tokenizer(llama_dir: Path) -> None:
    bad = SamplingParams(structured_outputs=StructuredOutputs(regex="a(b"))
    with LLM(device=CPU) as llm:
        with pytest.raises(ValueError, match="prompt 1: structured_outputs regex"):
            llm.generate(["a", "b"], [SamplingParams(), bad], use_tqdm=False)
        # One bad prompt among good ones, given with the prompt: it fails alone.
        out = llm.generate(
            ["ok", Prompt("bad", sampling_params=bad)],
            SamplingParams(max_tokens=3, structured_outputs=SPECS["choice"]),
            use_tqdm=False,
        )
        assert out[0].text in CHOICES and out[1].finish_reason == "error"
        assert "unclosed group" in (out[1].error or "")
    with LLM(str(llama_dir), device=CPU) as llm, pytest.raises(ValueError, match="no tokenizer"):
        llm.generate([[1, 2, 3]], SamplingParams(structured_outputs=SPECS["choice"]))


def test_generate_lines_take_structured_outputs_and_a_bad_one_fails_alone(
    tmp_path: Path,
) -> None:
    lines = [
        {"prompt": "Id: ", "max_tokens": 30, "structured_outputs": {"regex": "[A-Z]{2}[0-9]{4}"}},
        {"prompt": "Id: ", "structured_outputs": {"regex": "[A-Z", "choice": ["a"]}},
        {"prompt": "Obj: ", "max_tokens": 200, "structured_outputs": {"json": SCHEMA}},
    ]
    proc, results = generate_cli(None, [json.dumps(x) for x in lines], tmp_path)
    assert proc.returncode != 0  # a line failed; the others ran
    good, bad, obj = results
    assert re.fullmatch("[A-Z]{2}[0-9]{4}", good["text"]) and good["finish_reason"] == "stop"
    assert bad["finish_reason"] == "error" and "exactly one of" in bad["error"]
    assert obj["finish_reason"] == "stop", obj
    check_language("json", obj["text"])
