#!/usr/bin/env python3
"""`pagedserve serve` against `vllm serve`, both driven by vLLM's own `bench serve` client.

    python benchmarks/serve_vs_vllm.py [--workloads random,chat,long-output]
        [--concurrency 1,4,16,64] [--pairs 3] [--num-prompts 64] [--peer-kv-gib 1]
        [--ours-flags "..."] [--peer-flags "..."] [--table FILE] [--quick]

Both servers run the real model (SmolLM2-135M-Instruct, float32; --model for another
checkpoint) with their default flags, but for vLLM's CPU KV space (VLLM_CPU_KVCACHE_SPACE,
--peer-kv-gib) and what --ours-flags / --peer-flags add. They are up at the same time and
take turns: for every pair, every cell (workload, concurrency) runs on one server then on
the other, the first one alternating from pair to pair, so a slow spell of the machine
falls on both. Each run reports how much CPU the idle server used meanwhile.

Workloads (vLLM's datasets; sizes are PREFIX,INPUT,OUTPUT tokens, --shape NAME=P,I,O):
- random: vLLM's random dataset, a 128-token prefix shared by all, 384 random tokens
  after it, 128 output tokens.
- chat: chat completions (/v1/chat/completions, each server applying its chat template),
  vLLM's repeated-prefix dataset: 4 long prefixes (1024 tokens) each shared by a quarter
  of the requests, a 64-token question after it, 128 output tokens.
- long-output: random, 32-token prompts, 512 output tokens.
Greedy, ignore_eos: every request generates exactly OUTPUT tokens. Each run has a seed of
its own (pair, workload, concurrency), the same for both servers: the prompts of one run
are new to each server's prefix cache, so every run starts cold.

Per run: output and request throughput, TTFT / TPOT / ITL / E2E p50 and p99 (as `bench
serve` measures them), preemptions (both servers' vllm:num_preemptions counter), each
server's CPU seconds. Per cell and server: median, min and max over the pairs, and the
ratio ours / vLLM of the medians. Placement: every process of each server, its threads and
the CPUs they may run on. When the peer venv is absent ($PEERS_DIR/vllm-full-venv with
`vllm serve`'s packages: bash $PEER_SCRIPTS/setup-serve.sh), our server runs alone, driven
by serve_bench's client on the same shapes, and the report says the peer is missing.
Progress on stderr; the last stdout line is one JSON object.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shlex
import signal
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from peer import PEER_SCRIPTS, PEERS_DIR  # noqa: E402
from serve_bench_runs import server_run  # noqa: E402
from serve_bench_server import ServerProcess  # noqa: E402
from serve_bench_workloads import Workload  # noqa: E402
from serve_vs_vllm_loads import SHAPES, Shape, client_args, token_prompts  # noqa: E402
from serve_vs_vllm_peer import (  # noqa: E402
    PeerServer,
    bench_serve,
    log,
    placement,
    preemptions,
    served_model,
    tree,
    tree_cpu,
)
from serve_vs_vllm_report import summarize, table, targets  # noqa: E402

from tests.helpers.real_model import fetch_real_model  # noqa: E402

PEER_PYTHON = PEERS_DIR / "vllm-full-venv" / "bin" / "python"
PEER_SCRIPT = PEER_SCRIPTS / "serve.py"
# Below this many streams a run sends --low-concurrency-prompts requests, not --num-prompts.
LOW_CONCURRENCY = 4


class Side:
    """One server under test: its URL, served name, process tree, and how runs reach it."""

    def __init__(self, name: str, url: str, pid: int) -> None:
        self.name = name
        self.url = url
        self.pid = pid
        self.served = served_model(url)
        self.pids = tree(pid)

    def cpu(self) -> float:
        return tree_cpu(self.pids)


@contextlib.contextmanager
def paused(sides: list[Side]) -> Iterator[None]:
    """The idle servers stopped (SIGSTOP) while another is measured, each resumed after:
    every run then has the machine to itself. An idle `vllm serve` keeps polling for a
    while after its last request, and on two cores its wake-ups land in the measured
    server's steps (docs/benchmarks.md)."""
    pids = [pid for side in sides for pid in side.pids]
    for pid in pids:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGSTOP)
    try:
        yield
    finally:
        for pid in pids:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGCONT)


def run_once(
    a: argparse.Namespace,
    side: Side,
    other: Side | None,
    shape: Shape,
    run: tuple[int, int, int],
    work: Path,
) -> dict[str, Any]:
    """One run of a cell on one server, run = (requests, concurrency, seed): bench
    serve's figures, or (peer absent) serve_bench's client's, plus preemptions and both
    servers' CPU seconds."""
    n, c, seed = run
    p0, cpu0 = preemptions(side.url), side.cpu()
    idle0 = other.cpu() if other else None
    if a.peer_ok:
        out = work / f"{side.name}-{shape.name}-c{c}-s{seed}.json"
        args = client_args(shape, n)
        got = bench_serve(
            a.peer_python, a.peer_script, side.url, side.served, a.model, args, c, seed, out
        )
    else:
        got = fallback_run(a, side, shape, n, c, seed)
    p1 = preemptions(side.url)
    got["preemptions"] = p1 - p0 if p0 is not None and p1 is not None else None
    got["server_cpu_s"] = round(side.cpu() - cpu0, 2)
    if other is not None and idle0 is not None:
        # The other server is idle during this run; its CPU says whether it really is.
        got["idle_server_cpu_s"] = round(other.cpu() - idle0, 2)
    got["load_avg_1m"] = round(os.getloadavg()[0], 2)
    return got


def fallback_run(
    a: argparse.Namespace, side: Side, shape: Shape, n: int, c: int, seed: int
) -> dict[str, Any]:
    """Without the peer venv there is no `bench serve`: serve_bench's client sends the
    same shapes as token ids, and its figures are put under bench serve's names."""
    prompts = token_prompts(shape, n, seed, a.model)
    ns = argparse.Namespace(
        max_tokens=shape.output,
        client="raw",
        request_rate=None,
        request_timeout=a.request_timeout,
        seed=seed,
    )
    r, _ = server_run(side.url, side.served, Workload(shape.name, prompts), ns, c)
    if not r["finished"]:
        raise RuntimeError(f"no request completed: {r['errors']}")
    got: dict[str, Any] = {
        "output_tok_s": r["output_tok_s"],
        "request_s": r["request_s"],
        "duration_s": r["seconds"],
        "completed": r["finished"],
        "failed": r["requests"] - r["finished"],
        "input_tokens": sum(len(p) for p in prompts),
        "output_tokens": r["output_tokens"],
    }
    for ours, theirs in (("ttft", "ttft_ms"), ("tpot", "tpot_ms"), ("itl", "itl_ms")):
        got[f"{ours}_p50_ms"] = r[theirs]["p50"]
        got[f"{ours}_p99_ms"] = r[theirs]["p99"]
    got["e2el_p50_ms"], got["e2el_p99_ms"] = r["e2e_ms"]["p50"], r["e2e_ms"]["p99"]
    return got


def run_pairs(
    a: argparse.Namespace, sides: list[Side], work: Path, runs: list[dict[str, Any]]
) -> None:
    """Every cell on every server, --pairs times; who goes first alternates per pair."""
    cells = [(a.shapes[w], c) for w in a.workloads for c in a.concurrency]
    for pair in range(a.pairs):
        order = sides if pair % 2 == 0 else sides[::-1]
        for k, (shape, c) in enumerate(cells):
            seed = a.seed + 1000 * pair + k
            row: dict[str, Any] = {
                "workload": shape.name,
                "concurrency": c,
                "pair": pair,
                "seed": seed,
                "order": [s.name for s in order],
            }
            n = a.num_prompts if c >= LOW_CONCURRENCY else a.low_concurrency_prompts
            for side in order:
                others = [s for s in sides if s is not side]
                try:
                    with paused(others if a.pause_idle else []):
                        got = run_once(
                            a, side, others[0] if others else None, shape, (n, c, seed), work
                        )
                    row[side.name] = got
                except RuntimeError as e:
                    row[side.name] = {"error": str(e)[-2000:]}
                    log(f"{side.name} {shape.name} c={c} pair {pair} failed: {str(e)[-800:]}")
                    continue
                r = row[side.name]
                log(
                    f"pair {pair} {shape.name} c={c} {side.name}: {r['output_tok_s']} tok/s, "
                    f"TTFT p50/p99 {r['ttft_p50_ms']}/{r['ttft_p99_ms']} ms, ITL p99 "
                    f"{r['itl_p99_ms']} ms, preemptions {r['preemptions']}, "
                    f"done {r['completed']}/{r['completed'] + r['failed']}"
                )
            runs.append(row)


def warm_up(a: argparse.Namespace, sides: list[Side], work: Path) -> None:
    """A first run pays for lazy start-up work (allocators, our CPU worker's choice of
    thread count in a large batch's first steps): one short run per server, unreported."""
    if a.warmup_prompts <= 0:
        return
    shape = a.shapes[a.workloads[0]]
    c = max(a.concurrency)
    for side in sides:
        log(f"warm-up: {side.name}, {a.warmup_prompts} prompts of {shape.name} at c={c}")
        run_once(a, side, None, shape, (a.warmup_prompts, c, a.seed - 1), work)


def parse_shape(text: str) -> tuple[str, Shape]:
    name, _, sizes = text.partition("=")
    try:
        p, i, o = (int(x) for x in sizes.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"--shape wants NAME=PREFIX,INPUT,OUTPUT, got {text!r}"
        ) from None
    if name not in SHAPES or p < 0 or i < 1 or o < 1:
        raise argparse.ArgumentTypeError(
            f"--shape {text!r}: NAME one of {sorted(SHAPES)}, PREFIX >= 0, INPUT and OUTPUT >= 1"
        )
    return name, Shape(name, p, i, o)


def _csv_ints(text: str) -> list[int]:
    try:
        vals = [int(x) for x in text.split(",") if x]
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"expected comma-separated integers, got {text!r}"
        ) from None
    if not vals or min(vals) < 1:
        raise argparse.ArgumentTypeError(f"expected integers >= 1, got {text!r}")
    return vals


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", type=Path, help="checkpoint directory (default: the real model)")
    p.add_argument("--workloads", default="random,chat,long-output")
    p.add_argument("--concurrency", type=_csv_ints, default=[1, 4, 16, 64])
    p.add_argument("--pairs", type=int, default=3, help="runs of every cell on each server")
    p.add_argument("--num-prompts", type=int, default=64, help="requests per run")
    p.add_argument(
        "--low-concurrency-prompts",
        type=int,
        default=16,
        help=f"requests per run below {LOW_CONCURRENCY} streams (default 16: one stream "
        "runs them one by one)",
    )
    p.add_argument("--shape", type=parse_shape, action="append", default=[])
    p.add_argument("--peer-kv-gib", type=int, default=1, help="vLLM's CPU KV space, whole GiB")
    p.add_argument("--dtype", default="float32", help="both servers' --dtype")
    p.add_argument("--ours-flags", default="", help="more `pagedserve serve` flags")
    p.add_argument("--peer-flags", default="", help="more `vllm serve` flags")
    p.add_argument(
        "--variant",
        action="append",
        default=[],
        metavar="NAME=FLAGS",
        help="one more `pagedserve serve` beside ours, with these flags added (repeatable): "
        "run in every pair like the others and reported under NAME, with its ratios to vLLM",
    )
    p.add_argument("--warmup-prompts", type=int, default=16)
    p.add_argument("--seed", type=int, default=20261203)
    p.add_argument("--peer-python", type=Path, default=PEER_PYTHON)
    p.add_argument("--peer-script", type=Path, default=PEER_SCRIPT)
    p.add_argument("--startup-timeout", type=float, default=600)
    p.add_argument("--request-timeout", type=float, default=600)
    p.add_argument("--table", type=Path, help="also write the markdown table here")
    p.add_argument("--keep", type=Path, help="keep bench serve's result files here")
    p.add_argument("--quick", action="store_true", help="a small run of the harness")
    p.add_argument(
        "--co-resident",
        dest="pause_idle",
        action="store_false",
        help="leave the idle servers running during a run (default: stopped, SIGSTOP)",
    )
    a = p.parse_args(argv)
    a.workloads = [w for w in a.workloads.split(",") if w]
    unknown = set(a.workloads) - set(SHAPES)
    if unknown:
        p.error(f"unknown workloads {sorted(unknown)}; known: {sorted(SHAPES)}")
    counts = (
        ("--pairs", a.pairs),
        ("--num-prompts", a.num_prompts),
        ("--low-concurrency-prompts", a.low_concurrency_prompts),
    )
    for name, value in counts:
        if value < 1:
            p.error(f"{name} must be >= 1")
    if a.peer_kv_gib < 1:
        p.error("--peer-kv-gib must be >= 1 (vLLM reads a whole number of GiB)")
    a.shapes = dict(SHAPES)
    if a.quick:
        a.concurrency, a.pairs, a.num_prompts, a.warmup_prompts = [4], 1, 8, 4
        a.shapes = {
            n: Shape(n, s.prefix // 8, max(8, s.input // 8), max(8, s.output // 32))
            for n, s in SHAPES.items()
        }
    a.shapes.update(dict(a.shape))
    a.variants = [v.partition("=")[::2] for v in a.variant]
    if any(not n or n in ("ours", "peer") for n, _ in a.variants):
        p.error("--variant wants NAME=FLAGS, with a NAME other than ours and peer")
    return a


def check_peer(a: argparse.Namespace) -> str:
    """Whether `vllm serve` and `bench serve` can run; a.peer_ok says it."""
    a.peer_ok = a.peer_python.exists() and a.peer_script.exists()
    if not a.peer_ok:
        return (
            f"absent: {a.peer_python} or {a.peer_script} missing (make it with bash "
            f"{PEER_SCRIPTS}/setup-serve.sh); our server alone, driven by serve_bench's client"
        )
    return f"vllm serve and bench serve from {a.peer_python} ({a.peer_script})"


def start(a: argparse.Namespace, stack: contextlib.ExitStack) -> list[Side]:
    """Both servers started at once (the peer's start-up is the long one), then waited on."""
    ns = argparse.Namespace(
        profile_server=None, device=None, dtype=a.dtype, stream_interval=1, model=str(a.model)
    )
    log("starting pagedserve serve" + (" and vllm serve" if a.peer_ok else ""))
    ours = ServerProcess(ns, True, tuple(shlex.split(a.ours_flags)))
    stack.callback(ours.stop)
    peer = None
    if a.peer_ok:
        extra = ["--dtype", a.dtype, *shlex.split(a.peer_flags)]
        peer = PeerServer(a.peer_python, a.peer_script, a.model, a.peer_kv_gib, extra)
        stack.callback(peer.stop)
    variants = []
    for name, flags in a.variants:
        server = ServerProcess(ns, True, tuple(shlex.split(f"{a.ours_flags} {flags}")))
        stack.callback(server.stop)
        variants.append((name, server))
    sides = [Side("ours", ours.wait_ready(a.startup_timeout), ours.proc.pid)]
    sides += [Side(n, v.wait_ready(a.startup_timeout), v.proc.pid) for n, v in variants]
    a.ours_log = ours.lines
    if peer is not None:
        started = time.perf_counter()
        a.peer_log = peer.lines
        try:
            sides.append(Side("peer", peer.wait_ready(a.startup_timeout), peer.proc.pid))
        except (RuntimeError, OSError) as e:
            # Ours is still measured, under the same client; the report says why alone.
            a.peer_failure = f"vllm serve failed to start: {str(e)[-1500:]}"
            log(a.peer_failure)
            peer.stop()
            return sides
        log(f"vllm serve ready ({time.perf_counter() - started:.0f} s after ours)")
    return sides


def _interrupt(_sig: int, _frame: object) -> None:
    raise KeyboardInterrupt


def main(argv: list[str] | None = None) -> int:
    a = parse_args(argv)
    a.model = a.model or fetch_real_model()
    started = time.perf_counter()
    result: dict[str, Any] = {
        "benchmark": "serve_vs_vllm",
        "model": str(a.model),
        "cpus": len(os.sched_getaffinity(0)),
        "peer_status": check_peer(a),
        "client": "vllm bench serve" if a.peer_ok else "serve_bench's openai client",
        "settings": {
            "dtype": a.dtype,
            "peer_kv_gib": a.peer_kv_gib,
            "ours_flags": a.ours_flags,
            "peer_flags": a.peer_flags,
            "variants": dict(a.variants),
            "pairs": a.pairs,
            "num_prompts": a.num_prompts,
            "low_concurrency_prompts": a.low_concurrency_prompts,
            "shapes": {w: vars(a.shapes[w]) for w in a.workloads},
            "concurrency": a.concurrency,
            "idle_servers": "stopped" if a.pause_idle else "running",
        },
    }
    log(result["peer_status"])
    work = a.keep or Path(tempfile.mkdtemp(prefix="pagedserve-svv-"))
    work.mkdir(parents=True, exist_ok=True)
    runs: list[dict[str, Any]] = []
    # SIGTERM ends us as Ctrl-C does, so the ExitStack stops both servers' process groups.
    signal.signal(signal.SIGTERM, _interrupt)
    try:
        with contextlib.ExitStack() as stack:
            sides = start(a, stack)
            warm_up(a, sides, work)
            result["placement"] = {s.name: placement(s.pid) for s in sides}
            result["placement_log"] = placement_log(a)
            run_pairs(a, sides, work, runs)
    except KeyboardInterrupt:
        log("interrupted: both servers are stopped")
        return 130
    names = [s.name for s in sides]
    if getattr(a, "peer_failure", None):
        result["peer_status"] = a.peer_failure
    summary = summarize(runs, names)
    result["summary"] = summary
    result["targets"] = targets(summary) if "peer" in names else None
    result["table_md"] = table(summary, "peer" in names)
    if a.table:
        a.table.write_text(result["table_md"])
    result["all_completed"] = all(
        r.get(s, {}).get("failed") == 0 for r in runs for s in ("ours", "peer") if s in r
    )
    result["runs"] = runs
    result["seconds"] = round(time.perf_counter() - started, 1)
    result["files"] = str(work) if a.keep else None
    print(json.dumps(result))
    return 0 if result["all_completed"] else 1


def placement_log(a: argparse.Namespace) -> dict[str, list[str]]:
    """What each server logged about its threads: our CPU worker's thread choice, vLLM's
    OpenMP binding and reserved CPUs."""
    keys = {
        "ours": ("CPU threads", "CPU placement"),
        "peer": ("OMP", "bind", "reserved", "core ids"),
    }
    logs = {"ours": getattr(a, "ours_log", []), "peer": getattr(a, "peer_log", [])}
    return {
        side: [line.strip()[-300:] for line in lines if any(k in line for k in keys[side])][:12]
        for side, lines in logs.items()
    }


if __name__ == "__main__":
    sys.exit(main())
