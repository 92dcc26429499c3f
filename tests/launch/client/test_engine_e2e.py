"""The whole engine, as users run it: `pagedserve generate` starts the EngineCore and a
worker as separate processes; greedy tokens must equal transformers' own generate()."""

from __future__ import annotations

import json
import random
import re
from pathlib import Path

import pytest

from tests.helpers.cli_helpers import generate_cli
from tests.helpers.hf_checkpoints import VOCAB, hf_greedy, save_checkpoint

MAX_TOKENS = 10


def make_prompts(seed: int = 7) -> list[list[int]]:
    """18 prompts of mixed lengths: 4 shared prefixes with different suffixes, plus two
    prompts equal to a prefix (a full hit recomputes the last block)."""
    rng = random.Random(seed)
    prefixes = [[rng.randrange(3, VOCAB) for _ in range(n)] for n in (9, 13, 17, 24)]
    prompts = []
    for prefix in prefixes:
        for n in (1, 3, 6, 11):
            prompts.append(prefix + [rng.randrange(3, VOCAB) for _ in range(n)])
    prompts += [prefixes[1][:12], prefixes[3][:8]]
    return prompts


@pytest.fixture(scope="module")
def checkpoint(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory):
    """(model dir, prompts, transformers' greedy continuations)."""
    path = tmp_path_factory.mktemp(request.param)
    hf_model = save_checkpoint(request.param, path)
    prompts = make_prompts()
    expected = [hf_greedy(hf_model, prompt, MAX_TOKENS) for prompt in prompts]
    return path, prompts, expected


def run_generate(model: Path, lines: list[dict], tmp: Path, *flags: str) -> tuple[list, str]:
    proc, results = generate_cli(
        model, [json.dumps(x) for x in lines], tmp, "--block-size", "4", *flags
    )
    assert proc.returncode == 0, proc.stderr
    return results, proc.stderr


def greedy_lines(prompts: list[list[int]]) -> list[dict]:
    return [
        {"prompt_token_ids": p, "temperature": 0, "max_tokens": MAX_TOKENS, "ignore_eos": True}
        for p in prompts
    ]


MODES = {
    "prefix-caching": (),
    "no-prefix-caching": ("--no-prefix-caching",),
    "chunked-prefill": ("--max-num-batched-tokens", "7"),
    # 19 usable blocks of 4 tokens: far too few for 18 requests at once. The engine refuses
    # a pool that cannot hold one max_model_len request, hence the shorter context (45
    # tokens is the longest here) and chunks (a sliding group holds its window plus a chunk).
    "preemption": (
        "--num-gpu-blocks",
        "{preemption_blocks}",
        "--max-num-seqs",
        "12",
        "--max-model-len",
        "48",
        "--max-num-batched-tokens",
        "16",
    ),
}


ALL = [
    "llama",
    "qwen2",
    "mistral",
    "qwen2_interleaved",
    "qwen2_5to1",
    "qwen3",
    "gemma3",
    "gemma3_softcap",
]
# Six groups (5 sliding + 1 full) hold more blocks per request: 47 for one of max_model_len.
# Matched by prefix, so "gemma3" covers gemma3_softcap too.
PREEMPTION_BLOCKS = {"qwen2_5to1": 50, "gemma3": 50}


@pytest.mark.parametrize("mode", list(MODES))
@pytest.mark.parametrize("checkpoint", ALL, indirect=True)
def test_greedy_tokens_equal_transformers(checkpoint, mode: str, tmp_path: Path) -> None:
    check_against_transformers(checkpoint, mode, tmp_path)


@pytest.mark.parametrize("mode", list(MODES))
@pytest.mark.parametrize("checkpoint", ["llama", "qwen2", "gemma3"], indirect=True)
def test_tensor_parallel_2_equals_transformers(checkpoint, mode: str, tmp_path: Path) -> None:
    check_against_transformers(checkpoint, mode, tmp_path, "--tensor-parallel-size", "2")


def check_against_transformers(checkpoint, mode: str, tmp_path: Path, *extra: str) -> None:
    path, prompts, expected = checkpoint
    family = next((f for f in PREEMPTION_BLOCKS if path.name.startswith(f)), None)
    blocks = str(PREEMPTION_BLOCKS.get(family, 20))  # type: ignore[arg-type]
    flags = tuple(f.replace("{preemption_blocks}", blocks) for f in (*MODES[mode], *extra))
    results, stderr = run_generate(path, greedy_lines(prompts), tmp_path, *flags)
    assert [r["index"] for r in results] == list(range(len(prompts)))
    for r, prompt, want in zip(results, prompts, expected):
        assert r["prompt_token_ids"] == prompt
        assert r["token_ids"] == want, f"prompt {r['index']} ({mode})"
        assert r["finish_reason"] == "length"
    cached = sum(r["num_cached_tokens"] for r in results)
    hit_rate = float(re.search(r"prefix-cache hit rate: ([\d.]+)%", stderr).group(1))
    preemptions = int(re.search(r"preemptions: (\d+)", stderr).group(1))
    if mode == "no-prefix-caching":
        assert cached == 0 and hit_rate == 0.0
    elif mode in ("prefix-caching", "chunked-prefill"):
        assert cached > 0 and hit_rate > 0.0
    if mode == "preemption":
        assert preemptions > 0, stderr
