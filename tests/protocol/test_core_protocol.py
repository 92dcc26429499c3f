"""The core as another program embeds it: the router example over two engines, the
distinct rejection of a request id that is already open, and the --log-kv view."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from launch.client.engine_args import EngineArgs
from launch.client.engine_processes import EngineProcesses
from protocol.engine import SamplingParams
from protocol.zmq_security import make_keys
from tests.helpers.cli_helpers import CPU, run_json_script

ROOT = Path(__file__).resolve().parents[2]
ENV = {**os.environ, "PYTHONPATH": str(ROOT)}


@pytest.mark.parametrize("curve", [False, True], ids=["plain", "curve"])
def test_router_example_beats_round_robin(curve: bool, llama_dir: Path, tmp_path: Path) -> None:
    """With keys, the router reads both engines' events as an admitted CURVE client."""
    flags: tuple[str, ...] = ()
    if curve:
        make_keys(tmp_path / "keys", ["client"])
        flags = ("--zmq-curve-keys", str(tmp_path / "keys"))
    result = run_json_script(
        "examples/router.py",
        *("--model", str(llama_dir), "--requests", "24", "--prefixes", "4"),
        *("--prefix-len", "48", "--block-size", "8", "--device", CPU, *flags),
    )
    kv, rr = result["kv_aware"], result["round_robin"]
    assert kv["prompt_tokens"] == rr["prompt_tokens"]
    assert kv["hit_rate"] > rr["hit_rate"] > 0, result
    assert sum(kv["requests_per_engine"]) == 24 and min(kv["requests_per_engine"]) > 0


def test_an_open_request_id_is_rejected_not_failed(llama_dir: Path) -> None:
    long = SamplingParams(max_tokens=60, temperature=0, ignore_eos=True)
    with EngineProcesses(EngineArgs(model=str(llama_dir), device=CPU)) as engine:
        engine.add_request("a", [5, 6, 7, 8], long)
        engine.add_request("a", [9, 9], long)  # while the first "a" is open
        tokens: list[int] = []
        rejected = []
        reason = None
        deadline = time.monotonic() + 300  # only so that a broken engine cannot hang CI
        while reason is None and time.monotonic() < deadline:
            batch = engine.get_outputs()
            if batch is None:
                continue
            rejected.extend(batch.rejected)
            for out in batch.outputs:
                assert out.request_id == "a"
                tokens.extend(out.new_token_ids)
                reason = out.finish_reason or reason
    assert [(r.request_id, "already open" in r.reason) for r in rejected] == [("a", True)]
    assert reason == "length" and len(tokens) == 60  # the live request never saw it


def test_an_abort_reports_the_freed_blocks_at_once(llama_dir: Path) -> None:
    """The abort's own reply carries the scheduler stats: KV usage back to 0 without
    waiting for another step (an idle engine takes none)."""
    long = SamplingParams(max_tokens=4000, ignore_eos=True)
    with EngineProcesses(EngineArgs(model=str(llama_dir), device=CPU)) as engine:
        engine.add_request("a", list(range(3, 60)), long)
        deadline = time.monotonic() + 300  # only so that a broken engine cannot hang CI
        running = False
        while not running and time.monotonic() < deadline:
            batch = engine.get_outputs()
            running = batch is not None and any(o.new_token_ids for o in batch.outputs)
        engine.abort(["a"])
        final = None
        while final is None and time.monotonic() < deadline:
            batch = engine.get_outputs()
            if batch is not None and any(o.finish_reason == "abort" for o in batch.outputs):
                final = batch
    assert final is not None and final.stats is not None
    assert final.stats.kv_cache_usage == 0.0 and final.stats.num_running == 0


def test_log_kv_prints_a_line_per_step(llama_dir: Path, tmp_path: Path) -> None:
    inp, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    prompt = list(range(3, 40))
    inp.write_text(json.dumps({"prompt_token_ids": prompt}) + "\n")
    run = subprocess.run(
        [
            *(sys.executable, "-m", "launch.cli", "generate", "--model", str(llama_dir)),
            *("--input", str(inp), "--output", str(out), "--device", CPU, "--no-progress"),
            *("--max-tokens", "3", "--block-size", "8", "--max-num-batched-tokens", "16"),
            "--log-kv",
        ],
        capture_output=True,
        text=True,
        timeout=600,
        env=ENV,
    )
    assert run.returncode == 0, run.stderr
    lines = [ln for ln in run.stderr.splitlines() if "pagedserve.kv" in ln]
    # 37 prompt tokens in chunks of 16: 3 prefill steps, then 2 decode steps.
    assert len(lines) == 5, run.stderr
    assert "req-0 hit 0 new 2 held [2]" in lines[0]
    assert "req-0 new 2 held [4]" in lines[1]
    assert "req-0 new 1 held [5]" in lines[2]
    assert all("free " in ln for ln in lines)


@pytest.mark.parametrize("curve", [False, True], ids=["ipc", "tcp-curve"])
def test_raw_client_example_speaks_the_documented_protocol(
    curve: bool, llama_dir: Path, tmp_path: Path
) -> None:
    """examples/raw_client.py: only pyzmq, msgspec and protocol/, as docs/protocol.md says;
    with keys, over loopback TCP where the core (connecting) is the CURVE server."""
    flags: tuple[str, ...] = ()
    if curve:
        make_keys(tmp_path / "keys", ["client"])
        flags = ("--zmq-curve-keys", str(tmp_path / "keys"))
    summary = run_json_script("examples/raw_client.py", "--model", str(llama_dir), *flags)
    assert summary["finish"] == {"a": "length", "b": "abort"}
    assert len(summary["tokens"]["a"]) == 8 and summary["rejected"] == ["a"]
