#!/usr/bin/env python3
"""KV memory of a long-context run on an interleaved sliding/full model: hybrid KV cache
groups against treating every layer as full attention. Same prompts, same outputs.

    python benchmarks/hybrid_kv_memory.py [--num-requests 8] [--prompt-min 1024]
        [--prompt-max 2048] [--decode 256] [--window 128] [--block-size 16]

A tiny random Qwen2 checkpoint (hidden --hidden-size, --num-layers layers alternating
sliding_attention / full_attention, window --window) is written to a temporary
directory. The real Scheduler and the real ModelRunner then run the workload one step at
a time in this process (messages through the wire codecs), twice:

1. hybrid: the KVCacheConfig built from the specs the worker reports, two groups
   (SlidingWindowSpec, FullAttentionSpec); sliding-window blocks behind the window
   return to the pool during the run.
2. all_full: every layer reported as FullAttentionSpec, one group holding every layer,
   so the core keeps every block of every layer. The model still attends through its
   window (the layers read the window from the checkpoint's config), so its greedy
   tokens must equal run 1's.

Each step, once the scheduler has allocated that step's slots, it records the blocks in
use (usable - free; one block id serves every layer of its group) and the bytes of KV
actually held: the sum over groups of live blocks x page size x layers in the group.
Peak and mean over steps are reported for both runs, with the ratio hybrid / all_full.
Both runs get the same, ample, block count, so neither preempts. Progress goes to
stderr; the last line of stdout is one JSON object.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402
import transformers  # noqa: E402

from enginecore.kv_cache_config import make_kv_cache_config, with_num_blocks  # noqa: E402
from enginecore.request import Request  # noqa: E402
from enginecore.scheduler import Scheduler, SchedulerConfig  # noqa: E402
from protocol.codec import Codec  # noqa: E402
from protocol.config import WorkerConfig  # noqa: E402
from protocol.engine import SamplingParams  # noqa: E402
from protocol.kv_cache import FullAttentionSpec, KVCacheSpec  # noqa: E402
from protocol.worker import (  # noqa: E402
    CoreToWorker,
    SchedulerOutput,
    WorkerConfigure,
    WorkerToCore,
)
from worker.model_runner import ModelRunner  # noqa: E402

# Far more KV memory than any workload here needs: only the block count derived from
# it matters, and it is capped to what the workload can use (see run_workload).
_SIZING_MEMORY = 1 << 40


def log(msg: str) -> None:
    print(f"[hybrid_kv_memory] {msg}", file=sys.stderr, flush=True)


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


# -- model and workload -------------------------------------------------------------
def build_checkpoint(path: Path, a: argparse.Namespace) -> None:
    """A random interleaved Qwen2: sliding window on even layers, full on odd ones."""
    torch.manual_seed(a.seed)
    config = transformers.Qwen2Config(
        vocab_size=a.vocab,
        hidden_size=a.hidden_size,
        intermediate_size=2 * a.hidden_size,
        num_attention_heads=a.num_heads,
        num_key_value_heads=a.num_kv_heads,
        num_hidden_layers=a.num_layers,
        max_position_embeddings=a.prompt_max + a.decode + 1,
        use_sliding_window=True,
        sliding_window=a.window,
        layer_types=[
            "sliding_attention" if i % 2 == 0 else "full_attention" for i in range(a.num_layers)
        ],
        bos_token_id=1,
        eos_token_id=2,
        tie_word_embeddings=False,
    )
    model = transformers.Qwen2ForCausalLM(config).float().eval()
    model.config.architectures = [type(model).__name__]
    model.save_pretrained(path)


def make_prompts(a: argparse.Namespace) -> list[list[int]]:
    """Distinct random prompts: no prefix hits, so both runs hold the same tokens."""
    rng = random.Random(a.seed)
    return [
        [rng.randrange(3, a.vocab) for _ in range(rng.randint(a.prompt_min, a.prompt_max))]
        for _ in range(a.num_requests)
    ]


def all_full_specs(specs: dict[str, KVCacheSpec]) -> dict[str, KVCacheSpec]:
    """Every layer as full attention, same page: the core then keeps every block."""
    return {
        name: FullAttentionSpec(s.block_size, s.num_kv_heads, s.head_size, s.dtype)
        for name, s in specs.items()
    }


# -- one run ------------------------------------------------------------------------
@dataclass
class Usage:
    blocks_in_use: list[int] = field(default_factory=list)
    kv_bytes_held: list[int] = field(default_factory=list)
    # Steps that only decode (one token per scheduled request): no prompt chunk whose
    # window-group blocks are all allocated before the step can free any of them.
    decode_only: list[bool] = field(default_factory=list)
    live_blocks_per_group: list[list[int]] = field(default_factory=list)


def measure(
    scheduler: Scheduler, so: SchedulerOutput, bytes_per_block_id: list[int], usage: Usage
) -> None:
    """Blocks in use, and the bytes of KV they hold, right after this step's allocation."""
    kv = scheduler.kv_cache_manager
    pool = kv.block_pool
    null = pool.null_block
    in_use = pool.num_usable_blocks - pool.get_num_free_blocks()
    live = []
    for m in kv.coordinator.managers:
        # A set: a prefix block shared by several requests is held once.
        ids = {b.block_id for blocks in m.req_to_blocks.values() for b in blocks if b is not null}
        live.append(len(ids))
    # Every block in use belongs to exactly one group's live set: the byte count below
    # covers the whole pool usage.
    if sum(live) != in_use:
        raise AssertionError(f"groups hold {sum(live)} blocks but {in_use} are in use")
    usage.blocks_in_use.append(in_use)
    usage.kv_bytes_held.append(sum(n * b for n, b in zip(live, bytes_per_block_id)))
    usage.live_blocks_per_group.append(live)
    usage.decode_only.append(so.total_num_scheduled_tokens == len(so.num_scheduled_tokens))


def run_workload(
    runner: ModelRunner,
    specs: dict[str, KVCacheSpec],
    prompts: list[list[int]],
    a: argparse.Namespace,
) -> tuple[dict[str, Any], list[list[int]]]:
    sized = make_kv_cache_config(specs, _SIZING_MEMORY)
    max_model_len = a.prompt_max + a.decode
    # Enough blocks for every request's whole life at once in two groups, whichever
    # the config: the same count for both runs, and nothing is preempted.
    num_blocks = 1 + 2 * sum(cdiv(len(p) + a.decode, a.block_size) for p in prompts)
    kv_config = with_num_blocks(sized.kv_cache_groups, num_blocks)
    # Pool bytes per block id as make_kv_cache_config lays the buffers out (shared
    # across groups of equal layer counts), and per group: what one id of that group
    # holds, page size x its layers.
    pool_bytes_per_block = sum(t.size for t in sized.kv_cache_tensors) // sized.num_blocks
    per_group = [
        g.kv_cache_spec.page_size_bytes * len(g.layer_names) for g in kv_config.kv_cache_groups
    ]
    config = SchedulerConfig(
        max_num_batched_tokens=a.max_num_batched_tokens,
        max_num_seqs=max(len(prompts), 1),
        max_model_len=max_model_len,
    )
    scheduler = Scheduler(config, kv_config, runner.model_config.vocab_size, None)
    runner.initialize(
        WorkerConfigure(kv_config, len(prompts), max_model_len, a.max_num_batched_tokens)
    )
    # What the worker really allocated (distinct storages), against what the core sized.
    physical_bytes, num_buffers = runner.kv_cache_storage_bytes()
    config_bytes = sum(t.size for t in kv_config.kv_cache_tensors)
    to_worker = Codec(CoreToWorker, "core->worker")
    to_core = Codec(WorkerToCore, "worker->core")
    params = SamplingParams(max_tokens=a.decode, temperature=0, ignore_eos=True)
    requests = []
    for i, prompt in enumerate(prompts):
        request = Request(
            f"r{i}", prompt, scheduler.kv_cache_manager.block_hasher, sampling_params=params
        )
        if scheduler.add_request(request) is not None:
            raise SystemExit(f"request r{i} was refused")
        requests.append(request)
    usage = Usage()
    t0 = time.perf_counter()
    while scheduler.has_unfinished_requests():
        so = scheduler.schedule()
        measure(scheduler, so, per_group, usage)
        out = runner.execute(to_worker.decode(to_worker.encode(so)))
        if out is not None:
            scheduler.update_from_output(so, to_core.decode(to_core.encode(out)))
        if scheduler.step_id % 64 == 0:
            log(f"  step {scheduler.step_id}: {usage.blocks_in_use[-1]} blocks in use")
    runner.execute(to_worker.decode(to_worker.encode(scheduler.schedule())))
    seconds = time.perf_counter() - t0
    if scheduler.num_preemptions:
        raise AssertionError(f"{scheduler.num_preemptions} preemptions with ample blocks")
    pool = scheduler.kv_cache_manager.block_pool
    if pool.get_num_free_blocks() != pool.num_usable_blocks:
        raise AssertionError("blocks still in use after every request finished")

    peak_blocks = max(usage.blocks_in_use)
    peak_live = [
        max(step[g] for step in usage.live_blocks_per_group) for g in range(len(per_group))
    ]
    result = {
        "groups": [
            {
                "type": type(g.kv_cache_spec).__name__,
                "num_layers": len(g.layer_names),
                "page_size_bytes": g.kv_cache_spec.page_size_bytes,
                "bytes_per_block_id": b,
                "peak_live_blocks": p,
            }
            for g, b, p in zip(kv_config.kv_cache_groups, per_group, peak_live)
        ],
        "pool_bytes_per_block": pool_bytes_per_block,
        "physical_kv_bytes": physical_bytes,
        "physical_kv_buffers": num_buffers,
        "physical_over_config": round(physical_bytes / config_bytes, 4),
        "steps": len(usage.blocks_in_use),
        "seconds": round(seconds, 3),
        "blocks_in_use": {
            "peak": peak_blocks,
            "mean": round(statistics.fmean(usage.blocks_in_use), 2),
        },
        "kv_bytes_held": {
            "peak": max(usage.kv_bytes_held),
            "mean": round(statistics.fmean(usage.kv_bytes_held), 1),
            "peak_decode_only_steps": max(
                (b for b, d in zip(usage.kv_bytes_held, usage.decode_only) if d), default=0
            ),
        },
        # What a pool laid out by make_kv_cache_config needs to hold the peak.
        "pool_bytes_for_peak": peak_blocks * pool_bytes_per_block,
    }
    return result, [r.all_token_ids[r.num_prompt_tokens :] for r in requests]


def ratio(x: float, y: float) -> float:
    return round(x / y, 4) if y else float("nan")


# -- main ---------------------------------------------------------------------------
def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    w = p.add_argument_group("workload")
    w.add_argument("--num-requests", type=int, default=8)
    w.add_argument("--prompt-min", type=int, default=1024)
    w.add_argument("--prompt-max", type=int, default=2048)
    w.add_argument("--decode", type=int, default=256, help="greedy tokens per request")
    w.add_argument("--block-size", type=int, default=16)
    w.add_argument("--max-num-batched-tokens", type=int, default=4096)
    w.add_argument("--seed", type=int, default=0)
    m = p.add_argument_group("model")
    m.add_argument("--window", type=int, default=128, help="sliding window of the even layers")
    m.add_argument("--num-layers", type=int, default=4)
    m.add_argument("--hidden-size", type=int, default=64)
    m.add_argument("--num-heads", type=int, default=4)
    m.add_argument("--num-kv-heads", type=int, default=2)
    m.add_argument("--vocab", type=int, default=512)
    return p


def main(argv: list[str] | None = None) -> int:
    a = build_parser().parse_args(argv)
    if not 1 <= a.prompt_min <= a.prompt_max:
        raise SystemExit("need 1 <= --prompt-min <= --prompt-max")
    if a.num_requests < 1 or a.decode < 1 or a.num_layers < 2:
        raise SystemExit("need --num-requests >= 1, --decode >= 1, --num-layers >= 2")
    prompts = make_prompts(a)
    with tempfile.TemporaryDirectory(prefix="hybrid-kv-") as tmp:
        log(f"writing a {a.num_layers}-layer interleaved checkpoint (window {a.window})")
        build_checkpoint(Path(tmp), a)
        runner = ModelRunner(
            WorkerConfig(
                model=tmp,
                rank=0,
                world_size=1,
                core_address="",
                block_size=a.block_size,
                device="cpu",
                dtype="float32",
            )
        )
    hybrid_specs = runner.kv_cache_specs()
    log(f"threads {torch.get_num_threads()}; {len(prompts)} prompts, decode {a.decode}")
    log("run 1: hybrid groups")
    hybrid, hybrid_out = run_workload(runner, hybrid_specs, prompts, a)
    log(f"  {hybrid['seconds']} s, peak {hybrid['kv_bytes_held']['peak']} bytes")
    log("run 2: every layer as full attention")
    full, full_out = run_workload(runner, all_full_specs(hybrid_specs), prompts, a)
    log(f"  {full['seconds']} s, peak {full['kv_bytes_held']['peak']} bytes")
    same = hybrid_out == full_out
    if not same:
        bad = next(i for i, (x, y) in enumerate(zip(hybrid_out, full_out)) if x != y)
        raise AssertionError(f"request r{bad}: the two runs' greedy tokens differ")
    result: dict[str, Any] = {
        "benchmark": "hybrid_kv_memory",
        "model": {
            "num_layers": a.num_layers,
            "layer_types": [type(s).__name__ for s in hybrid_specs.values()],
            "sliding_window": a.window,
            "hidden_size": a.hidden_size,
            "num_kv_heads": a.num_kv_heads,
            "dtype": "float32",
        },
        "workload": {
            "num_requests": a.num_requests,
            "prompt_tokens": [len(p) for p in prompts],
            "decode_tokens": a.decode,
            "block_size": a.block_size,
            "max_num_batched_tokens": a.max_num_batched_tokens,
            "seed": a.seed,
        },
        "threads": torch.get_num_threads(),
        "cpu_count": os.cpu_count(),
        "hybrid": hybrid,
        "all_full": full,
        "ratio_hybrid_over_all_full": {
            "peak_kv_bytes": ratio(hybrid["kv_bytes_held"]["peak"], full["kv_bytes_held"]["peak"]),
            "mean_kv_bytes": ratio(hybrid["kv_bytes_held"]["mean"], full["kv_bytes_held"]["mean"]),
            "peak_kv_bytes_decode_only_steps": ratio(
                hybrid["kv_bytes_held"]["peak_decode_only_steps"],
                full["kv_bytes_held"]["peak_decode_only_steps"],
            ),
            "peak_blocks_in_use": ratio(
                hybrid["blocks_in_use"]["peak"], full["blocks_in_use"]["peak"]
            ),
            "mean_blocks_in_use": ratio(
                hybrid["blocks_in_use"]["mean"], full["blocks_in_use"]["mean"]
            ),
        },
        "same_outputs": same,
    }
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
