"""Tensor parallelism on CPU: ranks are spawned processes in one gloo group on loopback.

Each rank builds its shard of a tiny checkpoint and runs the same paged batches
(prefill, chunked prefill, decode together) as test_llama does at TP 1; the parent
checks every rank's logits against transformers and that all ranks agree bit for bit,
which is what lets every rank sample the same tokens on its own. A ModelRunner run
through the real Scheduler checks the runner's wiring (rendezvous from the environment,
KV specs per rank, random and seeded sampling identical on all ranks).
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Callable
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.multiprocessing as mp
import torch.nn.functional as F

from enginecore.kv_cache_config import make_kv_cache_config, with_num_blocks
from enginecore.request import Request
from enginecore.scheduler import Scheduler
from launch.client.engine_args import EngineArgs, runner_config
from protocol.codec import Codec
from protocol.engine import SamplingParams
from protocol.worker import CoreToWorker, WorkerConfigure
from tests.helpers.hf_checkpoints import VOCAB, hf_greedy, save_checkpoint, small_model_config
from tests.helpers.kv_helpers import sched_config
from tests.helpers.paged_harness import (
    GEN_TOKENS,
    PagedHarness,
    PagedRequest,
    paged_prompts,
    run_paged_batches,
)
from worker.layers import ParallelLMHead, VocabParallelEmbedding
from worker.model_config import load_model_config
from worker.model_runner import ModelRunner
from worker.models import get_model_class
from worker.models.llama import LlamaForCausalLM
from worker.parallel import (
    DIST_INIT_ENV,
    Shard,
    TPContext,
    destroy_distributed,
    init_distributed,
    load_shard,
    mark_sharded,
    shard_heads,
    shard_vocab,
)
from worker.weights import iterate_weights

CPU = torch.device("cpu")
BLOCK_SIZE = 4
PROMPT_LENS = {"a": 11, "b": 5, "c": 17, "d": 14}
# A dead or diverged peer fails the test within this instead of hanging it.
COLLECTIVE_TIMEOUT = timedelta(seconds=60)
RUNNER_PARAMS = {
    "greedy": SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True),
    "random": SamplingParams(max_tokens=6, temperature=1.0, ignore_eos=True),
    "seeded": SamplingParams(max_tokens=6, temperature=0.9, top_k=40, top_p=0.9, seed=11),
}


# ---- run inside each spawned rank -------------------------------------------------------


def _child_setup() -> None:
    # Several ranks share two cores: one thread each, or OpenMP spinning dominates.
    os.environ["OMP_NUM_THREADS"] = "1"
    torch.set_num_threads(1)


def _run_paged_batches(harness: PagedHarness) -> dict[str, PagedRequest]:
    return run_paged_batches(harness, paged_prompts())


def _model_results(tp: TPContext, model_dir: str, num_groups: int) -> dict[str, Any]:
    config = load_model_config(model_dir)
    model = get_model_class(config.architecture)(config, torch.float32, CPU, tp)
    model.load_weights(iterate_weights(model_dir))
    # The harness sizes its caches from the config; give it this rank's KV heads.
    local_kv = next(iter(model.attention_layers().values())).num_kv_heads
    harness = PagedHarness(
        model, dataclasses.replace(config, num_key_value_heads=local_kv), num_groups
    )
    reqs = _run_paged_batches(harness)
    return {
        "kv_heads": [spec.num_kv_heads for spec in model.kv_cache_specs(4, "float32").values()],
        "logits": {
            k: torch.stack([r.logits[p] for p in sorted(r.logits)]) for k, r in reqs.items()
        },
        "generated": {k: r.generated for k, r in reqs.items()},
    }


def _check_vocab_padding(tp: TPContext) -> None:
    """A vocabulary no tp divides: embeddings exact, logits full width, no padding."""
    vocab, dim = 157, 16
    weight = torch.randn(vocab, dim, generator=torch.Generator().manual_seed(0))
    shard = shard_vocab(vocab, tp)
    embed = VocabParallelEmbedding(shard, dim, torch.float32, CPU, tp)
    head = ParallelLMHead(shard, dim, torch.float32, CPU, tp)
    load_shard(embed.weight, "embed", weight)
    load_shard(head.weight, "head", weight)
    ids = torch.tensor([0, 1, 39, 40, 78, 79, 80, 119, 120, 155, 156])
    assert torch.equal(embed(ids), F.embedding(ids, weight))
    hidden = torch.randn(5, dim, generator=torch.Generator().manual_seed(1))
    logits = head(hidden)
    assert logits.shape == (5, vocab)
    torch.testing.assert_close(logits, F.linear(hidden, weight), atol=1e-6, rtol=1e-6)


def _drive_runner(runner: ModelRunner) -> list[tuple[list[str], list[int]]]:
    """Real Scheduler + runner, SchedulerOutputs through the wire codec; the steps taken do
    not depend on sampled values (no stop tokens), so ranks stay in lockstep even if
    their tokens differed."""
    base = make_kv_cache_config(runner.kv_cache_specs(), 1 << 30)
    kv_config = with_num_blocks(base.kv_cache_groups, 64)
    config = sched_config(128, max_num_batched_tokens=16, max_num_seqs=8)
    scheduler = Scheduler(config, kv_config, runner.model_config.vocab_size)
    runner.initialize(WorkerConfigure(kv_config, 8, 128, 16))
    codec = Codec(CoreToWorker, "core->worker")
    prompts = paged_prompts()
    for (rid, params), prompt in zip(RUNNER_PARAMS.items(), prompts.values()):
        req = Request(rid, prompt, scheduler.kv_cache_manager.block_hasher, sampling_params=params)
        assert scheduler.add_request(req) is None
    outputs = []
    while scheduler.has_unfinished_requests():
        so = scheduler.schedule()
        out = runner.execute(codec.decode(codec.encode(so)))
        if out is not None:
            outputs.append((list(out.req_ids), list(out.sampled_token_ids)))
            scheduler.update_from_output(so, out)
    return outputs


def _tp2_rank(rank: int, world_size: int, init_method: str, dirs: dict, out_dir: str) -> None:
    _child_setup()
    # The runner joins the group itself, from the launcher's environment variable.
    os.environ[DIST_INIT_ENV] = init_method
    args = EngineArgs(model=dirs["qwen2"], device="cpu", block_size=BLOCK_SIZE, seed=7)
    config = runner_config(args, rank=rank, world_size=world_size)
    runner = ModelRunner(config)
    try:
        results: dict[str, Any] = {
            "runner_specs": runner.kv_cache_specs(),
            "runner_outputs": _drive_runner(runner),
        }
        for name, path in dirs.items():
            results[name] = _model_results(runner.tp, path, 2 if name == "qwen2" else 1)
        _check_vocab_padding(runner.tp)
        torch.save(results, Path(out_dir) / f"rank{rank}.pt")
    finally:
        destroy_distributed()


def _tp_rank(rank: int, world_size: int, init_method: str, dirs: dict, out_dir: str) -> None:
    _child_setup()
    tp = init_distributed(rank, world_size, init_method, CPU, COLLECTIVE_TIMEOUT)
    try:
        results = {name: _model_results(tp, path, 1) for name, path in dirs.items()}
        _check_vocab_padding(tp)
        torch.save(results, Path(out_dir) / f"rank{rank}.pt")
    finally:
        destroy_distributed()


# ---- the parent -------------------------------------------------------------------------


def _spawn(fn: Callable[..., None], world_size: int, dirs: dict, out_dir: Path) -> list[dict]:
    # A rendezvous file, not a port: nothing else on the machine can take it first.
    init_method = f"file://{out_dir / 'dist-store'}"
    mp.spawn(fn, args=(world_size, init_method, dirs, str(out_dir)), nprocs=world_size)
    return [torch.load(out_dir / f"rank{r}.pt", weights_only=False) for r in range(world_size)]


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory: pytest.TempPathFactory) -> dict[str, tuple[str, Any]]:
    out = {}
    for name in ("llama", "qwen2", "mistral"):
        path = tmp_path_factory.mktemp(name)
        out[name] = (str(path), save_checkpoint(name, path))
    return out


def _check_against_transformers(name: str, hf_model: Any, ranks: list[dict]) -> None:
    first = ranks[0][name]
    for rank, results in enumerate(ranks[1:], start=1):
        # Bit-identical logits on every rank: the premise of rank-local sampling.
        for key, logits in first["logits"].items():
            assert torch.equal(results[name]["logits"][key], logits), (name, rank, key)
        assert results[name]["generated"] == first["generated"], (name, rank)
    for key, prompt in paged_prompts().items():
        generated = first["generated"][key]
        full = torch.tensor([prompt + generated[:-1]])
        with torch.no_grad():
            want = hf_model(full).logits[0].float()
        torch.testing.assert_close(
            first["logits"][key],
            want,
            atol=1e-4,
            rtol=1e-4,
            msg=lambda m, k=key: f"{name} {k}: {m}",
        )
        assert hf_greedy(hf_model, prompt, GEN_TOKENS) == generated, (name, key)


def test_tp2_matches_transformers_and_ranks_agree(
    checkpoints: dict[str, tuple[str, Any]], tmp_path: Path
) -> None:
    dirs = {name: path for name, (path, _) in checkpoints.items()}
    ranks = _spawn(_tp2_rank, 2, dirs, tmp_path)
    for name, (_, hf_model) in checkpoints.items():
        # 2 KV heads over 2 ranks: one each, the same spec on both.
        assert all(r[name]["kv_heads"] == [1] * len(r[name]["kv_heads"]) for r in ranks)
        _check_against_transformers(name, hf_model, ranks)

    assert ranks[0]["runner_specs"] == ranks[1]["runner_specs"]
    assert {s.num_kv_heads for s in ranks[0]["runner_specs"].values()} == {1}
    outputs = ranks[0]["runner_outputs"]
    assert outputs == ranks[1]["runner_outputs"]
    tokens: dict[str, list[int]] = {rid: [] for rid in RUNNER_PARAMS}
    for req_ids, sampled in outputs:
        for rid, token in zip(req_ids, sampled):
            tokens[rid].append(token)
    assert all(len(t) == 6 and all(0 <= x < VOCAB for x in t) for t in tokens.values())
    hf_qwen = checkpoints["qwen2"][1]
    assert tokens["greedy"] == hf_greedy(hf_qwen, paged_prompts()["a"], 6)


def test_tp4_replicates_kv_heads(checkpoints: dict[str, tuple[str, Any]], tmp_path: Path) -> None:
    # 4 ranks, 2 KV heads: each rank holds one KV head, shared with its neighbour.
    path, hf_model = checkpoints["qwen2"]
    ranks = _spawn(_tp_rank, 4, {"qwen2": path}, tmp_path)
    assert all(r["qwen2"]["kv_heads"] == [1, 1, 1] for r in ranks)
    _check_against_transformers("qwen2", hf_model, ranks)


# ---- sharding rules, no process group needed --------------------------------------------


def test_head_sharding_splits_or_replicates_kv_heads() -> None:
    even = [shard_heads(8, 4, TPContext(r, 2)) for r in range(2)]
    assert [(h.q_heads, h.kv_heads) for h in even] == [
        (Shard(0, 4, 8), Shard(0, 2, 4)),
        (Shard(4, 4, 8), Shard(2, 2, 4)),
    ]
    # 8 query heads in 2 groups of 4; ranks 0-1 read KV head 0, ranks 2-3 KV head 1.
    replicated = [shard_heads(8, 2, TPContext(r, 4)) for r in range(4)]
    assert [h.q_heads.start for h in replicated] == [0, 2, 4, 6]
    assert [h.kv_heads for h in replicated] == [Shard(k, 1, 2) for k in (0, 0, 1, 1)]
    assert shard_vocab(157, TPContext(3, 4)) == Shard(120, 40, 157)


@pytest.mark.parametrize(
    ("overrides", "tp", "message"),
    [
        ({}, 3, r"num_attention_heads \(4\) is not divisible by the tensor-parallel size \(3\)"),
        (
            {"num_attention_heads": 12, "num_key_value_heads": 4, "hidden_size": 96},
            6,
            r"num_key_value_heads \(4\) and the tensor-parallel size \(6\) must divide",
        ),
        ({"intermediate_size": 130}, 4, r"intermediate_size \(130\) is not divisible"),
    ],
)
def test_indivisible_shapes_are_rejected(overrides: dict, tp: int, message: str) -> None:
    config = small_model_config("LlamaForCausalLM", **overrides)
    with pytest.raises(ValueError, match=message):
        LlamaForCausalLM(config, torch.float32, CPU, TPContext(0, tp))


def test_sharded_loading_checks_the_full_shape_and_zeroes_padding() -> None:
    param = torch.nn.Parameter(torch.full((40, 3), 7.0), requires_grad=False)
    mark_sharded(param, 0, Shard(120, 40, 157))
    full = torch.arange(157 * 3, dtype=torch.float32).view(157, 3)
    load_shard(param, "w", full)
    assert torch.equal(param[:37], full[120:]) and not param[37:].any()
    with pytest.raises(ValueError, match=r"'w' has shape \(40, 3\), expected \(157, 3\)"):
        load_shard(param, "w", torch.zeros(40, 3))


def test_runner_needs_the_rendezvous_address(
    checkpoints: dict[str, tuple[str, Any]], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv(DIST_INIT_ENV, raising=False)
    config = runner_config(EngineArgs(model=checkpoints["qwen2"][0], device="cpu"), world_size=2)
    with pytest.raises(ValueError, match=DIST_INIT_ENV):
        ModelRunner(config)
