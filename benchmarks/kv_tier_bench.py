#!/usr/bin/env python3
"""The second KV tier on the real model (CPU): prints one JSON object.

- shared documents, several questions each, whose prefix working set is at least 3x the
  device pool: prefix hit rate (cached / prompt tokens) and output tok/s with the tier
  off, in host memory, and persisted to disk;
- a long shared prefix after a restart: the time to first token on a cold engine, and on
  a restarted one whose disk tier holds the prefix;
- the disk tier's read-back bandwidth at start-up against a plain read of the same files.

    python benchmarks/kv_tier_bench.py [--model DIR] [--docs 7] [--doc-tokens 512]
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from launch import LLM, SamplingParams
from tests.helpers.real_model import fetch_real_model
from worker.kv_disk_tier import _HEADER, DiskKVTier

SEED = "kv tier benchmark"
BLOCK = 16


def _tokens(rng: random.Random, n: int) -> list[int]:
    return [rng.randrange(100, 40000) for _ in range(n)]


def _engine(model: str, blocks: int, max_len: int, **tier: Any) -> LLM:
    return LLM(
        model,
        device="cpu",
        num_gpu_blocks=blocks,
        block_size=BLOCK,
        max_model_len=max_len,
        prefix_cache_hash_seed=SEED,
        **tier,
    )


def working_set(model: str, args: argparse.Namespace, **tier: Any) -> dict[str, float]:
    """Questions on each document in turn, round after round, one request at a time."""
    rng = random.Random(1)
    docs = [_tokens(rng, args.doc_tokens) for _ in range(args.docs)]
    prompts = [d + _tokens(rng, 8) for _ in range(args.rounds) for d in docs]
    params = SamplingParams(max_tokens=args.output_tokens, temperature=0, ignore_eos=True)
    # The pool holds about two documents: the working set is docs / 2 times it.
    blocks = 2 * (args.doc_tokens + 8 + args.output_tokens) // BLOCK + 4
    with _engine(model, blocks, args.doc_tokens + 64, **tier) as llm:
        start = time.perf_counter()
        cached = prompt = out = 0
        for p in prompts:
            (res,) = llm.generate([p], params, use_tqdm=False)
            cached += res.num_cached_tokens
            prompt += len(p)
            out += len(res.token_ids)
        seconds = time.perf_counter() - start
    return {
        "pool_blocks": blocks,
        "working_set_blocks": args.docs * args.doc_tokens // BLOCK,
        "hit_rate": cached / prompt,
        "output_tok_s": out / seconds,
        "seconds": seconds,
    }


def restart_ttft(model: str, args: argparse.Namespace, kv_dir: str) -> dict[str, float]:
    """TTFT of a long-prefix request on a fresh engine, then after a restart onto the
    disk tier that kept it (a second long request evicted it into the tier first)."""
    rng = random.Random(2)
    prefix, filler = _tokens(rng, args.prefix_tokens), _tokens(rng, args.prefix_tokens)
    one = SamplingParams(max_tokens=1, temperature=0)
    blocks = (args.prefix_tokens + 64) // BLOCK + 8
    tier = dict(kv_offload_memory=args.prefix_tokens * 2 * 48 * 1024, kv_cache_dir=kv_dir)

    def ttft(llm: LLM, prompt: list[int]) -> tuple[float, int]:
        start = time.perf_counter()
        (res,) = llm.generate([prompt], one, use_tqdm=False)
        return time.perf_counter() - start, res.num_cached_tokens

    with _engine(model, blocks, args.prefix_tokens + 64, **tier) as llm:
        cold, _ = ttft(llm, [*prefix, 1])
        ttft(llm, [*filler, 1])  # evicts the prefix's blocks into the tier
    with _engine(model, blocks, args.prefix_tokens + 64, **tier) as llm:
        warm, cached = ttft(llm, [*prefix, 2])
    return {"prefix_tokens": args.prefix_tokens, "cold_s": cold, "warm_s": warm, "cached": cached}


def disk_bandwidth(kv_dir: str) -> dict[str, float]:
    """The disk tier's start-up read-back (read, verify, copy into host slots) against a
    plain read of the same files; both from the page cache after a first pass."""
    files = sorted(Path(kv_dir, "rank0").glob("slot*.kv"))
    if not files:
        return {}
    head = _HEADER.unpack_from(files[0].read_bytes())
    fingerprint, payload = head[1], head[5]
    slots = 1 + max(int(f.stem[4:]) for f in files)
    disk = DiskKVTier(kv_dir, 0, fingerprint, slots, payload)
    sink = memoryview(bytearray(payload))
    total = sum(f.stat().st_size for f in files)
    best_tier = best_plain = float("inf")
    for _ in range(3):
        start = time.perf_counter()
        restored = disk.restore(lambda _slot, data: sink.__setitem__(slice(None), data))
        best_tier = min(best_tier, time.perf_counter() - start)
        start = time.perf_counter()
        for f in files:
            f.read_bytes()
        best_plain = min(best_plain, time.perf_counter() - start)
    return {
        "blocks": len(restored),
        "bytes": total,
        "tier_gb_s": total / best_tier / 1e9,
        "plain_read_gb_s": total / best_plain / 1e9,
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=None, help="default: the real test model")
    parser.add_argument("--docs", type=int, default=7)
    parser.add_argument("--doc-tokens", type=int, default=512)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--output-tokens", type=int, default=16)
    parser.add_argument("--prefix-tokens", type=int, default=4000)
    args = parser.parse_args()
    model = args.model or str(fetch_real_model())
    result: dict[str, Any] = {"model": Path(model).name, "block_size": BLOCK}
    host_bytes = args.docs * (args.doc_tokens // BLOCK + 2) * BLOCK * 48 * 1024
    with tempfile.TemporaryDirectory() as d:
        result["off"] = working_set(model, args)
        result["host"] = working_set(model, args, kv_offload_memory=host_bytes)
        result["disk"] = working_set(
            model, args, kv_offload_memory=host_bytes, kv_cache_dir=str(Path(d, "ws"))
        )
    for name in ("host", "disk"):
        off = result["off"]
        # None when the tier-off run hit nothing (any hit rate is then infinitely better).
        result[name]["hit_rate_x"] = (
            result[name]["hit_rate"] / off["hit_rate"] if off["hit_rate"] else None
        )
        result[name]["throughput_x"] = result[name]["output_tok_s"] / off["output_tok_s"]
    with tempfile.TemporaryDirectory() as d:
        result["restart"] = restart_ttft(model, args, d)
        result["restart"]["warm_over_cold"] = (
            result["restart"]["warm_s"] / result["restart"]["cold_s"]
        )
        result["disk_read"] = disk_bandwidth(d)
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
