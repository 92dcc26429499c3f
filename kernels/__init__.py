"""Paged-attention kernels: CuPy RawKernel CUDA sources (kernels/cuda/, compiled by NVRTC at
first use), batched torch kernels for the CPU (kernels.cpu), and the torch reference that
defines their semantics."""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any

import torch

# auto: the CUDA kernels on a GPU where they support the dtype and head size, the batched
# CPU kernels (kernels.cpu, with the C kernel of kernels.cpu_native for decode rows where it
# builds; PAGEDSERVE_NATIVE_KERNELS=0 turns it off) on the CPU, else the torch reference.
# cpu: the batched CPU kernels or an error. reference: the per-request torch reference
# anywhere (the oracle; debugging, bisecting a kernel). cuda: the CUDA kernels or an error.
# emulated: the CUDA sources run on the CPU through kernels.cuda_emulator (very slow; lets
# the CPU tests drive the CUDA kernels through the whole engine).
KERNELS_ENV = "PAGEDSERVE_ATTENTION"
CHOICES = ("auto", "cpu", "reference", "cuda", "emulated")


@dataclass(frozen=True)
class AttentionKernels:
    """The one switch between kernel families: cache write and paged attention."""

    name: str
    write_kv_cache: Any
    paged_attention: Any


def select_kernels(device: torch.device, dtype: torch.dtype, head_dim: int) -> AttentionKernels:
    from kernels import cpu, reference

    choice = os.environ.get(KERNELS_ENV, "auto")
    if choice not in CHOICES:
        raise ValueError(f"{KERNELS_ENV} must be one of {', '.join(CHOICES)}, not {choice!r}")
    if choice == "emulated":
        from kernels import cuda_emulator, cuda_kernels

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
    if device.type == "cuda" and choice != "reference":
        from kernels import cuda_kernels

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
        from kernels import cpu_native

        name = "torch cpu (batched)"
        # Builds the C kernel here, at start-up (once per machine), not in the first step.
        if cpu_native.library() is not None:
            name += ", C kernel for decode"
        return AttentionKernels(name, cpu.write_kv_cache, cpu.paged_attention)
    return AttentionKernels("torch reference", reference.write_kv_cache, reference.paged_attention)
