"""benchmarks/overlap.py runs end to end (serial and async engines, the worker's timing
file): its JSON is complete and both modes generate the same tokens. No timing asserted."""

from __future__ import annotations

import pytest

from tests.helpers.cli_helpers import run_json_script


@pytest.mark.parametrize("skip", ["none", "attention", "layers"])
def test_overlap_benchmark_smoke(skip: str) -> None:
    result = run_json_script(
        "benchmarks/overlap.py",
        *("--requests", "8", "--tokens", "6", "--rounds", "1", "--delay-ms", "50"),
        *("--skip", skip),
    )
    assert result["skip"] == skip
    assert result["tokens_equal"] is True
    assert result["delay_ms"] == 50.0
    modes = [r["mode"] for r in result["runs"]]
    assert modes == ["serial", "async"]
    for r in result["runs"]:
        assert r["steps"] >= 6 and r["steps_per_s"] > 0
        # The modelled device was busy the delay in every step.
        assert r["worker_busy_ms_per_step"] >= 50.0
        assert 0.0 <= r["worker_idle_share"] <= 1.0
    serial, async_ = result["runs"]
    # A serial core sends nothing before it has the answer; under async scheduling the
    # next step arrives while the device is busy (50 ms) and the worker plans it then.
    assert serial["planned_ahead"] == 0
    assert async_["planned_ahead"] > 0
