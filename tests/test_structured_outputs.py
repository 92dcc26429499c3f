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
from cli_helpers import CPU, generate_cli

from launch import LLM, SamplingParams
from launch.builtin_model import builtin_model_dir
from protocol.engine import StructuredOutputs
from worker.sampler import apply_token_bitmask
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
