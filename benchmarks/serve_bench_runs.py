"""One serve_bench run of a workload: through the server's HTTP clients, through
LLM.generate in waves, and the engine alone one request at a time; each reports its
throughput, latency percentiles and CPU per token."""

from __future__ import annotations

import argparse
import itertools
import statistics
import time
from typing import Any

from serve_bench_clients import drive
from serve_bench_server import COUNTERS, cpu_seconds, reset_server_cache, server_counters, total_cpu
from serve_bench_workloads import Workload

from launch.client.async_llm import run as run_async
from protocol.engine import SamplingParams


def percentiles(xs: list[float], scale: float = 1e3) -> dict[str, float | None]:
    """p50/p90/p99 (in ms by default); None when there is nothing to measure."""
    if not xs:
        return {"p50": None, "p90": None, "p99": None}
    s = sorted(xs)

    def at(q: float) -> float:
        return round(s[min(len(s) - 1, int(q * len(s)))] * scale, 3)

    return {"p50": round(statistics.median(s) * scale, 3), "p90": at(0.9), "p99": at(0.99)}


def _us_per_token(cpu0: float | None, cpu1: float | None, ntok: int) -> float | None:
    return round((cpu1 - cpu0) / ntok * 1e6, 1) if cpu0 is not None and cpu1 and ntok else None


def server_run(
    url: str,
    model: str,
    w: Workload,
    a: argparse.Namespace,
    concurrency: int,
    pid: int | None = None,
    engine_pids: list[int] | None = None,
) -> tuple[dict[str, Any], list[list[int]]]:
    reset_server_cache(url)
    m0 = server_counters(url)
    s0, c0, e0 = cpu_seconds(pid), time.process_time(), total_cpu(engine_pids or [])
    # The clients' loop on uvloop, as the server's: less CPU per token than asyncio's
    # loop, and on a small machine the clients' CPU is taken from the engine's.
    results, seconds = run_async(drive(url, model, w.prompts, a, concurrency))
    s1, c1, e1 = cpu_seconds(pid), time.process_time(), total_cpu(engine_pids or [])
    m1 = server_counters(url)
    q, h, ttft_s, n = (m1[k] - m0[k] for k in COUNTERS)
    done = [r for r in results if r.error is None and r.finish_reason is not None]
    ntok = sum(len(r.token_ids) for r in results)
    tpot = [
        (r.latency - r.ttft) / (len(r.token_ids) - 1)
        for r in done
        if r.ttft is not None and len(r.token_ids) > 1
    ]
    prompt_tokens = sum(r.prompt_tokens for r in results)
    errors = sorted({r.error for r in results if r.error})
    return {
        "seconds": round(seconds, 3),
        "requests": len(results),
        "finished": len(done),
        "errors": errors[:3],
        "output_tokens": ntok,
        "output_tok_s": round(ntok / seconds, 1),
        "request_s": round(len(done) / seconds, 3),
        # CPU per output token of the server process alone (not its engine), and of
        # this client: less noisy than wall time on a shared machine.
        "server_cpu_us_per_token": _us_per_token(s0, s1, ntok),
        "client_cpu_us_per_token": _us_per_token(c0, c1, ntok),
        "engine_cpu_us_per_token": _us_per_token(e0, e1, ntok),
        "ttft_ms": percentiles([r.ttft for r in done if r.ttft is not None]),
        "tpot_ms": percentiles(tpot),
        "itl_ms": percentiles([x for r in done for x in r.itl]),
        "e2e_ms": percentiles([r.latency for r in done]),
        # The server's own view: arrival to first token, without the client's part.
        "server_ttft_mean_ms": round(ttft_s / n * 1e3, 3) if n else None,
        "prefix_hit_rate": round(h / q, 4) if q else 0.0,
        "cached_token_rate": round(sum(r.cached_tokens for r in results) / prompt_tokens, 4)
        if prompt_tokens
        else 0.0,
    }, [r.token_ids for r in results]


def llm_run(
    llm: Any, w: Workload, a: argparse.Namespace, concurrency: int
) -> tuple[dict[str, Any], list[list[int]]]:
    llm.reset_prefix_cache()
    params = SamplingParams(max_tokens=a.max_tokens, temperature=0, ignore_eos=True)
    outs = []
    engine_pids = [p.pid for p in llm.engine.procs.values()]
    c0, e0 = time.process_time(), total_cpu(engine_pids)
    start = time.perf_counter()
    for k in range(0, len(w.prompts), concurrency):
        outs += llm.generate(w.prompts[k : k + concurrency], params, use_tqdm=False)
    seconds = time.perf_counter() - start
    c1, e1 = time.process_time(), total_cpu(engine_pids)
    ntok = sum(len(o.token_ids) for o in outs)
    prompt_tokens = sum(len(p) for p in w.prompts)
    return {
        "seconds": round(seconds, 3),
        "requests": len(outs),
        "finished": sum(o.finish_reason == "length" for o in outs),
        "output_tokens": ntok,
        "output_tok_s": round(ntok / seconds, 1),
        "request_s": round(len(outs) / seconds, 3),
        "client_cpu_us_per_token": _us_per_token(c0, c1, ntok),
        "engine_cpu_us_per_token": _us_per_token(e0, e1, ntok),
        "cached_token_rate": round(sum(o.num_cached_tokens for o in outs) / prompt_tokens, 4),
    }, [o.token_ids for o in outs]


def engine_step_time(llm: Any, prompts: list[list[int]], a: argparse.Namespace) -> dict[str, Any]:
    """The engine alone on a low-load run's prompts, one request at a time through the
    LLM's engine (the prefix cache reset once before, as before a server run, so hits
    are the same): its first output's latency (the prefill step, what TTFT at low load
    compares to) and the gaps between its outputs (decode steps), in ms."""
    params = SamplingParams(max_tokens=a.step_probe_tokens, temperature=0, ignore_eos=True)
    engine = llm.engine
    llm.reset_prefix_cache()
    gaps: list[float] = []
    firsts: list[float] = []
    for i, prompt in enumerate(prompts):
        rid = f"step-probe-{i}"
        start = time.perf_counter()
        engine.add_request(rid, prompt, params)
        stamps: list[float] = []
        finished = False
        while not finished:
            batch = engine.get_outputs()
            now = time.perf_counter()
            for o in batch.outputs if batch is not None else ():
                if o.request_id == rid and o.new_token_ids:
                    stamps.append(now)
                finished |= o.request_id == rid and o.finish_reason is not None
        firsts.append(stamps[0] - start)
        gaps += [b - c for c, b in itertools.pairwise(stamps)]
    return {"first_token_ms": percentiles(firsts), "decode_step_ms": percentiles(gaps)}
