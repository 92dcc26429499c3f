#!/usr/bin/env python3
"""A KV-aware router over two pagedserve engines, the way a cluster embeds them.

    python examples/router.py [--model DIR|ORG/NAME] [--requests 48] [--prefixes 6]

Two engines (each an EngineCore plus its worker) start with KV-cache events on and the
same prefix-cache hash seed, as replicas behind one router must. The router subscribes to
both event streams and keeps, per engine, the set of block hashes it holds. For each
request it computes the prompt's block hashes exactly as the engines do (the deployment's
seed, the same block size and hash) and sends the request to the engine holding the
longest cached prefix; ties go round-robin. The same workload, many requests over a few
long shared prefixes in a cache that holds about half of them per engine, then runs with
plain round-robin on emptied caches. It prints both prefix-cache hit rates (cached prompt
tokens / prompt tokens, as the engines report them) and, last on stdout, one JSON object.

The router reads events without trusting timing: it drains its SUB sockets, and asks each
engine's replay socket for anything after the last sequence number it applied (a gap, or
the tail of a step that just ended), before every decision. See docs/protocol.md.
"""

from __future__ import annotations

import argparse
import json
import random
import sys
from pathlib import Path

import msgspec
import zmq

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from launch import LLM, SamplingParams
from protocol.block_hash import BlockHasher
from protocol.kv_events import END_OF_REPLAY, CachedPrefixView, KVEventBatch
from protocol.zmq_security import ClientKeys, load_client_keys, secure_client

SEED = "router-demo-secret"  # every replica behind one router: the same private seed


def log(msg: str) -> None:
    print(f"[router] {msg}", file=sys.stderr, flush=True)


class EngineView:
    """What the router knows of one engine: its event streams and, from them, the block
    hashes each KV group holds (protocol.kv_events.CachedPrefixView)."""

    def __init__(self, ctx: zmq.Context, llm: LLM, keys: ClientKeys | None) -> None:
        ready = llm.engine.ready
        if ready.kv_events_endpoint is None or ready.kv_events_replay_endpoint is None:
            raise SystemExit("the engine was started without KV events")
        self.llm = llm
        self.sub = ctx.socket(zmq.SUB)
        self.sub.setsockopt(zmq.SUBSCRIBE, b"")
        # With keys the engines admit only key holders to their events (CURVE).
        secure_client(self.sub, keys, ready.kv_events_endpoint)
        self.sub.connect(ready.kv_events_endpoint)
        self.replay = ctx.socket(zmq.DEALER)
        secure_client(self.replay, keys, ready.kv_events_replay_endpoint)
        self.replay.connect(ready.kv_events_replay_endpoint)
        self.decoder = msgspec.msgpack.Decoder(KVEventBatch)
        self.next_seq = 0
        self.cache = CachedPrefixView()

    def _apply(self, seq: int, payload: bytes) -> None:
        if seq != self.next_seq:
            return  # a duplicate (SUB and replay both delivered it) or out of order
        self.next_seq += 1
        self.cache.apply(self.decoder.decode(payload))

    def sync(self) -> None:
        """Apply everything published so far, in sequence order."""
        while self.sub.poll(0):
            _topic, seq, payload = self.sub.recv_multipart()
            if int.from_bytes(seq, "big") > self.next_seq:
                break  # a gap: the replay below fills it, in order
            self._apply(int.from_bytes(seq, "big"), payload)
        self.replay.send_multipart((b"", self.next_seq.to_bytes(8, "big")))
        while True:
            if not self.replay.poll(60_000):
                raise SystemExit("an engine's replay socket did not answer")
            _empty, _topic, seq, payload = self.replay.recv_multipart()
            if seq == END_OF_REPLAY:
                return
            self._apply(int.from_bytes(seq, "big"), payload)


def make_workload(a: argparse.Namespace, vocab: int) -> list[list[int]]:
    rng = random.Random(a.seed)
    prefixes = [[rng.randrange(vocab) for _ in range(a.prefix_len)] for _ in range(a.prefixes)]
    return [
        rng.choice(prefixes) + [rng.randrange(vocab) for _ in range(rng.randint(4, a.suffix_max))]
        for _ in range(a.requests)
    ]


def run(policy: str, views: list[EngineView], prompts: list[list[int]], a) -> dict:
    hasher = BlockHasher(a.block_size, "xxh3_128", SEED.encode())
    params = SamplingParams(max_tokens=a.max_tokens, temperature=0, ignore_eos=True)
    prompt_tokens = cached_tokens = 0
    sent = [0] * len(views)
    for i, prompt in enumerate(prompts):
        if policy == "kv_aware":
            for v in views:
                v.sync()
            hashes: list[bytes] = []
            hasher.extend(hashes, prompt)
            scores = [v.cache.cached_prefix_blocks(hashes) for v in views]
            best = max(scores)
            # Ties (no engine holds anything useful) spread the load round-robin.
            tied = [e for e, s in enumerate(scores) if s == best]
            engine = tied[i % len(tied)]
        else:
            engine = i % len(views)
        (out,) = views[engine].llm.generate([prompt], params, use_tqdm=False)
        if out.finish_reason == "error":
            raise SystemExit(f"request {i} failed: {out.error}")
        sent[engine] += 1
        prompt_tokens += len(prompt)
        cached_tokens += out.num_cached_tokens
    return {
        "hit_rate": round(cached_tokens / prompt_tokens, 4),
        "cached_tokens": cached_tokens,
        "prompt_tokens": prompt_tokens,
        "requests_per_engine": sent,
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", help="checkpoint directory or Hub id (default: built-in)")
    p.add_argument("--requests", type=int, default=48)
    p.add_argument("--prefixes", type=int, default=6)
    p.add_argument("--prefix-len", type=int, default=96)
    p.add_argument("--suffix-max", type=int, default=24)
    p.add_argument("--max-tokens", type=int, default=4)
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--device", default="cpu")
    p.add_argument(
        "--zmq-curve-keys",
        metavar="DIR",
        help="a `pagedserve keys` directory: the engines' event sockets speak CURVE and "
        "the router subscribes with its client key",
    )
    a = p.parse_args(argv)
    if min(a.requests, a.prefixes, a.prefix_len, a.max_tokens) < 1 or a.suffix_max < 4:
        raise SystemExit("need positive sizes and --suffix-max >= 4")
    longest = a.prefix_len + a.suffix_max + a.max_tokens
    per_request = -(-longest // a.block_size)
    # Room for about half the prefixes (and one request's tail) per engine: where each
    # prefix lands decides whether it is still cached when it comes back.
    num_blocks = (
        1
        + max(per_request, (a.prefixes // 2) * (a.prefix_len // a.block_size))
        + (per_request - a.prefix_len // a.block_size)
    )
    engine_args = dict(
        device=a.device,
        block_size=a.block_size,
        num_gpu_blocks=num_blocks,
        max_model_len=longest,
        prefix_cache_hash_seed=SEED,
        kv_events_endpoint="tcp://127.0.0.1:0",
        kv_events_replay_endpoint="tcp://127.0.0.1:0",
        zmq_curve_keys=a.zmq_curve_keys,
    )
    keys = None if a.zmq_curve_keys is None else load_client_keys(a.zmq_curve_keys)
    ctx = zmq.Context()
    log(f"starting two engines ({num_blocks} KV blocks of {a.block_size} tokens each)")
    with LLM(a.model, **engine_args) as e0, LLM(a.model, **engine_args) as e1:
        views = [EngineView(ctx, e0, keys), EngineView(ctx, e1, keys)]
        prompts = make_workload(a, e0.vocab_size)
        results = {}
        for policy in ("kv_aware", "round_robin"):
            for v in views:
                v.llm.reset_prefix_cache()
            results[policy] = run(policy, views, prompts, a)
            log(f"{policy}: prefix-cache hit rate {results[policy]['hit_rate']:.1%}")
    ctx.destroy(linger=0)
    out = {
        "example": "router",
        "requests": a.requests,
        "prefixes": a.prefixes,
        "prefix_len": a.prefix_len,
        "num_gpu_blocks": num_blocks,
        **results,
        "hit_rate_ratio": round(
            results["kv_aware"]["hit_rate"] / max(results["round_robin"]["hit_rate"], 1e-9), 3
        ),
    }
    print(
        f"KV-aware routing: {results['kv_aware']['hit_rate']:.1%} of prompt tokens from cache; "
        f"round-robin: {results['round_robin']['hit_rate']:.1%}"
    )
    print(json.dumps(out))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
