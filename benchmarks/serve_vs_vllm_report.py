"""serve_vs_vllm's report: per cell and server the median, min and max over the pairs,
the ratios ours / vLLM, the targets read from them, and a markdown table."""

from __future__ import annotations

import statistics
from typing import Any

METRICS = (
    "output_tok_s",
    "request_s",
    "ttft_p50_ms",
    "ttft_p99_ms",
    "tpot_p50_ms",
    "tpot_p99_ms",
    "itl_p50_ms",
    "itl_p99_ms",
    "e2el_p50_ms",
    "e2el_p99_ms",
    "preemptions",
    "server_cpu_s",
    "idle_server_cpu_s",
)
# Targets: throughput at these concurrencies at least this many times vLLM's.
THROUGHPUT_AT = (16, 64)
THROUGHPUT_RATIO = 1.8


def _spread(vals: list[float]) -> dict[str, float] | None:
    if not vals:
        return None
    return {
        "median": round(statistics.median(vals), 3),
        "min": round(min(vals), 3),
        "max": round(max(vals), 3),
    }


def summarize(runs: list[dict[str, Any]], sides: list[str]) -> list[dict[str, Any]]:
    cells: dict[tuple[str, int], list[dict[str, Any]]] = {}
    for r in runs:
        cells.setdefault((r["workload"], r["concurrency"]), []).append(r)
    out = []
    for (wl, c), rows in cells.items():
        cell: dict[str, Any] = {"workload": wl, "concurrency": c, "pairs": len(rows)}
        for side in sides:
            ok = [r[side] for r in rows if side in r and "error" not in r[side]]
            cell[side] = {m: _spread([x[m] for x in ok if x.get(m) is not None]) for m in METRICS}
            cell[side]["runs"] = len(ok)
        if "peer" in sides:
            for side in (s for s in sides if s != "peer"):
                cell[f"{side}_over_peer"] = {
                    m: _ratio(cell[side][m], cell["peer"][m]) for m in METRICS[:10]
                }
        out.append(cell)
    return out


def _ratio(x: dict[str, float] | None, y: dict[str, float] | None) -> float | None:
    if not x or not y or not y["median"]:
        return None
    return round(x["median"] / y["median"], 3)


def targets(summary: list[dict[str, Any]]) -> dict[str, Any]:
    """The serving goals, read from the medians: throughput at 16 and 64 streams at least
    1.8x vLLM's; TTFT p50 and p99 and ITL p99 at most vLLM's at every concurrency; no
    preemption on the random workload. None where a cell did not run."""
    res: dict[str, Any] = {}
    thr = [
        s["ours_over_peer"]["output_tok_s"]
        for s in summary
        if s["concurrency"] in THROUGHPUT_AT and s["ours_over_peer"]["output_tok_s"] is not None
    ]
    res["throughput_ratio_min"] = min(thr) if thr else None
    res["throughput_met"] = min(thr) >= THROUGHPUT_RATIO if thr else None
    for m in ("ttft_p50_ms", "ttft_p99_ms", "itl_p99_ms"):
        rs = [s["ours_over_peer"][m] for s in summary if s["ours_over_peer"][m] is not None]
        res[f"{m}_ratio_max"] = max(rs) if rs else None
        res[f"{m}_met"] = max(rs) <= 1.0 if rs else None
    pre = [
        s["ours"]["preemptions"]["max"]
        for s in summary
        if s["workload"] == "random" and s["ours"]["preemptions"] is not None
    ]
    res["random_preemptions_max"] = max(pre) if pre else None
    res["no_preemption_met"] = max(pre) == 0 if pre else None
    return res


def _med(cell: dict[str, Any], side: str, m: str, digits: int = 0) -> str:
    v = cell.get(side, {}).get(m)
    if v is None:
        return "-"
    return f"{v['median']:.{digits}f}"


def table(summary: list[dict[str, Any]], with_peer: bool) -> str:
    """Medians per cell: 'ours / vLLM (ratio)' for throughput, 'ours / vLLM' for the rest."""
    cols = [
        ("output tok/s", "output_tok_s", 1),
        ("TTFT p50 ms", "ttft_p50_ms", 0),
        ("TTFT p99 ms", "ttft_p99_ms", 0),
        ("TPOT p50 ms", "tpot_p50_ms", 1),
        ("TPOT p99 ms", "tpot_p99_ms", 1),
        ("ITL p50 ms", "itl_p50_ms", 1),
        ("ITL p99 ms", "itl_p99_ms", 0),
        ("preemptions", "preemptions", 0),
    ]
    who = "ours / vLLM" if with_peer else "ours (vLLM absent)"
    head = f"| workload | streams | {' | '.join(c[0] for c in cols)} |"
    lines = [f"Medians over the pairs, {who}.", "", head, "|" + " --- |" * (len(cols) + 2)]
    for s in summary:
        cells = []
        for _, m, d in cols:
            text = _med(s, "ours", m, d)
            if with_peer:
                text += f" / {_med(s, 'peer', m, d)}"
                ratio = s["ours_over_peer"].get(m)
                if m == "output_tok_s" and ratio is not None:
                    text += f" ({ratio:.2f}x)"
            cells.append(text)
        lines.append(f"| {s['workload']} | {s['concurrency']} | {' | '.join(cells)} |")
    return "\n".join(lines) + "\n"
