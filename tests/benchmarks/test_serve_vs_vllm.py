"""benchmarks/serve_vs_vllm.py in its --quick form with the peer venv pointed away: the
harness starts our server on the real model, drives every workload, says the peer is
missing, stops what it started and reports every figure. Nothing is timed (the machine is
shared); vLLM itself is not started here (its start-up alone takes minutes)."""

from __future__ import annotations

import re
from pathlib import Path

from tests.helpers.cli_helpers import run_json_script
from tests.helpers.real_model import fetch_real_model

RUN_KEYS = {
    "output_tok_s",
    "request_s",
    "completed",
    "failed",
    "ttft_p50_ms",
    "ttft_p99_ms",
    "tpot_p50_ms",
    "tpot_p99_ms",
    "itl_p50_ms",
    "itl_p99_ms",
    "preemptions",
    "server_cpu_s",
}


def test_serve_vs_vllm_quick_without_peer(tmp_path: Path) -> None:
    model = fetch_real_model()
    missing = tmp_path / "no-peer" / "python"
    table = tmp_path / "table.md"
    report = run_json_script(
        "benchmarks/serve_vs_vllm.py",
        "--quick",
        "--model",
        str(model),
        "--peer-python",
        str(missing),
        "--table",
        str(table),
        cwd=tmp_path,
    )
    assert report["peer_status"].startswith("absent: ") and str(missing) in report["peer_status"]
    assert report["client"] == "serve_bench's openai client" and report["targets"] is None
    assert report["all_completed"]
    runs = report["runs"]
    assert {(r["workload"], r["concurrency"]) for r in runs} == {
        ("random", 4),
        ("chat", 4),
        ("long-output", 4),
    }
    shapes = report["settings"]["shapes"]
    for r in runs:
        assert "peer" not in r and r["order"] == ["ours"]
        ours = r["ours"]
        assert ours.keys() >= RUN_KEYS
        n = report["settings"]["num_prompts"]
        assert ours["completed"] == n and ours["failed"] == 0
        # ignore_eos: every request generated exactly its shape's output tokens.
        assert ours["output_tokens"] == n * shapes[r["workload"]]["output"]
        assert ours["preemptions"] == 0
    for cell in report["summary"]:
        spread = cell["ours"]["output_tok_s"]
        assert spread["min"] <= spread["median"] <= spread["max"]
        assert "ours_over_peer" not in cell
    # Placement: every process of our server (API server, core, worker) with its threads.
    procs = report["placement"]["ours"]
    assert len(procs) >= 3 and all(p["threads"] >= 1 and p["threads_by_cpus"] for p in procs)
    assert "peer" not in report["placement"]
    text = table.read_text()
    assert text == report["table_md"] and "vLLM absent" in text
    assert len(re.findall(r"^\| (random|chat|long-output) \| 4 \|", text, re.M)) == 3


def _run(tok_s: float, ttft: float, itl99: float, preempt: float = 0.0) -> dict[str, float]:
    return {
        "output_tok_s": tok_s,
        "ttft_p50_ms": ttft,
        "ttft_p99_ms": 2 * ttft,
        "itl_p99_ms": itl99,
        "preemptions": preempt,
    }


def test_the_report_takes_medians_over_pairs_and_reads_the_targets_from_them() -> None:
    from benchmarks.serve_vs_vllm_report import summarize, table, targets

    runs = [
        {"workload": "random", "concurrency": 16, "ours": _run(o, t, 50), "peer": _run(p, 100, 60)}
        for o, p, t in ((200, 100, 90), (260, 120, 80), (230, 110, 120))
    ]
    # A failed run is left out of the medians, not read as zeros.
    runs.append(
        {
            "workload": "random",
            "concurrency": 16,
            "ours": {"error": "x"},
            "peer": _run(110, 100, 60),
        }
    )
    runs.append(
        {"workload": "chat", "concurrency": 1, "ours": _run(10, 300, 40), "peer": _run(10, 200, 30)}
    )
    summary = summarize(runs, ["ours", "peer"])
    random16 = next(s for s in summary if s["workload"] == "random")
    assert random16["ours"]["output_tok_s"] == {"median": 230, "min": 200, "max": 260}
    assert random16["ours"]["runs"] == 3 and random16["peer"]["runs"] == 4
    assert random16["ours_over_peer"]["output_tok_s"] == round(230 / 110, 3)
    assert random16["ours_over_peer"]["ttft_p50_ms"] == 0.9
    got = targets(summary)
    # Throughput counts at 16 and 64 streams only; latencies at every concurrency.
    assert got["throughput_met"] and got["throughput_ratio_min"] == round(230 / 110, 3)
    assert got["ttft_p50_ms_ratio_max"] == 1.5 and got["ttft_p50_ms_met"] is False
    assert got["itl_p99_ms_met"] is False and got["no_preemption_met"] is True
    md = table(summary, True)
    assert "| random | 16 | 230.0 / 110.0 (2.09x) | 90 / 100 |" in md
