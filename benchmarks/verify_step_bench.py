#!/usr/bin/env python3
"""The forward of a speculative verify step of the real model on the CPU: the C kernel's
multi-query requests against the chunked-prefill path, and a plain decode step beside them.

    python benchmarks/verify_step_bench.py [--requests 1 16] [--drafts 4] [--context 160]
        [--rounds 15] [--threads 1]

SmolLM2-135M-Instruct (float32, tests/helpers/real_model.py) in a real ModelRunner, its KV cache
filled with normal noise. A batch of R requests of --context tokens each runs the model's
forward (30 layers, the paged attention kernels, the KV write) over one step's tokens:

- decode: one query per request;
- multi_query: drafts + 1 queries per request (a verify), with
  pagedkernels.cpu.NATIVE_MAX_QUERIES at least drafts + 1, so the C kernel attends each
  verify as one multi-query request;
- chunked_prefill: the same verify with NATIVE_MAX_QUERIES below drafts + 1, so each
  verify takes the gather and SDPA path, as before the C kernel took several queries.

The three alternate round by round (a load change on the shared machine weighs on all
alike). Per batch: median and min wall ms and median process CPU ms per forward. Progress
on stderr; the last stdout line is one JSON object.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

from enginecore.kv_cache_config import make_kv_cache_config, with_num_blocks  # noqa: E402
from launch.client.engine_args import EngineArgs, runner_config  # noqa: E402
from pagedkernels import cpu  # noqa: E402
from protocol.kv_cache import NULL_BLOCK_ID  # noqa: E402
from protocol.worker import WorkerConfigure  # noqa: E402
from tests.helpers.real_model import fetch_real_model  # noqa: E402
from worker.attention import AttentionMetadata  # noqa: E402
from worker.host_memory import keep_freed_memory  # noqa: E402
from worker.model_runner import ModelRunner  # noqa: E402

BLOCK_SIZE = 16


def log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def step_inputs(
    num_reqs: int, queries: int, context: int, vocab: int
) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata]:
    """One step's tokens: each request's last `queries` positions of `context`, its blocks
    numbered after the previous request's."""
    per_req = -(-context // BLOCK_SIZE)
    table = torch.arange(num_reqs * per_req, dtype=torch.int32).view(num_reqs, per_req) + 1
    positions = torch.arange(context - queries, context).repeat(num_reqs)
    rows = torch.arange(num_reqs).repeat_interleave(queries)
    slots = table[rows, positions // BLOCK_SIZE].long() * BLOCK_SIZE + positions % BLOCK_SIZE
    attn = AttentionMetadata(
        query_start_loc=torch.arange(0, num_reqs * queries + 1, queries, dtype=torch.int32),
        seq_lens=torch.full((num_reqs,), context, dtype=torch.int32),
        block_tables=[table],
        slot_mappings=[slots],
    )
    ids = torch.randint(3, vocab, (num_reqs * queries,), generator=torch.Generator().manual_seed(0))
    return ids, positions, attn


def run_batch(runner: ModelRunner, num_reqs: int, a: argparse.Namespace) -> dict[str, Any]:
    groups = make_kv_cache_config(runner.kv_cache_specs(), 1 << 40).kv_cache_groups
    if len(groups) != 1:
        raise SystemExit("this benchmark lays out one KV cache group")
    num_blocks = 1 + num_reqs * -(-a.context // BLOCK_SIZE)
    runner.initialize(
        WorkerConfigure(
            with_num_blocks(groups, num_blocks), num_reqs, a.context, num_reqs * (a.drafts + 1)
        )
    )
    gen = torch.Generator().manual_seed(1)
    for k_cache, v_cache in runner.kv_caches:
        for cache in (k_cache, v_cache):
            cache.normal_(generator=gen)
            cache[NULL_BLOCK_ID].fill_(float("nan"))
    vocab = runner.model_config.vocab_size
    decode = step_inputs(num_reqs, 1, a.context, vocab)
    verify = step_inputs(num_reqs, a.drafts + 1, a.context, vocab)
    paths = {
        "decode": (decode, a.drafts + 1),
        "multi_query": (verify, a.drafts + 1),
        "chunked_prefill": (verify, a.drafts),
    }
    times: dict[str, list[tuple[float, float]]] = {name: [] for name in paths}
    for round_ in range(a.rounds + 1):
        for name, ((ids, positions, attn), native_max) in paths.items():
            cpu.NATIVE_MAX_QUERIES = native_max
            wall, proc = time.perf_counter(), time.process_time()
            runner.model(ids, positions, attn, runner.kv_caches)
            wall, proc = time.perf_counter() - wall, time.process_time() - proc
            if round_:  # the first round warms up (plans, scratch buffers)
                times[name].append((wall * 1e3, proc * 1e3))
    result: dict[str, Any] = {}
    for name, xs in times.items():
        walls, procs = [w for w, _ in xs], [p for _, p in xs]
        result[name] = {
            "wall_ms_median": round(statistics.median(walls), 2),
            "wall_ms_min": round(min(walls), 2),
            "cpu_ms_median": round(statistics.median(procs), 2),
        }
        log(f"{num_reqs} x {a.drafts} drafts on {a.context}, {name}: {result[name]}")
    return result


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--requests", type=int, nargs="+", default=[1, 16])
    p.add_argument("--drafts", type=int, default=4)
    p.add_argument("--context", type=int, default=160, help="tokens per request after the step")
    p.add_argument("--rounds", type=int, default=15)
    p.add_argument("--threads", type=int, default=1)
    a = p.parse_args(argv)
    if not 1 <= a.drafts <= 32 or a.context <= a.drafts or a.rounds < 1:
        p.error("--drafts must be 1..32, --context above it, --rounds >= 1")
    keep_freed_memory()  # as the worker process does on a CPU
    torch.set_num_threads(a.threads)
    args = EngineArgs(
        model=str(fetch_real_model()), block_size=BLOCK_SIZE, device="cpu", dtype="float32"
    )
    runner = ModelRunner(runner_config(args))
    report: dict[str, Any] = {"drafts": a.drafts, "context": a.context, "threads": a.threads}
    with torch.inference_mode():
        for n in a.requests:
            report[f"{n} requests"] = run_batch(runner, n, a)
    print(json.dumps(report))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
