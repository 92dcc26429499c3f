"""launch/results.py: the output file of `pagedserve generate`, one JSON line per result,
flushed as each ends and sorted into input order when the run ends normally."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from launch import SamplingParams
from launch.client.llm import CompletionOutput
from launch.results import MAX_LISTED_ERRORS, ResultWriter
from protocol.engine import Logprobs


def _lines(path: Path) -> list[dict[str, Any]]:
    return [json.loads(x) for x in path.read_text().splitlines()]


def test_each_result_is_on_disk_before_the_file_is_closed(tmp_path: Path) -> None:
    path = tmp_path / "deep" / "out.jsonl"
    writer = ResultWriter(path)
    writer.start()
    assert path.read_text() == ""  # created at once, folders too
    writer.write(3, CompletionOutput(3, [1, 2], [9], text="x", finish_reason="stop"))
    assert _lines(path) == [
        {
            "index": 3,
            "prompt_token_ids": [1, 2],
            "token_ids": [9],
            "finish_reason": "stop",
            "num_cached_tokens": 0,
            "text": "x",
        }
    ]
    writer.close(sort=False)
    writer.close(sort=True)  # a second close does nothing


def test_keys_for_options_appear_only_when_the_request_asked_for_them(tmp_path: Path) -> None:
    writer = ResultWriter(tmp_path / "out.jsonl")
    writer.start()
    plain = CompletionOutput(0, [1], [2], finish_reason="length", stop_reason="never shown")
    writer.write(0, plain, SamplingParams())
    lp = Logprobs(-0.5, [2, 4], [-0.5, -1.5])
    asked = CompletionOutput(
        1,
        [1, 2],
        [2],
        finish_reason="stop",
        stop_reason="END",
        seq_index=1,
        logprobs=[lp],
        prompt_logprobs=[None, lp],
    )
    writer.write(1, asked, SamplingParams(n=2, stop=["END"]))
    writer.close(sort=False)
    first, second = _lines(tmp_path / "out.jsonl")
    assert set(first) == {"index", "prompt_token_ids", "token_ids", "finish_reason"} | {
        "num_cached_tokens"
    }
    as_object = {"logprob": -0.5, "top_token_ids": [2, 4], "top_logprobs": [-0.5, -1.5]}
    assert second["seq_index"] == 1 and second["stop_reason"] == "END"
    assert second["logprobs"] == [as_object]
    assert second["prompt_logprobs"] == [None, as_object]


def test_failed_requests_are_counted_and_the_first_ones_listed(tmp_path: Path) -> None:
    writer = ResultWriter(tmp_path / "out.jsonl")
    writer.start()
    writer.write(0, CompletionOutput(0, [1], [2], finish_reason="length"))
    for i in range(1, MAX_LISTED_ERRORS + 3):
        out = CompletionOutput(i, [1], finish_reason="error", error=f"bad {i}", seq_index=1)
        writer.write(i, out, SamplingParams(n=2, stop=["x"]) if i == 1 else None)
    writer.close(sort=False)
    assert writer.written == MAX_LISTED_ERRORS + 3
    assert writer.failed == MAX_LISTED_ERRORS + 2
    assert len(writer.errors) == MAX_LISTED_ERRORS
    assert writer.errors[:2] == ["request 1 (copy 1) failed: bad 1", "request 2 failed: bad 2"]
    lines = _lines(tmp_path / "out.jsonl")
    assert lines[1]["error"] == "bad 1" and "stop_reason" not in lines[1]


def test_the_final_sort_keeps_copies_in_seq_order(tmp_path: Path) -> None:
    writer = ResultWriter(tmp_path / "out.jsonl")
    writer.start()
    two = SamplingParams(n=2)
    # Finish order: copies out of order, and interleaved with other prompts.
    for index, seq in ((1, 1), (0, 0), (1, 0), (2, 0)):
        out = CompletionOutput(index, [5], [7], finish_reason="length", seq_index=seq)
        writer.write(index, out, two if index == 1 else None)
    writer.close(sort=True)
    lines = _lines(tmp_path / "out.jsonl")
    assert [(r["index"], r.get("seq_index")) for r in lines] == [
        (0, None),
        (1, 0),
        (1, 1),
        (2, None),
    ]
    assert [p.name for p in tmp_path.iterdir()] == ["out.jsonl"]  # no temporary file left
