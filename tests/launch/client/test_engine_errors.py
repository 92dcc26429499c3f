"""Bad input fails alone; a bad model directory, a dead worker or Ctrl-C stop cleanly."""

from __future__ import annotations

import json
import os
import signal
import subprocess
from pathlib import Path

import pytest

from launch import LLM, SamplingParams
from launch.client.engine_processes import EngineDeadError
from tests.helpers.cli_helpers import (
    CPU,
    ENV,
    StderrWatch,
    all_gone,
    children_of,
    generate_cli,
    generate_cmd,
    processes_mentioning,
)
from tests.helpers.hf_checkpoints import VOCAB


def test_bad_requests_fail_alone(llama_dir: Path, tmp_path: Path) -> None:
    good = json.dumps({"prompt_token_ids": [5, 6, 7, 8], "max_tokens": 4, "temperature": 0})
    lines = [
        good,
        json.dumps({"prompt_token_ids": list(range(3, 103))}),  # 100 > max_model_len 64
        json.dumps({"prompt_token_ids": []}),
        json.dumps({"prompt_token_ids": [5, VOCAB + 7, 9]}),
        json.dumps({"prompt_token_ids": [5, 6], "max_tokens": 0}),
        json.dumps({"prompt_token_ids": [5, 6], "bogus": 1}),
        json.dumps({"prompt": "text needs a tokenizer"}),
        "{not json",
        good,
    ]
    proc, results = generate_cli(llama_dir, lines, tmp_path, "--max-model-len", "64")
    assert proc.returncode == 1, proc.stderr  # some requests failed: not a clean run
    assert [r["index"] for r in results] == list(range(len(lines)))
    errors = {r["index"]: r.get("error", "") for r in results}
    assert results[0]["finish_reason"] == results[8]["finish_reason"] == "length"
    assert len(results[0]["token_ids"]) == 4 and results[0]["token_ids"] == results[8]["token_ids"]
    expected = {
        1: "longer than max_model_len 64",
        2: "empty prompt",
        3: f"token id {VOCAB + 7} is outside the vocabulary",
        4: "max_tokens must be in [1, 2**63), got 0",
        5: "unknown field `bogus`",
        6: "no tokenizer",
        7: "in.jsonl:8",
    }
    for index, message in expected.items():
        assert results[index]["finish_reason"] == "error"
        assert message in errors[index], (index, errors[index])
        # Every error names its input line (index + 1: no blank lines here).
        assert errors[index].startswith(f"{tmp_path / 'in.jsonl'}:{index + 1}: "), errors[index]
    assert "(7 failed)" in proc.stderr and "7 of 9 requests failed" in proc.stderr


@pytest.mark.parametrize(
    ("setup", "message"),
    [
        (lambda d: None, "does not exist"),
        (lambda d: d.mkdir(), "config.json"),
        (lambda d: (d.mkdir(), (d / "config.json").write_text("{oops")), "config.json"),
    ],
)
def test_bad_model_directory_fails_at_start_naming_the_file(setup, message, tmp_path: Path):
    model = tmp_path / "model"
    setup(model)
    proc, _ = generate_cli(model, ['{"prompt_token_ids": [1]}'], tmp_path)
    assert proc.returncode == 1
    assert message in proc.stderr and str(model) in proc.stderr, proc.stderr


def test_missing_weights_fail_at_start(llama_dir: Path, tmp_path: Path) -> None:
    model = tmp_path / "noweights"
    model.mkdir()
    (model / "config.json").write_text((llama_dir / "config.json").read_text())
    proc, _ = generate_cli(model, ['{"prompt_token_ids": [1]}'], tmp_path)
    assert proc.returncode == 1
    assert "worker rank 0" in proc.stderr and "safetensors" in proc.stderr, proc.stderr


@pytest.mark.parametrize("async_scheduling", [False, True], ids=["serial", "async"])
def test_killed_worker_fails_open_requests_and_names_the_rank(async_scheduling: bool) -> None:
    # The built-in model (4096 positions: long runs); 299 usable blocks hold one request
    # of 4096 tokens, not four of 3000. Async, the core keeps two steps queued while the
    # requests decode, so the kill lands with both in flight.
    llm = LLM(num_gpu_blocks=300, device=CPU, async_scheduling=async_scheduling)
    procs = dict(llm.engine.procs)
    params = SamplingParams(max_tokens=3000, temperature=0, ignore_eos=True)
    tokens: dict[str, list[int]] = {f"r{i}": [] for i in range(4)}
    for rid in tokens:
        llm.engine.add_request(rid, [5, 6, 7], params)
    errors: dict[str, str | None] = {}
    killed = False
    with pytest.raises(EngineDeadError) as dead:
        while True:  # until the engine reports its death, after failing every request
            batch = llm.engine.get_outputs()
            for o in batch.outputs if batch is not None else ():
                tokens[o.request_id].extend(o.new_token_ids)
                if o.finish_reason is not None:
                    assert o.finish_reason == "error", o
                    errors[o.request_id] = o.error
            if not killed and all(tokens.values()):
                # Every request has streamed tokens: the kill lands mid-run.
                procs["worker rank 0"].send_signal(signal.SIGKILL)
                killed = True
    assert killed
    assert set(errors) == set(tokens)
    for rid, error in errors.items():
        assert "worker rank 0 disconnected" in (error or ""), error
        assert 0 < len(tokens[rid]) < 3000  # what was streamed before the loss is kept
    assert "worker rank 0" in str(dead.value) and "killed by signal 9" in str(dead.value)
    llm.close()
    assert all_gone([p.pid for p in procs.values()])


# When Ctrl-C comes, each moment a line the processes log: the launcher about to spawn,
# the core up and waiting, the worker loading, the worker loaded (the engine not ready),
# the KV cache sized (generation starts right after). Every time: exit status 130, a
# one-line message, no process left, no socket folder left.
CTRL_C_MOMENTS = {
    "launching": r"starting the engine core",
    "core-up": r"engine core: waiting for 1 worker",
    "loading": r"worker rank 0: loading",
    "loaded": r"attention kernels:",
    "generating": r"KV cache: \d+ blocks",
}


@pytest.mark.parametrize("moment", list(CTRL_C_MOMENTS))
def test_ctrl_c_stops_everything(moment: str, tmp_path: Path) -> None:
    inp, tmp = tmp_path / "in.jsonl", tmp_path / "tmp"
    tmp.mkdir()
    inp.write_text(json.dumps({"prompt": "x", "max_tokens": 4000, "ignore_eos": True}) + "\n")
    proc = subprocess.Popen(
        generate_cmd(inp, tmp_path / "out.jsonl", "--log-level", "INFO"),
        stderr=subprocess.PIPE,
        text=True,
        env={**ENV, "TMPDIR": str(tmp)},  # the socket folder goes here
    )
    watch = StderrWatch(proc)
    watch.wait_for(CTRL_C_MOMENTS[moment])
    children = children_of(proc.pid)  # the launcher may not have spawned them all yet
    proc.send_signal(signal.SIGINT)
    assert proc.wait(timeout=60) == 130, watch.join()
    stderr = watch.join()
    assert "interrupted" in stderr and "Traceback" not in stderr, stderr
    assert all_gone(children + processes_mentioning(str(tmp))), "orphans after Ctrl-C"
    assert not os.listdir(tmp), "socket folder left behind"
