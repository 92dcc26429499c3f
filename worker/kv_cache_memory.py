"""A worker's KV-cache memory: how many bytes it can give (an explicit budget; on a GPU
its share of the device less the weights and the largest step's peak; on the CPU a default
bounded by the host's memory and by what the scheduler can use), and the buffers it
allocates for exactly the core's KVCacheConfig."""

from __future__ import annotations

import mmap

import numpy as np
import torch

from protocol.config import available_host_memory
from protocol.kv_cache import NULL_BLOCK_ID, KVCacheConfig, KVCacheSpec
from worker.attention import AttentionMetadata
from worker.sampler import SamplingTensors, sample

# CPU workers get a set KV budget (there is no device memory to profile): vLLM's CPU
# backend default, within the two bounds of cpu_kv_budget.
DEFAULT_CPU_KV_CACHE_MEMORY = 4 << 30
# The KV caches of a host's workers take at most this share of its available memory; the
# weights, a step's activations and everything else on the machine need the rest.
CPU_KV_HOST_SHARE = 0.25
# Running requests hold at most max_num_seqs x the model's context; beyond that, blocks only
# keep finished prefixes cached. The default holds that much again, no more: a tiny model
# would otherwise get millions of blocks that nothing fills.
CPU_KV_PREFIX_CACHE_FACTOR = 2
# Kept free beyond the profiled step: decode steps' split-K scratch (a prefill profile
# allocates none; pagedkernels.cuda_kernels bounds it at 512 MiB) and allocator fragmentation.
GPU_STEP_MARGIN_BYTES = 768 << 20
KVCaches = dict[str, tuple[torch.Tensor, torch.Tensor]]


def gpu_kv_budget(
    *,
    total: int,
    free_at_start: int,
    free_now: int,
    step_peak: int,
    utilization: float,
    where: str,
    margin: int = GPU_STEP_MARGIN_BYTES,
) -> tuple[int, str]:
    """A GPU worker's KV-cache bytes, and how they were found (for the log).

    The worker may hold `utilization` of the device's memory (vLLM's per-instance rule: two
    engines at 0.45 share a GPU). What it took since it started (weights, buffers) and the
    peak of the largest step come out of that share, and a margin is kept; what other
    processes hold is not charged to it, but the budget must also fit in what is free
    now. ValueError, with the numbers, when nothing is left.
    """
    gib = 1 << 30
    taken = max(free_at_start - free_now, 0)
    share = int(utilization * total)
    budget = share - taken - step_peak - margin
    summary = (
        f"{utilization:.0%} of {total / gib:.1f} GiB is {share / gib:.2f} GiB; the model "
        f"and buffers take {taken / gib:.2f} GiB, a step of the largest size peaks at "
        f"{step_peak / gib:.2f} GiB, {margin / gib:.2f} GiB margin"
    )
    if budget <= 0:
        raise ValueError(
            f"{where}: no memory left for a KV cache ({summary}); raise "
            "--gpu-memory-utilization, lower --max-num-batched-tokens, raise "
            "--tensor-parallel-size or use a smaller model"
        )
    fits = free_now - step_peak - margin
    if budget > fits:
        others = max(total - free_at_start, 0)
        raise ValueError(
            f"{where}: a KV cache of {budget / gib:.2f} GiB ({summary}) does not fit in the "
            f"{max(fits, 0) / gib:.2f} GiB free beside the step's peak and margin: other "
            f"processes held {others / gib:.2f} GiB when this worker started; lower "
            "--gpu-memory-utilization or free the device"
        )
    return budget, summary


def cpu_kv_budget(
    *,
    available: int | None,
    world_size: int,
    token_bytes: int,
    max_len: int,
    max_num_seqs: int,
) -> tuple[int, str]:
    """A CPU worker's default KV-cache bytes, and how they were found (for the log): the
    default, or less where a quarter of the host's available memory, split among the
    world_size workers (all may run on this host), is less, or where max_num_seqs
    requests of max_len tokens (token_bytes each over every layer), twice over, need less.
    available None: unknown, that bound is left out."""
    gib = 1 << 30
    limits = [
        (DEFAULT_CPU_KV_CACHE_MEMORY, f"the CPU default {DEFAULT_CPU_KV_CACHE_MEMORY / gib:g} GiB")
    ]
    if available is not None:
        share = int(available * CPU_KV_HOST_SHARE) // world_size
        limits.append(
            (
                share,
                f"{CPU_KV_HOST_SHARE:.0%} of the {available / gib:.1f} GiB of host memory "
                f"available, over {world_size} worker(s)",
            )
        )
    usable = CPU_KV_PREFIX_CACHE_FACTOR * max_num_seqs * max_len * token_bytes
    limits.append(
        (usable, f"{CPU_KV_PREFIX_CACHE_FACTOR} x {max_num_seqs} requests of {max_len} tokens")
    )
    budget, why = min(limits, key=lambda limit: limit[0])
    held = budget // (max_len * token_bytes)
    return budget, f"{why}; holds {held} request(s) of the model's {max_len} tokens"


def check_fits(nbytes: int, what: str, device: torch.device, rank: int) -> None:
    """ValueError with numbers if nbytes cannot be allocated on device now: better than an
    out-of-memory kill a minute into start-up."""
    if device.type == "cuda":
        available, where = torch.cuda.mem_get_info(device)[0], f"free on {device}"
    else:
        available, where = available_host_memory(), "available host memory"
    if available is not None and nbytes > available:
        gib = 1 << 30
        raise ValueError(
            f"rank {rank}: {what} needs {nbytes / gib:.2f} GiB but only "
            f"{available / gib:.2f} GiB is {where}: lower --kv-cache-memory or "
            "--num-gpu-blocks"
        )


def allocate_kv_caches(
    config: KVCacheConfig,
    specs: dict[str, KVCacheSpec],
    dtype: torch.dtype,
    device: torch.device,
    rank: int,
) -> KVCaches:
    """One zeroed buffer per KVCacheTensor, exactly its size: what the core budgeted. Every
    layer sharing a buffer views all of it as [2, num_blocks, block_size, heads,
    head_dim] (K then V, each contiguous); a block id belongs to one group at a time,
    so layers of different groups never touch the same block."""
    total = sum(t.size for t in config.kv_cache_tensors)
    check_fits(total, f"a KV cache of {config.num_blocks} blocks", device, rank)
    caches: KVCaches = {}
    for tensor in config.kv_cache_tensors:
        buffer = _zeroed_buffer(tensor.size, device)
        for name in tensor.shared_by:
            spec = specs.get(name)
            if spec is None or name in caches:
                raise ValueError(f"KV cache tensor names layer {name!r} twice or not at all")
            if tensor.size != spec.page_size_bytes * config.num_blocks:
                raise ValueError(
                    f"KV cache tensor of {tensor.size} bytes for layer {name!r}: its spec "
                    f"needs {spec.page_size_bytes} x {config.num_blocks} blocks"
                )
            shape = (2, config.num_blocks, spec.block_size, spec.num_kv_heads, spec.head_size)
            kv = buffer.view(dtype).view(shape)
            caches[name] = (kv[0], kv[1])
    # The null block stands in for positions a sliding window has left; no kernel may
    # read it. NaN there turns a kernel that does (even under a mask: 0 * NaN is NaN)
    # into garbage tokens that every equality test sees, instead of a silent read.
    for key_cache, value_cache in caches.values():
        key_cache[NULL_BLOCK_ID].fill_(float("nan"))
        value_cache[NULL_BLOCK_ID].fill_(float("nan"))
    return caches


def _zeroed_buffer(nbytes: int, device: torch.device) -> torch.Tensor:
    """nbytes of zeros. On the CPU an anonymous mapping: its pages are the kernel's zero
    pages until first written, so a large cache costs resident memory only as blocks
    fill (torch.zeros writes every page at start-up). The tensor keeps the mapping."""
    if device.type == "cpu":
        return torch.frombuffer(mmap.mmap(-1, nbytes), dtype=torch.uint8)
    return torch.zeros(nbytes, dtype=torch.uint8, device=device)


def kv_cache_storage_bytes(kv_caches: list[tuple[torch.Tensor, torch.Tensor]]) -> tuple[int, int]:
    """(bytes, buffers) of KV storage really allocated: distinct storages behind every
    layer's K and V views, counted from the tensors themselves."""
    storages: dict[int, int] = {}
    for pair in kv_caches:
        for cache in pair:
            storage = cache.untyped_storage()
            storages[storage.data_ptr()] = storage.nbytes()
    return sum(storages.values()), len(storages)


def _profile_layout(
    num_tokens: int, max_len: int, block_size: int
) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray, int]:
    """Prefills of num_tokens in requests no longer than max_len, each in fresh blocks
    after the null block: (lens, block table, positions, slots, blocks in all)."""
    lens = np.full(num_tokens // max_len, max_len, dtype=np.int64)
    if num_tokens % max_len:
        lens = np.append(lens, num_tokens % max_len)
    blocks = -(-lens // block_size)
    first_block = 1 + np.concatenate(([0], np.cumsum(blocks)[:-1]))  # 0: the null block
    table = np.zeros((len(lens), int(blocks.max())), dtype=np.int32)
    for i, (start, n) in enumerate(zip(first_block, blocks)):
        table[i, :n] = np.arange(start, start + n)
    req = np.repeat(np.arange(len(lens)), lens)
    pos = np.arange(num_tokens) - np.repeat(np.cumsum(lens) - lens, lens)
    slots = first_block[req] * block_size + pos
    return lens, table, pos, slots, int(first_block[-1] + blocks[-1])


@torch.inference_mode()
def profile_step(
    model: torch.nn.Module,
    max_len: int,
    block_size: int,
    dtype: torch.dtype,
    device: torch.device,
    num_tokens: int,
    num_seqs: int,
) -> int:
    """Run the largest step the core may schedule and return its peak allocation on a
    GPU (0 on the CPU, where the run only proves the path): num_tokens tokens of
    prefill (requests no longer than max_len, the model's context) into a scratch KV
    cache, then top-k/top-p sampling of num_seqs rows. All ranks run it together (TP
    layers all-reduce)."""
    lens, table, pos, slots, num_blocks = _profile_layout(num_tokens, max_len, block_size)
    layers = model.attention_layers().values()
    scratch = [
        tuple(
            torch.zeros(
                (num_blocks, block_size, layer.num_kv_heads, layer.head_dim),
                dtype=dtype,
                device=device,
            )
            for _ in range(2)
        )
        for layer in layers
    ]
    groups = 1 + max(layer.kv_group for layer in layers)
    attn = AttentionMetadata(
        query_start_loc=torch.from_numpy(np.concatenate(([0], np.cumsum(lens)))).to(
            device, torch.int32
        ),
        seq_lens=torch.from_numpy(lens).to(device, torch.int32),
        block_tables=[torch.from_numpy(table).to(device)] * groups,
        slot_mappings=[torch.from_numpy(slots).to(device)] * groups,
    )
    input_ids = torch.zeros(num_tokens, dtype=torch.int64, device=device)
    positions = torch.from_numpy(pos).to(device)
    rows = torch.arange(num_seqs, device=device) % num_tokens
    cuda = device.type == "cuda"
    if cuda:
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)
        base = torch.cuda.memory_allocated(device)
    hidden = model(input_ids, positions, attn, scratch)
    logits = model.compute_logits(hidden.index_select(0, rows))
    sampling = SamplingTensors.from_arrays(
        np.ones(num_seqs, dtype=np.float32),
        np.full(num_seqs, 50, dtype=np.int64),
        np.full(num_seqs, 0.9, dtype=np.float32),
        device,
    )
    generator = torch.Generator(device=device).manual_seed(0)  # leaves the seeds alone
    sample(logits, sampling, [None] * num_seqs, generator)
    if not cuda:
        return 0
    torch.cuda.synchronize(device)
    return torch.cuda.max_memory_allocated(device) - base
