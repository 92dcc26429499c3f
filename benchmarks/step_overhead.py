#!/usr/bin/env python3
"""Per-step host overhead of steady decode: core, wire, IPC and worker bookkeeping.

    python benchmarks/step_overhead.py --requests 256 [--warmup 50] [--steps 1000]

The model has one tiny layer (hidden 64, one 8-wide head, vocabulary --vocab): a model
with no layers would leave the host path alone, but worker/model_config.py rejects
num_hidden_layers 0, and a model without attention layers reports no KV-cache spec,
which the core needs. In the worker the layer's paged attention returns zeros (unless
--attention real), and the vocabulary is small (trace token ids are taken modulo it),
so the model costs about what embedding and head alone would (under 1 ms on this CPU);
its compute is timed inside the worker and taken out of the host numbers. A costlier
model still inflates them: its compute evicts the host path's data from the caches
between steps, and a longer wait puts the core's CPU to sleep (see --vocab).

Two runs, both stepping --requests decode requests (the first prompts of the vLLM
peer's KV trace when it exists, else synthetic ones of the same shape), greedy,
ignore_eos, max_tokens large enough that none finishes, enough KV blocks that nothing
is preempted; prefill runs until every request decodes, then --warmup, then --steps
timed steps:

1. In one process, each piece on its own: Scheduler.schedule(); encoding the
   SchedulerOutput; decoding it on the worker side; the worker's bookkeeping on a real
   ModelRunner's persistent batch (apply the delta, prepare_inputs with slot mapping,
   block-table commit, input tensors and sampling parameters, append the sampled
   tokens); a fake model (one deterministic token per sampling request, untimed);
   encoding ModelRunnerOutput and decoding it in the core; update_from_output() and
   stats(); encoding the client's EngineOutputs.
2. Across processes: this process is the core (a real Scheduler and Executor: sockets,
   handshake) and drives a real worker process running worker.main with the real
   model. The worker is started through this file (--as-worker,
   step_overhead_multiprocess.py), which only wraps the runner's pieces with timers and
   writes them out at exit; the worker code itself runs unchanged. total_us is a step's
   whole wall time in the core (schedule to encoded client outputs) less the worker's
   model time (forward, logits, sample).

When vLLM's peer is present (benchmarks/peer.py) its bench_sched.py decode256
variant runs in the same run (schedule() + update_from_output() with a fake model, in
one process, like our run 1), then run 1 is repeated and both runs' steps are pooled,
so a load change on a shared machine weighs on both sides alike. Reported:
schedule_update_us (run 1: schedule() + update_from_output() + stats()), total_us
(run 2), their ratios to the peer, and every piece's median and p90. Before and after
run 2 (half the rounds each, pooled), the bare baseline: the same-sized frames ping-ponged
between this process and a child over a ZeroMQ PAIR ipc socket with nothing else done,
both sides polling without blocking (bare_pingpong_poll_us) and both blocking in recv
(bare_pingpong_block_us); the engine's
IPC round trip is judged against the first (ipc_vs_bare_poll). Progress goes to stderr;
the last line of stdout is one JSON object. About 30 s here with the defaults.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from peer import PEER_PYTHON, PEER_SCRIPTS, PEERS_DIR, run_peer_script
from step_overhead_common import NUM_LAYERS, Setup, load_prompts, log, summarize, write_model_dir
from step_overhead_inprocess import run_inprocess, summarize_inprocess
from step_overhead_multiprocess import run_multiprocess, worker_entry
from step_overhead_pingpong import bare_pingpong, pingpong_entry

from launch.client.engine_args import EngineArgs

PEER_SCRIPT = PEER_SCRIPTS / "bench_sched.py"
DEFAULT_TRACE = PEERS_DIR / "traces" / "kv_trace.jsonl"
# The targets against the peer: schedule + update at least 8x faster than the peer's, the
# whole host path at most half the peer's schedule + update (moonshot a quarter), the IPC
# round trip within 1.5x of a bare polling ping-pong of the same frames.
TARGETS = {
    "schedule_update_ratio_max": 0.125,
    "total_vs_peer_schedule_update_max": 0.5,
    "total_vs_peer_schedule_update_moonshot": 0.25,
    "ipc_vs_bare_poll_max": 1.5,
}


def run_peer(a: argparse.Namespace) -> dict[str, Any] | None:
    args = [
        "--variant",
        "decode256",
        "--num-running",
        str(a.requests),
        "--warmup",
        str(a.warmup),
        "--measure",
        str(a.steps),
        "--block-size",
        str(a.block_size),
        "--max-num-batched-tokens",
        str(a.max_num_batched_tokens),
        "--trace",
        str(a.trace),
    ]
    return run_peer_script(a.peer_python, a.peer_script, args, "Scheduler")


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--requests", type=int, default=256, help="running decode requests")
    p.add_argument("--warmup", type=int, default=50)
    p.add_argument("--steps", type=int, default=1000, help="timed decode steps")
    p.add_argument(
        "--ipc-steps",
        type=int,
        default=None,
        help="timed steps of the multi-process run (default: --steps)",
    )
    p.add_argument("--trace", type=Path, default=DEFAULT_TRACE, help="the peer's KV trace")
    p.add_argument(
        "--vocab",
        type=int,
        default=256,
        help="model vocabulary; trace token ids are taken modulo it. A bigger LM head "
        "costs more than `next to nothing` on a CPU and cools the caches between steps: "
        "with 4096 the host path measured ~1.7x slower here, with 32000 the head alone "
        "takes ~25 ms a step",
    )
    p.add_argument("--hash", choices=("xxh3_128", "sha256"), default=EngineArgs.hash_algo)
    p.add_argument("--block-size", type=int, default=EngineArgs.block_size)
    p.add_argument("--max-num-batched-tokens", type=int, default=8192)
    p.add_argument("--device", default="cpu", help="worker device (cpu, cuda, auto)")
    p.add_argument("--seed", type=int, default=1, help="synthetic prompts")
    p.add_argument(
        "--no-worker-hooks",
        dest="worker_hooks",
        action="store_false",
        help="run plain `python -m worker.main` (total then includes the model)",
    )
    p.add_argument(
        "--attention",
        choices=("skip", "real"),
        default="skip",
        help="worker's paged attention: skip (zeros, so the model is embedding, MLP and "
        "head, ~0.5 ms a step here) or real (the worker's own CPU kernel, ~5 ms a step at 256 "
        "requests)",
    )
    p.add_argument("--profile-steps", type=int, default=100, help="cProfiled extra steps")
    p.add_argument("--profile-top", type=int, default=12)
    p.add_argument("--multiprocess", choices=("on", "off"), default="on")
    p.add_argument("--peer", choices=("auto", "off"), default="auto")
    p.add_argument("--peer-python", type=Path, default=PEER_PYTHON)
    p.add_argument("--peer-script", type=Path, default=PEER_SCRIPT)
    return p


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["--as-worker"]:
        return worker_entry(argv[1], argv[2], argv[3])
    if argv[:1] == ["--as-pingpong"]:
        return pingpong_entry(argv[1], argv[2], argv[3])
    a = build_parser().parse_args(argv)
    if a.ipc_steps is None:
        a.ipc_steps = a.steps
    if min(a.requests, a.steps, a.ipc_steps) < 1 or a.warmup < 0:
        raise SystemExit("--requests, --steps and --ipc-steps must be >= 1")
    prompts, source = load_prompts(a)
    s = Setup(a, prompts)
    result = _describe(a, s, prompts, source)
    runs, multi, bare, peer = _measure(a, s)
    result["load_average_at_end"] = [round(x, 2) for x in os.getloadavg()]
    _report(result, summarize_inprocess(runs), multi, bare)
    if peer is not None:
        _report_peer(result, peer)
    print(json.dumps(result))
    return 0


def _describe(
    a: argparse.Namespace, s: Setup, prompts: list[list[int]], source: str
) -> dict[str, Any]:
    """The result's settings, before anything runs."""
    return {
        "benchmark": "step_overhead",
        "requests": a.requests,
        "steps": a.steps,
        "warmup": a.warmup,
        "prompts": source,
        "mean_prompt_tokens": round(statistics.fmean(len(p) for p in prompts), 1),
        "num_blocks": s.num_blocks,
        "block_size": a.block_size,
        "hash": a.hash,
        "model": f"Llama, {NUM_LAYERS} layer (0 is rejected by worker/model_config.py and "
        f"leaves no KV-cache group), hidden 64, 1 head of 8, vocab {a.vocab}",
        "device": a.device,
        "worker_attention": a.attention if a.worker_hooks else "real",
        "load_average_at_start": [round(x, 2) for x in os.getloadavg()],
        "cpus": os.cpu_count(),
    }


def _measure(
    a: argparse.Namespace, s: Setup
) -> tuple[list[dict[str, Any]], dict[str, Any] | None, dict[str, Any], dict[str, Any] | None]:
    """Run 1, run 2 between its bare baselines, the peer and run 1 again after it: (the
    in-process runs, run 2, the baselines, the peer's result)."""
    multi = None
    bare: dict[str, Any] = {}
    with tempfile.TemporaryDirectory(prefix="step-overhead-") as tmp:
        model_dir = Path(tmp)
        write_model_dir(model_dir, a.vocab, s.max_model_len)
        log(f"in-process run: {a.requests} requests, {a.warmup} warm-up, {a.steps} timed steps")
        t0 = time.perf_counter()
        runs = [run_inprocess(s, model_dir, a.profile_steps)]
        log(f"in-process run done in {time.perf_counter() - t0:.1f} s")
        if a.multiprocess == "on":
            multi, bare = _multiprocess_between_baselines(a, s, model_dir, runs[0])
        peer = None if a.peer == "off" else run_peer(a)
        if peer is not None:
            # Once more after the peer, so a load change on a shared machine during the
            # run weighs on both sides alike; the medians pool both runs.
            log("in-process run again, after the peer")
            runs.append(run_inprocess(s, model_dir, 0))
    return runs, multi, bare, peer


def _multiprocess_between_baselines(
    a: argparse.Namespace, s: Setup, model_dir: Path, run1: dict[str, Any]
) -> tuple[dict[str, Any], dict[str, Any]]:
    """Run 2, with the bare baseline before and after it, pooled: measured once, its
    short window caught whatever the shared machine did then."""
    frame = int(statistics.median(run1["rec"]["so_bytes"]))
    reply = int(statistics.median(run1["rec"]["mro_bytes"]))
    samples: dict[str, list[list[int]]] = {"poll": [], "block": []}
    half = max(2, a.ipc_steps // 2)
    for mode in samples:
        samples[mode].append(bare_pingpong(frame, reply, mode, half))
    log(f"multi-process run: core here, worker.main in a child, {a.ipc_steps} steps")
    t0 = time.perf_counter()
    multi = run_multiprocess(s, model_dir)
    log(f"multi-process run done in {time.perf_counter() - t0:.1f} s")
    for mode in samples:
        samples[mode].append(bare_pingpong(frame, reply, mode, half))
    bare = {
        mode: {
            **summarize([t for window in windows for t in window]),
            "median_us_before_after": [summarize(w)["median_us"] for w in windows],
        }
        for mode, windows in samples.items()
    }
    log(
        "bare ZeroMQ ping-pong: "
        + ", ".join(f"{m} {b['median_us']:.0f} us" for m, b in bare.items())
    )
    return multi, bare


def _report(
    result: dict[str, Any],
    inproc: dict[str, Any],
    multi: dict[str, Any] | None,
    bare: dict[str, Any],
) -> None:
    """The headline figures into result, then every run's own."""
    result["schedule_update_us"] = inproc["schedule_update"]["median_us"]
    result["schedule_update_p90_us"] = inproc["schedule_update"]["p90_us"]
    if multi is not None:
        result["total_us"] = multi["total"]["median_us"]
        result["total_p90_us"] = multi["total"]["p90_us"]
        if "ipc_round_trip" in multi:
            result["ipc_round_trip_us"] = multi["ipc_round_trip"]["median_us"]
            result["worker_bookkeeping_us"] = multi["worker_bookkeeping"]["median_us"]
            result["worker_model_us"] = multi["worker_model"]["median_us"]
            result["bare_pingpong_poll_us"] = bare["poll"]["median_us"]
            result["bare_pingpong_block_us"] = bare["block"]["median_us"]
            result["bare_pingpong_poll_us_before_after"] = bare["poll"]["median_us_before_after"]
            result["ipc_vs_bare_poll"] = round(
                result["ipc_round_trip_us"] / result["bare_pingpong_poll_us"], 3
            )
    else:
        result["total_us"] = inproc["total_without_ipc"]["median_us"]
        result["total_note"] = "--multiprocess off: in-process sum, no IPC"
    result["scheduler_output_bytes"] = inproc["scheduler_output_bytes"]["median"]
    result["model_runner_output_bytes"] = inproc["model_runner_output_bytes"]
    result["model_runner_output_bytes_vocab_32000"] = inproc[
        "model_runner_output_bytes_vocab_32000"
    ]
    result["inprocess"] = inproc
    if multi is not None:
        result["multiprocess"] = multi


def _report_peer(result: dict[str, Any], peer: dict[str, Any]) -> None:
    """The peer's figures, our ratios to them and the targets met."""
    d = peer["decode256"]
    peer_su = d["step_median_us"]
    result["peer"] = {
        "impl": peer.get("impl"),
        "schedule_update_us": peer_su,
        "schedule_update_p90_us": d.get("step_p90_us"),
        "schedule_us": d.get("schedule_median_us"),
        "update_from_output_us": d.get("update_from_output_median_us"),
        "hash": d.get("config", {}).get("prefix_caching_hash_algo"),
        "log_stats": d.get("config", {}).get("log_stats"),
        "steps": d.get("steps"),
    }
    result["schedule_update_ratio"] = round(result["schedule_update_us"] / peer_su, 4)
    result["total_vs_peer_schedule_update"] = round(result["total_us"] / peer_su, 4)
    result["targets"] = {
        **TARGETS,
        "schedule_update_met": result["schedule_update_ratio"]
        <= TARGETS["schedule_update_ratio_max"],
        "total_met": result["total_vs_peer_schedule_update"]
        <= TARGETS["total_vs_peer_schedule_update_max"],
        "ipc_met": result.get("ipc_vs_bare_poll", float("inf")) <= TARGETS["ipc_vs_bare_poll_max"],
    }


if __name__ == "__main__":
    raise SystemExit(main())
