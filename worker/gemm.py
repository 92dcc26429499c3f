"""Dense products y = x W^T (+ b) on the CPU: oneDNN with each weight prepacked once.

`F.linear` on the CPU goes to MKL's sgemm, which on AMD CPUs takes a generic code path:
on this machine's AMD EPYC (AVX-512), one thread, float32, a [T, 576] x [576, 1536] product
ran at 29-97 GFLOPS through F.linear and 30-224 GFLOPS through oneDNN with the weight
reordered once into its blocked layout (T = 1: 29 / 30; 8: 68 / 154; 32: 94 / 218;
64: 95 / 209; 256: 53 / 224; 2048: 90 / 134). A decode step's products (one row per
request) gain the most. Results differ from F.linear only by summation order (max abs
difference ~1e-4 on sums of 576 N(0, 1) products, ~5e-6 relative).

Decode-sized products (at most SMALL_BATCH_ROWS rows) of float32 weights go to the small-batch
C kernel (pagedkernels.cpu_gemm) where the native library is built for a CPU with AVX-512:
oneDNN runs 16 rows at about 60% of its large-batch rate, leaving the memory idle while it
computes, and the C kernel streams each weight once under its arithmetic. It reads its own
copy of the weights (panels of 16 output features) beside oneDNN's, which prefills keep:
the products' weights are held twice.

WorkerConfig.cpu_gemm (PAGEDSERVE_CPU_GEMM) `torch` keeps F.linear (to compare, or where
oneDNN is missing); `onednn` packs for oneDNN alone (one copy of the weights); the default
`auto` packs float32 weights (and bfloat16 ones where the CPU has bf16 support) for oneDNN
and, for float32 where it is built, for the small-batch kernel too.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch

from pagedkernels import cpu_gemm
from pagedkernels.cpu_gemm import CpuGemm
from protocol import envs
from protocol.envs import CpuGemmChoice

log = logging.getLogger("pagedserve.worker")

CPU_GEMM_ENV = envs.CPU_GEMM
# The row count oneDNN tunes the packed layout for; measured flat from 8 to 2048 rows.
_PACK_FOR_ROWS = 128
# Products of at most this many rows go to the small-batch kernel where it is built: it
# beats oneDNN up to here and falls behind at prefill sizes (docs/benchmarks.md).
SMALL_BATCH_ROWS = 64
# The most of the host's available memory the kernel's second copy of the weights may take:
# past it, the KV cache and the steps' activations need the memory more than decode needs
# the speed.
SMALL_BATCH_MEMORY_SHARE = 0.25


@dataclass(frozen=True)
class PackedWeight:
    """A weight [out, in] in oneDNN's layout, and in the small-batch kernel's panels where
    that runs (panels and small both set, or neither)."""

    onednn: torch.Tensor
    out_features: int
    panels: torch.Tensor | None = None
    small: CpuGemm | None = None


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


def small_batch_kernel(
    dtype: torch.dtype,
    choice: CpuGemmChoice,
    native_kernels: bool,
    weight_bytes: int = 0,
    available: int | None = None,
) -> CpuGemm | None:
    """The small-batch kernel for a CPU model's products, or None: not `auto`, not float32,
    the native library turned off or not built, no AVX-512, or its copy of the weights
    (weight_bytes) over SMALL_BATCH_MEMORY_SHARE of the host's available memory."""
    if choice != "auto" or dtype != torch.float32 or not native_kernels:
        return None
    if available is not None and weight_bytes > available * SMALL_BATCH_MEMORY_SHARE:
        gib = 1 << 30
        log.warning(
            "small-batch products off: their copy of the weights (%.2f GiB) is over %.0f%% "
            "of the %.2f GiB of host memory available; decode steps run on oneDNN alone",
            weight_bytes / gib, SMALL_BATCH_MEMORY_SHARE * 100, available / gib,
        )  # fmt: skip
        return None
    return cpu_gemm.load()


def pack(weight: torch.Tensor, small: CpuGemm | None = None) -> PackedWeight:
    """The weight [out, in] in oneDNN's blocked layout, and in small's panels when given
    (new tensors; weight is kept)."""
    with torch.inference_mode(False), torch.no_grad():
        onednn = torch.ops.mkldnn._reorder_linear_weight(weight.detach(), _PACK_FOR_ROWS)
    if small is None:
        return PackedWeight(onednn, weight.shape[0])
    return PackedWeight(onednn, weight.shape[0], small.pack(weight), small)


def packed_linear(x: torch.Tensor, packed: PackedWeight, bias: torch.Tensor | None) -> torch.Tensor:
    """x [..., in] times a weight packed by pack(), plus bias."""
    if packed.small is not None and x.dim() == 2 and x.shape[0] <= SMALL_BATCH_ROWS:
        assert packed.panels is not None
        return packed.small.linear(x, packed.panels, packed.out_features, bias)
    return torch.ops.mkldnn._linear_pointwise(x, packed.onednn, bias, "none", [], "")


def describe_products(cpu_gemm: str, small_batch: bool) -> str:
    """The worker's start-up log words for its CPU products."""
    if cpu_gemm != "onednn":
        return ""
    # The kernel's own copy of the weights is worth saying: it doubles their memory.
    small = ", small batches: C kernel (its own copy of the weights)" if small_batch else ""
    return "; products: oneDNN" + small
