"""The second KV tier for hybrid models through the whole engine: a Gemma 3 style 5:1
sliding-window mix (six KV cache groups) and Qwen2's interleaved sliding window (two),
with a pool smaller than the documents' working set. Evicted prefixes come back from
host memory, from disk, and from a warm disk after a restart, with greedy tokens equal
to the engine without a tier and to transformers."""

from __future__ import annotations

import random
from pathlib import Path
from typing import Any

import pytest
import torch

from launch import SamplingParams
from protocol.engine import KVTierStats
from tests.helpers.cli_helpers import CPU
from tests.helpers.hf_checkpoints import VOCAB, hf_greedy, save_checkpoint
from tests.helpers.tier_serving import serve_in_batches

BLOCK = 4
DOC_TOKENS = 40  # 10 blocks per shared document
NEW_TOKENS = 5
GREEDY = SamplingParams(max_tokens=NEW_TOKENS, temperature=0, ignore_eos=True)
SEED = "hybrid tier test"
# KV cache groups per checkpoint.
GROUPS = {"gemma3": 6, "qwen2_interleaved": 2}


def _docs() -> list[list[int]]:
    rng = random.Random(5)
    return [[rng.randrange(3, VOCAB) for _ in range(DOC_TOKENS)] for _ in range(4)]


def _questions() -> list[list[int]]:
    """Each document twice with another short question after it."""
    return [[*doc, 3 + r, 5 + i] for r in range(2) for i, doc in enumerate(_docs())]


@pytest.fixture(scope="module", params=sorted(GROUPS))
def hybrid(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> tuple[Path, torch.nn.Module, int]:
    """(model dir, transformers' model, KV cache groups)."""
    path = tmp_path_factory.mktemp(request.param)
    hf_model = save_checkpoint(request.param, path)
    return path, hf_model, GROUPS[request.param]


def _serve(
    model: Path, groups: int, prompts: list[list[int]], batch: int = 1, **settings: Any
) -> tuple[list[tuple[list[int], int]], KVTierStats | None]:
    """(tokens, cached prompt tokens) per prompt, `batch` at a time; the tier's counts.
    The pool holds 16 blocks per group: about one and a half requests."""
    settings = dict(max_model_len=64, prefix_cache_hash_seed=SEED) | settings
    settings.setdefault("num_gpu_blocks", 1 + 16 * groups)
    out, stats = serve_in_batches(
        model, prompts, GREEDY, batch, device=CPU, block_size=BLOCK, **settings
    )
    return out, stats.kv_tier if stats else None


def test_hybrid_groups_reload_evicted_prefixes_from_host_disk_and_a_warm_restart(
    hybrid: tuple[Path, torch.nn.Module, int], tmp_path: Path
) -> None:
    model, hf_model, groups = hybrid
    prompts = _questions()
    second = len(prompts) // 2
    off, _ = _serve(model, groups, prompts)
    host, host_tier = _serve(model, groups, prompts, kv_offload_memory=1 << 20)
    disk, disk_tier = _serve(model, groups, prompts, kv_cache_dir=str(tmp_path))
    warm, warm_tier = _serve(model, groups, prompts[second:], kv_cache_dir=str(tmp_path))
    for prompt, (tokens, _) in zip(prompts, off):
        assert tokens == hf_greedy(hf_model, prompt, NEW_TOKENS)
    assert [t for t, _ in host] == [t for t, _ in disk] == [t for t, _ in off]
    assert [t for t, _ in warm] == [t for t, _ in off[second:]]
    # Without a tier the evicted documents recompute; with one every full block comes
    # back: each group's blocks for full attention, the window's for a sliding window.
    assert sum(cached for _, cached in off[second:]) == 0
    for run, tier in ((host, host_tier), (disk, disk_tier), (warm, warm_tier)):
        assert [cached for _, cached in run[-4:]] == [DOC_TOKENS] * 4
        assert tier is not None and tier.hits == 4 * DOC_TOKENS
    assert disk_tier is not None and disk_tier.disk_loaded_blocks == disk_tier.loaded_blocks
    assert warm_tier is not None and warm_tier.disk_loaded_blocks == warm_tier.loaded_blocks
    # A sliding window loads only the blocks it reads: fewer than every group's ten.
    assert host_tier is not None and 40 < host_tier.loaded_blocks < 40 * groups


@pytest.mark.parametrize(
    "settings",
    [
        pytest.param(dict(tensor_parallel_size=2), id="tp2"),
        pytest.param(dict(max_num_batched_tokens=16), id="chunked_prefill"),
        pytest.param(dict(batch=4, max_model_len=48), id="preemption"),
        pytest.param(dict(async_scheduling=True), id="async_scheduling"),
    ],
)
@pytest.mark.parametrize("level", ["host", "disk"])
def test_hybrid_tokens_equal_with_and_without_the_tier(
    hybrid: tuple[Path, torch.nn.Module, int], settings: dict, level: str, tmp_path: Path
) -> None:
    model, _, groups = hybrid
    tier: dict[str, Any] = (
        dict(kv_offload_memory=1 << 20) if level == "host" else dict(kv_cache_dir=str(tmp_path))
    )
    prompts = _questions()
    off, _ = _serve(model, groups, prompts, **settings)
    on, stats = _serve(model, groups, prompts, **tier, **settings)
    assert [t for t, _ in on] == [t for t, _ in off]
    assert stats is not None and stats.hits > 0
