"""serve_bench's workloads: prompts of words in the model's tokenizer, cut to a token count,
either each its own (random) or a few system prompts shared by many questions (shared)."""

from __future__ import annotations

import argparse
import random
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from launch.client.inputs import InputProcessor

WORDS = [
    "river",
    "stone",
    "lamp",
    "orbit",
    "cedar",
    "maple",
    "signal",
    "harbor",
    "copper",
    "velvet",
    "meadow",
    "canyon",
    "ember",
    "lantern",
    "quartz",
    "prairie",
    "falcon",
    "tundra",
    "glacier",
    "violet",
    "summit",
    "willow",
    "thunder",
    "marble",
    "compass",
    "saddle",
    "timber",
    "beacon",
    "ribbon",
    "pepper",
    "walnut",
    "harvest",
    "jasmine",
    "cobalt",
]


@dataclass
class Workload:
    name: str
    prompts: list[list[int]]


def _ids(inputs: InputProcessor, rng: random.Random, head: str, n: int) -> list[int]:
    """Token ids of head + random words, exactly n of them."""
    tok = inputs.tokenizer
    assert tok is not None, "the model has no tokenizer: the workloads are built from words"
    text = head
    ids = tok.encode(text, add_special_tokens=False)
    while len(ids) < n:
        text += " " + " ".join(rng.choice(WORDS) for _ in range(max(8, (n - len(ids)) // 2)))
        ids = tok.encode(text, add_special_tokens=False)
    return ids[:n]


def build_workload(name: str, inputs: InputProcessor, n: int, a: argparse.Namespace) -> Workload:
    rng = random.Random(f"{a.seed}-{name}-{n}")
    lo, hi = a.prompt_len
    if name == "random":
        prompts = [_ids(inputs, rng, f"Case {i}:", rng.randint(lo, hi)) for i in range(n)]
        heads = {tuple(p[:16]) for p in prompts}
        # A shared first block would be a prefix-cache hit this workload must not have.
        assert len(heads) == len(prompts), "two random prompts share their first 16 tokens"
        return Workload(name, prompts)
    if name == "shared":
        # Up to 4 system prompts, each shared by at least 4 requests when n allows.
        k = max(1, min(4, n // 4))
        systems = [
            _ids(inputs, rng, f"System {j}: you are helper {j}.", a.system_len) for j in range(k)
        ]
        prompts = [
            systems[i % k] + _ids(inputs, rng, f" Question {i}:", a.question_len) for i in range(n)
        ]
        return Workload(name, prompts)
    raise ValueError(f"unknown workload {name!r} (random, shared)")
