"""benchmarks/step_overhead.py runs end to end (in-process and multi-process engines, the
worker's timers, the bare ping-pong before and after): its JSON is complete. Synthetic
prompts, no peer; no timing asserted."""

from __future__ import annotations

from tests.helpers.cli_helpers import run_json_script


def test_step_overhead_benchmark_smoke(tmp_path) -> None:
    result = run_json_script(
        "benchmarks/step_overhead.py",
        *("--requests", "8", "--steps", "6", "--warmup", "2", "--profile-steps", "2"),
        *("--trace", str(tmp_path / "absent.jsonl"), "--peer", "off"),
    )
    assert result["requests"] == 8 and result["steps"] == 6
    assert result["prompts"].startswith("synthetic")
    for key in ("schedule_update_us", "total_us", "ipc_round_trip_us", "worker_bookkeeping_us"):
        assert result[key] > 0, key
    # The baseline pooled from a ping-pong before and one after the engine's run.
    assert len(result["bare_pingpong_poll_us_before_after"]) == 2
    assert result["bare_pingpong_poll_us"] > 0 and result["bare_pingpong_block_us"] > 0
    assert result["ipc_vs_bare_poll"] > 0
