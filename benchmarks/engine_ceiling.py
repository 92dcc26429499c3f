#!/usr/bin/env python3
"""The most a server could deliver: the engine alone on a serving workload, no HTTP.

    python benchmarks/engine_ceiling.py [--concurrency 16,64] [--repeat 3] [--shape ...]

`pagedserve generate` (default flags, as `serve` would run) on the same shape as
`serve_vs_vllm.py`'s random workload (a shared prefix, random tokens after it, greedy,
ignore_eos), with `--max-num-seqs C`: a closed loop of C streams with no API server, no
client and no streaming, so its output tok/s bounds what `pagedserve serve` can reach at
C streams on this machine. Runs of each concurrency are interleaved over the repeats.
The last stdout line is one JSON object: per run the generate phase, output tok/s,
preemptions and prefix hit rate; per concurrency the median, min and max.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from benchmarks.e2e_throughput import SUMMARY_RE, _run, generate_cmd  # noqa: E402
from benchmarks.serve_vs_vllm import parse_shape  # noqa: E402
from benchmarks.serve_vs_vllm_loads import token_prompts  # noqa: E402
from tests.helpers.real_model import fetch_real_model  # noqa: E402


def run(model: Path, workload: Path, work: Path, concurrency: int, tag: str) -> dict:
    out = work / f"{tag}.jsonl"
    cmd = generate_cmd(model, workload, out, "--max-num-seqs", str(concurrency))
    rc, _wall, err = _run(cmd, None, work / f"{tag}.log")
    m = SUMMARY_RE.search(err)
    if rc != 0 or m is None:
        raise RuntimeError(f"pagedserve generate exited {rc}:\n{err[-3000:]}")
    rows = [json.loads(line) for line in out.read_text().splitlines() if line.strip()]
    tokens = sum(len(r["token_ids"]) for r in rows)
    gen_s = float(m["seconds"])
    return {
        "concurrency": concurrency,
        "gen_s": gen_s,
        "output_tokens": tokens,
        "output_tok_s": round(tokens / gen_s, 2),
        "prefix_hit_rate": float(m["hit"]) / 100,
        "preemptions": int(m["preempt"]),
    }


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", type=Path, help="checkpoint directory (default: the real model)")
    p.add_argument("--concurrency", default="16,64")
    p.add_argument("--repeat", type=int, default=3)
    p.add_argument("--num-prompts", type=int, default=64)
    p.add_argument("--shape", default="random=128,384,128", help="NAME=PREFIX,INPUT,OUTPUT")
    p.add_argument("--seed", type=int, default=0)
    a = p.parse_args()
    model = a.model or fetch_real_model()
    _, shape = parse_shape(a.shape)
    levels = [int(c) for c in a.concurrency.split(",")]
    runs = []
    with tempfile.TemporaryDirectory(prefix="ceiling-") as tmp:
        work = Path(tmp)
        for rep in range(a.repeat):
            # New prompts each repeat, as serve_vs_vllm's runs: nothing cached from before.
            prompts = token_prompts(shape, a.num_prompts, a.seed + rep, model)
            workload = work / f"w{rep}.jsonl"
            rows = [
                {
                    "prompt_token_ids": ids,
                    "max_tokens": shape.output,
                    "temperature": 0.0,
                    "ignore_eos": True,
                }
                for ids in prompts
            ]
            workload.write_text("".join(json.dumps(r) + "\n" for r in rows))
            for c in levels if rep % 2 == 0 else levels[::-1]:
                r = run(model, workload, work, c, f"c{c}-{rep}")
                print(f"[ceiling] {c} streams: {r['output_tok_s']} tok/s", file=sys.stderr)
                runs.append(r)
    summary = {}
    for c in levels:
        rates = [r["output_tok_s"] for r in runs if r["concurrency"] == c]
        summary[str(c)] = {
            "output_tok_s_median": statistics.median(rates),
            "min": min(rates),
            "max": max(rates),
        }
    print(json.dumps({"shape": a.shape, "runs": runs, "summary": summary}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
