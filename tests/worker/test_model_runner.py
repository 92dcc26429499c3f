"""Logits through the real worker path, at every computed position, against transformers.

The real Scheduler's SchedulerOutputs (prefill, chunked prefill, prefix hits, decode,
preemption and resumption; serial, and async with the next step scheduled before the
last one's answer) go through the wire codec into the real ModelRunner; every
logit it computes must equal transformers' over the request's final sequence. Unlike
test_llama's hand-built harness, this checks InputBatch, prepare_inputs, BlockTable
and slot mapping at logit level. TP 2 runs the same in two spawned ranks of a gloo group.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.multiprocessing as mp

from tests.helpers.hf_checkpoints import CHECKPOINTS, hf_greedy, save_checkpoint
from tests.helpers.runner_driver import (
    GEN_TOKENS,
    check_against_hf,
    check_coverage,
    drive,
    make_runner,
)
from worker.parallel import DIST_INIT_ENV, destroy_distributed

FAMILIES = list(CHECKPOINTS)


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory: pytest.TempPathFactory) -> dict[str, tuple[str, Any]]:
    out = {}
    for name in FAMILIES:
        path = tmp_path_factory.mktemp(name)
        out[name] = (str(path), save_checkpoint(name, path))
    return out


def _check(record: Any, hf_model: torch.nn.Module) -> None:
    check_coverage(record)
    check_against_hf(record, hf_model)
    for rid, prompt in record.prompts.items():
        assert record.generated[rid] == hf_greedy(hf_model, prompt, GEN_TOKENS), rid


@pytest.mark.parametrize("max_in_flight", [1, 2], ids=["serial", "async"])
@pytest.mark.parametrize("name", FAMILIES)
def test_runner_logits_equal_transformers(name: str, checkpoints: dict, max_in_flight: int) -> None:
    path, hf_model = checkpoints[name]
    record = drive(make_runner(path), max_in_flight=max_in_flight)
    _check(record, hf_model)
    if max_in_flight > 1:
        # The runner planned steps while their predecessor was in flight, as the worker
        # does under async scheduling (token ids gathered at launch).
        assert record.planned_ahead > 0
    if max_in_flight > 1 and name in ("llama", "qwen2_interleaved"):
        # This workload preempts a request whose step is still in flight (with and
        # without sliding windows); the worker keeps the token that step samples.
        assert record.preempted_in_flight, "no preemption of a request with a step in flight"


def _tp2_rank(rank: int, init_method: str, path: str, out_dir: str) -> None:
    # Two ranks share two cores: one thread each, or OpenMP spinning dominates.
    os.environ["OMP_NUM_THREADS"] = "1"
    torch.set_num_threads(1)
    os.environ[DIST_INIT_ENV] = init_method  # the runner joins as a worker would
    try:
        runner = make_runner(path, rank, 2)
        kv_heads = {s.num_kv_heads for s in runner.kv_cache_specs().values()}
        record = drive(runner)
    finally:
        destroy_distributed()
    torch.save({"kv_heads": kv_heads, "record": record}, Path(out_dir) / f"rank{rank}.pt")


@pytest.mark.parametrize("name", FAMILIES)
def test_runner_logits_tp2_equal_transformers_and_ranks_agree(
    name: str, checkpoints: dict, tmp_path: Path
) -> None:
    path, hf_model = checkpoints[name]
    init_method = f"file://{tmp_path / 'dist-store'}"  # no port to race for
    mp.spawn(_tp2_rank, args=(init_method, path, str(tmp_path)), nprocs=2)
    first, second = (torch.load(tmp_path / f"rank{r}.pt", weights_only=False) for r in range(2))
    # 2 KV heads over 2 ranks: one each.
    assert first["kv_heads"] == second["kv_heads"] == {1}
    a, b = first["record"], second["record"]
    # Bit-identical logits on both ranks: the premise of rank-local sampling.
    assert a.generated == b.generated
    for rid, positions in a.logits.items():
        for pos, values in positions.items():
            for x, y in zip(values, b.logits[rid][pos], strict=True):
                assert torch.equal(x, y), (rid, pos)
    _check(a, hf_model)
