"""How many bytes of memory a worker gives its KV cache: the flag, or a budget from the
host's memory (CPU) or from a profiled step's peak (GPU)."""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

import torch

from protocol.config import available_host_memory, max_num_batched_tokens_for
from worker.kv_cache_memory import check_fits, cpu_kv_budget, gpu_kv_budget

if TYPE_CHECKING:
    from worker.model_runner import ModelRunner

log = logging.getLogger("pagedserve.worker")


def available_kv_memory(runner: ModelRunner) -> int:
    """Bytes this worker can give its KV cache: --kv-cache-memory when set; on the CPU
    a default bounded by the host's memory and the scheduler's limits (cpu_kv_budget);
    on a GPU, what its --gpu-memory-utilization share of the device leaves after the
    memory it took (weights, buffers) and the peak of the largest step (gpu_kv_budget)."""
    config = runner.config
    if config.kv_cache_memory is not None:
        check_fits(config.kv_cache_memory, "--kv-cache-memory", runner.device, config.rank)
        return config.kv_cache_memory
    if runner.device.type == "cpu":
        page_bytes = sum(spec.page_size_bytes for spec in runner.kv_cache_specs().values())
        budget, summary = cpu_kv_budget(
            available=available_host_memory(),
            world_size=config.world_size,
            token_bytes=-(-page_bytes // config.block_size),
            max_len=runner.model_config.max_position_embeddings,
            max_num_seqs=config.max_num_seqs,
        )
        log.info("rank %d: KV cache budget %.2f GiB (%s)", config.rank, budget / (1 << 30), summary)
        return budget
    largest = max_num_batched_tokens_for(runner.device.type, config.max_num_batched_tokens)
    step_peak = runner.profile_step(largest, config.max_num_seqs)
    torch.cuda.empty_cache()
    free, total = torch.cuda.mem_get_info(runner.device)
    where = f"rank {config.rank} on {runner.device}"
    budget, summary = gpu_kv_budget(
        total=total,
        free_at_start=runner._free_at_start,
        free_now=free,
        step_peak=step_peak,
        utilization=config.gpu_memory_utilization,
        where=where,
    )
    log.info("%s: KV cache budget %.2f GiB (%s)", where, budget / (1 << 30), summary)
    return budget
