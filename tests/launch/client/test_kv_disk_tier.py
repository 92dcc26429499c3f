"""The disk tier through the whole engine: blocks evicted into the host tier persist under
--kv-cache-dir and a restarted engine loads them instead of recomputing; a corrupt,
truncated or foreign file is a miss, never a wrong token; a directory that cannot be
written leaves serving as it was."""

from __future__ import annotations

import os
import random
import shutil
import time
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
DOC_TOKENS = 40
GREEDY = SamplingParams(max_tokens=5, temperature=0, ignore_eos=True)
SEED = "a test deployment's seed"


def _docs() -> list[list[int]]:
    rng = random.Random(11)
    return [[rng.randrange(1, VOCAB) for _ in range(DOC_TOKENS)] for _ in range(4)]


_STATS: list[KVTierStats | None] = [None]  # the last _serve's tier counts


def _serve(model: Path, prompts: list[list[int]], **tier: Any) -> list[tuple[list[int], int]]:
    settings: dict[str, Any] = dict(
        device=CPU,
        num_gpu_blocks=24,
        block_size=BLOCK,
        max_model_len=64,
        enable_prefix_caching=True,
    )
    settings.update(prefix_cache_hash_seed=SEED, kv_offload_memory=1 << 20)
    settings.update(tier)
    out, stats = serve_in_batches(model, prompts, GREEDY, **settings)  # one at a time
    _STATS[0] = stats.kv_tier if stats else None
    return out


@pytest.fixture(scope="module")
def warm_dir(llama_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A disk tier holding every document: what the device evicted during the run, and
    what it still held when the engine stopped."""
    path = tmp_path_factory.mktemp("kv-tier")
    _serve(llama_dir, [[*d, 1] for d in _docs()], kv_cache_dir=str(path))
    return path


@pytest.fixture(scope="module")
def expected(llama_dir: Path) -> list[list[int]]:
    """Tokens for the questions, from the engine without any tier."""
    with LLM(str(llama_dir), device=CPU, block_size=BLOCK) as llm:
        return [o.token_ids for o in llm.generate(_questions(), GREEDY, use_tqdm=False)]


def _questions() -> list[list[int]]:
    return [[*d, 2] for d in _docs()]


def _copy(src: Path, dst: Path) -> Path:
    shutil.copytree(src, dst)
    return dst


def test_a_restart_onto_a_warm_disk_tier_loads_the_stored_prefixes(
    llama_dir: Path, warm_dir: Path, expected: list[list[int]], tmp_path: Path
) -> None:
    assert len(list((warm_dir / "rank0").glob("slot*.kv"))) >= 40  # 4 documents x 10 blocks
    out = _serve(llama_dir, _questions(), kv_cache_dir=str(_copy(warm_dir, tmp_path / "d")))
    assert [t for t, _ in out] == expected
    # Loaded from disk, not one token recomputed (the last document was on the device).
    assert [c for _, c in out] == [DOC_TOKENS] * 4
    # Without the disk, the restarted engine recomputes it.
    assert _serve(llama_dir, _questions()[:1])[0][1] == 0


def test_a_restart_with_the_disk_level_alone_loads_the_stored_prefixes(
    llama_dir: Path, warm_dir: Path, expected: list[list[int]], tmp_path: Path
) -> None:
    path = _copy(warm_dir, tmp_path / "d")
    out = _serve(llama_dir, _questions(), kv_cache_dir=str(path), kv_offload_memory=None)
    assert [t for t, _ in out] == expected
    assert [c for _, c in out] == [DOC_TOKENS] * 4
    assert _STATS[0] is not None and _STATS[0].disk_loaded_blocks == 4 * DOC_TOKENS // BLOCK


@pytest.mark.parametrize("damage", ["flip_byte", "truncate"])
def test_a_damaged_block_file_is_a_miss_never_a_wrong_token(
    llama_dir: Path, warm_dir: Path, expected: list[list[int]], tmp_path: Path, damage: str
) -> None:
    path = _copy(warm_dir, tmp_path / "d")
    for f in (path / "rank0").glob("slot*.kv"):
        data = bytearray(f.read_bytes())
        if damage == "flip_byte":
            data[-7] ^= 0x10  # inside the KV bytes: only the checksum can tell
            f.write_bytes(bytes(data))
        else:
            f.write_bytes(bytes(data[: len(data) // 2]))
    out = _serve(llama_dir, _questions(), kv_cache_dir=str(path))
    assert [t for t, _ in out] == expected
    if damage == "truncate":  # not a whole file: never indexed
        assert [c for _, c in out] == [0, 0, 0, 0]
    else:  # indexed from its header; its checksum fails on the read: recomputed
        assert _STATS[0] is not None and _STATS[0].failed_blocks == 4 * DOC_TOKENS // BLOCK


def test_blocks_of_another_seed_or_model_are_ignored(
    llama_dir: Path, warm_dir: Path, expected: list[list[int]], tmp_path: Path
) -> None:
    # Another hash seed: the fingerprint differs (and so would every hash).
    out = _serve(
        llama_dir,
        _questions(),
        kv_cache_dir=str(_copy(warm_dir, tmp_path / "a")),
        prefix_cache_hash_seed="another deployment",
    )
    assert [t for t, _ in out] == expected and [c for _, c in out] == [0, 0, 0, 0]
    # Another model of the very same shape: equal hashes, other weights.
    other = _copy(llama_dir, tmp_path / "other-model")
    model = transformers.AutoModelForCausalLM.from_pretrained(other)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.01 * torch.randn_like(p))
    model.save_pretrained(other)
    out = _serve(other, _questions(), kv_cache_dir=str(_copy(warm_dir, tmp_path / "b")))
    assert [c for _, c in out] == [0, 0, 0, 0]


def test_an_unwritable_dir_or_a_full_disk_turns_the_disk_tier_off_and_serving_goes_on(
    llama_dir: Path, expected: list[list[int]], tmp_path: Path
) -> None:
    blocker = tmp_path / "a-file"
    blocker.write_text("not a directory")
    prompts = [[*d, 1] for d in _docs()] + _questions()
    out = _serve(llama_dir, prompts, kv_cache_dir=str(blocker / "kv"))
    assert [t for t, _ in out][4:] == expected
    assert out[4][1] == DOC_TOKENS  # the host tier still serves
    # Every write fails with ENOSPC: the temporary files lead to /dev/full.
    full = tmp_path / "full" / "rank0"
    full.mkdir(parents=True)
    for slot in range(64):
        os.symlink("/dev/full", full / f"slot{slot}.tmp")
    out = _serve(llama_dir, prompts, kv_cache_dir=str(full.parent))
    assert [t for t, _ in out][4:] == expected
    assert out[4][1] == DOC_TOKENS
    assert not list(full.glob("slot*.kv"))


def _wait_for_files(directory: Path, count: int) -> list[Path]:
    """The slot files once at least count are written (the writer thread runs on)."""
    deadline = time.monotonic() + 60
    while len(files := sorted(directory.glob("slot*.kv"))) < count:
        assert time.monotonic() < deadline, f"only {len(files)} block files written"
        time.sleep(0.05)
    return files


def _disk_only_llm(model: Path, cache_dir: Path, **extra: Any) -> LLM:
    """A 24-block pool of 4-token blocks with a disk-only tier in cache_dir."""
    return LLM(
        str(model),
        device=CPU,
        num_gpu_blocks=24,
        block_size=BLOCK,
        max_model_len=64,
        enable_prefix_caching=True,
        kv_cache_dir=str(cache_dir),
        **extra,
    )


def _flip_a_byte_in_each(folder: Path, count: int) -> None:
    """Flip a payload byte in each of the first `count` block files written to folder."""
    for f in _wait_for_files(folder, count):
        data = bytearray(f.read_bytes())
        data[-5] ^= 0x08
        f.write_bytes(bytes(data))


def test_a_disk_only_tier_holds_more_than_the_pool_and_survives_a_byte_flipped_while_serving(
    llama_dir: Path, tmp_path: Path
) -> None:
    hf_model = transformers.AutoModelForCausalLM.from_pretrained(llama_dir).float().eval()
    hf_model.config._attn_implementation = "eager"
    docs = _docs()
    rounds = [[[*d, 2 + r] for d in docs] for r in range(2)]
    with _disk_only_llm(llama_dir, tmp_path) as llm:

        def ask(prompts: list[list[int]]) -> list[tuple[list[int], int]]:
            return [
                (r.token_ids, r.num_cached_tokens)
                for p in prompts
                for r in llm.generate([p], GREEDY, use_tqdm=False)
            ]

        ask([[*d, 1] for d in docs])  # 40 blocks through a pool of 23: most go to disk
        first = ask(rounds[0])
        assert [t for t, _ in first] == [hf_greedy(hf_model, p, 5) for p in rounds[0]]
        # No host memory: the evicted documents came back from disk alone.
        assert [c for _, c in first][:2] == [DOC_TOKENS] * 2
        # Every stored block's file flipped while the engine runs: a miss, never a token
        # of other KV.
        _flip_a_byte_in_each(tmp_path / "rank0", 4 * DOC_TOKENS // BLOCK - 23)
        second = ask(rounds[1])
        assert [t for t, _ in second] == [hf_greedy(hf_model, p, 5) for p in rounds[1]]
        stats = llm.last_summary.stats
        tier = stats.kv_tier if stats else None
        assert tier is not None and tier.failed_blocks >= DOC_TOKENS // BLOCK
        assert tier.disk_loaded_blocks >= 2 * DOC_TOKENS // BLOCK and tier.load_seconds > 0


def test_tp2_ranks_agree_on_a_block_only_one_rank_cannot_read(
    llama_dir: Path, expected: list[list[int]], tmp_path: Path
) -> None:
    # Only rank 1's files are damaged while serving: rank 0 reads its shard fine, yet
    # both ranks recompute the block (they must run the same step), and tokens stay.
    with _disk_only_llm(llama_dir, tmp_path, tensor_parallel_size=2) as llm:
        for d in _docs():
            llm.generate([[*d, 1]], GREEDY, use_tqdm=False)
        _flip_a_byte_in_each(tmp_path / "rank1", 4 * DOC_TOKENS // BLOCK - 23)
        out = [llm.generate([q], GREEDY, use_tqdm=False)[0].token_ids for q in _questions()]
        stats = llm.last_summary.stats
    assert out == expected
    tier = stats.kv_tier if stats else None
    assert tier is not None and tier.disk_loaded_blocks > 0
    assert 0 < tier.failed_blocks <= tier.disk_loaded_blocks
