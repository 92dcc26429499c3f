#!/usr/bin/env python3
"""Serial vs async scheduling: steps/s and the worker's idle share, in one run.

    python benchmarks/overlap.py [--requests 256] [--tokens 200] [--delay-ms auto] [--rounds 2]
                                 [--model tiny|builtin] [--device cpu|cuda]

The whole engine as users run it (`LLM`: a core process and a worker process) steps
--requests decode requests (short random prompts, greedy, ignore_eos, --tokens each) on
a Llama with one tiny layer, so the worker's own step costs little, and the model step's
length is set by the worker's benchmark delay (benchmarks/bench_clock.py: a modelled device
busy from each launch, the CPU left free as while a GPU runs). --delay-ms auto measures
the serial host path first (a serial step with a delay less that delay: the core's
schedule and update, both IPC hops, the worker's bookkeeping) and takes it as the delay,
so that the model step is as long as the host path, the case the overlap is for (ideal
overlap: 2x).

Then serial and async alternate --rounds times (a load change on a shared machine
weighs on both). The worker reports its steps, busy and idle seconds
(PAGEDSERVE_BENCH_WORKER_TIMING): steps/s = steps / (busy + idle), idle share =
idle / (busy + idle), from its first step to its last. Tokens are checked equal between
the modes. Progress on stderr; the last line of stdout is one JSON object.

On the CPU the worker's thread runs the model itself (milliseconds a step at 256
requests even for the tiny layer, mostly the attention plan and kernels), work that a
GPU's host thread only queues; under async scheduling that thread must also plan the next step, so
the forward's CPU time, which the delay already models as device time, would count twice.
--skip (a benchmark-only worker setting, benchmarks/bench_clock.py) cuts it short: attention
makes every attention layer return zeros (the rest of the layer left); layers passes every
decoder layer's input through (embedding, norm, LM head and sampling left, as cheap as
queueing a small model's kernels), so the overlap measured is the host path's against
the modelled device.

--model builtin runs the built-in model (4 layers) instead, and --device cuda runs on a
GPU (its default dtype), where the model step is the device's and no delay is needed
(--delay-ms 0): the overlap then hides the host path behind real GPU work.
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
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from launch.client.builtin_model import builtin_model_dir  # noqa: E402
from launch.client.llm import LLM  # noqa: E402
from protocol import envs  # noqa: E402
from protocol.engine import SamplingParams  # noqa: E402

sys.path.insert(0, str(ROOT / "benchmarks"))
from bench_clock import DELAY_ENV, HOOKS, SKIP_ENV, SKIPS, TIMING_ENV  # noqa: E402

# The one-tiny-layer Llama of the step-overhead benchmark: the worker's compute stays
# far below the host path.
from step_overhead import write_model_dir  # noqa: E402

VOCAB = 512


def run(
    model: Path,
    prompts: list[list[int]],
    tokens: int,
    delay_ms: float,
    async_on: bool,
    tmp: Path,
    device: str,
) -> dict[str, Any]:
    timing = tmp / f"timing-{time.monotonic_ns()}.json"
    os.environ[DELAY_ENV] = f"{delay_ms:g}"
    os.environ[TIMING_ENV] = str(timing)
    params = SamplingParams(max_tokens=tokens, temperature=0, ignore_eos=True)
    with LLM(
        str(model),
        device=device,
        async_scheduling=async_on,
        max_num_seqs=len(prompts),
        max_model_len=64 + tokens,
    ) as llm:
        start = time.perf_counter()
        outs = llm.generate(prompts, params, use_tqdm=False)
        wall = time.perf_counter() - start
    stats = json.loads(timing.read_text())  # written when the worker exits
    steps = stats["steps"]
    host_span = stats["busy_s"] + stats["idle_s"]
    # With a delay the modelled device does the model step: its idle share is the one
    # a GPU would show. Without one the worker's thread is the device (the CPU runs the
    # model in it), and its idle time is what the host path costs.
    if delay_ms:
        span, idle = stats["device_span_s"], stats["device_span_s"] - stats["device_busy_s"]
    else:
        span, idle = host_span, stats["idle_s"]
    return {
        "mode": "async" if async_on else "serial",
        "steps": steps,
        "planned_ahead": stats["planned_ahead"],
        "steps_per_s": round(steps / span, 1),
        "worker_idle_share": round(idle / span, 4),
        "worker_busy_ms_per_step": round((span - idle) / steps * 1e3, 3),
        "worker_idle_ms_per_step": round(idle / steps * 1e3, 3),
        "host_step_ms": round(host_span / steps * 1e3, 3),
        "launch_ms_per_step": round(stats["launch_s"] / steps * 1e3, 3),
        "host_idle_share": round(stats["idle_s"] / host_span, 4),
        "generate_s": round(wall, 3),
        "token_ids": [o.token_ids for o in outs],
    }


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--requests", type=int, default=256)
    p.add_argument("--tokens", type=int, default=200, help="output tokens per request")
    p.add_argument(
        "--delay-ms",
        default="auto",
        help="model step length added in the worker (ms), or auto: the host path's length",
    )
    p.add_argument("--rounds", type=int, default=2, help="serial/async pairs")
    p.add_argument("--model", choices=("tiny", "builtin"), default="tiny")
    p.add_argument("--device", default="cpu")
    p.add_argument(
        "--skip",
        choices=("none", *SKIPS),
        default="none",
        help="what of the worker's CPU forward to skip (benchmarks/bench_clock.py), so that it "
        "shrinks toward what a GPU launch costs its thread and the delay is the device; "
        "tokens are meaningless but still compared between the modes",
    )
    return p.parse_args()


def auto_delay(model: Path, prompts: list[list[int]], a: argparse.Namespace, tmp: Path) -> float:
    """The model step as long as the host path: what a serial step takes besides the model
    (the core's schedule and update, both IPC hops, the worker's bookkeeping). The
    modelled device runs from the launch, so the worker's own forward (CPU work a GPU would
    not do) hides inside any longer delay: the host path is a serial step with a delay
    less that delay. A first run without a delay gives a delay long enough to hide the
    forward."""
    probe = run(model, prompts, a.tokens, 0, False, tmp, a.device)
    longer = probe["host_step_ms"]
    timed = run(model, prompts, a.tokens, longer, False, tmp, a.device)
    delay = 1e3 / timed["steps_per_s"] - longer
    print(
        f"serial step {1e3 / timed['steps_per_s']:.3f} ms with a {longer:.3f} ms "
        f"delay: host path and delay {delay:.3f} ms",
        file=sys.stderr,
    )
    return delay


def run_rounds(
    a: argparse.Namespace, prompts: list[list[int]]
) -> tuple[float, list[dict[str, Any]]]:
    """The step delay, and --rounds pairs of a serial then an async run on one model."""
    with tempfile.TemporaryDirectory(prefix="overlap-") as d:
        tmp = Path(d)
        if a.model == "tiny":
            model = tmp / "model"
            write_model_dir(model, VOCAB, 64 + a.tokens)
        else:
            model = builtin_model_dir()
        delay = auto_delay(model, prompts, a, tmp) if a.delay_ms == "auto" else float(a.delay_ms)
        runs: list[dict[str, Any]] = []
        for i in range(a.rounds):
            for async_on in (False, True):
                r = run(model, prompts, a.tokens, delay, async_on, tmp, a.device)
                print(
                    f"round {i + 1} {r['mode']}: {r['steps_per_s']} steps/s, worker idle "
                    f"{r['worker_idle_share']:.1%}",
                    file=sys.stderr,
                )
                runs.append(r)
    return delay, runs


def report(a: argparse.Namespace, delay: float, runs: list[dict[str, Any]]) -> dict[str, Any]:
    """Each mode's medians over its runs, the async speedup, and the goals read from it."""
    tokens_equal = all(r["token_ids"] == runs[0]["token_ids"] for r in runs)
    by_mode: dict[str, dict[str, float]] = {}
    for mode in ("serial", "async"):
        mine = [r for r in runs if r["mode"] == mode]
        by_mode[mode] = {
            key: statistics.median(r[key] for r in mine)
            for key in (
                "steps_per_s",
                "worker_idle_share",
                "worker_busy_ms_per_step",
                "worker_idle_ms_per_step",
            )
        }
    speedup = by_mode["async"]["steps_per_s"] / by_mode["serial"]["steps_per_s"]
    return {
        "benchmark": "overlap",
        "model": a.model,
        "device": a.device,
        "skip": a.skip,
        "requests": a.requests,
        "tokens": a.tokens,
        "delay_ms": round(delay, 3),
        "serial": by_mode["serial"],
        "async": by_mode["async"],
        "async_speedup": round(speedup, 3),
        "tokens_equal": tokens_equal,
        "goals": {
            "speedup_at_least_1.6": speedup >= 1.6,
            "async_worker_idle_under_10pct": by_mode["async"]["worker_idle_share"] < 0.10,
        },
        "runs": [{k: v for k, v in r.items() if k != "token_ids"} for r in runs],
    }


def main() -> None:
    a = parse_args()
    os.environ[SKIP_ENV] = "" if a.skip == "none" else a.skip
    # The workers load the clock and skips from benchmarks/bench_clock.py.
    os.environ[envs.WORKER_HOOKS] = HOOKS
    rng = random.Random(0)
    prompts = [
        # Byte ids: valid in both vocabularies.
        [rng.randrange(3, 250) for _ in range(rng.randint(8, 32))]
        for _ in range(a.requests)
    ]
    delay, runs = run_rounds(a, prompts)
    print(json.dumps(report(a, delay, runs)))


if __name__ == "__main__":
    main()
