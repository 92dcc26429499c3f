"""Paged-attention kernels: CuPy RawKernel CUDA sources (kernels/cuda/, compiled by NVRTC at
first use) and the torch references that define their semantics and run on the CPU."""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any

import torch

# "reference" forces the torch path on a GPU too (debugging, or bisecting a kernel).
KERNELS_ENV = "PAGEDSERVE_ATTENTION"


@dataclass(frozen=True)
class AttentionKernels:
    """The one switch between kernel families: cache write and paged attention."""

    name: str
    write_kv_cache: Any
    paged_attention: Any


def select_kernels(device: torch.device, dtype: torch.dtype, head_dim: int) -> AttentionKernels:
    from kernels import reference

    choice = os.environ.get(KERNELS_ENV, "auto")
    if choice not in ("auto", "reference", "cuda"):
        raise ValueError(f"{KERNELS_ENV} must be auto, reference or cuda, not {choice!r}")
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
    return AttentionKernels("torch reference", reference.write_kv_cache, reference.paged_attention)
