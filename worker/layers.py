"""Building blocks of the decoders (Llama family, Gemma 3): linear, embedding, RMSNorm,
rotary, MLP, and their tensor-parallel forms (how they split is described in worker.parallel).

Parameters are allocated uninitialised (`torch.empty`): every one is overwritten by
`load_weights`, and random initialisation of a multi-billion-parameter model on the CPU
would cost minutes at start-up for nothing. A sharded parameter records which part of the
checkpoint tensor it holds (`mark_sharded`), so loading slices by parameter, not by name.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from pagedkernels.cpu_elementwise import CpuElementwise
from pagedkernels.cpu_gemm import CpuGemm
from worker import gemm
from worker.model_config import (
    SUPPORTED_ACTIVATIONS,
    LinearRopeScaling,
    RopeScaling,
)
from worker.parallel import Shard, TPContext, even_shard, mark_sharded


def _empty_param(*shape: int, dtype: torch.dtype, device: torch.device) -> nn.Parameter:
    return nn.Parameter(torch.empty(*shape, dtype=dtype, device=device), requires_grad=False)


class Linear(nn.Module):
    def __init__(
        self,
        in_features: int,
        out_features: int,
        bias: bool,
        dtype: torch.dtype,
        device: torch.device,
    ) -> None:
        super().__init__()
        self.weight = _empty_param(out_features, in_features, dtype=dtype, device=device)
        self.bias = _empty_param(out_features, dtype=dtype, device=device) if bias else None
        # The weight in oneDNN's layout (and the small-batch kernel's) once loaded, on CPUs
        # where that pays (worker.gemm).
        self.packed: gemm.PackedWeight | None = None

    def pack_weight(self, small: CpuGemm | None = None) -> None:
        """From now on, products through oneDNN (and small's kernel for decode-sized
        batches); the plain weight is released."""
        self.packed = gemm.pack(self.weight, small)
        self.weight = _empty_param(0, dtype=self.weight.dtype, device=self.weight.device)

    def product(self, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        if self.packed is not None:
            return gemm.packed_linear(x, self.packed, bias)
        return F.linear(x, self.weight, bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.product(x, self.bias)


def stack_linears(*parts: Linear) -> Linear:
    """One Linear whose output is the parts' outputs side by side: their weights' rows (and
    biases, a missing one as zeros) stacked. A product per layer instead of one per part
    costs a dispatch and a pass over the input each, most of a decode step's small products."""
    first = parts[0].weight
    stacked = Linear(first.shape[1], 0, False, first.dtype, first.device)
    stacked.weight = nn.Parameter(torch.cat([p.weight for p in parts]), requires_grad=False)
    if any(p.bias is not None for p in parts):
        biases = [p.bias if p.bias is not None else torch.zeros_like(p.weight[:, 0]) for p in parts]
        stacked.bias = nn.Parameter(torch.cat(biases), requires_grad=False)
    return stacked


class ColumnParallelLinear(Linear):
    """Holds output rows `rows` of the full weight (and bias): its output is this rank's
    slice of features, consumed locally, so no communication."""

    def __init__(
        self,
        in_features: int,
        rows: Shard,
        bias: bool,
        dtype: torch.dtype,
        device: torch.device,
    ) -> None:
        super().__init__(in_features, rows.size, bias, dtype, device)
        mark_sharded(self.weight, 0, rows)
        if self.bias is not None:
            mark_sharded(self.bias, 0, rows)


class RowParallelLinear(Linear):
    """Holds input columns `cols` of the full weight: each rank's product is a partial
    sum, all-reduced. The bias is replicated and added after the reduce, so it counts once."""

    def __init__(
        self,
        cols: Shard,
        out_features: int,
        bias: bool,
        dtype: torch.dtype,
        device: torch.device,
        tp: TPContext,
    ) -> None:
        super().__init__(cols.size, out_features, bias, dtype, device)
        mark_sharded(self.weight, 1, cols)
        self.tp = tp

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.tp.size == 1:
            return self.product(x, self.bias)
        out = self.tp.all_reduce(self.product(x, None))
        return out if self.bias is None else out + self.bias


class _VocabRows(nn.Module):
    """A [vocab slice, dim] weight: this rank's rows of the vocabulary."""

    def __init__(
        self, vocab: Shard, dim: int, dtype: torch.dtype, device: torch.device, tp: TPContext
    ) -> None:
        super().__init__()
        self.vocab = vocab
        self.tp = tp
        self.weight = _empty_param(vocab.size, dim, dtype=dtype, device=device)
        mark_sharded(self.weight, 0, vocab)


class VocabParallelEmbedding(_VocabRows):
    """Holds the embedding rows of vocabulary slice `vocab`; other ids embed to zero here
    and get their rows from the rank that has them through the all-reduce."""

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        if self.tp.size == 1:
            return F.embedding(ids, self.weight)
        local = ids - self.vocab.start
        inside = (local >= 0) & (local < self.vocab.size)
        out = F.embedding(torch.where(inside, local, 0), self.weight)
        out.masked_fill_(~inside[..., None], 0.0)
        return self.tp.all_reduce(out)


class ParallelLMHead(_VocabRows):
    """Holds the output rows of vocabulary slice `vocab` (possibly the embedding's own
    Parameter when tied); returns the full float32 logits on every rank."""

    packed: gemm.PackedWeight | None = None  # oneDNN's copy (worker.gemm); the weight stays

    def pack_weight(self, small: CpuGemm | None = None) -> None:
        # The weight stays: it may be the embedding's own (tied), and the LM head is one
        # matrix, so the copy costs little next to the decoder layers.
        self.packed = gemm.pack(self.weight, small)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        if self.packed is not None:
            logits = gemm.packed_linear(hidden, self.packed, None).float()
        else:
            logits = F.linear(hidden, self.weight).float()
        if self.tp.size == 1:
            return logits
        # Padding is cut only after the gather (each rank's slice has the same width),
        # and before anyone samples, so a padded id can never be chosen.
        logits = self.tp.all_gather_last_dim(logits)
        return logits[..., : self.vocab.full]


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float, dtype: torch.dtype, device: torch.device) -> None:
        super().__init__()
        self.eps = eps
        self.weight = _empty_param(dim, dtype=dtype, device=device)
        # The C kernels, set by the runner on float32 CPU models (pagedkernels.cpu_elementwise).
        self.native: CpuElementwise | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.native is not None and x.dim() == 2:
            return self.native.rms_norm(x, self.weight, self.eps, None)
        # Normalise in float32 and round back before the weight, as the reference
        # implementation does, so half-precision outputs round the same way.
        return self._normalized(x).to(x.dtype).mul_(self.weight)

    def add_forward(
        self, x: torch.Tensor, residual: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(norm(residual + x), residual + x). The sum may be written over x, which must be
        a fresh tensor of the caller's (a layer's output); residual is never written."""
        if self.native is not None and x.dim() == 2:
            # The kernel adds its second operand into its first: x += residual, normalised.
            return self.native.rms_norm(residual, self.weight, self.eps, x), x
        summed = residual + x
        return self(summed), summed

    def _normalized(self, x: torch.Tensor) -> torch.Tensor:
        """x / rms(x) over the last dim, in float32."""
        x32 = x.float()
        return x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)


class GemmaRMSNorm(RMSNorm):
    """Gemma's RMSNorm: the weight is stored as an offset from 1 (zero is the identity),
    and the product is taken in float32, rounding only once at the end."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return (self._normalized(x) * (1.0 + self.weight.float())).to(x.dtype)


def rope_inv_freq(head_dim: int, theta: float, scaling: RopeScaling | None = None) -> torch.Tensor:
    """Per-pair rotation frequencies [head_dim // 2], float32."""
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim))
    if scaling is None:
        return inv_freq
    if isinstance(scaling, LinearRopeScaling):
        return inv_freq / scaling.factor
    # Llama 3.1: long wavelengths (beyond the original context) are slowed by `factor`,
    # short ones are kept, and the band between is blended linearly in 1/wavelength.
    wavelen = 2 * math.pi / inv_freq
    old_len = scaling.original_max_position_embeddings
    low_freq_wavelen = old_len / scaling.low_freq_factor
    high_freq_wavelen = old_len / scaling.high_freq_factor
    smooth = (old_len / wavelen - scaling.low_freq_factor) / (
        scaling.high_freq_factor - scaling.low_freq_factor
    )
    blended = (1 - smooth) * inv_freq / scaling.factor + smooth * inv_freq
    scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / scaling.factor, inv_freq)
    in_band = (wavelen >= high_freq_wavelen) & (wavelen <= low_freq_wavelen)
    return torch.where(in_band, blended, scaled)


class RotaryEmbedding(nn.Module):
    """Rotary position embedding, "rotate half" layout: dims i and i + D/2 form a pair."""

    def __init__(
        self, head_dim: int, theta: float, scaling: RopeScaling | None, device: torch.device
    ) -> None:
        super().__init__()
        self.register_buffer(
            "inv_freq", rope_inv_freq(head_dim, theta, scaling).to(device), persistent=False
        )

    def forward(
        self, positions: torch.Tensor, dtype: torch.dtype
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """cos and sin [T, head_dim] for the given positions, computed in float32.

        Computed from positions each step instead of a table so no maximum length is
        baked in; it is one outer product per forward, shared by all layers.
        """
        freqs = positions.float()[:, None] * self.inv_freq[None, :]
        angles = torch.cat((freqs, freqs), dim=-1)
        return angles.cos().to(dtype), angles.sin().to(dtype)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate x [T, H, D] by cos/sin [T, D]."""
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos[:, None, :] + rotated * sin[:, None, :]


def _gelu_tanh(x: torch.Tensor) -> torch.Tensor:
    return F.gelu(x, approximate="tanh")


# Hugging Face activation names (as config.json gives them) -> the function.
# Each may overwrite its input (a projection's output nothing else holds).
_ACTIVATIONS: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "silu": functools.partial(F.silu, inplace=True),
    "gelu_pytorch_tanh": _gelu_tanh,
}
assert set(_ACTIVATIONS) == set(SUPPORTED_ACTIVATIONS)


class GatedMLP(nn.Module):
    """down(act(gate(x)) * up(x)), the intermediate features split across ranks: SwiGLU
    with silu (Llama), GeGLU with gelu_pytorch_tanh (Gemma)."""

    def __init__(
        self,
        hidden_size: int,
        intermediate_size: int,
        bias: bool,
        dtype: torch.dtype,
        device: torch.device,
        tp: TPContext | None = None,
        activation: str = "silu",
    ) -> None:
        super().__init__()
        tp = tp or TPContext()
        self.act = _ACTIVATIONS[activation]
        self.activation = activation
        # The C kernels, set by the runner on float32 CPU models (pagedkernels.cpu_elementwise).
        self.native: CpuElementwise | None = None
        self.gate_up_proj: Linear | None = None  # fuse_projections()
        part = even_shard(intermediate_size, tp, "intermediate_size")
        self.gate_proj = ColumnParallelLinear(hidden_size, part, bias, dtype, device)
        self.up_proj = ColumnParallelLinear(hidden_size, part, bias, dtype, device)
        self.down_proj = RowParallelLinear(part, hidden_size, bias, dtype, device, tp)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # In place on the gate projection's fresh output: a prefill step's [tokens x
        # intermediate] tensors are the largest the model makes.
        if self.gate_up_proj is not None and self.native is not None:
            both = self.gate_up_proj(x)
            gate, up = both[:, : self.part], both[:, self.part :]
            # A fresh contiguous output: down_proj reads it faster than the strided gate.
            out = torch.empty_like(gate, memory_format=torch.contiguous_format)
            return self.down_proj(self.native.silu_mul(gate, up, out))
        return self.down_proj(self.act(self.gate_proj(x)).mul_(self.up_proj(x)))

    def fuse_projections(self) -> None:
        """From now on gate and up are one product (their weights stacked), for silu MLPs
        whose activation runs in the C kernel (self.native); the two modules are released."""
        if self.activation != "silu" or self.native is None:
            return
        self.gate_up_proj = stack_linears(self.gate_proj, self.up_proj)
        self.part = self.gate_proj.weight.shape[0]
        del self.gate_proj, self.up_proj
