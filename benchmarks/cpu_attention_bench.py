#!/usr/bin/env python3
"""CPU paged attention: pagedkernels.cpu with the C kernel (pagedkernels.cpu_native: decode
and short extends, and every request where its AVX-512 copies apply), the same with those
copies off (`generic`, only where they apply), pagedkernels.cpu gathering everything for
torch, and pagedkernels.reference (a loop per request).

    python benchmarks/cpu_attention_bench.py [--threads N] [--rounds R] [--quick] [--out FILE]

One layer's attention per case, the three paths timed alternately in the same run (R rounds
each, median reported), on shuffled pages of a block-16 cache. Cases:
decode of 32 requests x 264 tokens and of 256 x 512, a prefill of 2048 tokens, a mixed
step (decodes of assorted lengths, an extend after a cached prefix, a short prefill), and
speculative verifies of 4 drafts (16 requests and one).
Shapes default to 32 query heads, 8 kv heads, head dim 128, float32 (--heads Q KV D for
others; `--heads 9 3 64` is SmolLM2). Each case also checks the outputs agree. The plan
cache is hit after the first call, as in every layer after a forward's first. Without a C
compiler the native column is missing (null).

The last line printed is the JSON object (also written to --out), with ratios per case:
reference_ms / native_ms, gather_ms / native_ms and generic_ms / native_ms (reference_ms /
gather_ms without the C kernel).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

from pagedkernels import cpu, cpu_native, reference  # noqa: E402
from pagedkernels.testing import random_paged_batch  # noqa: E402

BLOCK_SIZE = 16


def cases(quick: bool) -> list[tuple[str, list[int], list[int]]]:
    """(name, seq_lens, query_lens) per case."""
    mixed_lens = [100 + 37 * i for i in range(24)] + [768, 128]
    mixed_queries = [1] * 24 + [256, 128]
    out = [
        ("decode 32 x 264", [264] * 32, [1] * 32),
        ("decode 256 x 512", [512] * 256, [1] * 256),
        ("prefill 2048", [2048], [2048]),
        ("mixed 24 decode + extend 256 on 512 + prefill 128", mixed_lens, mixed_queries),
        # Speculative verifies of 4 drafts (5 queries each).
        ("verify 16 x 5 on 300", [300] * 16, [5] * 16),
        ("verify 1 x 5 on 300", [300], [5]),
        # A 512-token serving step's prompt, after a 128-token cached prefix.
        ("extend 512 on 640", [640], [512]),
    ]
    return [out[0], out[3]] if quick else out


def with_native(on: bool, fn: Callable[[], torch.Tensor]) -> Callable[[], torch.Tensor]:
    def call() -> torch.Tensor:
        os.environ[cpu_native.NATIVE_ENV] = "1" if on else "0"
        return fn()

    return call


def with_generic(lib: Any, fn: Callable[[], torch.Tensor]) -> Callable[[], torch.Tensor]:
    """fn on the C kernel's generic copies (the AVX-512 ones off), with the routing they
    get: more than NATIVE_MAX_QUERIES queries to the gather path."""

    def call() -> torch.Tensor:
        os.environ[cpu_native.NATIVE_ENV] = "1"
        cpu_native.set_fast_copies(lib, False)
        try:
            return fn()
        finally:
            cpu_native.set_fast_copies(lib, True)

    return call


def time_all(fns: dict[str, Callable[[], Any]], rounds: int) -> dict[str, list[float]]:
    """Alternating timings, so load from other processes weighs on every path alike."""
    for fn in fns.values():
        fn()
    times: dict[str, list[float]] = {name: [] for name in fns}
    for _ in range(rounds):
        for name, fn in fns.items():
            start = time.perf_counter()
            fn()
            times[name].append((time.perf_counter() - start) * 1e3)
    return times


def run_case(
    name: str,
    seq_lens: list[int],
    query_lens: list[int],
    heads: tuple[int, int, int],
    dtype: torch.dtype,
    rounds: int,
) -> dict[str, Any]:
    hq, hkv, d = heads
    gen = torch.Generator().manual_seed(len(seq_lens) * 1000 + sum(query_lens))
    query, kc, vc, table, qsl, lens = random_paged_batch(
        gen, seq_lens, query_lens, BLOCK_SIZE, hkv, hq, d, dtype
    )
    scale = d**-0.5
    args = (query, kc, vc, table, qsl, lens, scale)
    fns = {
        "gather": with_native(False, lambda: cpu.paged_attention(*args)),
        "reference": lambda: reference.paged_attention(*args),
    }
    lib = with_native(True, cpu_native.library)()
    if lib is not None:
        fns = {"native": with_native(True, lambda: cpu.paged_attention(*args)), **fns}
        if cpu_native.fast_path(lib, query, kc, None):
            fns["generic"] = with_generic(lib, lambda: cpu.paged_attention(*args))
    times = time_all(fns, rounds)
    want = reference.paged_attention(*args).float()
    row: dict[str, Any] = {
        "case": name,
        "requests": len(seq_lens),
        "query_tokens": sum(query_lens),
        "kv_tokens": sum(seq_lens),
        "native_ms": None,
    }
    for path, fn in fns.items():
        row[f"{path}_ms"] = round(statistics.median(times[path]), 2)
        row[f"{path}_ms_all"] = [round(t, 2) for t in times[path]]
        if path != "reference":
            row[f"{path}_max_abs_err"] = float((fn().float() - want).abs().max())
    fastest = "native" if row["native_ms"] is not None else "gather"
    row["ratios"] = {
        f"reference/{fastest}": round(row["reference_ms"] / row[f"{fastest}_ms"], 2),
    }
    if fastest == "native":
        row["ratios"]["gather/native"] = round(row["gather_ms"] / row["native_ms"], 2)
    if "generic_ms" in row:
        row["ratios"]["generic/native"] = round(row["generic_ms"] / row["native_ms"], 2)
    return row


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, default=1, help="torch intra-op threads")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument(
        "--heads", type=int, nargs=3, default=(32, 8, 128), metavar=("Q", "KV", "D")
    )
    parser.add_argument("--dtype", choices=["float32", "bfloat16", "float16"], default="float32")
    parser.add_argument("--quick", action="store_true", help="the two small cases only")
    parser.add_argument("--out", type=Path, help="also write the JSON here")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    dtype = getattr(torch, args.dtype)
    rows = []
    for name, seq_lens, query_lens in cases(args.quick):
        rows.append(run_case(name, seq_lens, query_lens, tuple(args.heads), dtype, args.rounds))
        print(json.dumps(rows[-1]), file=sys.stderr, flush=True)
    report = {
        "threads": args.threads,
        "heads": {"q": args.heads[0], "kv": args.heads[1], "dim": args.heads[2]},
        "dtype": args.dtype,
        "block_size": BLOCK_SIZE,
        "torch": torch.__version__,
        "cases": rows,
        "native": with_native(True, cpu_native.library)() is not None,
        "ratios": {r["case"]: r["ratios"] for r in rows},
    }
    text = json.dumps(report)
    if args.out:
        args.out.write_text(json.dumps(report, indent=1))
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
