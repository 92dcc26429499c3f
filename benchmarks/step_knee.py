#!/usr/bin/env python3
"""How a prefill step's time grows with its tokens on this machine: the knee past which
it is linear, where a larger step budget buys no throughput (the CPU default of
--max-num-batched-tokens rests on it).

    python benchmarks/step_knee.py [--threads 1] [--sizes 16,64,128,256,512,1024] [--reps 3]

One in-process ModelRunner on the real model (SmolLM2-135M, float32, CPU), driven by the
real Scheduler with a budget as large as the largest size: each timed step is the whole
prefill of fresh prompts of N tokens in total (prompts of at most 512 tokens, random
ids, no prefix hit). Reported per size: the fastest and median step and the fastest
time per token. Progress on stderr; the last line of stdout is one JSON object.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import time

import torch

from enginecore.kv_cache_config import make_kv_cache_config
from enginecore.scheduler import Scheduler
from launch.client.engine_args import EngineArgs, runner_config
from protocol.engine import SamplingParams
from protocol.worker import WorkerConfigure
from tests.helpers.kv_helpers import sched_config
from tests.helpers.real_model import fetch_real_model
from worker.model_runner import ModelRunner

MAX_MODEL_LEN = 2048
PROMPT_TOKENS = 512


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--threads", type=int, default=1, help="torch threads")
    p.add_argument("--sizes", default="16,64,128,256,512,1024", help="step tokens, comma-separated")
    p.add_argument("--reps", type=int, default=3, help="timed steps per size")
    a = p.parse_args()
    sizes = [int(x) for x in a.sizes.split(",")]
    torch.set_num_threads(a.threads)
    args = EngineArgs(model=str(fetch_real_model()), device="cpu", dtype="float32", seed=7)
    runner = ModelRunner(runner_config(args))
    vocab = runner.model_config.vocab_size
    budget = max(sizes)
    kv_config = make_kv_cache_config(runner.kv_cache_specs(), 1 << 30)
    config = sched_config(MAX_MODEL_LEN, max_num_batched_tokens=budget, max_num_seqs=256)
    sched = Scheduler(config, kv_config, vocab)
    runner.initialize(WorkerConfigure(kv_config, 256, MAX_MODEL_LEN, budget))
    rng = random.Random(0)
    params = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)
    count = 0

    def prefill(n: int) -> float:
        """Seconds of one step that computes n prompt tokens; the requests then end."""
        nonlocal count
        while n > 0:
            size = min(n, PROMPT_TOKENS)
            prompt = [rng.randrange(3, vocab) for _ in range(size)]
            sched.add_request(sched.new_request(f"r{count}", prompt, params))
            count, n = count + 1, n - size
        so = sched.schedule()
        start = time.perf_counter()
        out = runner.execute(so)
        seconds = time.perf_counter() - start
        assert out is not None
        sched.update_from_output(so, out)
        return seconds

    prefill(64)  # warm-up: first-use costs stay out of the figures
    rows = []
    for n in sizes:
        times = [prefill(n) for _ in range(a.reps)]
        row = {
            "tokens": n,
            "min_ms": round(min(times) * 1e3, 1),
            "median_ms": round(statistics.median(times) * 1e3, 1),
            "ms_per_token": round(min(times) * 1e3 / n, 3),
        }
        print(f"[step_knee] {row}", file=sys.stderr, flush=True)
        rows.append(row)
    print(json.dumps({"threads": a.threads, "steps": rows}))


if __name__ == "__main__":
    main()
