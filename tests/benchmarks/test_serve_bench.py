"""benchmarks/serve_bench.py end to end in its --quick form: it starts a server and an
LLM, drives both, stops what it started, and reports every figure. No timing is checked
(the machine is shared); only that the report is whole and every request finished."""

from __future__ import annotations

import os
from pathlib import Path

from tests.helpers.cli_helpers import CPU, run_json_script

ROOT = Path(__file__).resolve().parents[2]
CELL_KEYS = {
    "workload",
    "concurrency",
    "prefix_caching",
    "server_tok_s",
    "llm_tok_s",
    "ratio",
    "ttft_p50_ms",
    "tpot_p50_ms",
    "itl_p50_ms",
    "prefix_hit_rate",
    "engine_first_token_p50_ms",
    "engine_decode_step_p50_ms",
}
SERVER_KEYS = {"output_tok_s", "request_s", "ttft_ms", "tpot_ms", "itl_ms", "prefix_hit_rate"}


def test_serve_bench_quick(tmp_path: Path) -> None:
    report = run_json_script("benchmarks/serve_bench.py", "--quick", "--device", CPU, cwd=tmp_path)
    assert report["all_finished"] and report["same_token_ids"]
    # The clients keep a core of their own: the workers get the rest, in both variants
    # (unless the environment fixed a count).
    fixed = os.environ.get("OMP_NUM_THREADS", "")
    expected = int(fixed) if fixed.isdigit() else max(1, len(os.sched_getaffinity(0)) - 1)
    assert report["worker_threads"] == expected
    cells = report["summary"]
    assert {(c["workload"], c["concurrency"], c["prefix_caching"]) for c in cells} == {
        (w, c, p) for w in ("random", "shared") for c in (1, 4) for p in ("on", "off")
    }
    for cell in cells:
        assert cell.keys() >= CELL_KEYS
    for run in report["runs"]:
        assert run["server"].keys() >= SERVER_KEYS
        assert run["server"]["ttft_ms"].keys() == {"p50", "p90", "p99"}
        assert run["server"]["finished"] == run["server"]["requests"] > 0
    # The shared system prompt hits once cached, and never with caching off.
    hits = {(c["workload"], c["prefix_caching"]): c["prefix_hit_rate"] for c in cells}
    assert hits["shared", "on"] > 0 and hits["shared", "off"] == hits["random", "off"] == 0
    assert report["goals"].keys() >= {"throughput_ratio_min", "ttft_over_engine_first_token_ms"}
