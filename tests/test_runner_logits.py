"""Logits through the real worker path, at every computed position, against transformers.

The real Scheduler's SchedulerOutputs (prefill, chunked prefill, prefix hits, decode,
preemption and resumption) go through the wire codec into the real ModelRunner; every
logit it computes must equal transformers' over the request's final sequence. Unlike
test_model_vs_hf's hand-built harness, this checks InputBatch, prepare_inputs, BlockTable
and slot mapping at logit level. TP 2 runs the same in two spawned ranks of a gloo group.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.multiprocessing as mp
from hf_checkpoints import CHECKPOINTS, hf_greedy, save_checkpoint
from runner_driver import GEN_TOKENS, check_against_hf, check_coverage, drive, make_runner

from protocol.config import free_port
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


@pytest.mark.parametrize("name", FAMILIES)
def test_runner_logits_equal_transformers(name: str, checkpoints: dict) -> None:
    path, hf_model = checkpoints[name]
    _check(drive(make_runner(path)), hf_model)


def _tp2_rank(rank: int, init_method: str, dirs: dict[str, str], out_dir: str) -> None:
    # Two ranks share two cores: one thread each, or OpenMP spinning dominates.
    os.environ["OMP_NUM_THREADS"] = "1"
    torch.set_num_threads(1)
    os.environ[DIST_INIT_ENV] = init_method  # the runner joins as a worker would
    results = {}
    try:
        for i, (name, path) in enumerate(dirs.items()):
            runner = make_runner(path, rank, 2)
            if i == 0:
                results["kv_heads"] = {s.num_kv_heads for s in runner.kv_cache_specs().values()}
            record = drive(runner)
            results[name] = {
                "generated": record.generated,
                "logits": {r: dict(p) for r, p in record.logits.items()},
                "record": record if rank == 0 else None,
            }
            destroy_distributed()
    finally:
        destroy_distributed()
    torch.save(results, Path(out_dir) / f"rank{rank}.pt")


def test_runner_logits_tp2_equal_transformers_and_ranks_agree(
    checkpoints: dict, tmp_path: Path
) -> None:
    dirs = {name: path for name, (path, _) in checkpoints.items()}
    init_method = f"tcp://127.0.0.1:{free_port()}"
    mp.spawn(_tp2_rank, args=(init_method, dirs, str(tmp_path)), nprocs=2)
    ranks = [torch.load(tmp_path / f"rank{r}.pt", weights_only=False) for r in range(2)]
    assert ranks[0]["kv_heads"] == ranks[1]["kv_heads"] == {1}
    for name, (_, hf_model) in checkpoints.items():
        first, second = ranks[0][name], ranks[1][name]
        # Bit-identical logits on both ranks: the premise of rank-local sampling.
        assert first["generated"] == second["generated"], name
        for rid, positions in first["logits"].items():
            for pos, values in positions.items():
                for a, b in zip(values, second["logits"][rid][pos]):
                    assert torch.equal(a, b), (name, rid, pos)
        _check(first["record"], hf_model)
