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
from protocol.engine import KVTierStats
from tests.helpers.cli_helpers import CPU
from tests.helpers.hf_checkpoints import VOCAB, hf_greedy
from tests.helpers.tier_serving import serve_in_batches

BLOCK = 4
DOC_TOKENS = 40  # 10 blocks per shared document
NEW_TOKENS = 5
GREEDY = SamplingParams(max_tokens=NEW_TOKENS, temperature=0, ignore_eos=True)
_LAST_STATS: list[Any] = []  # _serve's last run's SchedulerStats


def _docs() -> list[list[int]]:
    rng = random.Random(7)
    return [[rng.randrange(1, VOCAB) for _ in range(DOC_TOKENS)] for _ in range(4)]


def _questions(docs: list[list[int]]) -> list[list[int]]:
    """Each document twice with another short question after it: the second round's
    prefixes were evicted from a 24-block pool by the other documents."""
    return [[*doc, 3 + r, 5 + i] for r in range(2) for i, doc in enumerate(docs)]


def _serve(
    model: Path, prompts: list[list[int]], batch: int = 1, **settings: Any
) -> tuple[list[tuple[list[int], int]], KVTierStats | None]:
    """(tokens, cached prompt tokens) per prompt, served `batch` at a time (1: eviction
    order, and the tier's traffic, are fixed); the tier's counts at the end."""
    settings = dict(num_gpu_blocks=24, max_model_len=64) | settings
    out, stats = serve_in_batches(
        model, prompts, GREEDY, batch, device=CPU, block_size=BLOCK, **settings
    )
    _LAST_STATS[:] = [stats]
    return out, stats.kv_tier if stats else None


@pytest.fixture(scope="module")
def hf_model(llama_dir: Path) -> torch.nn.Module:
    model = transformers.AutoModelForCausalLM.from_pretrained(llama_dir).float().eval()
    model.config._attn_implementation = "eager"
    return model


def test_a_pool_smaller_than_the_working_set_hits_in_the_host_tier_with_equal_tokens(
    llama_dir: Path, hf_model: torch.nn.Module
) -> None:
    prompts = _questions(_docs())
    off, no_tier = _serve(llama_dir, prompts)
    on, tier = _serve(llama_dir, prompts, kv_offload_memory=1 << 20)
    assert no_tier is None
    for prompt, (tokens_off, _), (tokens_on, _) in zip(prompts, off, on):
        assert tokens_on == tokens_off == hf_greedy(hf_model, prompt, NEW_TOKENS)
    second_round = slice(len(prompts) // 2, None)
    # Without a tier the evicted documents recompute; with it every full block comes back.
    assert sum(cached for _, cached in off[second_round]) == 0
    assert [cached for _, cached in on[second_round]] == [DOC_TOKENS] * 4
    # Visible in the stats: every hit token was loaded, 2 KiB per block.
    assert tier is not None and tier.hits == 4 * DOC_TOKENS and tier.loaded_blocks == 40
    assert tier.block_bytes == 2048 and tier.stored_blocks >= 40


def test_a_tier_of_few_slots_keeps_the_most_recent_blocks_and_tokens_stay_equal(
    llama_dir: Path,
) -> None:
    # 6 slots of 2 KiB blocks (the tiny model's K and V of 4 tokens, all layers):
    # the tier evicts too, loads partial prefixes, and never a wrong block.
    prompts = _questions(_docs())
    off, _ = _serve(llama_dir, prompts)
    on, _ = _serve(llama_dir, prompts, kv_offload_memory=6 * 2048)
    assert [t for t, _ in on] == [t for t, _ in off]
    assert all(cached % BLOCK == 0 and cached <= DOC_TOKENS for _, cached in on)


@pytest.mark.parametrize(
    "settings",
    [
        pytest.param(dict(tensor_parallel_size=2), id="tp2"),
        pytest.param(dict(max_num_batched_tokens=16), id="chunked_prefill"),
        pytest.param(dict(batch=4, num_gpu_blocks=16, max_model_len=48), id="preemption"),
        pytest.param(dict(async_scheduling=True), id="async_scheduling"),
    ],
)
def test_tokens_equal_with_and_without_the_tier(llama_dir: Path, settings: dict) -> None:
    prompts = _questions(_docs())
    off, _ = _serve(llama_dir, prompts, **settings)
    on, tier = _serve(llama_dir, prompts, kv_offload_memory=1 << 20, **settings)
    assert [t for t, _ in on] == [t for t, _ in off]
    assert tier is not None and tier.hits > 0


def test_the_real_model_gives_equal_tokens_from_the_host_and_disk_tiers(
    real_model_dir: Path, tmp_path: Path
) -> None:
    # Three 96-token documents through a pool of 16-token blocks that holds one of them
    # at a time: the second round loads every document back (host), and a restart loads
    # them from disk.
    rng = random.Random(3)
    docs = [[rng.randrange(100, 40000) for _ in range(96)] for _ in range(3)]
    prompts = [[*d, 11 + r] for r in range(2) for d in docs]
    common: dict[str, Any] = dict(block_size=16, num_gpu_blocks=10, max_model_len=128)
    seeded = dict(common, prefix_cache_hash_seed="real model tier", kv_offload_memory=64 << 20)
    with LLM(str(real_model_dir), device=CPU, **common) as llm:
        off = [o.token_ids for o in llm.generate(prompts, GREEDY, use_tqdm=False)]

    def run(prompts: list[list[int]]) -> list[tuple[list[int], int]]:
        with LLM(str(real_model_dir), device=CPU, kv_cache_dir=str(tmp_path), **seeded) as llm:
            return [
                (o.token_ids, o.num_cached_tokens)
                for p in prompts
                for o in llm.generate([p], GREEDY, use_tqdm=False)
            ]

    host = run(prompts)
    assert [t for t, _ in host] == off
    assert [c for _, c in host[3:]] == [96] * 3
    restarted = run(prompts[3:])
    assert [t for t, _ in restarted] == off[3:]
    assert [c for _, c in restarted] == [96] * 3


def test_speculation_beside_the_tier_keeps_tokens_and_tier_hits(
    llama_dir: Path, hf_model: torch.nn.Module
) -> None:
    # Drafts hold lookahead slots and free the blocks of rejected ones; none of that may
    # be stored in the tier or disturb what the tier loads back.
    prompts = [[*p, *p[:8]] for p in _questions(_docs())]  # a repeat to draft from
    spec = {"method": "ngram", "num_speculative_tokens": 3}
    spec |= {"prompt_lookup_min": 1, "prompt_lookup_max": 3}  # one token of context: drafts
    off, _ = _serve(llama_dir, prompts, max_model_len=80)
    on, tier = _serve(
        llama_dir, prompts, max_model_len=80, kv_offload_memory=1 << 20, speculative_config=spec
    )
    for prompt, (tokens_off, _), (tokens_on, _) in zip(prompts, off, on):
        assert tokens_on == tokens_off == hf_greedy(hf_model, prompt, NEW_TOKENS)
    assert tier is not None and tier.hits > 0
    drafts = _LAST_STATS[0].spec_decode
    assert drafts is not None and drafts.num_draft_tokens > 0
