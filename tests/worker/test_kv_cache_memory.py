"""How a worker sizes its KV cache: an explicit budget; on the CPU a default bounded by the
host's memory and the scheduler's limits; on a GPU what is left after the largest step the
core may schedule (worker/kv_cache_memory.py).

The profile's forward is the real model on scratch KV caches; on the CPU it returns no
peak (there is no device memory to read) but runs the same code a GPU worker runs, so a
broken profile fails here rather than at a GPU worker's start-up.
"""

from __future__ import annotations

import logging
import os
from pathlib import Path

import pytest
import torch

from enginecore.kv_cache_config import make_kv_cache_config
from launch.client.engine_args import EngineArgs, runner_config
from protocol.worker import WorkerConfigure
from tests.helpers.cli_helpers import CPU
from tests.helpers.hf_checkpoints import save_checkpoint
from tests.helpers.proc_memory import rss_bytes
from worker.kv_cache_memory import (
    DEFAULT_CPU_KV_CACHE_MEMORY,
    GPU_STEP_MARGIN_BYTES,
    cpu_kv_budget,
    gpu_kv_budget,
)
from worker.model_runner import ModelRunner

GIB = 1 << 30


def runner(path: Path, device: str = CPU, **kw) -> ModelRunner:
    return ModelRunner(runner_config(EngineArgs(model=str(path), device=device, **kw)))


@pytest.mark.parametrize("name", ["llama", "qwen2_interleaved", "mistral", "gemma3"])
def test_profile_step_runs_the_largest_step(name: str, tmp_path: Path) -> None:
    save_checkpoint(name, tmp_path)
    r = runner(tmp_path, block_size=16)
    assert r.model_config.max_position_embeddings == 256
    # 600 tokens: more than one request's context (256), so three prefills of 256/256/88;
    # 40 sampler rows over them.
    assert r.profile_step(600, 40) == 0
    assert r.profile_step(7, 3) == 0


def test_explicit_and_default_budgets(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """The test model's context is 256 tokens: 256 requests of it, twice over, is less than
    the 4 GiB default, so that bound sizes the cache, and the start-up log says so.
    --kv-cache-memory overrides every bound."""
    save_checkpoint("llama", tmp_path)
    r = runner(tmp_path)
    (page,) = {s.page_size_bytes for s in r.kv_cache_specs().values()}
    token_bytes = page * len(r.kv_cache_specs()) // r.config.block_size
    with caplog.at_level(logging.INFO, logger="pagedserve.worker"):
        assert r.available_kv_memory() == 2 * 256 * 256 * token_bytes
    assert (
        f"rank 0: KV cache budget {2 * 256 * 256 * token_bytes / GIB:.2f} GiB "
        "(2 x 256 requests of 256 tokens; holds 512 request(s) of the model's 256 tokens)"
    ) in caplog.messages
    assert runner(tmp_path, kv_cache_memory=12345).available_kv_memory() == 12345


def cpu_budget(available: float | None, world_size: int = 1, max_num_seqs: int = 256) -> int:
    """cpu_kv_budget of a model of 46,080 bytes a token (SmolLM2-135M in float32) and an
    8,192-token context; available in GiB."""
    return cpu_kv_budget(
        available=None if available is None else int(available * GIB),
        world_size=world_size,
        token_bytes=46_080,
        max_len=8192,
        max_num_seqs=max_num_seqs,
    )[0]


def test_the_cpu_default_is_vllm_s_4_gib_on_a_roomy_host() -> None:
    assert DEFAULT_CPU_KV_CACHE_MEMORY == 4 * GIB
    assert cpu_budget(64) == cpu_budget(None) == 4 * GIB
    _, summary = cpu_kv_budget(
        available=64 * GIB, world_size=1, token_bytes=46_080, max_len=8192, max_num_seqs=256
    )
    # 4 GiB / (8192 x 46,080 bytes) = 11.4 requests of the whole context.
    assert summary == "the CPU default 4 GiB; holds 11 request(s) of the model's 8192 tokens"


def test_a_small_host_gets_a_quarter_of_its_available_memory_split_among_workers() -> None:
    assert cpu_budget(8) == 2 * GIB
    assert cpu_budget(8, world_size=4) == GIB // 2
    _, summary = cpu_kv_budget(
        available=8 * GIB, world_size=4, token_bytes=46_080, max_len=8192, max_num_seqs=256
    )
    assert summary.startswith("25% of the 8.0 GiB of host memory available, over 4 worker(s)")


def test_no_more_than_the_scheduler_can_use_twice_over() -> None:
    """Four requests of 8,192 tokens hold 1.41 GiB at once; the cache is twice that."""
    assert cpu_budget(64, max_num_seqs=4) == 2 * 4 * 8192 * 46_080


def test_a_cpu_cache_costs_memory_only_as_its_blocks_fill(tmp_path: Path) -> None:
    """The buffers are zero until written, but pages nobody wrote are not resident: a
    default cache of gigabytes costs a test engine what its requests fill."""
    save_checkpoint("llama", tmp_path)
    r = runner(tmp_path, block_size=4)
    config = make_kv_cache_config(r.kv_cache_specs(), 512 << 20)
    before = rss_bytes(os.getpid())
    r.initialize(WorkerConfigure(config, 4, 64, 64))
    assert rss_bytes(os.getpid()) - before < 64 << 20
    key, value = r.kv_caches[0]
    assert not key[1:].any() and not value[-1].any()


def budget(free_at_start: float, free_now: float, utilization: float, peak: float = 5) -> int:
    """gpu_kv_budget on a 100 GiB device, sizes in GiB."""
    return gpu_kv_budget(
        total=100 * GIB,
        free_at_start=int(free_at_start * GIB),
        free_now=int(free_now * GIB),
        step_peak=int(peak * GIB),
        utilization=utilization,
        where="rank 0 on cuda:0",
    )[0]


def test_a_gpu_share_is_the_engine_s_own_whatever_else_runs_there() -> None:
    """vLLM's per-instance rule: the share holds the worker's weights and buffers (what it
    took since it started), the largest step's peak and the margin; the KV cache gets the
    rest, and memory other processes hold is not charged to it."""
    margin = GPU_STEP_MARGIN_BYTES
    alone = budget(100, 90, 0.9)  # took 10 GiB of weights
    assert alone == 90 * GIB - 10 * GIB - 5 * GIB - margin
    # Beside a process holding 40 GiB, the same share gives the same cache...
    assert budget(60, 50, 0.5) == budget(100, 90, 0.5) == 35 * GIB - margin
    # ...and a second engine at 0.45 beside a first one at 0.45 fits.
    assert budget(55, 45, 0.45) == 45 * GIB - 15 * GIB - margin


def test_a_gpu_share_that_cannot_be_had_is_refused_with_numbers() -> None:
    with pytest.raises(ValueError, match=r"other processes held 40\.00 GiB.*lower --gpu-memory"):
        budget(60, 50, 0.9)  # 74 GiB asked, 44 free beside the step
    with pytest.raises(ValueError, match=r"no memory left for a KV cache.*raise --gpu-memory"):
        budget(100, 80, 0.2)  # 20 GiB share, 20 taken by the model


@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA GPU present")
def test_gpu_budget_leaves_the_profiled_step_free(tmp_path: Path) -> None:
    save_checkpoint("llama_d128", tmp_path)
    r = runner(tmp_path, "cuda", max_num_batched_tokens=4096, max_num_seqs=64)
    step_peak = r.profile_step(4096, 64)
    assert step_peak > 0  # at least the logits and the activations of 4096 tokens
    kv = r.available_kv_memory()
    _, total = torch.cuda.mem_get_info()
    assert 0 < kv <= 0.9 * total - step_peak
    # Half the share, and the cache shrinks by what the share lost.
    half = runner(
        tmp_path, "cuda", max_num_batched_tokens=4096, max_num_seqs=64, gpu_memory_utilization=0.45
    ).available_kv_memory()
    assert 0 < half <= kv - 0.4 * total


@pytest.mark.parametrize(
    ("name", "shared"),
    [
        ("llama", False),
        ("mistral", False),
        ("qwen2_interleaved", True),
        ("qwen2_5to1", True),
        ("gemma3", True),
    ],
)
def test_kv_storage_is_exactly_the_budgeted_config(name: str, shared: bool, tmp_path: Path):
    """The worker allocates the config's buffers and nothing else: distinct storages,
    counted from the tensors themselves, sum to sum(tensor.size) <= the budget. Hybrid
    models share theirs across groups (layer k of each group): the 1:1 interleaved model
    in two buffers for four layers, the 5:1 model in one for six."""
    save_checkpoint(name, tmp_path)
    r = runner(tmp_path, block_size=4)
    budget = 1 << 20
    config = make_kv_cache_config(r.kv_cache_specs(), budget)
    r.initialize(WorkerConfigure(config, 4, 64, 64))
    nbytes, buffers = r.kv_cache_storage_bytes()
    assert nbytes == sum(t.size for t in config.kv_cache_tensors) <= budget
    assert buffers == len(config.kv_cache_tensors)
    assert (buffers < len(r.kv_caches)) == shared
    # Logical capacity: a block id costs one page in each buffer, and serves any group.
    (page,) = {s.page_size_bytes for s in r.kv_cache_specs().values()}
    assert config.num_blocks == budget // (page * buffers)


@pytest.mark.parametrize(
    ("field", "value", "message"),
    [
        ("gpu_memory_utilization", 0.0, r"gpu_memory_utilization must be in \(0, 1\], got 0.0"),
        ("gpu_memory_utilization", 1.2, r"gpu_memory_utilization must be in \(0, 1\], got 1.2"),
        ("kv_cache_memory", 0, "kv_cache_memory must be >= 1 byte, got 0"),
    ],
)
def test_memory_settings_are_checked_before_any_process_starts(
    field: str, value: float, message: str
) -> None:
    with pytest.raises(ValueError, match=message):
        EngineArgs(model="unused", **{field: value}).validate()
