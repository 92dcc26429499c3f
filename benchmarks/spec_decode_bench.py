#!/usr/bin/env python3
"""Speculative decoding on the CPU: output tok/s with drafts against without, in turns.

    python benchmarks/spec_decode_bench.py [--model DIR] [--concurrency 1 4 16]
        [--tokens 128] [--repeat 3] [--speculative-config JSON]

Two engines run side by side, one with --speculative-config (n-gram by default) and one
without; every (workload, concurrency) cell runs on both in turns, --repeat times, the
order swapped each time, so a slow spell of a shared machine falls on both. Workloads:
"copy" asks the chat model to repeat a passage or rewrite code with one change (the
answer copies the prompt: drafts pay), "free" asks for new text (drafts rarely match:
the back-off must keep it at par). Requests are greedy, so both engines generate the
same tokens and tok/s compares like for like. The default model is the real one
(benchmarks/fetch_real_model.py) when it is present, else the built-in random model.
Progress on stderr; the last stdout line is one JSON object.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from launch import LLM, SamplingParams  # noqa: E402

REAL_MODEL = Path.home() / ".cache/pagedserve/real-models/smollm2-135m-instruct-q4_1-0.1.2-f32-c2"
NGRAM = {
    "method": "ngram",
    "num_speculative_tokens": 4,
    "prompt_lookup_min": 2,
    "prompt_lookup_max": 4,
}

PASSAGES = [
    "The river rises in the northern hills and runs south for two hundred miles. Along its "
    "banks the towns grew up one by one: first the mill town, then the market town, and "
    "last the port, where the river meets the sea and the ships wait for the tide.",
    "Photosynthesis turns light, water and carbon dioxide into sugar and oxygen. It takes "
    "place in the chloroplasts of plant cells, where chlorophyll absorbs red and blue "
    "light and reflects green, which is why leaves look green to us.",
]
CODE = [
    "def total(items):\n    result = 0\n    for item in items:\n        result += item.price"
    " * item.count\n    return result\n\n\ndef average(items):\n    if not items:\n        "
    "return 0\n    return total(items) / len(items)\n",
    "class Stack:\n    def __init__(self):\n        self.items = []\n\n    def push(self, "
    "item):\n        self.items.append(item)\n\n    def pop(self):\n        return "
    "self.items.pop()\n\n    def empty(self):\n        return not self.items\n",
]
TOPICS = ["a lighthouse keeper", "a city under snow", "the first day of school", "a lost key"]


def conversations(workload: str, n: int) -> list[list[dict[str, str]]]:
    out = []
    for i in range(n):
        if workload == "copy" and i % 2 == 0:
            text = f"Repeat this passage word for word:\n\n{PASSAGES[i // 2 % len(PASSAGES)]}"
        elif workload == "copy":
            code = CODE[i // 2 % len(CODE)]
            text = (
                f"Rewrite this code, renaming `items` to `goods`. Reply with code only.\n\n{code}"
            )
        else:
            text = f"Write a short story about {TOPICS[i % len(TOPICS)]}."
        out.append([{"role": "user", "content": text}])
    return out


def log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def timed(llm: LLM, convs: list, params: SamplingParams) -> tuple[float, int, Any]:
    t0 = time.perf_counter()
    outs = llm.chat(convs, params, use_tqdm=False)
    seconds = time.perf_counter() - t0
    return seconds, sum(len(o.token_ids) for o in outs), llm.last_summary.stats


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    default = str(REAL_MODEL) if REAL_MODEL.exists() else None
    p.add_argument("--model", default=default, help="checkpoint (default: the real model)")
    p.add_argument("--concurrency", type=int, nargs="+", default=[1, 4, 16])
    p.add_argument("--workloads", nargs="+", default=["copy", "free"])
    p.add_argument("--tokens", type=int, default=128)
    p.add_argument("--repeat", type=int, default=3)
    p.add_argument("--speculative-config", default=json.dumps(NGRAM))
    a = p.parse_args(argv)
    params = SamplingParams(max_tokens=a.tokens, temperature=0)
    common = dict(device="cpu", log_level="warning", max_model_len=1024)
    cells: dict[str, dict[str, Any]] = {}
    with (
        LLM(a.model, **common) as off,
        LLM(a.model, speculative_config=a.speculative_config, **common) as on,
    ):
        engines = {"off": off, "on": on}
        for llm in engines.values():  # the first requests pay one-time costs
            llm.chat(conversations("copy", 1), SamplingParams(max_tokens=8), use_tqdm=False)
        for r in range(a.repeat):
            for workload in a.workloads:
                for c in a.concurrency:
                    key = f"{workload}@{c}"
                    cell = cells.setdefault(
                        key,
                        {"off": [], "on": [], "drafts": [0, 0, 0], "steps": {"off": 0, "on": 0}},
                    )
                    convs = conversations(workload, c)
                    for name in ("off", "on") if r % 2 == 0 else ("on", "off"):
                        before = engines[name].stats
                        seconds, tokens, stats = timed(engines[name], convs, params)
                        cell[name].append(tokens / seconds)
                        if stats is not None and before is not None:
                            cell["steps"][name] += stats.step - before.step
                        if name == "on" and stats is not None and stats.spec_decode:
                            s, b = stats.spec_decode, before.spec_decode if before else None
                            cell["drafts"][0] += s.num_drafts - (b.num_drafts if b else 0)
                            cell["drafts"][1] += s.num_draft_tokens - (
                                b.num_draft_tokens if b else 0
                            )
                            cell["drafts"][2] += s.num_accepted_tokens - (
                                b.num_accepted_tokens if b else 0
                            )
                    log(
                        f"repeat {r} {key}: off {cell['off'][-1]:.1f} on {cell['on'][-1]:.1f} tok/s"
                    )
    result: dict[str, Any] = {
        "model": a.model or "built-in",
        "speculative_config": json.loads(a.speculative_config),
    }
    for key, cell in cells.items():
        ratios = [on / off for on, off in zip(cell["on"], cell["off"])]
        drafts, draft_tokens, accepted = cell["drafts"]
        result[key] = {
            "off_tok_s": round(statistics.median(cell["off"]), 1),
            "on_tok_s": round(statistics.median(cell["on"]), 1),
            "ratio_median": round(statistics.median(ratios), 3),
            "ratio_min": round(min(ratios), 3),
            "ratio_max": round(max(ratios), 3),
            # Engine steps the runs took, off over on: what speculation saves in model
            # passes, free of the machine's noise (greedy: both make the same tokens).
            "step_ratio": round(cell["steps"]["off"] / cell["steps"]["on"], 3)
            if cell["steps"]["on"]
            else 0.0,
            "acceptance_rate": round(accepted / draft_tokens, 3) if draft_tokens else 0.0,
            "mean_accepted_length": round(1 + accepted / drafts, 3) if drafts else 0.0,
        }
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
