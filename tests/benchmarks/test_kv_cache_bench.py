"""benchmarks/kv_cache_bench.py runs end to end on a small synthetic trace: replays with KV
events off and on give the same hits, nothing leaks, the trace it writes replays again
and names what the peer needs. No peer, no timing asserted."""

from __future__ import annotations

import json

from tests.helpers.cli_helpers import run_json_script

SMALL = (
    *("--num-requests", "60", "--num-prefixes", "3", "--prefix-min", "32"),
    *("--prefix-max", "96", "--suffix-min", "8", "--suffix-max", "40"),
    *("--decode-min", "4", "--decode-max", "24", "--max-running", "16"),
    *("--num-gpu-blocks", "96", "--repeat", "1", "--peer", "off"),
)


def test_kv_cache_benchmark_smoke(tmp_path) -> None:
    trace = tmp_path / "trace.jsonl"
    result = run_json_script(
        "benchmarks/kv_cache_bench.py", "--synthetic", "--write-trace", str(trace), *SMALL
    )
    assert result["ops"]["arrive"] == 60 and result["ops"]["finish"] == 60
    assert result["hit_tokens"] > 0 and result["evictions"] > 0 and result["dropped"] == 0
    events = result["kv_events"]
    assert events["same_hit_tokens"] and events["batches_published"] > 0
    meta = json.loads(trace.read_text().splitlines()[0])
    assert meta["decode_len"] == [4, 24] and meta["prefix_len"] == [32, 96]
    again = run_json_script(
        "benchmarks/kv_cache_bench.py", "--trace", str(trace), "--repeat", "1", "--peer", "off"
    )
    assert again["hit_tokens"] == result["hit_tokens"]
    assert again["kv_events"]["batches_published"] == events["batches_published"]
