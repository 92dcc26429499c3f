"""The run summary's KV tier part: hits, transfers, load time and unreadable blocks."""

from __future__ import annotations

from launch.cli import _tier_summary
from launch.client.llm import RunSummary
from protocol.engine import KVTierStats, SchedulerStats


def test_the_summary_names_load_time_disk_loads_and_recomputed_blocks() -> None:
    tier = KVTierStats(80, 64, 20, 16, 1 << 20, 6, 2, 0.125)
    summary = RunSummary(stats=SchedulerStats(0, 0, 0.0, 0, 0, 0, 0, kv_tier=tier))
    line = _tier_summary(summary)
    assert "64/80 tokens hit" in line and "16 loaded (16.0 MiB, 6 from disk) in 0.125 s" in line
    assert "2 unreadable (recomputed)" in line
    assert _tier_summary(RunSummary()) == ""
