#!/usr/bin/env python3
"""The most any engine can serve on this machine: a roofline for a serving workload.

    python benchmarks/roofline.py [--model DIR] [--shape 128,384,128] [--concurrency 16,64]
        [--threads 2] [--peer-tok-s 16=65.2,64=81.9] [--ours-tok-s 16=91.2,64=128.6]

Measures the machine's two limits with torch on the CPU, at the model's dtype (float32):
the rate of a matrix product the size of a prefill step's projections (best of --reps,
FLOP/s) and the rate a reduction reads a tensor larger than the caches (bytes/s). Then,
from the model's config.json, what a request of the shape costs at least:

- its prompt after the shared prefix (cached), computed once: 2 FLOPs per weight of the
  linear layers per token, plus attention's products over the context;
- each output token: the same products plus the LM head's and its attention's, and its
  decode step reads every weight once for the whole batch (the LM head included) and,
  per stream, its context's K and V in every layer: the slower of the two bounds it.

Per output token at C streams: prompt FLOPs / output tokens / FLOP rate + the decode
token's bound. Its inverse is the ceiling in output tok/s; with a peer's measured tok/s,
the largest ratio any engine could reach over it, and with ours, the share of the
ceiling we reach. A real engine cannot beat either term. The serial ceiling adds the
time to read the K/V to the decode token's products instead of overlapping them: the
attention between two products waits for the first and holds up the second, and both
want every core. The last stdout line is one JSON object.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from tests.helpers.real_model import fetch_real_model  # noqa: E402

BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}


def best_seconds(fn, reps: int) -> float:
    fn()  # threads started, pages touched
    best = float("inf")
    for _ in range(reps):
        start = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - start)
    return best


def machine(hidden: int, inter: int, dtype: torch.dtype, reps: int) -> dict[str, float]:
    """FLOP/s of a [512 x hidden] x [hidden x inter] product, read bytes/s of a 1 GiB sum."""
    a, b = torch.randn(512, hidden, dtype=dtype), torch.randn(hidden, inter, dtype=dtype)
    mm = best_seconds(lambda: torch.mm(a, b), reps)
    big = torch.ones((1 << 30) // torch.finfo(dtype).bits * 8, dtype=dtype)
    read = best_seconds(lambda: big.sum(), reps)
    return {
        "flops_per_s": 2 * 512 * hidden * inter / mm,
        "read_bytes_per_s": big.numel() * big.element_size() / read,
    }


def model_costs(config: dict) -> dict[str, float]:
    h, inter = config["hidden_size"], config["intermediate_size"]
    heads, kv_heads = config["num_attention_heads"], config["num_key_value_heads"]
    hd = config.get("head_dim") or h // heads
    layers, vocab = config["num_hidden_layers"], config["vocab_size"]
    per_layer = h * heads * hd + 2 * h * kv_heads * hd + heads * hd * h + 3 * h * inter
    linear = layers * per_layer
    size = BYTES[config.get("dtype") or config.get("torch_dtype") or "float32"]
    return {
        "linear_params": linear,
        "head_params": vocab * h,
        "weight_bytes": (linear + vocab * h) * size,  # the LM head is read each decode step
        "kv_bytes_per_token": layers * 2 * kv_heads * hd * size,
        # Attention's two products per query token per context token, over all heads.
        "attn_flops_per_pair": layers * 4 * heads * hd,
    }


def ceiling(
    cost: dict[str, float], rates: dict[str, float], shape: tuple[int, int, int], streams: int
) -> dict[str, float]:
    """The bounds of a (prefix, prompt, output) request's cost per output token."""
    prefix, prompt, out = shape
    flops, read = rates["flops_per_s"], rates["read_bytes_per_s"]
    # Prompt tokens attend to the prefix and to the prompt before them: prefix + i.
    pairs = prompt * prefix + prompt * (prompt + 1) / 2
    prefill_flops = prompt * 2 * cost["linear_params"] + pairs * cost["attn_flops_per_pair"]
    mean_context = prefix + prompt + out / 2
    # A decode token costs a prompt token's products, the LM head's and its attention...
    decode_flops = 2 * cost["head_params"] + 2 * cost["linear_params"]
    decode_flops += mean_context * cost["attn_flops_per_pair"]
    # ...and reads its share of the weights and its own context's K and V.
    decode_bytes = cost["weight_bytes"] / streams + mean_context * cost["kv_bytes_per_token"]
    prefill_s = prefill_flops / out / flops
    decode_s = max(decode_flops / flops, decode_bytes / read)
    # Attention reads its K and V after the products that make its queries and before
    # those that use its output, and both need every core: the K/V time adds to the
    # products' (the weights stream under the products, as a product reads them).
    kv_s = mean_context * cost["kv_bytes_per_token"] / read
    serial_s = max(decode_flops / flops, cost["weight_bytes"] / streams / read) + kv_s
    return {
        "prefill_ms_per_output_token": prefill_s * 1e3,
        "decode_ms_per_output_token": decode_s * 1e3,
        "decode_bound": "compute" if decode_flops / flops > decode_bytes / read else "memory",
        "ceiling_output_tok_s": 1 / (prefill_s + decode_s),
        "decode_serial_ms_per_output_token": serial_s * 1e3,
        "ceiling_serial_output_tok_s": 1 / (prefill_s + serial_s),
    }


def per_concurrency(text: str) -> dict[int, float]:
    return {int(k): float(v) for k, v in (item.split("=") for item in text.split(",") if item)}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", type=Path, default=None, help="default: the real test model")
    p.add_argument("--shape", default="128,384,128", help="prefix,input,output tokens")
    p.add_argument("--concurrency", default="16,64")
    p.add_argument("--threads", type=int, default=torch.get_num_threads())
    p.add_argument("--reps", type=int, default=7)
    p.add_argument("--peer-tok-s", default="", help="C=tok/s,... the peer's measured medians")
    p.add_argument("--ours-tok-s", default="", help="C=tok/s,... ours")
    a = p.parse_args()
    torch.set_num_threads(a.threads)
    model = a.model or fetch_real_model()
    config = json.loads((model / "config.json").read_text())
    dtype = getattr(torch, config.get("dtype") or config.get("torch_dtype") or "float32")
    prefix, prompt, out = (int(x) for x in a.shape.split(","))
    shape = (prefix, prompt, out)
    cost = model_costs(config)
    rates = machine(config["hidden_size"], config["intermediate_size"], dtype, a.reps)
    print(
        f"[roofline] {a.threads} threads: {rates['flops_per_s'] / 1e9:.1f} GFLOP/s, "
        f"{rates['read_bytes_per_s'] / 1e9:.1f} GB/s read",
        file=sys.stderr,
    )
    peer, ours = per_concurrency(a.peer_tok_s), per_concurrency(a.ours_tok_s)
    cells = {}
    for c in (int(x) for x in a.concurrency.split(",")):
        cell = ceiling(cost, rates, shape, c)
        for kind in ("", "serial_"):
            top = cell[f"ceiling_{kind}output_tok_s"]
            if c in peer:
                cell[f"max_{kind}ratio_over_peer"] = top / peer[c]
            if c in ours:
                cell[f"ours_share_of_{kind}ceiling"] = ours[c] / top
        cells[str(c)] = cell
        print(f"[roofline] {c} streams: {json.dumps(cell)}", file=sys.stderr)
    out = {"benchmark": "roofline", "model": str(model), "threads": a.threads}
    out.update(shape=a.shape, machine=rates, model_costs=cost, cells=cells)
    print(json.dumps(out))


if __name__ == "__main__":
    main()
