"""benchmarks/step_knee.py runs end to end on the real model: a row per size, in order,
with positive times; no timing asserted."""

from __future__ import annotations

from tests.helpers.cli_helpers import run_json_script


def test_step_knee_benchmark_smoke() -> None:
    result = run_json_script("benchmarks/step_knee.py", "--sizes", "8,24", "--reps", "1")
    assert result["threads"] == 1
    assert [row["tokens"] for row in result["steps"]] == [8, 24]
    assert all(row["min_ms"] > 0 and row["ms_per_token"] > 0 for row in result["steps"])
