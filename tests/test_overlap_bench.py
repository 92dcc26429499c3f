"""benchmarks/overlap.py runs end to end (serial and async engines, the worker's timing
file): its JSON is complete and both modes generate the same tokens. No timing asserted."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from cli_helpers import ENV

ROOT = Path(__file__).resolve().parent.parent


def test_overlap_benchmark_smoke() -> None:
    run = subprocess.run(
        [
            *(sys.executable, str(ROOT / "benchmarks" / "overlap.py")),
            *("--requests", "8", "--tokens", "6", "--rounds", "1", "--delay-ms", "1"),
        ],
        capture_output=True,
        text=True,
        timeout=600,
        env=ENV,
    )
    assert run.returncode == 0, run.stderr
    result = json.loads(run.stdout.splitlines()[-1])
    assert result["tokens_equal"] is True
    assert result["delay_ms"] == 1.0
    modes = [r["mode"] for r in result["runs"]]
    assert modes == ["serial", "async"]
    for r in result["runs"]:
        assert r["steps"] >= 6 and r["steps_per_s"] > 0
        # Each step slept the delay: the worker's busy time per step includes it.
        assert r["worker_busy_ms_per_step"] >= 1.0
        assert 0.0 <= r["worker_idle_share"] <= 1.0
