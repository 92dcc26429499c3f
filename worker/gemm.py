"""Dense products y = x W^T (+ b) on the CPU: oneDNN with each weight prepacked once.

`F.linear` on the CPU goes to MKL's sgemm, which on AMD CPUs takes a generic code path:
on this machine's AMD EPYC (AVX-512), one thread, float32, a [T, 576] x [576, 1536] product
ran at 29-97 GFLOPS through F.linear and 30-224 GFLOPS through oneDNN with the weight
reordered once into its blocked layout (T = 1: 29 / 30; 8: 68 / 154; 32: 94 / 218;
64: 95 / 209; 256: 53 / 224; 2048: 90 / 134). A decode step's products (one row per
request) gain the most. Results differ from F.linear only by summation order (max abs
difference ~1e-4 on sums of 576 N(0, 1) products, ~5e-6 relative).

WorkerConfig.cpu_gemm (PAGEDSERVE_CPU_GEMM) `torch` keeps F.linear (to compare, or where
oneDNN is missing); the default `auto` packs float32 weights (and bfloat16 ones where the
CPU has bf16 support).
"""

from __future__ import annotations

import torch

from protocol import envs
from protocol.envs import CpuGemmChoice

CPU_GEMM_ENV = envs.CPU_GEMM
# The row count oneDNN tunes the packed layout for; measured flat from 8 to 2048 rows.
_PACK_FOR_ROWS = 128


def use_onednn(
    device: torch.device, dtype: torch.dtype, choice: CpuGemmChoice | None = None
) -> bool:
    """Whether CPU products of this dtype go through prepacked oneDNN weights; choice is
    the worker's config (None: read from the environment, protocol/envs.py)."""
    choice = envs.cpu_gemm() if choice is None else choice
    if device.type != "cpu" or choice == "torch":
        return False
    supported = torch.backends.mkldnn.is_available() and (
        dtype == torch.float32
        or (dtype == torch.bfloat16 and torch.ops.mkldnn._is_mkldnn_bf16_supported())
    )
    if choice == "onednn" and not supported:
        raise ValueError(f"{CPU_GEMM_ENV}=onednn: oneDNN cannot run {dtype} products here")
    return supported


def pack(weight: torch.Tensor) -> torch.Tensor:
    """The weight [out, in] in oneDNN's blocked layout (a new tensor; weight is kept)."""
    with torch.inference_mode(False), torch.no_grad():
        return torch.ops.mkldnn._reorder_linear_weight(weight.detach(), _PACK_FOR_ROWS)


def packed_linear(x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """x [..., in] times a weight packed by pack(), plus bias."""
    return torch.ops.mkldnn._linear_pointwise(x, packed, bias, "none", [], "")
