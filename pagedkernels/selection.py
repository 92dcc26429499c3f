"""Which kernel family a layer runs: the worker's attention choice (WorkerConfig.attention,
protocol/envs.py lists the choices) against the device, dtype and head size."""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any, get_args

import torch

from pagedkernels import cpu, reference
from protocol import envs
from protocol.envs import AttentionChoice

KERNELS_ENV = envs.ATTENTION


@dataclass(frozen=True)
class AttentionKernels:
    """The one switch between kernel families: cache write and paged attention."""

    name: str
    write_kv_cache: Any
    paged_attention: Any


def select_kernels(
    device: torch.device,
    dtype: torch.dtype,
    head_dim: int,
    choice: AttentionChoice | None = None,
    native: bool | None = None,
) -> AttentionKernels:
    """choice and native (the CPU C kernel for decode rows, pagedkernels.cpu_native) come from
    the worker's config; None reads them from the environment (protocol/envs.py)."""
    choice = envs.attention() if choice is None else choice
    if choice not in get_args(AttentionChoice):
        raise ValueError(
            f"{KERNELS_ENV} must be one of {', '.join(get_args(AttentionChoice))}, not {choice!r}"
        )
    if choice == "emulated":
        return _emulated(device, dtype, head_dim)
    if device.type == "cuda" and choice != "reference":
        from pagedkernels import cuda_kernels  # CuPy: only where a GPU runs

        if cuda_kernels.supports(dtype, head_dim):
            return AttentionKernels(
                "cuda (CuPy RawKernel)", cuda_kernels.write_kv_cache, cuda_kernels.paged_attention
            )
        if choice == "cuda":
            raise ValueError(f"no CUDA attention kernel for {dtype} with head_dim {head_dim}")
    elif choice == "cuda":
        raise ValueError(f"{KERNELS_ENV}=cuda needs a CUDA device, the worker runs on {device}")
    if choice == "cpu" and device.type != "cpu":
        raise ValueError(f"{KERNELS_ENV}=cpu needs the CPU device, the worker runs on {device}")
    if device.type == "cpu" and choice in ("auto", "cpu"):
        return _cpu(envs.native_kernels() if native is None else native)
    return AttentionKernels("torch reference", reference.write_kv_cache, reference.paged_attention)


def _cpu(native: bool) -> AttentionKernels:
    from pagedkernels import cpu_native

    name = "torch cpu (batched)"
    if not native:
        attention = functools.partial(cpu.paged_attention, allow_native=False)
        return AttentionKernels(name, cpu.write_kv_cache, attention)
    # Builds the C kernel here, at start-up (once per machine), not in the first step.
    if cpu_native.library() is not None:
        name += ", C kernel for decode"
    return AttentionKernels(name, cpu.write_kv_cache, cpu.paged_attention)


def _emulated(device: torch.device, dtype: torch.dtype, head_dim: int) -> AttentionKernels:
    from pagedkernels import cuda_emulator, cuda_kernels

    if device.type != "cpu" or not cuda_kernels.supports(dtype, head_dim):
        raise ValueError(
            f"{KERNELS_ENV}=emulated runs the CUDA kernels on the CPU for float16/bfloat16 "
            f"and their head sizes; the worker has {dtype} with head_dim {head_dim} on {device}"
        )
    return AttentionKernels(
        "CUDA sources on the CPU emulator",
        cuda_emulator.write_kv_cache,
        cuda_emulator.paged_attention,
    )
