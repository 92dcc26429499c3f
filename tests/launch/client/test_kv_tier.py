"""The host-memory KV tier through the whole engine: a pool smaller than the prefixes'
working set reloads evicted blocks from the tier, and greedy tokens stay those of the
engine without a tier and of transformers."""

from __future__ import annotations

import random
from pathlib import Path
from typing import Any

import pytest
import torch
import transformers

from launch import LLM, SamplingParams
from tests.helpers.cli_helpers import CPU
from tests.helpers.hf_checkpoints import VOCAB, hf_greedy

BLOCK = 4
DOC_TOKENS = 40  # 10 blocks per shared document
NEW_TOKENS = 5
GREEDY = SamplingParams(max_tokens=NEW_TOKENS, temperature=0, ignore_eos=True)


def _docs() -> list[list[int]]:
    rng = random.Random(7)
    return [[rng.randrange(1, VOCAB) for _ in range(DOC_TOKENS)] for _ in range(4)]


def _questions(docs: list[list[int]]) -> list[list[int]]:
    """Each document twice with another short question after it: the second round's
    prefixes were evicted from a 24-block pool by the other documents."""
    return [[*doc, 3 + r, 5 + i] for r in range(2) for i, doc in enumerate(docs)]


def _serve(model: Path, prompts: list[list[int]], **tier: Any) -> list[tuple[list[int], int]]:
    # One request at a time, so eviction order (and the tier's traffic) is fixed.
    with LLM(
        str(model), device=CPU, num_gpu_blocks=24, block_size=BLOCK, max_model_len=64, **tier
    ) as llm:
        out = []
        for prompt in prompts:
            (res,) = llm.generate([prompt], GREEDY, use_tqdm=False)
            out.append((res.token_ids, res.num_cached_tokens))
        return out


@pytest.fixture(scope="module")
def hf_model(llama_dir: Path) -> torch.nn.Module:
    model = transformers.AutoModelForCausalLM.from_pretrained(llama_dir).float().eval()
    model.config._attn_implementation = "eager"
    return model


def test_a_pool_smaller_than_the_working_set_hits_in_the_host_tier_with_equal_tokens(
    llama_dir: Path, hf_model: torch.nn.Module
) -> None:
    prompts = _questions(_docs())
    off = _serve(llama_dir, prompts)
    on = _serve(llama_dir, prompts, kv_offload_memory=1 << 20)
    for prompt, (tokens_off, _), (tokens_on, _) in zip(prompts, off, on):
        assert tokens_on == tokens_off == hf_greedy(hf_model, prompt, NEW_TOKENS)
    second_round = slice(len(prompts) // 2, None)
    # Without a tier the evicted documents recompute; with it every full block comes back.
    assert sum(cached for _, cached in off[second_round]) == 0
    assert [cached for _, cached in on[second_round]] == [DOC_TOKENS] * 4


def test_a_tier_of_few_slots_keeps_the_most_recent_blocks_and_tokens_stay_equal(
    llama_dir: Path,
) -> None:
    # 6 slots (each block is 2 layers x K,V x 4 tokens x 2 heads x 32 x 4 bytes = 4 KiB):
    # the tier evicts too, loads partial prefixes, and never a wrong block.
    prompts = _questions(_docs())
    off = _serve(llama_dir, prompts)
    on = _serve(llama_dir, prompts, kv_offload_memory=6 * 4096)
    assert [t for t, _ in on] == [t for t, _ in off]
    assert all(cached % BLOCK == 0 and cached <= DOC_TOKENS for _, cached in on)
