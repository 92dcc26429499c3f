#!/usr/bin/env python3
"""The second KV tier on the real model (CPU): prints one JSON object.

- shared documents, several questions each, whose prefix working set is at least 3x the
  device pool: prefix hit rate (cached / prompt tokens), output tok/s and the time spent
  loading, with the tier off, in host memory, host memory with a disk level, and on disk
  alone; the configurations interleaved, repeated, reported as median [min-max];
- a long shared prefix after a restart: the time to first token on a cold engine, and on
  a restarted one whose disk level holds the prefix;
- the disk level's load path (read into a staging buffer, verify hash and crc32) against
  a plain read of the same files.

    python benchmarks/kv_tier_bench.py [--model DIR] [--docs 7] [--doc-tokens 384]
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

import statistics

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
        stats = llm.last_summary.stats
        counts = stats.kv_tier if stats else None
    return {
        "pool_blocks": blocks,
        "working_set_blocks": args.docs * args.doc_tokens // BLOCK,
        "hit_rate": cached / prompt,
        "output_tok_s": out / seconds,
        "seconds": seconds,
        "load_s": counts.load_seconds if counts else 0.0,
        "disk_loaded_blocks": counts.disk_loaded_blocks if counts else 0,
    }


def restart_ttft(
    model: str, args: argparse.Namespace, kv_dir: str, chunk: int | None = None
) -> dict[str, Any]:
    """TTFT of a long-prefix request on a fresh engine, then after a restart onto the
    disk level that kept it (a second long request evicted it there first). chunk: the
    step's token budget (None: the default); a disk hit loads first, over steps of
    --kv-tier-load-bytes, whatever the budget (enginecore/kv_tier_loads.py)."""
    rng = random.Random(2)
    prefix, filler = _tokens(rng, args.prefix_tokens), _tokens(rng, args.prefix_tokens)
    one = SamplingParams(max_tokens=1, temperature=0)
    blocks = (args.prefix_tokens + 64) // BLOCK + 8
    # The disk level alone: the load reads the files.
    tier: dict[str, Any] = dict(kv_cache_dir=kv_dir, max_num_batched_tokens=chunk)

    def ttft(llm: LLM, prompt: list[int]) -> tuple[float, int]:
        start = time.perf_counter()
        (res,) = llm.generate([prompt], one, use_tqdm=False)
        return time.perf_counter() - start, res.num_cached_tokens

    with _engine(model, blocks, args.prefix_tokens + 64, **tier) as llm:
        cold, _ = ttft(llm, [*prefix, 1])
        ttft(llm, [*filler, 1])  # evicts the prefix's blocks into the tier
    with _engine(model, blocks, args.prefix_tokens + 64, **tier) as llm:
        warm, cached = ttft(llm, [*prefix, 2])
    return {
        "prefix_tokens": args.prefix_tokens,
        "max_num_batched_tokens": chunk,
        "cold_s": cold,
        "warm_s": warm,
        "cached": cached,
        "warm_over_cold": warm / cold,
    }


def disk_bandwidth(kv_dir: str) -> dict[str, float]:
    """The disk level's load path (header, hash check, readinto a staging row, crc32, on
    the worker's reader threads) against a plain read of the same files, one after
    another; both from the page cache after a first pass."""
    files = sorted(Path(kv_dir, "rank0").glob("slot*.kv"))
    if not files:
        return {}
    head = _HEADER.unpack_from(files[0].read_bytes())
    fingerprint, payload = head[1], head[5]
    slots = 1 + max(int(f.stem[4:]) for f in files)
    disk = DiskKVTier(kv_dir, 0, fingerprint, slots, payload)
    found = disk.restore()
    staging = memoryview(bytearray(payload * len(found)))  # a row per block, as a load
    rows = [staging[i * payload : (i + 1) * payload] for i in range(len(found))]
    slots, hashes = [f[0] for f in found], [f[1] for f in found]
    total = sum(f.stat().st_size for f in files)
    best_tier = best_serial = best_plain = float("inf")
    for _ in range(3):
        start = time.perf_counter()
        ok = sum(disk.read_many(slots, hashes, rows))
        best_tier = min(best_tier, time.perf_counter() - start)
        start = time.perf_counter()  # one file after another, as loads were before
        for slot, block_hash, row in zip(slots, hashes, rows):
            disk.read_into(slot, block_hash, row)
        best_serial = min(best_serial, time.perf_counter() - start)
        start = time.perf_counter()
        for f in files:
            f.read_bytes()
        best_plain = min(best_plain, time.perf_counter() - start)
    disk.close()
    return {
        "blocks": ok,
        "bytes": total,
        "tier_gb_s": total / best_tier / 1e9,
        "tier_one_thread_gb_s": total / best_serial / 1e9,
        "plain_read_gb_s": total / best_plain / 1e9,
    }


def transfer_costs(model: str, blocks: int, kv_dir: str) -> dict[str, float]:
    """Worker-side cost of moving one document's blocks (the model's KV shapes, float32):
    seconds to store them into host memory, to queue them for disk, to load them back
    from host memory and from disk (read, verify, scatter). Best of five."""
    import torch

    from protocol.worker import KVTierOps
    from worker.kv_host_tier import HostKVTier

    config = json.loads(Path(model, "config.json").read_text())
    heads = config["num_key_value_heads"]
    dim = config.get("head_dim") or config["hidden_size"] // config["num_attention_heads"]
    shape = (blocks * 3 + 1, BLOCK, heads, dim)
    caches = [(torch.randn(shape), torch.randn(shape)) for _ in range(config["num_hidden_layers"])]
    tier = HostKVTier(caches, num_slots=blocks)
    tier.disk = DiskKVTier(kv_dir, 0, b"f" * 32, blocks, tier.block_bytes)
    src, dst = list(range(1, blocks + 1)), list(range(blocks + 1, 2 * blocks + 1))
    slots = list(range(blocks))
    hashes = [i.to_bytes(16, "little") for i in slots]
    cases = {
        "host_store_s": KVTierOps(src, slots, [], []),
        "host_load_s": KVTierOps([], [], slots, dst),
        "disk_store_s": KVTierOps([], [], [], [], hashes, [b""] * blocks, src, slots),
        "disk_load_s": KVTierOps(
            [], [], [], [], disk_load_slots=slots, disk_load_block_ids=dst, disk_load_hashes=hashes
        ),
    }
    out: dict[str, float] = {"blocks": blocks, "block_bytes": tier.block_bytes}
    for name, ops in cases.items():
        best = float("inf")
        for _ in range(5):
            start = time.perf_counter()
            assert not tier.apply(ops)
            best = min(best, time.perf_counter() - start)
            tier.disk.flush()  # the writer's time is off the step: not counted
        out[name] = best
    tier.close()
    return out


def _spread(values: list[float]) -> dict[str, float]:
    return {"median": statistics.median(values), "min": min(values), "max": max(values)}


def compare(model: str, args: argparse.Namespace, kv_dir: str) -> dict[str, Any]:
    """Every configuration once per repeat, interleaved (the machine's load drifts);
    each figure as median [min-max], and its ratio to tier off's median."""
    host_bytes = args.docs * (args.doc_tokens // BLOCK + 2) * BLOCK * 48 * 1024
    configs: dict[str, dict[str, Any]] = {
        "off": {},
        "host": dict(kv_offload_memory=host_bytes),
        "host_disk": dict(kv_offload_memory=host_bytes, kv_cache_dir=str(Path(kv_dir, "a"))),
        "disk_only": dict(kv_cache_dir=str(Path(kv_dir, "b"))),
    }
    runs: dict[str, list[dict[str, float]]] = {name: [] for name in configs}
    for r in range(args.repeats):
        for name, tier in configs.items():
            if "kv_cache_dir" in tier:  # each repeat starts with an empty disk level
                tier = {**tier, "kv_cache_dir": f"{tier['kv_cache_dir']}{r}"}
            runs[name].append(working_set(model, args, **tier))
    out: dict[str, Any] = {}
    for name, each in runs.items():
        out[name] = {
            key: _spread([run[key] for run in each])
            for key in ("hit_rate", "output_tok_s", "seconds", "load_s")
        }
        out[name]["pool_blocks"] = each[0]["pool_blocks"]
        out[name]["working_set_blocks"] = each[0]["working_set_blocks"]
        out[name]["disk_loaded_blocks"] = each[0]["disk_loaded_blocks"]
    off = out["off"]
    for name in configs:
        hit = off["hit_rate"]["median"]
        # None when the tier-off run hit nothing (any hit rate is then infinitely better).
        out[name]["hit_rate_x"] = out[name]["hit_rate"]["median"] / hit if hit else None
        out[name]["throughput_x"] = (
            out[name]["output_tok_s"]["median"] / off["output_tok_s"]["median"]
        )
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=None, help="default: the real test model")
    parser.add_argument("--docs", type=int, default=7)
    parser.add_argument("--doc-tokens", type=int, default=384)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--transfers-only", action="store_true", help="only the copy costs")
    parser.add_argument("--restart-only", action="store_true", help="only the restart TTFT")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--output-tokens", type=int, default=16)
    parser.add_argument("--prefix-tokens", type=int, default=4000)
    args = parser.parse_args()
    model = args.model or str(fetch_real_model())
    if args.restart_only:
        out = {}
        for name, chunk in (
            ("default_budget", None),
            ("budget_over_prefix", args.prefix_tokens + 64),
        ):
            with tempfile.TemporaryDirectory() as d:
                out[name] = restart_ttft(model, args, d, chunk)
        print(json.dumps(out))
        return 0
    if args.transfers_only:
        with tempfile.TemporaryDirectory() as d:
            print(json.dumps(transfer_costs(model, args.doc_tokens // BLOCK, d)))
        return 0
    result: dict[str, Any] = {"model": Path(model).name, "block_size": BLOCK}
    with tempfile.TemporaryDirectory() as d:
        result.update(compare(model, args, d))
    with tempfile.TemporaryDirectory() as d:
        result["restart"] = restart_ttft(model, args, d)
        result["disk_read"] = disk_bandwidth(d)
    with tempfile.TemporaryDirectory() as d:
        result["restart_budget_over_prefix"] = restart_ttft(model, args, d, args.prefix_tokens + 64)
    with tempfile.TemporaryDirectory() as d:
        result["transfers"] = transfer_costs(model, args.doc_tokens // BLOCK, d)
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
