#!/usr/bin/env python3
"""What structured outputs cost: LLM.generate on the same prompts, free and constrained.

    python benchmarks/structured_output_bench.py [--model DIR] [--requests 32]
        [--tokens 96] [--repeat 3]

Every request generates exactly --tokens tokens (greedy): free ones ignore EOS, and the
constrained ones follow a language that cannot end sooner (a regex of 8 characters per
token; a JSON array of at least 1000 objects), so the runs do the same model work and
their tok/s differ by what the masks cost: each worker fills one bitmask row per
constrained request per step (llguidance) and applies it before sampling. Variants run
in turns, --repeat times, in one engine (a slow spell of a shared machine falls on all);
the first constrained request (the tokenizer's trie is built then) is run before timing.
The default model is the built-in one (byte tokenizer, 320 tokens); the real model
(benchmarks/fetch_real_model.py, 49k tokens) is the case that matters.
Progress on stderr; the last stdout line is one JSON object.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from launch import LLM, SamplingParams  # noqa: E402
from protocol.engine import StructuredOutputs  # noqa: E402

ITEMS = {
    "type": "object",
    "properties": {"id": {"type": "integer"}, "name": {"type": "string"}},
    "required": ["id", "name"],
}


def variants(tokens: int) -> dict[str, SamplingParams]:
    def constrained(spec: StructuredOutputs) -> SamplingParams:
        return SamplingParams(max_tokens=tokens, temperature=0, structured_outputs=spec)

    array = {"type": "array", "items": ITEMS, "minItems": 1000}
    return {
        "free": SamplingParams(max_tokens=tokens, temperature=0, ignore_eos=True),
        "regex": constrained(StructuredOutputs(regex=f"[a-z ,.]{{{8 * tokens}}}")),
        "json": constrained(StructuredOutputs(json=json.dumps(array))),
    }


def log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", help="a checkpoint directory (default: the built-in model)")
    p.add_argument("--requests", type=int, default=32)
    p.add_argument("--tokens", type=int, default=96)
    p.add_argument("--repeat", type=int, default=3)
    p.add_argument("--prompt-tokens", type=int, default=64)
    a = p.parse_args(argv)
    rng = random.Random(0)
    runs: dict[str, list[dict[str, Any]]] = {}
    context = a.prompt_tokens + a.tokens
    with LLM(a.model, device="cpu", log_level="warning", max_model_len=context) as llm:
        vocab = min(llm.vocab_size, 256) if a.model is None else llm.vocab_size
        prompts = [
            [rng.randrange(1, vocab) for _ in range(a.prompt_tokens)] for _ in range(a.requests)
        ]
        params = variants(a.tokens)
        log("warming up (the first constrained request builds the tokenizer's trie)")
        t0 = time.perf_counter()
        llm.generate(prompts[:1], params["json"], use_tqdm=False)
        warmup_s = time.perf_counter() - t0
        for r in range(a.repeat):
            names = list(params)
            names = names[r % len(names) :] + names[: r % len(names)]
            for name in names:
                t0 = time.perf_counter()
                outs = llm.generate(prompts, params[name], use_tqdm=False)
                seconds = time.perf_counter() - t0
                n = sum(len(o.token_ids) for o in outs)
                if n != a.requests * a.tokens:
                    raise SystemExit(f"{name}: {n} tokens, not {a.requests * a.tokens}")
                runs.setdefault(name, []).append({"seconds": seconds, "tok_s": n / seconds})
                log(f"repeat {r} {name}: {n / seconds:.1f} tok/s")
    med = {k: statistics.median(x["tok_s"] for x in v) for k, v in runs.items()}
    result = {
        "benchmark": "structured_output",
        "model": a.model or "builtin",
        "requests": a.requests,
        "tokens_per_request": a.tokens,
        "warmup_first_constrained_s": round(warmup_s, 3),
        "tok_s_median": {k: round(v, 1) for k, v in med.items()},
        "ratio_to_free": {k: round(v / med["free"], 3) for k, v in med.items() if k != "free"},
        "runs": runs,
    }
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
