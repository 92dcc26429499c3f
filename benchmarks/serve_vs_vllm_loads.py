"""serve_vs_vllm's workloads: each a shape (shared prefix, input and output tokens), sent
either as `bench serve` dataset flags or, without the peer, as token ids."""

from __future__ import annotations

import functools
import random
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from serve_bench_workloads import WORDS

# Chat requests: this many distinct long prefixes, each shared by a share of the requests.
CHAT_SYSTEMS = 4
# Random token ids start past the special tokens, which sit at the start of the vocabulary.
FIRST_PLAIN_ID = 256


@dataclass(frozen=True)
class Shape:
    """Token counts of a workload's requests: prefix (shared: one for random, one of
    CHAT_SYSTEMS for chat), input after it, output generated."""

    name: str
    prefix: int
    input: int
    output: int


SHAPES = {
    "random": Shape("random", 128, 384, 128),
    "chat": Shape("chat", 1024, 64, 128),
    "long-output": Shape("long-output", 0, 32, 512),
}


@functools.cache
def _tokenizer(model: Path) -> Any:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(model))


def _text(tok: Any, rng: random.Random, head: str, n: int) -> str:
    """head + random words, cut to n tokens and decoded back to text."""
    words = [rng.choice(WORDS) for _ in range(n)]
    ids = tok.encode(f"{head} {' '.join(words)}", add_special_tokens=False)[:n]
    return str(tok.decode(ids))


def chat_texts(shape: Shape, n: int, seed: int, model: Path) -> list[str]:
    """n chat requests as the model's chat template renders them (one user message, a long
    shared text then a question, the assistant's turn opened), request i on shared text
    i mod CHAT_SYSTEMS: what a server makes of the chat workload, for a client that sends
    token ids."""
    tok = _tokenizer(model)
    rng = random.Random(f"chat-{seed}")
    systems = [
        _text(tok, rng, f"Manual {seed}-{j}. Rules:", shape.prefix) for j in range(CHAT_SYSTEMS)
    ]
    texts = []
    for i in range(n):
        content = systems[i % CHAT_SYSTEMS] + _text(tok, rng, f" Question {i}:", shape.input)
        messages = [{"role": "user", "content": content}]
        texts.append(tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True))
    return texts


def client_args(shape: Shape, n: int) -> list[str]:
    """`bench serve` flags for n requests of this shape: the random dataset on
    /v1/completions, or for chat vLLM's repeated-prefix dataset on /v1/chat/completions
    (each prompt one user message, so each server applies its own chat template)."""
    if shape.name == "chat":
        return [
            "--backend",
            "openai-chat",
            "--endpoint",
            "/v1/chat/completions",
            "--num-prompts",
            str(n),
            "--dataset-name",
            "prefix_repetition",
            "--prefix-repetition-prefix-len",
            str(shape.prefix),
            "--prefix-repetition-suffix-len",
            str(shape.input),
            "--prefix-repetition-num-prefixes",
            str(CHAT_SYSTEMS),
            "--prefix-repetition-output-len",
            str(shape.output),
        ]
    return [
        "--backend",
        "openai",
        "--endpoint",
        "/v1/completions",
        "--num-prompts",
        str(n),
        "--dataset-name",
        "random",
        "--random-prefix-len",
        str(shape.prefix),
        "--random-input-len",
        str(shape.input),
        "--random-output-len",
        str(shape.output),
        "--random-range-ratio",
        "0",
    ]


def token_prompts(shape: Shape, n: int, seed: int, model: Path) -> list[list[int]]:
    """The same shape as token ids, for a client that sends ids (the peer absent)."""
    if shape.name == "chat":
        tok = _tokenizer(model)
        return [tok.encode(t, add_special_tokens=False) for t in chat_texts(shape, n, seed, model)]
    vocab = len(_tokenizer(model))
    rng = random.Random(f"{shape.name}-{seed}")

    def draw(k: int) -> list[int]:
        return [rng.randrange(FIRST_PLAIN_ID, vocab) for _ in range(k)]

    prefix = draw(shape.prefix)
    return [prefix + draw(shape.input) for _ in range(n)]
