#!/usr/bin/env python3
"""Speculative decoding at concurrency 1, side by side with vLLM's CPU backend.

    python benchmarks/spec_vs_vllm.py [--model DIR] [--pairs 3] [--tokens 128]
        [--workloads copy free] [--speculative-config JSON] [--also-off]

Both engines get the same chat prompts as token ids (the copy-heavy and free-writing
workloads of spec_decode_bench.py), one request at a time, greedy, with the same n-gram
settings (vLLM's `speculative_config` keys; its n-gram proposer runs on the CPU when
`numba` is installed in its venv, else the run says so and fails). Each pair runs our
engine and vLLM's in turn (order swapped every pair), each in a process of its own
(benchmarks/spec_c1_run.py); only generation is timed. --also-off adds both engines
without speculation to every pair. Reports output tok/s median [min-max] per engine and
workload, the ratio ours/vLLM per pair, acceptance, and whether the greedy tokens agree.
Progress on stderr; the last stdout line is one JSON object.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "benchmarks"))

from peer import PEERS_DIR  # noqa: E402
from spec_decode_bench import NGRAM, REAL_MODEL, conversations  # noqa: E402

RUNNER = ROOT / "benchmarks" / "spec_c1_run.py"
PEER_PYTHON = PEERS_DIR / "vllm-full-venv" / "bin" / "python"
PROMPTS_PER_WORKLOAD = 4


def log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def write_workload(model: str, workload: str, tokens: int, path: Path) -> None:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model)
    with path.open("w") as f:
        for conv in conversations(workload, PROMPTS_PER_WORKLOAD):
            ids = tok.apply_chat_template(conv, add_generation_prompt=True, tokenize=True)
            if not isinstance(ids, list):  # newer transformers return a BatchEncoding
                ids = list(ids["input_ids"])
            f.write(json.dumps({"prompt_token_ids": [int(i) for i in ids], "max_tokens": tokens}))
            f.write("\n")


def run(python: Path, engine: str, model: str, workload: Path, spec: str | None) -> dict:
    cmd = [str(python), str(RUNNER), "--engine", engine, "--model", model, "--input", str(workload)]
    if spec is not None:
        cmd += ["--speculative-config", spec]
    out = subprocess.run(cmd, capture_output=True, text=True, check=False)
    if out.returncode != 0:
        raise SystemExit(f"{engine} failed:\n{out.stderr[-3000:]}")
    # vLLM logs to stdout too, also at exit: the result is the line the runner printed.
    line = next(x for x in reversed(out.stdout.splitlines()) if x.startswith('{"engine"'))
    return json.loads(line)


def summary(runs: list[dict]) -> dict[str, Any]:
    rates = [sum(len(t) for t in r["token_ids"]) / sum(r["seconds"]) for r in runs]
    spent = [r["spec"] for r in runs if r["spec"].get("draft_tokens")]
    drafts = sum(s.get("drafts", 0) for s in spent)
    draft_tokens = sum(s.get("draft_tokens", 0) for s in spent)
    accepted = sum(s.get("accepted", 0) for s in spent)
    return {
        "tok_s_median": round(statistics.median(rates), 2),
        "tok_s_min": round(min(rates), 2),
        "tok_s_max": round(max(rates), 2),
        "acceptance_rate": round(accepted / draft_tokens, 3) if draft_tokens else 0.0,
        "mean_accepted_length": round(1 + accepted / drafts, 3) if drafts else 0.0,
        "load_s_median": round(statistics.median(r["load_s"] for r in runs), 1),
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    default = str(REAL_MODEL) if REAL_MODEL.exists() else None
    p.add_argument("--model", default=default, help="checkpoint (default: the real model)")
    p.add_argument("--pairs", type=int, default=3)
    p.add_argument("--tokens", type=int, default=128)
    p.add_argument("--workloads", nargs="+", default=["copy", "free"])
    p.add_argument("--speculative-config", default=json.dumps(NGRAM))
    p.add_argument("--also-off", action="store_true", help="both engines without drafts too")
    p.add_argument("--peer-python", type=Path, default=PEER_PYTHON)
    a = p.parse_args(argv)
    if a.model is None:
        p.error("no --model and no real model (benchmarks/fetch_real_model.py fetches it)")
    if not a.peer_python.exists():
        p.error(f"no vLLM peer at {a.peer_python} (the peer's setup-full.sh makes it)")
    variants = [("on", a.speculative_config)] + ([("off", None)] if a.also_off else [])
    pythons = {"pagedserve": Path(sys.executable), "vllm": a.peer_python}
    runs: dict[str, list[dict]] = {}
    result: dict[str, Any] = {
        "model": a.model,
        "speculative_config": json.loads(a.speculative_config),
    }
    with tempfile.TemporaryDirectory() as tmp:
        files = {w: Path(tmp) / f"{w}.jsonl" for w in a.workloads}
        for w, path in files.items():
            write_workload(a.model, w, a.tokens, path)
        for pair in range(a.pairs):
            order = ["pagedserve", "vllm"] if pair % 2 == 0 else ["vllm", "pagedserve"]
            for w, path in files.items():
                for variant, spec in variants:
                    for engine in order:
                        r = run(pythons[engine], engine, a.model, path, spec)
                        runs.setdefault(f"{engine}/{w}/{variant}", []).append(r)
                        rate = sum(len(t) for t in r["token_ids"]) / sum(r["seconds"])
                        log(f"pair {pair} {w} spec {variant} {engine}: {rate:.1f} tok/s")
    for w in a.workloads:
        for variant, _ in variants:
            ours, peer = runs[f"pagedserve/{w}/{variant}"], runs[f"vllm/{w}/{variant}"]
            ratios = [
                (sum(len(t) for t in o["token_ids"]) / sum(o["seconds"]))
                / (sum(len(t) for t in v["token_ids"]) / sum(v["seconds"]))
                for o, v in zip(ours, peer)
            ]
            result[f"{w}/spec_{variant}"] = {
                "pagedserve": summary(ours),
                "vllm": summary(peer),
                "ratio_median": round(statistics.median(ratios), 3),
                "ratio_min": round(min(ratios), 3),
                "ratio_max": round(max(ratios), 3),
                "same_tokens": ours[0]["token_ids"] == peer[0]["token_ids"],
            }
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
