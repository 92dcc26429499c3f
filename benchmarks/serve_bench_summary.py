"""serve_bench's report: the median of each cell's repeats, and the two goals read from
them."""

from __future__ import annotations

import statistics
from typing import Any


def _median(rows: list[dict[str, Any]], *path: str) -> float | None:
    vals = []
    for r in rows:
        v: Any = r
        for p in path:
            v = v.get(p) if isinstance(v, dict) else None
        if v is not None:
            vals.append(v)
    return round(statistics.median(vals), 3) if vals else None


def summarize(runs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    cells: dict[tuple, list[dict[str, Any]]] = {}
    for r in runs:
        cells.setdefault((r["workload"], r["concurrency"], r["prefix_caching"]), []).append(r)
    out = []
    for (wl, c, pc), rows in cells.items():
        out.append(
            {
                "workload": wl,
                "concurrency": c,
                "prefix_caching": pc,
                "repeats": len(rows),
                "server_tok_s": _median(rows, "server", "output_tok_s"),
                "llm_tok_s": _median(rows, "llm", "output_tok_s"),
                "ratio": _median(rows, "ratio"),
                "ratios": [r["ratio"] for r in rows],
                "ttft_p50_ms": _median(rows, "server", "ttft_ms", "p50"),
                "server_ttft_mean_ms": _median(rows, "server", "server_ttft_mean_ms"),
                "tpot_p50_ms": _median(rows, "server", "tpot_ms", "p50"),
                "itl_p50_ms": _median(rows, "server", "itl_ms", "p50"),
                "server_cpu_us_per_token": _median(rows, "server", "server_cpu_us_per_token"),
                "client_cpu_us_per_token": _median(rows, "server", "client_cpu_us_per_token"),
                "llm_client_cpu_us_per_token": _median(rows, "llm", "client_cpu_us_per_token"),
                "engine_cpu_us_per_token": _median(rows, "server", "engine_cpu_us_per_token"),
                "llm_engine_cpu_us_per_token": _median(rows, "llm", "engine_cpu_us_per_token"),
                "prefix_hit_rate": _median(rows, "server", "prefix_hit_rate"),
                "engine_first_token_p50_ms": _median(rows, "engine", "first_token_ms", "p50"),
                "engine_decode_step_p50_ms": _median(rows, "engine", "decode_step_ms", "p50"),
            }
        )
    return out


def goals(summary: list[dict[str, Any]]) -> dict[str, Any]:
    """The serving layer's two goals: the throughput ratio at the highest concurrency
    (every cell, the worst counts; met at 0.9), and TTFT at concurrency 1 against the
    engine's own first token on the same prompts (its prefill step; the decode step is
    reported beside it; met within 5 ms)."""
    out: dict[str, Any] = {}
    if not summary:
        return out
    top = max(s["concurrency"] for s in summary)
    ratios = [s["ratio"] for s in summary if s["concurrency"] == top and s["ratio"]]
    if ratios:
        out["throughput_concurrency"] = top
        out["throughput_ratio_min"] = min(ratios)
        out["throughput_ratio_median"] = round(statistics.median(ratios), 3)
        out["throughput_met"] = min(ratios) >= 0.9
    low = [
        s for s in summary if s["concurrency"] == 1 and s["engine_first_token_p50_ms"] is not None
    ]
    if low and all(s["ttft_p50_ms"] is not None for s in low):
        over = [round(s["ttft_p50_ms"] - s["engine_first_token_p50_ms"], 3) for s in low]
        out["ttft_over_engine_first_token_ms"] = over
        out["ttft_over_engine_first_token_max_ms"] = max(over)
        out["engine_decode_step_p50_ms"] = round(
            statistics.median(s["engine_decode_step_p50_ms"] for s in low), 3
        )
        out["ttft_met"] = max(over) <= 5.0
    return out
