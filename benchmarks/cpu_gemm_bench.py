#!/usr/bin/env python3
"""CPU dense products of a decode step: the small-batch C kernel (pagedkernels.cpu_gemm)
against oneDNN with prepacked weights (worker.gemm's two paths), on one model's shapes.

    python benchmarks/cpu_gemm_bench.py [--rows 1,4,16,64,128] [--layers 30] [--threads 2]
        [--rounds 5] [--shapes 576x960,576x576,576x3072,1536x576] [--quick] [--out FILE]

Per row count, every layer's products in turn (`--layers` copies of each weight, so the
weights stream from memory as in a real step rather than sit in cache), the two paths
timed alternately in the same run, R rounds each, median reported. Default shapes are
SmolLM2-135M's per layer (in x out: fused q/k/v, o, fused gate/up, down). Each row count
also checks the two agree. Without the kernel (no AVX-512, no C compiler) its column is
missing (null).

The last line printed is the JSON object (also written to --out), with ratios per row
count: onednn_ms / small_ms.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402
from cpu_attention_bench import time_all  # noqa: E402

from pagedkernels import cpu_gemm  # noqa: E402
from worker import gemm  # noqa: E402


def parse_shapes(text: str) -> list[tuple[int, int]]:
    shapes = []
    for part in text.split(","):
        k, n = part.split("x")
        shapes.append((int(k), int(n)))
    return shapes


def run_rows(
    rows: int, weights: list[list[gemm.PackedWeight]], shapes: list[tuple[int, int]], rounds: int
) -> dict[str, Any]:
    xs = {k: torch.randn(rows, k) for k, _ in shapes}

    def onednn() -> None:
        for layer in weights:
            for (k, _), packed in zip(shapes, layer, strict=True):
                torch.ops.mkldnn._linear_pointwise(xs[k], packed.onednn, None, "none", [], "")

    def small() -> None:
        for layer in weights:
            for (k, n), packed in zip(shapes, layer, strict=True):
                assert packed.small is not None and packed.panels is not None
                packed.small.linear(xs[k], packed.panels, n, None)

    paths: dict[str, Callable[[], Any]] = {"onednn": onednn}
    if weights[0][0].small is not None:
        paths["small"] = small
    times = time_all(paths, rounds)
    flop = 2 * rows * sum(k * n for k, n in shapes) * len(weights)
    row: dict[str, Any] = {"rows": rows, "small_ms": None}
    for name, ts in times.items():
        ms = statistics.median(ts)
        row[f"{name}_ms"] = round(ms, 2)
        row[f"{name}_ms_all"] = [round(t, 2) for t in ts]
        row[f"{name}_gflops"] = round(flop / ms / 1e6, 1)
    if "small" in paths:
        first = weights[0]
        for (k, n), packed in zip(shapes, first, strict=True):
            assert packed.small is not None and packed.panels is not None
            want = torch.ops.mkldnn._linear_pointwise(xs[k], packed.onednn, None, "none", [], "")
            got = packed.small.linear(xs[k], packed.panels, n, None)
            row["max_abs_err"] = max(row.get("max_abs_err", 0.0), float((got - want).abs().max()))
        row["ratio"] = round(row["onednn_ms"] / row["small_ms"], 2)
    return row


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", default="1,4,16,64,128")
    parser.add_argument("--layers", type=int, default=30)
    parser.add_argument("--threads", type=int, default=2, help="torch intra-op threads")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--shapes", default="576x960,576x576,576x3072,1536x576")
    parser.add_argument("--quick", action="store_true", help="2 layers, rows 1 and 16, 2 rounds")
    parser.add_argument("--out", type=Path, help="also write the JSON here")
    args = parser.parse_args()
    if args.quick:
        args.rows, args.layers, args.rounds = "1,16", 2, 2
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    shapes = parse_shapes(args.shapes)
    small = cpu_gemm.load()
    weights = [[gemm.pack(torch.randn(n, k), small) for k, n in shapes] for _ in range(args.layers)]
    results = []
    for rows in (int(r) for r in args.rows.split(",")):
        results.append(run_rows(rows, weights, shapes, args.rounds))
        print(json.dumps(results[-1]), file=sys.stderr, flush=True)
    report = {
        "threads": args.threads,
        "layers": args.layers,
        "shapes": [f"{k}x{n}" for k, n in shapes],
        "torch": torch.__version__,
        "small_batch_kernel": small is not None,
        "results": results,
        "ratios": {str(r["rows"]): r.get("ratio") for r in results},
    }
    if args.out:
        args.out.write_text(json.dumps(report, indent=1))
    print(json.dumps(report))
    return 0


if __name__ == "__main__":
    sys.exit(main())
