#!/usr/bin/env python3
"""Paged-attention CUDA kernels on a GPU: correctness sweep and speed, as JSON.

    python benchmarks/attention_bench.py check [--quick | --small] [--emulate] [--out FILE]
    python benchmarks/attention_bench.py bench [--quick] [--emulate] [--out FILE]

check: pagedkernels.cuda_kernels against pagedkernels.reference over a sweep (batch 1-256, contexts
1 to 32k, mixed prefill/extend/decode, GQA 1/4/8, head dims 64/128/256, window on/off,
soft cap, fp16/bf16, block sizes 16 and 32, padding rows, released out-of-window blocks
pointing at a NaN null block), plus the cache write. Exit status 1 if any case fails.

bench: decode (batch 1/16/64/256 x context 1k/4k/16k; 32 query heads, 8 kv heads, head
dim 128, bf16, block size 16, pages shuffled): achieved GB/s of K/V read against the
device's copy bandwidth measured in the same run, against torch SDPA on contiguous K/V
and against the torch reference gathering pages; prefill and extend TFLOP/s against SDPA.
`targets` says whether decode at batch >= 16 and context >= 4k reaches 75% of the copy
bandwidth and is no slower than SDPA.

--emulate runs both on the CPU through pagedkernels.cuda_emulator with small shapes: it proves
this script's own code paths without a GPU (the tests run it); its numbers mean nothing.

The last line printed is the JSON object (also written to --out).
"""

from __future__ import annotations

import argparse
import json
import platform
import random
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from pagedkernels import reference  # noqa: E402
from pagedkernels.cuda_kernels import paged_attention_with, plan_for  # noqa: E402
from pagedkernels.testing import random_paged_batch  # noqa: E402

# Split counts every decode row is also timed with (each split at least 256 keys).
SPLIT_SWEEP = (1, 2, 4, 8, 16, 32)
# The kernel's decode targets at batch >= 16 and context >= 4k: decode reads every KV
# byte once, so it should run near copy bandwidth, and never behind SDPA.
TARGET_FRACTION_OF_COPY_BW = 0.75
TARGET_SPEEDUP_VS_SDPA = 1.0


@dataclass(frozen=True)
class Shapes:
    """Problem sizes of one run: the real ones on a GPU, small ones under the emulator."""

    q_heads: int
    kv_heads: int
    head_dim: int
    batches: tuple[int, ...]
    contexts: tuple[int, ...]
    quick_contexts: tuple[int, ...]
    target_batch: int  # decode rows at least this large and long are held to the targets
    target_context: int
    prefill: tuple[tuple[str, int, int, int], ...]  # (case, batch, new tokens, prefix)
    quick_prefill: int  # how many of `prefill` a --quick run keeps
    copy_bytes: int


GPU_SHAPES = Shapes(
    32, 8, 128, (1, 16, 64, 256), (1024, 4096, 16384), (1024, 4096), 16, 4096,
    (("prefill", 1, 4096, 0), ("prefill", 4, 2048, 0), ("extend", 1, 512, 8192),
     ("prefill", 1, 16384, 0), ("extend", 16, 256, 2048)), 3, 2 << 30,
)  # fmt: skip
EMULATED_SHAPES = Shapes(
    8, 2, 64, (1, 2), (64, 192), (64, 192), 2, 192,
    (("prefill", 1, 48, 0), ("extend", 1, 16, 80)), 2, 64 << 20,
)  # fmt: skip


@dataclass(frozen=True)
class Target:
    """Where the kernels under test run."""

    device: str
    kernels: Any  # a module with paged_attention and write_kv_cache
    backend: Any  # its launch backend (pagedkernels.cuda_kernels.Backend)
    shapes: Shapes

    @property
    def emulated(self) -> bool:
        return self.device == "cpu"

    def synchronize(self) -> None:
        if not self.emulated:
            torch.cuda.synchronize()

    def empty_cache(self) -> None:
        if not self.emulated:
            torch.cuda.empty_cache()


def gpu_target() -> Target:
    from pagedkernels import cuda_kernels

    return Target("cuda", cuda_kernels, cuda_kernels.cuda_backend(), GPU_SHAPES)


def emulated_target() -> Target:
    from pagedkernels import cuda_emulator

    return Target("cpu", cuda_emulator, cuda_emulator.backend(), EMULATED_SHAPES)


# -- helpers ----------------------------------------------------------------------------


def environment(target: Target) -> dict[str, Any]:
    info: dict[str, Any] = {
        "python": platform.python_version(),
        "torch": torch.__version__,
        "kernels": "emulated on the CPU" if target.emulated else "CUDA (CuPy)",
    }
    if target.emulated:
        return info
    try:
        import cupy

        info["cupy"] = cupy.__version__
        info["cuda_runtime"] = cupy.cuda.runtime.runtimeGetVersion()
    except Exception as exc:
        info["cupy"] = f"unavailable: {exc}"
    props = torch.cuda.get_device_properties(0)
    info.update(
        gpu=props.name,
        sms=props.multi_processor_count,
        memory_gib=round(props.total_memory / 2**30, 1),
        capability=f"{props.major}.{props.minor}",
    )
    return info


def time_ms(
    target: Target, fn: Callable[[], object], min_ms: float = 40.0, max_iters: int = 50
) -> float:
    """Mean milliseconds per call after a warm-up call (which also compiles)."""
    fn()
    if target.emulated:
        start = time.perf_counter()
        fn()
        return (time.perf_counter() - start) * 1e3
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    fn()
    end.record()
    torch.cuda.synchronize()
    once = max(start.elapsed_time(end), 1e-3)
    iters = int(max(1, min(max_iters, min_ms / once)))
    start.record()
    for _ in range(iters):
        fn()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / iters


# -- check ------------------------------------------------------------------------------


def _tolerance(dtype: torch.dtype) -> float:
    return 2e-2 if dtype == torch.bfloat16 else 4e-3


def check_case(
    target: Target,
    name: str,
    seq_lens: list[int],
    query_lens: list[int],
    *,
    block_size: int = 16,
    num_kv_heads: int = 8,
    group: int = 4,
    head_dim: int = 128,
    dtype: torch.dtype = torch.bfloat16,
    window: int | None = None,
    soft_cap: float | None = None,
    pad_rows: int = 0,
    seed: int = 0,
) -> dict[str, Any]:
    gen = torch.Generator().manual_seed(seed)
    query, kc, vc, table, qsl, lens = random_paged_batch(
        gen,
        seq_lens,
        query_lens,
        block_size,
        num_kv_heads,
        num_kv_heads * group,
        head_dim,
        dtype,
        target.device,
        pad_rows,
        released_window=window,
    )
    scale = head_dim**-0.5
    result: dict[str, Any] = {
        "name": name,
        "batch": len(seq_lens),
        "max_context": max(seq_lens),
        "query_tokens": sum(query_lens),
        "block_size": block_size,
        "gqa": group,
        "head_dim": head_dim,
        "dtype": str(dtype).removeprefix("torch."),
        "window": window,
        "soft_cap": soft_cap,
    }
    try:
        result["splits"] = plan_for(target.backend, query, kc, table, lens, window).num_splits
        got = target.kernels.paged_attention(
            query, kc, vc, table, qsl, lens, scale, window, soft_cap
        )
        want = reference.paged_attention(query, kc, vc, table, qsl, lens, scale, window, soft_cap)
        target.synchronize()
        err = (got.float() - want.float()).abs()
        tol = _tolerance(dtype) * (1 + want.float().abs())
        pad_ok = pad_rows == 0 or bool(torch.all(got[-pad_rows:] == 0))
        result.update(
            max_abs_err=float(err.max()),
            mean_abs_err=float(err.mean()),
            nan=bool(torch.isnan(got).any()),
            ok=bool((err <= tol).all()) and pad_ok and not torch.isnan(got).any(),
        )
    except Exception as exc:  # report and go on: one broken case must not hide the rest
        result.update(ok=False, error=f"{type(exc).__name__}: {exc}")
    return result


def check_write(target: Target, dtype: torch.dtype, block_size: int) -> dict[str, Any]:
    device = target.device
    key = torch.randn(300, 8, 128, device=device).to(dtype)
    value = torch.randn(300, 8, 128, device=device).to(dtype)
    slots = torch.randperm(64 * block_size, device=device)[:300]
    slots[::7] = -1
    got_k = torch.zeros(64, block_size, 8, 128, dtype=dtype, device=device)
    got_v = torch.zeros_like(got_k)
    want_k, want_v = got_k.clone(), got_v.clone()
    target.kernels.write_kv_cache(key, value, got_k, got_v, slots)
    reference.write_kv_cache(key, value, want_k, want_v, slots)
    ok = torch.equal(got_k, want_k) and torch.equal(got_v, want_v)
    return {"name": "write_kv_cache", "dtype": str(dtype), "block_size": block_size, "ok": ok}


def sweep(target: Target, quick: bool, small: bool = False) -> list[dict[str, Any]]:
    rng = random.Random(0)
    cases: list[dict[str, Any]] = []
    for dtype in (torch.float16, torch.bfloat16):
        for block_size in (16, 32):
            cases.append(check_write(target, dtype, block_size))
    seed = 0

    def add(name: str, seq_lens: list[int], query_lens: list[int], **kw: Any) -> None:
        nonlocal seed
        seed += 1
        cases.append(check_case(target, name, seq_lens, query_lens, seed=seed, **kw))
        target.empty_cache()

    if target.emulated or small:
        # A few small cases through every path: decode, split-K, mixed, window, soft cap.
        add("decode b2", [700, 33], [1, 1], num_kv_heads=2)
        add("mixed w40", [90, 20, 130], [1, 20, 30], num_kv_heads=2, group=1, window=40)
        add("soft cap fp16", [50, 9], [1, 9], num_kv_heads=1, soft_cap=30.0, dtype=torch.half)
        add("bs32 pad", [70, 40], [5, 1], num_kv_heads=1, block_size=32, pad_rows=3)
        return cases

    # Decode: batch 1..256, contexts 1..32k.
    for batch, max_ctx in ((1, 1), (1, 32768), (4, 32768), (16, 8192), (64, 4096), (256, 2048)):
        lens = [rng.randint(1, max_ctx) for _ in range(batch)]
        lens[0] = max_ctx
        for dtype in (torch.bfloat16, torch.float16):
            add(f"decode b{batch} ctx<={max_ctx}", lens, [1] * batch, dtype=dtype)
    # Mixed prefill / extend / decode across the option grid.
    for dtype in (torch.float16, torch.bfloat16):
        for block_size in (16, 32):
            for group in (1, 4, 8):
                for window in (None, 1000):
                    if quick and (group == 8 or block_size == 32):
                        continue
                    n_dec, n_ext = rng.randint(1, 24), rng.randint(1, 4)
                    lens = [rng.randint(1, 6000) for _ in range(n_dec)]
                    qlens = [1] * n_dec
                    for _ in range(n_ext):  # extend after a cached prefix, or prefill
                        q = rng.randint(1, 300)
                        lens.append(q + rng.choice([0, rng.randint(1, 5000)]))
                        qlens.append(q)
                    add(
                        f"mixed g{group} bs{block_size} w{window}",
                        lens,
                        qlens,
                        block_size=block_size,
                        group=group,
                        dtype=dtype,
                        window=window,
                        pad_rows=rng.choice([0, 3]),
                    )
    # Head dims, soft cap, long prefill, small windows, odd GQA.
    for head_dim in (64, 256):
        add(f"mixed d{head_dim}", [3000, 17, 900], [1, 17, 128], head_dim=head_dim)
    add("soft cap", [4000, 300, 1], [1, 64, 1], soft_cap=30.0)
    add("prefill 2048", [2048], [2048], dtype=torch.float16)
    add("window 64 extend", [5000, 700], [200, 1], window=64)
    add("gqa 7 (28/4 heads)", [2500, 40], [1, 40], num_kv_heads=4, group=7)
    if not quick:
        add("decode b2 ctx 32k window 4096", [32768, 32000], [1, 1], window=4096)
        add("extend 512 on 16k", [16896], [512], block_size=32)
    return cases


# -- bench ------------------------------------------------------------------------------


def copy_bandwidth_gbps(target: Target) -> float:
    """Device-to-device copy, bytes read plus written per second."""
    n = target.shapes.copy_bytes
    x = torch.empty(n, dtype=torch.uint8, device=target.device)
    y = torch.empty_like(x)
    ms = time_ms(target, lambda: y.copy_(x), min_ms=100)
    return 2 * n / (ms * 1e-3) / 1e9


def bench_decode(
    target: Target, batch: int, ctx: int, copy_gbps: float, with_reference: bool
) -> dict[str, Any]:
    sh, device, bs, dtype = target.shapes, target.device, 16, torch.bfloat16
    hq, hkv, d = sh.q_heads, sh.kv_heads, sh.head_dim
    gen = torch.Generator().manual_seed(batch * 7 + ctx)
    query, kc, vc, table, qsl, lens = random_paged_batch(
        gen, [ctx] * batch, [1] * batch, bs, hkv, hq, d, dtype, device
    )
    scale = d**-0.5
    attention = target.kernels.paged_attention
    kv_bytes = 2 * batch * ctx * hkv * d * kc.element_size()
    ms = time_ms(target, lambda: attention(query, kc, vc, table, qsl, lens, scale))
    row: dict[str, Any] = {
        "batch": batch,
        "context": ctx,
        "kv_gb": round(kv_bytes / 1e9, 3),
        "kernel_ms": round(ms, 4),
        "kernel_gbps": round(kv_bytes / (ms * 1e-3) / 1e9, 1),
        "splits": plan_for(target.backend, query, kc, table, lens).num_splits,
    }
    row["fraction_of_copy_bw"] = round(row["kernel_gbps"] / copy_gbps, 3)
    # The same launch with other split counts: is the planner's choice the fast one?
    sweep_ms = {}
    for splits in SPLIT_SWEEP:
        if splits > 1 and splits * 256 > ctx:
            break

        def forced(splits: int = splits) -> object:
            return paged_attention_with(
                target.backend, query, kc, vc, table, qsl, lens, scale, num_splits=splits
            )

        sweep_ms[str(splits)] = round(time_ms(target, forced, min_ms=10), 4)
    row["ms_by_splits"] = sweep_ms
    # torch SDPA on contiguous K/V (what paging costs against an unpaged layout)
    k = torch.randn(batch, hkv, ctx, d, device=device, dtype=dtype)
    v = torch.randn_like(k)
    q = query.view(batch, hq, 1, d)
    try:
        sdpa_ms = time_ms(target, lambda: F.scaled_dot_product_attention(q, k, v, enable_gqa=True))
        row["sdpa_ms"] = round(sdpa_ms, 4)
        row["speedup_vs_sdpa"] = round(sdpa_ms / ms, 3)
    except Exception as exc:
        row["sdpa_error"] = f"{type(exc).__name__}: {exc}"
    k = v = None  # free the contiguous copy before the reference gathers pages
    target.empty_cache()
    if with_reference:
        ref_ms = time_ms(
            target,
            lambda: reference.paged_attention(query, kc, vc, table, qsl, lens, scale),
            min_ms=1,
            max_iters=3,
        )
        row["reference_ms"] = round(ref_ms, 3)
        row["speedup_vs_reference"] = round(ref_ms / ms, 2)
    return row


def bench_prefill(target: Target, name: str, batch: int, new: int, prefix: int) -> dict[str, Any]:
    sh, device, bs, dtype = target.shapes, target.device, 16, torch.bfloat16
    hq, hkv, d = sh.q_heads, sh.kv_heads, sh.head_dim
    total = prefix + new
    gen = torch.Generator().manual_seed(total)
    query, kc, vc, table, qsl, lens = random_paged_batch(
        gen, [total] * batch, [new] * batch, bs, hkv, hq, d, dtype, device
    )
    scale = d**-0.5
    attention = target.kernels.paged_attention
    # Visible (query, key) pairs: each query at p sees p + 1 keys.
    pairs = batch * sum(prefix + i + 1 for i in range(new))
    flops = 4 * pairs * hq * d
    ms = time_ms(target, lambda: attention(query, kc, vc, table, qsl, lens, scale))
    row: dict[str, Any] = {
        "case": name,
        "batch": batch,
        "new_tokens": new,
        "prefix": prefix,
        "kernel_ms": round(ms, 4),
        "kernel_tflops": round(flops / (ms * 1e-3) / 1e12, 2),
    }
    q = query.view(batch, new, hq, d).transpose(1, 2)
    k = torch.randn(batch, hkv, total, d, device=device, dtype=dtype)
    v = torch.randn_like(k)
    try:
        if prefix == 0:
            sdpa = lambda: F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)  # noqa: E731
        else:
            from torch.nn.attention.bias import causal_lower_right

            mask = causal_lower_right(new, total)
            sdpa = lambda: F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=True)  # noqa: E731
        sdpa_ms = time_ms(target, sdpa)
        row["sdpa_ms"] = round(sdpa_ms, 4)
        row["sdpa_tflops"] = round(flops / (sdpa_ms * 1e-3) / 1e12, 2)
        row["speedup_vs_sdpa"] = round(sdpa_ms / ms, 3)
    except Exception as exc:
        row["sdpa_error"] = f"{type(exc).__name__}: {exc}"
    return row


def targets(shapes: Shapes, decode: list[dict[str, Any]]) -> dict[str, Any]:
    """The decode targets over the rows they apply to (None: nothing measured)."""
    rows = [
        r
        for r in decode
        if r["batch"] >= shapes.target_batch and r["context"] >= shapes.target_context
    ]
    bandwidth = [r["fraction_of_copy_bw"] for r in rows]
    speedups = [r.get("speedup_vs_sdpa") for r in rows]
    return {
        "applies_to": f"decode, batch >= {shapes.target_batch}, context >= {shapes.target_context}",
        "cases": len(rows),
        "min_fraction_of_copy_bw": min(bandwidth) if bandwidth else None,
        "fraction_of_copy_bw_met": (
            all(b >= TARGET_FRACTION_OF_COPY_BW for b in bandwidth) if rows else None
        ),
        "min_speedup_vs_sdpa": min(s for s in speedups if s is not None) if rows else None,
        # A row whose SDPA failed cannot show the kernel is no slower: not met.
        "no_slower_than_sdpa_met": (
            all(s is not None and s >= TARGET_SPEEDUP_VS_SDPA for s in speedups) if rows else None
        ),
    }


def bench(target: Target, quick: bool) -> dict[str, Any]:
    sh = target.shapes
    copy_gbps = copy_bandwidth_gbps(target)
    target.empty_cache()
    contexts = sh.quick_contexts if quick else sh.contexts
    decode = []
    for batch in sh.batches:
        for ctx in contexts:
            row = bench_decode(target, batch, ctx, copy_gbps, with_reference=batch * ctx <= 2**20)
            decode.append(row)
            target.empty_cache()
            print(json.dumps(row), file=sys.stderr, flush=True)
    prefill = []
    for case in sh.prefill[: sh.quick_prefill] if quick else sh.prefill:
        prefill.append(bench_prefill(target, *case))
        target.empty_cache()
        print(json.dumps(prefill[-1]), file=sys.stderr, flush=True)
    return {
        "copy_bandwidth_gbps_read_plus_write": round(copy_gbps, 1),
        "shapes": {"q_heads": sh.q_heads, "kv_heads": sh.kv_heads, "head_dim": sh.head_dim,
                   "dtype": "bfloat16", "block_size": 16},
        "decode": decode,
        "prefill": prefill,
        "targets": targets(sh, decode),
    }  # fmt: skip


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("mode", choices=["check", "bench"])
    parser.add_argument("--quick", action="store_true", help="fewer cases")
    parser.add_argument(
        "--emulate",
        action="store_true",
        help="run on the CPU through the kernel emulator, small shapes (checks this script)",
    )
    parser.add_argument(
        "--small",
        action="store_true",
        help="check: only the few small cases (for compute-sanitizer, where each launch is slow)",
    )
    parser.add_argument("--out", type=Path, help="also write the JSON here")
    args = parser.parse_args()
    if args.emulate:
        target = emulated_target()
    elif torch.cuda.is_available():
        target = gpu_target()
    else:
        print(json.dumps({"error": "no CUDA GPU (use --emulate to run on the CPU emulator)"}))
        return 2
    start = time.perf_counter()
    report: dict[str, Any] = {"mode": args.mode, "environment": environment(target)}
    status = 0
    if args.mode == "check":
        cases = sweep(target, args.quick, args.small)
        failed = [c for c in cases if not c["ok"]]
        report.update(cases=cases, passed=len(cases) - len(failed), failed=len(failed))
        for c in failed:
            print(f"FAILED {json.dumps(c)}", file=sys.stderr)
        status = 1 if failed else 0
    else:
        report.update(bench(target, args.quick))
    report["seconds"] = round(time.perf_counter() - start, 1)
    text = json.dumps(report)
    if args.out:
        args.out.write_text(json.dumps(report, indent=1))
    print(text)
    return status


if __name__ == "__main__":
    sys.exit(main())
