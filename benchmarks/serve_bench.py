#!/usr/bin/env python3
"""The OpenAI-compatible server under load, against LLM.generate on the same requests.

    python benchmarks/serve_bench.py [--model M] [--concurrency 1,64] [--repeat 2]
        [--workloads random,shared] [--request-rate R] [--url URL] [--quick]

Clients: the official `openai` client (AsyncOpenAI) on its aiohttp transport
(DefaultAioHttpClient, the `openai[aiohttp]` extra: where the clients share the CPUs
with the server and the engine, its C HTTP parser spends far less of them per streamed
token than httpx's pure-Python one), one streaming completion per request, prompts sent
as token ids so the server and LLM.generate see identical ids; greedy, ignore_eos, fixed
max_tokens, so every variant generates the same tokens (checked: the server's ids, from
the `return_token_ids` extension, must equal LLM.generate's). That extension also makes
every step's tokens a chunk, so ITL is per step even when a token ends inside a
character. Load: --concurrency C keeps C streams open (a closed loop: a client sends its
next request when one ends); --request-rate R sends requests at Poisson arrivals of R
per second instead (still capped at C open).

Workloads (prompts are words in the model's tokenizer, cut to a token count):
- random: prompts of random words, no two sharing their first block.
- shared: 4 system prompts, each request one of them plus its own question.

Variants, all in one run: the server (`pagedserve serve`, started here on a free port,
waited for on /health, stopped with SIGTERM) with prefix caching on and then off, and an
in-process LLM with the same setting, up at the same time (an idle engine costs nothing)
so that server and LLM runs of one cell alternate, and a load change on a shared machine
falls on both. LLM.generate runs the requests in waves of C, which is what C closed-loop
clients do when every request generates the same number of tokens. The prefix cache is
reset before every run, so each run starts cold and its hit rate is its own.
Both variants' CPU workers run on the machine's CPUs less one (--worker-threads): the
clients are a load generator, and on the engines' cores they would slow the server's
variant alone.

Reported per run and, per cell (workload, concurrency, prefix caching), the median over
repeats: output and request throughput, TTFT / TPOT / ITL p50, p90, p99 (client side),
the prefix-cache hit rate (the server's /metrics counters before and after; also
cached_tokens / prompt_tokens from `usage`), ratio = server tok/s / LLM.generate tok/s.
The engine's step time: one request at a time through the LLM's engine, the median gap
between its outputs (a decode step) and its first output's latency (prefill), so the
server's TTFT at concurrency 1 reads against it. --url drives a server already running
(its own prefix-cache setting; "server" variant only, the LLM baseline runs locally
on --model). Progress on stderr; the last stdout line is one JSON object.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import signal
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from serve_bench_runs import engine_step_time, llm_run, server_run  # noqa: E402
from serve_bench_server import (  # noqa: E402
    ServerProcess,
    children,
    engine_kwargs,
    http_get,
    log,
)
from serve_bench_summary import goals, summarize  # noqa: E402
from serve_bench_workloads import Workload, build_workload  # noqa: E402

from launch.client.inputs import InputProcessor  # noqa: E402


def run_setting(
    a: argparse.Namespace,
    prefix_caching: bool,
    workloads: dict[tuple[str, int], Workload],
    stack: contextlib.ExitStack,
    runs: list[dict[str, Any]],
) -> None:
    """Every cell with prefix caching on or off (the server and an LLM up together)."""
    from launch import LLM

    tag = "on" if prefix_caching else "off"
    server = None
    if a.url is None:
        log(f"prefix caching {tag}: starting the server and the LLM")
        server = ServerProcess(a, prefix_caching)
        stack.callback(server.stop)
    llm = LLM(a.model, **engine_kwargs(a, prefix_caching))
    stack.callback(llm.close)
    url = a.url or (server.wait_ready(a.startup_timeout) if server else "")
    pid = server.proc.pid if server is not None else None
    engine_pids = children(pid) if pid is not None else []
    model = json.loads(http_get(f"{url}/v1/models"))["data"][0]["id"]
    # First runs pay for lazy start-up work (allocator, caches) and for the CPU worker's
    # choice of thread count, probed in the first ~70 steps of a large batch (a server
    # runs long; a cell lasts ~250 steps): one wave at the highest concurrency, not part
    # of any cell, for the server and the LLM alike.
    top = max(c for _, c in workloads)
    warm = next(w for (_, c), w in workloads.items() if c == top)
    warm_up = Workload("warm-up", warm.prompts[:top])
    server_run(url, model, warm_up, a, top)
    llm_run(llm, warm_up, a, top)
    if server is not None:
        for line in server.lines:
            if "CPU threads" in line:
                log(f"prefix caching {tag}, server's worker: {line.strip()}")
    for (name, c), w in workloads.items():
        step = engine_step_time(llm, w.prompts, a) if c == 1 else None
        if step is not None:
            log(f"{name} prefix {tag}: the engine alone, one request at a time: {step}")
        for rep in range(a.repeat):
            order = ("server", "llm") if rep % 2 == 0 else ("llm", "server")
            row: dict[str, Any] = {
                "workload": name,
                "concurrency": c,
                "prefix_caching": tag if a.url is None else "server's",
                "repeat": rep,
            }
            ids: dict[str, list[list[int]]] = {}
            for variant in order:
                if variant == "server":
                    seen = len(server.lines) if server is not None else 0
                    row["server"], ids["server"] = server_run(url, model, w, a, c, pid, engine_pids)
                    if server is not None:
                        # The CPU worker's thread-count switches during the run, if any.
                        row["server"]["worker_threads"] = [
                            line.strip() for line in server.lines[seen:] if "CPU threads" in line
                        ]
                else:
                    row["llm"], ids["llm"] = llm_run(llm, w, a, c)
            if step is not None:
                row["engine"] = step
            row["ratio"] = round(row["server"]["output_tok_s"] / row["llm"]["output_tok_s"], 3)
            row["same_token_ids"] = ids["server"] == ids["llm"]
            s = row["server"]
            log(
                f"{name} c={c} prefix {tag} #{rep}: server {s['output_tok_s']} tok/s, "
                f"LLM {row['llm']['output_tok_s']} tok/s, ratio {row['ratio']}, "
                f"TTFT p50 {s['ttft_ms']['p50']} ms, hit {s['prefix_hit_rate']}, "
                f"finished {s['finished']}/{s['requests']}"
            )
            runs.append(row)
    if server is not None:
        code = server.stop()
        if code != 0:
            raise RuntimeError(f"the server exited {code}:\n" + "".join(server.lines[-30:]))
    llm.close()


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", help="checkpoint directory or Hub id (default: the built-in)")
    p.add_argument("--url", help="drive this running server instead of starting one")
    p.add_argument("--device", help="engine device (default: the engine's)")
    p.add_argument("--dtype", help="engine dtype (default: the engine's)")
    p.add_argument("--workloads", default="random,shared")
    p.add_argument("--concurrency", default="1,64", help="comma-separated open streams")
    p.add_argument(
        "--client",
        choices=("raw", "openai"),
        default="raw",
        help="raw: the openai client's raw stream, events decoded with msgspec; openai: "
        "every chunk parsed into the client's typed objects (costs the client several times "
        "the CPU)",
    )
    p.add_argument(
        "--stream-interval",
        type=int,
        default=1,
        help="the server's --stream-interval (tokens per streamed chunk; default 1, the "
        "goal's setting)",
    )
    p.add_argument("--request-rate", type=float, help="Poisson arrivals per second")
    p.add_argument("--requests", type=int, help="requests per cell (default: 2x C, 16 at C=1)")
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--prompt-len", default="100,300", help="random prompts: min,max tokens")
    p.add_argument("--system-len", type=int, default=256)
    p.add_argument("--question-len", type=int, default=32)
    p.add_argument("--repeat", type=int, default=2)
    p.add_argument("--prefix-caching", default="on,off", help="settings to run: on,off")
    p.add_argument(
        "--step-probe-tokens", type=int, default=16, help="tokens per engine-alone request"
    )
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--worker-threads",
        type=int,
        help="the CPU workers' torch threads, server and LLM alike (OMP_NUM_THREADS); 0: "
        "each worker picks its own count. Default: OMP_NUM_THREADS if set, else the "
        "machine's CPUs less one, so the clients driving the server have a core of their "
        "own in both variants, as they would on another machine (default_worker_threads)",
    )
    p.add_argument("--request-timeout", type=float, default=600)
    p.add_argument("--startup-timeout", type=float, default=300)
    p.add_argument(
        "--profile-server",
        metavar="PREFIX",
        help="run the server under cProfile; stats in PREFIX.on.prof / PREFIX.off.prof",
    )
    p.add_argument("--quick", action="store_true", help="a small run (seconds)")
    a = p.parse_args(argv)
    if a.quick:
        a.concurrency, a.requests, a.max_tokens = "1,4", 4, 8
        a.prompt_len, a.system_len, a.question_len = "20,40", 48, 8
        a.repeat, a.step_probe_tokens = 1, 4
    a.concurrency = [int(c) for c in a.concurrency.split(",")]
    a.prompt_len = tuple(int(x) for x in a.prompt_len.split(","))
    a.workloads = a.workloads.split(",")
    a.prefix_caching = [s == "on" for s in a.prefix_caching.split(",")]
    if a.url is not None:
        a.url = a.url.rstrip("/").removesuffix("/v1")
        a.prefix_caching = [True]  # the server's own setting; only the baseline's is ours
    return a


def default_worker_threads() -> int:
    """The machine's CPUs less one. The clients here are a load generator, about as heavy
    per streamed token as the server itself; on the workers' cores they slow the server's
    variant alone, and the ratio then prices the clients, not the API layer."""
    return max(1, len(os.sched_getaffinity(0)) - 1)


def _interrupt(_sig: int, _frame: object) -> None:
    raise KeyboardInterrupt


def main(argv: list[str] | None = None) -> int:
    a = parse_args(argv)
    if a.worker_threads is None:
        # A count the caller fixed in the environment stands, as it does for the engines.
        fixed = os.environ.get("OMP_NUM_THREADS", "")
        a.worker_threads = int(fixed) if fixed.isdigit() else default_worker_threads()
    if a.worker_threads < 0:
        raise SystemExit("--worker-threads must be >= 0 (0: each worker picks its count)")
    if a.worker_threads:
        os.environ["OMP_NUM_THREADS"] = str(a.worker_threads)  # every engine started here
    inputs = InputProcessor.load(a.model)
    workloads = {}
    for name in a.workloads:
        for c in a.concurrency:
            n = a.requests or (16 if c == 1 else 2 * c)
            workloads[name, c] = build_workload(name, inputs, n, a)
    runs: list[dict[str, Any]] = []
    # SIGTERM ends us like Ctrl-C does, so the ExitStack stops what we started.
    signal.signal(signal.SIGTERM, _interrupt)
    started = time.perf_counter()
    try:
        for pc in a.prefix_caching:
            with contextlib.ExitStack() as stack:
                run_setting(a, pc, workloads, stack, runs)
    except KeyboardInterrupt:
        log("interrupted: everything this run started is stopped")
        return 130
    summary = summarize(runs)
    result = {
        "benchmark": "serve_bench",
        "model": a.model or "builtin",
        "url": a.url,
        "device": a.device or "engine default",
        "cpus": os.cpu_count(),
        "worker_threads": a.worker_threads or "each worker's choice",
        "max_tokens": a.max_tokens,
        "request_rate": a.request_rate,
        "client": a.client,
        "stream_interval": a.stream_interval,
        "seconds": round(time.perf_counter() - started, 1),
        "summary": summary,
        "goals": goals(summary),
        "all_finished": all(
            r["server"]["finished"] == r["server"]["requests"]
            and r["llm"]["finished"] == r["llm"]["requests"]
            for r in runs
        ),
        "same_token_ids": all(r["same_token_ids"] for r in runs),
        "runs": runs,
    }
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
