"""What the step-overhead benchmark's runs share (benchmarks/step_overhead.py): the
prompts, the one-tiny-layer model, the engine settings and scheduler, and the summaries."""

from __future__ import annotations

import argparse
import contextlib
import cProfile
import io
import json
import pstats
import random
import statistics
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from enginecore.core import scheduler_config  # noqa: E402
from enginecore.request import Request  # noqa: E402
from enginecore.scheduler import Scheduler  # noqa: E402
from launch.client.builtin_model import write_llama_checkpoint  # noqa: E402
from launch.client.engine_args import EngineArgs  # noqa: E402
from protocol.engine import SamplingParams  # noqa: E402
from protocol.kv_cache import KVCacheConfig  # noqa: E402
from protocol.worker import SchedulerOutput, WorkerConfigure  # noqa: E402

# One layer: a model without layers fails worker/model_config.py and has no KV-cache group.
NUM_LAYERS = 1
clock = time.perf_counter_ns
NOT_PROFILED = contextlib.nullcontext()


def log(msg: str) -> None:
    print(f"[step_overhead] {msg}", file=sys.stderr, flush=True)


# -- workload -------------------------------------------------------------------------
def load_prompts(a: argparse.Namespace) -> tuple[list[list[int]], str]:
    """The first --requests prompts of the trace (arrivals are in request-id order)."""
    if a.trace.exists():
        prompts: list[list[int]] = []
        with open(a.trace) as f:
            for line in f:
                if '"arrive"' not in line:
                    continue
                prompts.append(json.loads(line)["prompt"])
                if len(prompts) == a.requests:
                    return [[t % a.vocab for t in p] for p in prompts], str(a.trace)
        log(f"{a.trace} has only {len(prompts)} prompts; using synthetic ones")
    # Same shape as the peer's trace: one of 8 shared prefixes plus a unique suffix.
    rng = random.Random(a.seed)
    systems = [[rng.randrange(a.vocab) for _ in range(rng.randint(512, 1024))] for _ in range(8)]
    prompts = [
        rng.choice(systems) + [rng.randrange(a.vocab) for _ in range(rng.randint(64, 512))]
        for _ in range(a.requests)
    ]
    return prompts, "synthetic"


def write_model_dir(directory: Path, vocab: int, max_positions: int) -> None:
    """A Llama with one tiny layer and fixed-seed random weights."""
    hidden, inter, head_dim = 64, 64, 8
    config = {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "vocab_size": vocab,
        "hidden_size": hidden,
        "intermediate_size": inter,
        "num_hidden_layers": NUM_LAYERS,
        "num_attention_heads": 1,
        "num_key_value_heads": 1,
        "head_dim": head_dim,
        "rms_norm_eps": 1e-5,
        "rope_theta": 10000.0,
        "max_position_embeddings": max_positions,
        "tie_word_embeddings": False,
        "bos_token_id": 1,
        "eos_token_id": 2,
        "torch_dtype": "float32",
    }
    write_llama_checkpoint(directory, config, seed=0)


class Setup:
    """What both runs share: prompts, lengths, block count, scheduler config."""

    def __init__(self, a: argparse.Namespace, prompts: list[list[int]]) -> None:
        self.a = a
        self.prompts = prompts
        # As the peer (bounded prefill steps + warmup + timed steps, plus slack), and
        # the profiled steps: no request may finish, or a step would schedule nothing.
        steps = max(a.steps, a.ipc_steps) + a.profile_steps
        self.max_tokens = 64 + a.warmup + steps + 8
        bs = a.block_size
        self.max_model_len = max(len(p) for p in prompts) + self.max_tokens + bs
        self.num_blocks = sum(-(-(len(p) + self.max_tokens) // bs) for p in prompts) + 16
        # The engine's settings for this run, as the launcher takes them; every config
        # below is made from them, as the launcher makes its own.
        self.args = EngineArgs(
            model="unused",  # each run names its checkpoint
            block_size=bs,
            num_gpu_blocks=self.num_blocks,
            max_num_batched_tokens=a.max_num_batched_tokens,
            max_num_seqs=a.requests,
            max_model_len=self.max_model_len,
            enable_prefix_caching=True,
            hash_algo=a.hash,
            device=a.device,
        )
        self.sched_config = scheduler_config(self.args, max_model_len=self.max_model_len)
        self.params = SamplingParams(max_tokens=self.max_tokens, temperature=0.0, ignore_eos=True)

    def configure(self, kv_config: KVCacheConfig) -> WorkerConfigure:
        return WorkerConfigure(
            kv_cache_config=kv_config,
            max_num_reqs=self.a.requests,
            max_model_len=self.max_model_len,
            max_num_batched_tokens=self.a.max_num_batched_tokens,
        )

    def scheduler(self, kv_config: KVCacheConfig) -> Scheduler:
        sched = Scheduler(self.sched_config, kv_config, self.a.vocab, eos_token_ids=[2])
        hasher = sched.kv_cache_manager.block_hasher
        for i, prompt in enumerate(self.prompts):
            req = Request(str(i), prompt, hasher, sampling_params=self.params)
            error = sched.add_request(req)
            if error is not None:
                raise SystemExit(f"request {i} rejected: {error.error}")
        return sched


def all_decoding(so: SchedulerOutput, n: int) -> bool:
    return (
        not so.new_reqs and len(so.num_scheduled_tokens) == n and so.total_num_scheduled_tokens == n
    )


def summarize(values: list[int]) -> dict[str, float]:
    """Median and p90 of nanosecond samples, in microseconds."""
    if not values:
        return {"median_us": 0.0, "p90_us": 0.0}
    q = statistics.quantiles(values, n=10) if len(values) > 1 else [values[0]] * 9
    return {
        "median_us": round(statistics.median(values) / 1e3, 2),
        "p90_us": round(q[8] / 1e3, 2),
    }


def top_functions(prof: cProfile.Profile, limit: int) -> list[dict[str, Any]]:
    """The functions with the most own time, as (file:function, share of own time)."""
    stats = pstats.Stats(prof, stream=io.StringIO())
    rows = []
    total = sum(v[2] for v in stats.stats.values())  # type: ignore[attr-defined]
    for (file, line, name), (_, ncalls, tottime, cumtime, _) in stats.stats.items():  # type: ignore[attr-defined]
        path = Path(file)
        try:
            where = str(path.relative_to(ROOT))
        except ValueError:
            where = path.name if file != "~" else "builtin"
        rows.append(
            {
                "function": f"{where}:{line}:{name}",
                "calls": ncalls,
                "own_share": round(tottime / total, 3) if total else 0.0,
                "cum_share": round(cumtime / total, 3) if total else 0.0,
            }
        )
    rows.sort(key=lambda r: -r["own_share"])
    return rows[:limit]
