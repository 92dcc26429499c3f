#!/usr/bin/env python3
"""Host time of preparing one CUDA kernel launch (pagedkernels.cuda_kernels), on the CPU, as JSON.

    python benchmarks/launch_overhead.py [--calls 5000]

A GPU worker calls write_kv_cache and paged_attention once per layer per step: for a
32-layer model that is 64 launch preparations a step, all Python on the host, none of it
hidden from a small batch's step time. This measures our side of each: checking the
tensors, planning the grid and split count, packing the arguments, with a backend that
takes the packed launch and does nothing (CuPy's own call is not ours to measure, and
needs a GPU). The floor, measured in the same run, is the least any launcher must do:
allocate the output and hand the kernel its argument tuple.

The last line printed is the JSON object.
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

from pagedkernels import cuda_kernels  # noqa: E402
from pagedkernels.testing import random_paged_batch  # noqa: E402

LAYERS = 32


class NoLaunch:
    """A backend that accepts a prepared launch and drops it (one resident-CTA count)."""

    def __init__(self) -> None:
        self.launches = 0

    def resident_ctas(self, *_: Any) -> int:
        return 132 * 2

    def launch(self, *_: Any) -> None:
        self.launches += 1


def per_call_us(fn: Callable[[], object], calls: int) -> float:
    for _ in range(min(200, calls)):
        fn()
    best = float("inf")
    for _ in range(3):
        start = time.perf_counter()
        for _ in range(calls):
            fn()
        best = min(best, (time.perf_counter() - start) / calls * 1e6)
    return round(best, 2)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--calls", type=int, default=5000)
    args = parser.parse_args()
    torch.set_num_threads(1)
    gen = torch.Generator().manual_seed(0)
    # A decode step of 64 requests at ~1k context: 32 query heads, 8 KV heads, head dim 128.
    batch = random_paged_batch(gen, [1000] * 64, [1] * 64, 16, 8, 32, 128, torch.bfloat16)
    query, key_cache, value_cache = batch[:3]
    key = torch.randn(64, 8, 128).bfloat16()
    value = torch.randn(64, 8, 128).bfloat16()
    slots = torch.arange(64)
    backend = NoLaunch()
    args_34 = tuple(range(34))

    def floor() -> object:
        out = torch.empty_like(query)
        return backend.launch(out, args_34)

    attention = per_call_us(
        lambda: cuda_kernels.paged_attention_with(backend, *batch, 0.088), args.calls
    )
    write = per_call_us(
        lambda: cuda_kernels.write_kv_cache_with(
            backend, key, value, key_cache, value_cache, slots
        ),
        args.calls,
    )
    floor_us = per_call_us(floor, args.calls)
    report = {
        "benchmark": "launch_overhead",
        "python": platform.python_version(),
        "torch": torch.__version__,
        "case": "decode, 64 requests x 1000 tokens, 32/8 heads, head_dim 128, bf16",
        "paged_attention_us": attention,
        "write_kv_cache_us": write,
        "floor_us": floor_us,
        "paged_attention_vs_floor": round(attention / floor_us, 2),
        "write_kv_cache_vs_floor": round(write / floor_us, 2),
        f"per_step_{LAYERS}_layers_us": round(LAYERS * (attention + write), 1),
    }
    print(json.dumps(report))
    return 0


if __name__ == "__main__":
    sys.exit(main())
