#!/usr/bin/env python3
"""Start-up time and decode step time: the Ray executor against plain processes.

    python benchmarks/ray_executor_bench.py [--pairs 3] [--tp 2] [--requests 8] [--max-tokens 128]

The built-in model on the CPU, --tp ranks. First one engine on a Ray that it starts
itself (ray_cold_start_s: a local Ray, the placement group, the actors, the model), then
this process joins a local Ray of its own and runs --pairs interleaved pairs (plain
processes, then Ray actors, so a load change on a shared machine weighs on both alike).
Each engine: start-up (until the core reports ready), then one greedy batch of
--requests prompts of --max-tokens tokens; step_ms is the batch's wall time over its
decode steps. The last line of stdout is one JSON object: per backend, the median, min
and max of each figure, and the ratios ray / mp of the medians.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from launch.client.llm import LLM, SamplingParams

BACKENDS = ("mp", "ray")


def run_engine(backend: str, args: argparse.Namespace) -> tuple[float, float]:
    """(start-up seconds, milliseconds per decode step) of one engine."""
    start = time.perf_counter()
    llm = LLM(
        None,
        device="cpu",
        tensor_parallel_size=args.tp,
        distributed_executor_backend=backend,
        num_gpu_blocks=args.requests * (args.max_tokens // 16 + 4) + 16,
    )
    started = time.perf_counter() - start
    try:
        params = SamplingParams(max_tokens=args.max_tokens, temperature=0, ignore_eos=True)
        prompts = [[5 + i, 6, 7, 8] for i in range(args.requests)]
        llm.generate(prompts[:1], SamplingParams(max_tokens=4), use_tqdm=False)  # warm
        t = time.perf_counter()
        llm.generate(prompts, params, use_tqdm=False)
        step_ms = (time.perf_counter() - t) * 1000 / args.max_tokens
    finally:
        llm.close()
    return started, step_ms


def summary(values: list[float]) -> dict[str, float]:
    return {
        "median": round(statistics.median(values), 4),
        "min": round(min(values), 4),
        "max": round(max(values), 4),
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--pairs", type=int, default=3)
    p.add_argument("--tp", type=int, default=2)
    p.add_argument("--requests", type=int, default=8)
    p.add_argument("--max-tokens", type=int, default=128)
    args = p.parse_args()
    import ray

    cold_start, _ = run_engine("ray", args)
    print(f"ray, starting its own local Ray: start-up {cold_start:.2f} s", file=sys.stderr)
    ray.init(include_dashboard=False, log_to_driver=False)
    results: dict[str, dict[str, list[float]]] = {
        b: {"startup_s": [], "step_ms": []} for b in BACKENDS
    }
    try:
        for pair in range(args.pairs):
            for backend in BACKENDS:
                started, step_ms = run_engine(backend, args)
                results[backend]["startup_s"].append(started)
                results[backend]["step_ms"].append(step_ms)
                print(
                    f"pair {pair} {backend}: start-up {started:.2f} s, step {step_ms:.3f} ms",
                    file=sys.stderr,
                )
    finally:
        ray.shutdown()
    out: dict[str, object] = {
        "tp": args.tp,
        "requests": args.requests,
        "max_tokens": args.max_tokens,
        "pairs": args.pairs,
        "ray_cold_start_s": round(cold_start, 3),
    }
    for backend in BACKENDS:
        out[backend] = {k: summary(v) for k, v in results[backend].items()}
    for key in ("startup_s", "step_ms"):
        mp = statistics.median(results["mp"][key])
        out[f"ray_vs_mp_{key}"] = round(statistics.median(results["ray"][key]) / mp, 3)
    print(json.dumps(out))


if __name__ == "__main__":
    main()
