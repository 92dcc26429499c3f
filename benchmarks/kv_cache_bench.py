#!/usr/bin/env python3
"""Replay a KV-cache trace through enginecore's KVCacheManager and print JSON.

    python benchmarks/kv_cache_bench.py --synthetic [--hash sha256] [--write-trace FILE]
    python benchmarks/kv_cache_bench.py --trace FILE [--hash sha256]

Trace (JSON lines, execution order): {"op":"meta","block_size":B,"num_gpu_blocks":N,...}
(N counts the null block), then {"op":"arrive","req":I,"prompt":[ids]} (prefix lookup,
then allocate the whole prompt), {"op":"decode","req":I,"tok":T} (append T, allocate one
slot), {"op":"finish","req":I} (free). A request whose allocation fails is dropped and
counted; its later ops are skipped.

When vLLM's peer venv is present (peer.py: made by the peer's setup.sh) the same
trace is replayed there too, in the same run, and the ratio is reported. The last line
of output is one JSON object.
"""

from __future__ import annotations

import argparse
import gc
import json
import random
import sys
import tempfile
import time
import tracemalloc
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import zmq  # noqa: E402
from peer import PEER_PYTHON, PEER_SCRIPTS, run_peer_script  # noqa: E402

from enginecore import KVCacheManager, Request  # noqa: E402
from enginecore.kv_event_publisher import KVEventPublisher  # noqa: E402
from protocol.kv_cache import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec  # noqa: E402

PEER_SCRIPT = PEER_SCRIPTS / "bench_kv.py"
PEER_EVENTS_SCRIPT = Path(__file__).resolve().parent / "peer_kv_events.py"  # peer's Python
OP_KINDS = ("get_computed_blocks", "allocate_slots_prompt", "allocate_slots_decode", "free")


def log(msg: str) -> None:
    print(f"[kv_cache_bench] {msg}", file=sys.stderr, flush=True)


# -- synthetic traces ---------------------------------------------------------------
def synthetic_trace(a: argparse.Namespace) -> list[dict[str, Any]]:
    """Shared system prompts + unique suffixes + decode, stepped like a server.

    Each step: one decode per running request, then finishes, then arrivals. Admission
    reserves every request's whole lifetime of blocks, counting each shared prefix block
    once while any holder lives, so a correct prefix cache never fails an allocation.
    """
    rng = random.Random(a.seed)
    bs = a.block_size
    vocab = a.vocab

    def draw(n: int) -> list[int]:
        return [int(vocab * rng.random()) for _ in range(n)]

    systems = [draw(rng.randint(a.prefix_min, a.prefix_max)) for _ in range(a.num_prefixes)]
    usable = a.num_gpu_blocks - 1
    meta = {
        "op": "meta",
        "generator": "pagedserve kv_cache_bench",
        "seed": a.seed,
        "block_size": bs,
        "num_gpu_blocks": a.num_gpu_blocks,
        "max_running": a.max_running,
        "num_requests": a.num_requests,
        # The peer's replay sizes its max_model_len from these ranges.
        "prefix_len": [a.prefix_min, a.prefix_max],
        "suffix_len": [a.suffix_min, a.suffix_max],
        "decode_len": [a.decode_min, a.decode_max],
    }
    ops: list[dict[str, Any]] = [meta]
    holders: Counter[int] = Counter()  # system prompt -> live requests sharing it
    private = 0
    running: list[list[int]] = []  # [req, system, decodes left, private blocks]
    next_req = 0
    while next_req < a.num_requests or running:
        still = []
        for entry in running:
            ops.append({"op": "decode", "req": entry[0], "tok": int(vocab * rng.random())})
            entry[2] -= 1
        for entry in running:
            if entry[2] == 0:
                ops.append({"op": "finish", "req": entry[0]})
                holders[entry[1]] -= 1
                private -= entry[3]
            else:
                still.append(entry)
        running = still
        while next_req < a.num_requests and len(running) < a.max_running:
            system = rng.randrange(a.num_prefixes)
            prompt = systems[system] + draw(rng.randint(a.suffix_min, a.suffix_max))
            decodes = rng.randint(a.decode_min, a.decode_max)
            shared = len(systems[system]) // bs
            own = -(-(len(prompt) + decodes) // bs) - shared
            live_shared = sum(len(systems[s]) // bs for s, n in holders.items() if n > 0)
            extra_shared = 0 if holders[system] > 0 else shared
            if live_shared + extra_shared + private + own > usable:
                if not running:
                    raise SystemExit(f"request {next_req} alone needs more than {usable} blocks")
                rng.seed(rng.random())  # keep the stream moving; retry next step
                break
            holders[system] += 1
            private += own
            ops.append({"op": "arrive", "req": next_req, "prompt": prompt})
            running.append([next_req, system, decodes, own])
            next_req += 1
    return ops


def read_trace(path: Path) -> list[dict[str, Any]]:
    with open(path) as f:
        ops = [json.loads(line) for line in f if line.strip()]
    if not ops or ops[0].get("op") != "meta":
        raise SystemExit(f"{path}: the first line must be the meta op")
    for key in ("block_size", "num_gpu_blocks"):
        if not isinstance(ops[0].get(key), int) or ops[0][key] < 1:
            raise SystemExit(f"{path}: meta needs a positive integer {key!r}")
    return ops


def write_trace(ops: list[dict[str, Any]], path: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w") as f:
        for op in ops:
            f.write(json.dumps(op, separators=(",", ":")) + "\n")


# -- replay -------------------------------------------------------------------------
def make_manager(meta: dict[str, Any], hash_algo: str, kv_events: bool = False) -> KVCacheManager:
    spec = FullAttentionSpec(
        block_size=meta["block_size"], num_kv_heads=1, head_size=1, dtype="float32"
    )
    config = KVCacheConfig(
        num_blocks=meta["num_gpu_blocks"], kv_cache_groups=[KVCacheGroupSpec(["layer"], spec)]
    )
    return KVCacheManager(
        config,
        max_model_len=1 << 30,
        hash_algo=hash_algo,  # type: ignore[arg-type]
        enable_kv_events=kv_events,
    )


class Replayer:
    """One replay of a trace, op by op, each op timing its own manager calls; with a
    publisher, KV events are on and published once per step, as the core does."""

    def __init__(
        self, meta: dict[str, Any], hash_algo: str, publisher: KVEventPublisher | None = None
    ) -> None:
        self.mgr = mgr = make_manager(meta, hash_algo, kv_events=publisher is not None)
        self.publisher = publisher
        self.pool = mgr.block_pool
        self.usable = self.pool.num_usable_blocks
        self.reqs: dict[int, Request] = {}
        self.dropped_ids: set[int] = set()
        self.step_reqs: set[int] = set()
        self.calls: Counter[str] = Counter()
        self.ns: Counter[str] = Counter()
        self.hash_ns = 0
        self.prompt_tokens = self.hit_tokens = self.peak_used = 0

    def run(self, op: dict[str, Any], clock: Callable[[], int] = time.perf_counter_ns) -> None:
        mgr, ns, calls, reqs = self.mgr, self.ns, self.calls, self.reqs
        kind = op["op"]
        if kind == "decode":
            rid = op["req"]
            r = reqs.get(rid)
            if r is None:
                return
            t0 = clock()
            r.append_output_token_ids(op["tok"])
            t1 = clock()
            out = mgr.allocate_slots(r, 1)
            t2 = clock()
            self.hash_ns += t1 - t0
            ns["allocate_slots_decode"] += t2 - t1
            calls["allocate_slots_decode"] += 1
            if out is None:
                mgr.free(r)
                del reqs[rid]
                self.dropped_ids.add(rid)
                return
            r.num_computed_tokens += 1
            if out[0]:
                self.peak_used = max(self.peak_used, self.usable - self.pool.get_num_free_blocks())
        elif kind == "arrive":
            rid = op["req"]
            t0 = clock()
            r = Request(str(rid), op["prompt"], mgr.block_hasher)
            t1 = clock()
            hits, num_hit = mgr.get_computed_blocks(r)
            t2 = clock()
            out = mgr.allocate_slots(r, r.num_tokens - num_hit, num_hit, hits if num_hit else None)
            t3 = clock()
            self.hash_ns += t1 - t0
            ns["get_computed_blocks"] += t2 - t1
            ns["allocate_slots_prompt"] += t3 - t2
            calls["get_computed_blocks"] += 1
            calls["allocate_slots_prompt"] += 1
            self.prompt_tokens += r.num_tokens
            if out is None:
                self.dropped_ids.add(rid)
                return
            self.hit_tokens += num_hit
            r.num_computed_tokens = r.num_tokens
            reqs[rid] = r
            self.peak_used = max(self.peak_used, self.usable - self.pool.get_num_free_blocks())
        elif kind == "finish":
            r = reqs.pop(op["req"], None)
            if r is None:
                return
            t0 = clock()
            mgr.free(r)
            ns["free"] += clock() - t0
            calls["free"] += 1
            return
        else:
            raise SystemExit(f"unknown trace op {kind!r}")
        if self.publisher is not None:
            # The trace was made in scheduler steps, a request at most once per step: an
            # op for a request already seen opens the next step, and the core publishes
            # once per step. (The bookkeeping is the benchmark's; only publishing is
            # timed.)
            rid = op["req"]
            if rid in self.step_reqs:
                self.publish(clock)
                self.step_reqs.clear()
            self.step_reqs.add(rid)

    def publish(self, clock: Callable[[], int] = time.perf_counter_ns) -> None:
        assert self.publisher is not None
        t0 = clock()
        self.publisher.publish(self.mgr.take_events())
        self.ns["kv_events"] += clock() - t0

    def result(self, wall_s: float) -> dict[str, Any]:
        """The replay's numbers, after checking it left the pool whole."""
        if self.publisher is not None:
            self.publish()
        mgr, pool, ns, calls = self.mgr, self.pool, self.ns, self.calls
        mgr.check_invariants({r.request_id: r for r in self.reqs.values()})
        if pool.get_num_free_blocks() != pool.num_usable_blocks:
            raise SystemExit("blocks leaked: not every block is free after the trace")
        manager_ns = sum(ns.values())
        hash_ns = self.hash_ns
        return {
            "seconds": round((manager_ns + hash_ns) / 1e9, 6),
            "seconds_manager": round(manager_ns / 1e9, 6),
            "seconds_hashing": round(hash_ns / 1e9, 6),
            "replay_wall_seconds": round(wall_s, 6),
            "per_op": {
                k: {
                    "calls": calls[k],
                    "seconds": round(ns[k] / 1e9, 6),
                    "ops_per_s": round(calls[k] / (ns[k] / 1e9), 1) if ns[k] else None,
                    "mean_us": round(ns[k] / calls[k] / 1e3, 3) if calls[k] else None,
                }
                for k in OP_KINDS
            },
            "ops_per_s": round(sum(calls.values()) / ((manager_ns + hash_ns) / 1e9), 1),
            "prompt_tokens": self.prompt_tokens,
            "hit_tokens": self.hit_tokens,
            "hit_rate": round(self.hit_tokens / self.prompt_tokens, 6)
            if self.prompt_tokens
            else 0.0,
            "hash_ns_per_prompt_token": None,
            "evictions": pool.num_evictions,
            "dropped": len(self.dropped_ids),
            "peak_used_blocks": self.peak_used,
        }


def replay(
    ops: list[dict[str, Any]], hash_algo: str, publisher: KVEventPublisher | None = None
) -> dict[str, Any]:
    """Replay the trace once (with a publisher: KV events on)."""
    replayer = Replayer(ops[0], hash_algo, publisher)
    run = replayer.run
    gc.collect()
    gc.freeze()
    wall0 = time.perf_counter()
    for op in ops[1:]:
        run(op)
    wall = time.perf_counter() - wall0
    gc.unfreeze()
    return replayer.result(wall)


def replay_lockstep(
    ops: list[dict[str, Any]], hash_algo: str, publisher: KVEventPublisher
) -> tuple[dict[str, Any], dict[str, Any]]:
    """The trace replayed twice at once, KV events off and on, op by op (taking turns at
    going first): a slow spell of a shared machine lands on both replays alike, so their
    difference is what events cost, not what the machine did meanwhile."""
    off = Replayer(ops[0], hash_algo)
    on = Replayer(ops[0], hash_algo, publisher)
    gc.collect()
    gc.freeze()
    wall0 = time.perf_counter()
    first, second = off.run, on.run
    for op in ops[1:]:
        first(op)
        second(op)
        first, second = second, first
    wall = time.perf_counter() - wall0
    gc.unfreeze()
    return off.result(wall), on.result(wall)


def hashing_ns_per_token(ops: list[dict[str, Any]], hash_algo: str) -> float:
    """Prompt hashing alone (packing included), over every prompt of the trace."""
    hasher = make_manager(ops[0], hash_algo).block_hasher
    prompts = [op["prompt"] for op in ops if op["op"] == "arrive"]
    n = sum(len(p) for p in prompts)
    t0 = time.perf_counter_ns()
    for i, p in enumerate(prompts):
        Request(str(i), p, hasher)
    return (time.perf_counter_ns() - t0) / n


def steady_decode_allocations(block_size: int, hash_algo: str, running: int = 256) -> dict:
    """Python allocations of allocate_slots in steady decode (no block boundary crossed),
    measured with tracemalloc: memory blocks still held afterwards, and the peak of
    transient bytes during one step of `running` calls."""
    meta = {"block_size": block_size, "num_gpu_blocks": running * 8 + 1}
    mgr = make_manager(meta, hash_algo)
    reqs = []
    for i in range(running):
        r = Request(str(i), [i % 97 + 1] * (block_size * 3 + 1), mgr.block_hasher)
        mgr.allocate_slots(r, r.num_tokens)
        r.num_computed_tokens = r.num_tokens
        reqs.append(r)
    steps = block_size - 2
    for r in reqs:  # the tokens exist already; only the manager call is measured
        for t in range(steps):
            r.all_token_ids.append(t)
    allocate_slots = mgr.allocate_slots
    gc.collect()
    tracemalloc.start()
    snap0 = tracemalloc.take_snapshot()
    tracemalloc.reset_peak()
    base = tracemalloc.get_traced_memory()[0]
    for _ in range(steps):
        for r in reqs:
            allocate_slots(r, 1)
            r.num_computed_tokens += 1
    peak = tracemalloc.get_traced_memory()[1] - base
    snap1 = tracemalloc.take_snapshot()
    tracemalloc.stop()
    held = sum(
        s.count_diff
        for s in snap1.compare_to(snap0, "filename")
        if "enginecore" in s.traceback[0].filename
    )
    return {
        "running_requests": running,
        "steps": steps,
        "held_blocks_per_step": held / steps,
        "transient_peak_bytes_per_step": peak,
    }


# -- the peer -----------------------------------------------------------------------
def run_peer(trace: Path, python: Path, script: Path, repeat: int) -> dict[str, Any] | None:
    args = ["--trace", str(trace), "--repeat", str(repeat)]
    return run_peer_script(python, script, args, "KVCacheManager")


# -- main ---------------------------------------------------------------------------
def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--trace", type=Path, help="replay this JSON-lines trace")
    src.add_argument("--synthetic", action="store_true", help="generate a trace first")
    p.add_argument("--hash", choices=("xxh3_128", "sha256"), default="xxh3_128")
    p.add_argument("--write-trace", type=Path, help="with --synthetic: keep the trace here")
    p.add_argument("--repeat", type=int, default=3, help="timed replays; the median is reported")
    p.add_argument(
        "--peer",
        choices=("auto", "off"),
        default="auto",
        help="also replay through vLLM's peer venv when present (default auto)",
    )
    p.add_argument("--peer-python", type=Path, default=PEER_PYTHON)
    p.add_argument("--peer-script", type=Path, default=PEER_SCRIPT)
    g = p.add_argument_group("synthetic trace")
    g.add_argument("--seed", type=int, default=1)
    g.add_argument("--num-requests", type=int, default=2000)
    g.add_argument("--num-prefixes", type=int, default=8)
    g.add_argument("--prefix-min", type=int, default=512)
    g.add_argument("--prefix-max", type=int, default=1024)
    g.add_argument("--suffix-min", type=int, default=64)
    g.add_argument("--suffix-max", type=int, default=512)
    g.add_argument("--decode-min", type=int, default=32)
    g.add_argument("--decode-max", type=int, default=128)
    g.add_argument("--max-running", type=int, default=256)
    g.add_argument("--block-size", type=int, default=16)
    g.add_argument("--num-gpu-blocks", type=int, default=4096)
    g.add_argument("--vocab", type=int, default=32000)
    return p


def kv_events_overhead(ops: list[dict[str, Any]], hash_algo: str, repeat: int) -> dict:
    """KV events off and on, replayed in lockstep (see replay_lockstep), `repeat` times;
    the events are published on a real PUB socket that nobody reads, with a replay
    socket, so every batch is also kept for replays (the worst case for memory: nothing
    may grow without bound). The overhead is the median of the runs' on/off ratios."""
    ctx = zmq.Context()
    try:
        pairs = []
        for _ in range(repeat):
            publisher = KVEventPublisher(
                ctx, "tcp://127.0.0.1:0", "tcp://127.0.0.1:0", buffer_steps=1000
            )
            off, on = replay_lockstep(ops, hash_algo, publisher)
            on["batches"] = publisher.next_seq
            publisher.close()
            pairs.append((off, on))
    finally:
        ctx.destroy(linger=0)
    ratios = sorted(on["seconds"] / off["seconds"] for off, on in pairs)
    ons = sorted((on for _, on in pairs), key=lambda r: r["seconds"])
    result = dict(ons[len(ons) // 2])
    result["overhead"] = round(ratios[len(ratios) // 2] - 1, 4)
    result["overhead_per_pair"] = [round(r - 1, 4) for r in ratios]
    added = sorted(on["seconds"] - off["seconds"] for off, on in pairs)
    result["seconds_added"] = round(added[len(added) // 2], 6)
    result["seconds_off_lockstep"] = sorted(off["seconds"] for off, _ in pairs)[len(pairs) // 2]
    return result


def main(argv: list[str] | None = None) -> int:
    a = build_parser().parse_args(argv)
    if a.repeat < 1:
        raise SystemExit("--repeat must be >= 1")
    tmp_dir = None
    if a.synthetic:
        log(f"generating a synthetic trace ({a.num_requests} requests, seed {a.seed})")
        ops = synthetic_trace(a)
        if a.write_trace is None:
            tmp_dir = tempfile.TemporaryDirectory()
            trace_path = Path(tmp_dir.name) / "kv_trace.jsonl"
        else:
            trace_path = a.write_trace
        write_trace(ops, trace_path)
    else:
        trace_path = a.trace
        if not trace_path.exists():
            raise SystemExit(f"trace not found: {trace_path}")
        ops = read_trace(trace_path)
    kinds = Counter(op["op"] for op in ops[1:])
    log(f"{len(ops) - 1} ops: {dict(kinds)}; replaying {a.repeat}x with {a.hash}")
    runs = [replay(ops, a.hash) for _ in range(a.repeat)]
    runs.sort(key=lambda r: r["seconds"])
    events_on = kv_events_overhead(ops, a.hash, a.repeat)
    result: dict[str, Any] = {"benchmark": "kv_cache", "trace": str(trace_path), "hash": a.hash}
    result["ops"] = dict(kinds)
    result.update(runs[len(runs) // 2])
    result["seconds_all_runs"] = [r["seconds"] for r in runs]
    result["hash_ns_per_prompt_token"] = round(hashing_ns_per_token(ops, a.hash), 2)
    result["steady_decode_allocations"] = steady_decode_allocations(ops[0]["block_size"], a.hash)
    result["kv_events"] = {
        # Both from the lockstep replays: off and on side by side, op by op.
        "seconds_off": events_on["seconds_off_lockstep"],
        "seconds_on": events_on["seconds"],
        "overhead": events_on["overhead"],  # median of the lockstep runs' on/off - 1
        "overhead_per_pair": events_on["overhead_per_pair"],
        "seconds_added": events_on["seconds_added"],  # median of the pairs' on - off
        "batches_published": events_on["batches"],
        "same_hit_tokens": events_on["hit_tokens"] == result["hit_tokens"],
    }
    peer = None if a.peer == "off" else run_peer(trace_path, a.peer_python, a.peer_script, a.repeat)
    if peer is not None:
        peer_seconds = peer["kv_manager_seconds"] + peer["request_hashing_seconds"]
        result["peer"] = {
            "impl": peer.get("impl"),
            "seconds": round(peer_seconds, 6),
            "seconds_manager": peer["kv_manager_seconds"],
            "seconds_hashing": peer["request_hashing_seconds"],
            "hit_tokens": peer["prefix_hit_tokens"],
            "per_op_mean_us": {k: v["mean_us"] for k, v in peer["per_op"].items()},
        }
        result["speedup_vs_peer"] = round(peer_seconds / result["seconds"], 2)
        result["same_hit_tokens_as_peer"] = peer["prefix_hit_tokens"] == result["hit_tokens"]
        # The peer's KV events on the same trace: what publishing costs it, relatively and
        # in seconds added, next to ours.
        peer_events = run_peer_script(
            a.peer_python,
            PEER_EVENTS_SCRIPT,
            [
                *("--trace", str(trace_path), "--peer-scripts", str(a.peer_script.parent)),
                *("--repeat", str(a.repeat)),
            ],
            "KVCacheManager with KV events",
        )
        if peer_events is not None:
            result["kv_events"]["peer"] = peer_events
            result["kv_events"]["seconds_added_vs_peer"] = round(
                result["kv_events"]["seconds_added"] / peer_events["seconds_added"], 4
            )
    if tmp_dir is not None:
        tmp_dir.cleanup()
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
