"""benchmarks/overlap.py runs end to end (serial and async engines, the worker's timing
file): its JSON is complete and both modes generate the same tokens. No timing asserted."""

from __future__ import annotations

from cli_helpers import run_json_script


def test_overlap_benchmark_smoke() -> None:
    result = run_json_script(
        "benchmarks/overlap.py",
        *("--requests", "8", "--tokens", "6", "--rounds", "1", "--delay-ms", "1"),
    )
    assert result["tokens_equal"] is True
    assert result["delay_ms"] == 1.0
    modes = [r["mode"] for r in result["runs"]]
    assert modes == ["serial", "async"]
    for r in result["runs"]:
        assert r["steps"] >= 6 and r["steps_per_s"] > 0
        # Each step slept the delay: the worker's busy time per step includes it.
        assert r["worker_busy_ms_per_step"] >= 1.0
        assert 0.0 <= r["worker_idle_share"] <= 1.0
