"""Two-phase disk tier loads through the whole engine (enginecore/kv_tier_loads.py): a
restarted engine whose disk hits are several times the step's token budget loads them
over several steps of a small load budget, then computes from the verified prefix; the
greedy tokens are those of transformers and of the engine without a tier, with async
scheduling, TP 2, preemption, and a damaged file in the middle of a load."""

from __future__ import annotations

import random
import shutil
from array import array
from pathlib import Path
from typing import Any

import pytest
import transformers

from launch import LLM, SamplingParams
from protocol.engine import KVTierStats
from tests.helpers.cli_helpers import CPU
from tests.helpers.hf_checkpoints import VOCAB, hf_greedy
from tests.helpers.tier_serving import serve_in_batches

BLOCK = 4
DOC_TOKENS = 40  # 10 blocks: five times the step budget below
BUDGET = 8  # --max-num-batched-tokens
LOAD_BYTES = 3 * 2048  # 3 of the tiny model's 2 KiB blocks a step: 4 steps of loads
GREEDY = SamplingParams(max_tokens=5, temperature=0, ignore_eos=True)
SEED = "two-phase loads"
_LAST_STATS: list[Any] = []  # _serve's last run's SchedulerStats


def _docs() -> list[list[int]]:
    rng = random.Random(23)
    return [[rng.randrange(1, VOCAB) for _ in range(DOC_TOKENS)] for _ in range(4)]


def _questions() -> list[list[int]]:
    return [[*d, 2] for d in _docs()]


def _serve(
    model: Path, prompts: list[list[int]], batch: int = 1, **settings: Any
) -> tuple[list[tuple[list[int], int]], KVTierStats | None]:
    """(tokens, cached prompt tokens) per prompt, `batch` at a time; the tier's counts."""
    args: dict[str, Any] = dict(
        device=CPU,
        num_gpu_blocks=24,
        block_size=BLOCK,
        max_model_len=64,
        enable_prefix_caching=True,
        prefix_cache_hash_seed=SEED,
        max_num_batched_tokens=BUDGET,
        kv_tier_load_bytes=LOAD_BYTES,
    )
    out, stats = serve_in_batches(model, prompts, GREEDY, batch, **(args | settings))
    _LAST_STATS[:] = [stats]
    return out, stats.kv_tier if stats else None


@pytest.fixture(scope="module")
def warm_dir(llama_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A disk tier holding every document (evicted during the run, or stored at stop)."""
    path = tmp_path_factory.mktemp("kv-loads")
    _serve(llama_dir, [[*d, 1] for d in _docs()], kv_cache_dir=str(path))
    return path


@pytest.fixture(scope="module")
def expected(llama_dir: Path) -> list[list[int]]:
    """The questions' tokens from transformers, equal to the engine's without a tier."""
    model = transformers.AutoModelForCausalLM.from_pretrained(llama_dir).float().eval()
    model.config._attn_implementation = "eager"
    tokens = [hf_greedy(model, q, 5) for q in _questions()]
    with LLM(str(llama_dir), device=CPU, block_size=BLOCK, max_num_batched_tokens=BUDGET) as llm:
        assert [o.token_ids for o in llm.generate(_questions(), GREEDY, use_tqdm=False)] == tokens
    return tokens


def _copy(src: Path, dst: Path) -> Path:
    shutil.copytree(src, dst)
    return dst


@pytest.mark.parametrize(
    "settings",
    [
        pytest.param({}, id="serial"),
        pytest.param(dict(async_scheduling=True), id="async_scheduling"),
        pytest.param(dict(tensor_parallel_size=2), id="tp2"),
        pytest.param(dict(kv_offload_memory=1 << 20), id="host_and_disk"),
    ],
)
def test_a_restart_loads_disk_hits_five_times_the_step_budget_and_tokens_stay(
    llama_dir: Path, warm_dir: Path, expected: list[list[int]], tmp_path: Path, settings: dict
) -> None:
    if "tensor_parallel_size" in settings:  # each rank's shards, stored by a TP 2 run
        path = tmp_path / "tp2"
        _serve(llama_dir, [[*d, 1] for d in _docs()], kv_cache_dir=str(path), **settings)
    else:
        path = _copy(warm_dir, tmp_path / "d")
    out, tier = _serve(llama_dir, _questions(), kv_cache_dir=str(path), **settings)
    assert [t for t, _ in out] == expected
    # Every document's 40 tokens loaded from disk (a budget of 8 loaded only 4 before).
    assert [c for _, c in out] == [DOC_TOKENS] * 4
    assert tier is not None and tier.disk_loaded_blocks == 4 * DOC_TOKENS // BLOCK
    assert tier.failed_blocks == 0
    # Disk hits are copied into host memory, where there is one, in the steps after.
    assert (tier.promoted_blocks > 0) == ("kv_offload_memory" in settings)


def test_loading_requests_preempted_for_room_give_equal_tokens(
    llama_dir: Path, warm_dir: Path, expected: list[list[int]], tmp_path: Path
) -> None:
    # All four at once in a pool of 22 blocks (the warm run had 23: the pool's size is
    # not in the fingerprint): two are admitted to load (11 blocks each, all of them),
    # and the 12th block the first needs preempts the other, still loading or ready.
    path = _copy(warm_dir, tmp_path / "d")
    out, tier = _serve(llama_dir, _questions(), batch=4, num_gpu_blocks=23, kv_cache_dir=str(path))
    assert [t for t, _ in out] == expected
    assert tier is not None and tier.disk_loaded_blocks >= 4 * DOC_TOKENS // BLOCK
    assert _LAST_STATS[0].num_preemptions > 0


def test_a_damaged_file_in_the_middle_of_a_long_load_is_recomputed_from_there(
    llama_dir: Path, warm_dir: Path, expected: list[list[int]], tmp_path: Path
) -> None:
    path = _copy(warm_dir, tmp_path / "d")
    # Damage the file of each document's sixth block: its hash input holds its tokens.
    docs = _docs()
    sixth = {array("I", d[20:24]).tobytes() for d in docs}
    damaged = 0
    for f in (path / "rank0").glob("slot*.kv"):
        data = bytearray(f.read_bytes())
        if any(tokens in data[:200] for tokens in sixth):
            data[-7] ^= 0x10  # inside the KV bytes: only the checksum can tell
            f.write_bytes(bytes(data))
            damaged += 1
    assert damaged == 4
    out, tier = _serve(llama_dir, _questions(), kv_cache_dir=str(path))
    assert [t for t, _ in out] == expected
    # Loaded up to the damaged block, recomputed from it.
    assert [c for _, c in out] == [20] * 4
    assert tier is not None and tier.failed_blocks == 4
