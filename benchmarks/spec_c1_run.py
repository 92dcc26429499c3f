#!/usr/bin/env python3
"""One engine, one request at a time: the timed half of benchmarks/spec_vs_vllm.py.

    python benchmarks/spec_c1_run.py --engine pagedserve|vllm --model DIR --input in.jsonl
        [--speculative-config JSON]

Runs in our venv (pagedserve) or in the peer's (vllm), so it imports only the engine it
runs. Lines carry `prompt_token_ids` and `max_tokens`; each is generated alone (greedy),
after one untimed warm-up request. The last stdout line is one JSON object: load_s,
per-request seconds and token ids, and the engine's spec-decode counters when it has them.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent


def pagedserve_engine(model: str, spec: dict | None) -> tuple[Any, Any, Any]:
    sys.path.insert(0, str(ROOT))
    from launch import LLM, SamplingParams

    llm = LLM(model, device="cpu", log_level="warning", max_model_len=1024, speculative_config=spec)

    def generate(ids: list[int], n: int) -> list[int]:
        params = SamplingParams(max_tokens=n, temperature=0)
        return list(llm.generate([ids], params, use_tqdm=False)[0].token_ids)

    def counters() -> dict[str, int]:
        stats = llm.stats
        s = stats.spec_decode if stats is not None else None
        if s is None:
            return {}
        return {
            "drafts": s.num_drafts,
            "draft_tokens": s.num_draft_tokens,
            "accepted": s.num_accepted_tokens,
        }

    return llm, generate, counters


def vllm_engine(model: str, spec: dict | None) -> tuple[Any, Any, Any]:
    os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    kwargs: dict[str, Any] = dict(
        dtype="float32", enforce_eager=True, max_model_len=1024, seed=0, disable_log_stats=False
    )
    if spec is not None:
        kwargs["speculative_config"] = spec
    llm = LLM(model=model, **kwargs)

    def generate(ids: list[int], n: int) -> list[int]:
        params = SamplingParams(max_tokens=n, temperature=0)
        out = llm.generate([TokensPrompt(prompt_token_ids=ids)], params, use_tqdm=False)
        return list(out[0].outputs[0].token_ids)

    names = {
        "vllm:spec_decode_num_drafts": "drafts",
        "vllm:spec_decode_num_draft_tokens": "draft_tokens",
        "vllm:spec_decode_num_accepted_tokens": "accepted",
    }

    def counters() -> dict[str, int]:
        found: dict[str, int] = {}
        for metric in llm.get_metrics():
            if metric.name in names:
                found[names[metric.name]] = int(getattr(metric, "value", 0))
        return found

    return llm, generate, counters


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--engine", choices=["pagedserve", "vllm"], required=True)
    p.add_argument("--model", required=True)
    p.add_argument("--input", required=True)
    p.add_argument("--speculative-config", default=None, help="JSON; none: speculation off")
    a = p.parse_args()
    rows = [json.loads(line) for line in Path(a.input).read_text().splitlines() if line.strip()]
    spec = json.loads(a.speculative_config) if a.speculative_config else None
    t0 = time.perf_counter()
    make = pagedserve_engine if a.engine == "pagedserve" else vllm_engine
    _llm, generate, counters = make(a.model, spec)
    load_s = time.perf_counter() - t0
    generate(rows[0]["prompt_token_ids"], 8)  # one-time costs of the first request
    before = counters()
    seconds, token_ids = [], []
    for row in rows:
        t = time.perf_counter()
        token_ids.append(generate(row["prompt_token_ids"], row["max_tokens"]))
        seconds.append(time.perf_counter() - t)
    after = counters()
    spent = {k: after[k] - before.get(k, 0) for k in after}
    print(
        json.dumps(
            {
                "engine": a.engine,
                "load_s": round(load_s, 2),
                "seconds": [round(s, 4) for s in seconds],
                "token_ids": token_ids,
                "spec": spent,
            }
        )
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
