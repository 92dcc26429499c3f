"""Building blocks of Llama-family decoders: linear, embedding, RMSNorm, rotary, MLP.

Parameters are allocated uninitialised (`torch.empty`): every one is overwritten by
`load_weights`, and random initialisation of a multi-billion-parameter model on the CPU
would cost minutes at start-up for nothing.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from worker.model_config import Llama3RopeScaling


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

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight, self.bias)


class Embedding(nn.Module):
    def __init__(
        self, num_embeddings: int, dim: int, dtype: torch.dtype, device: torch.device
    ) -> None:
        super().__init__()
        self.weight = _empty_param(num_embeddings, dim, dtype=dtype, device=device)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return F.embedding(ids, self.weight)


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float, dtype: torch.dtype, device: torch.device) -> None:
        super().__init__()
        self.eps = eps
        self.weight = _empty_param(dim, dtype=dtype, device=device)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # Normalise in float32 and round back before the weight, as the reference
        # implementation does, so half-precision outputs round the same way.
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x32.to(x.dtype)


def rope_inv_freq(
    head_dim: int, theta: float, scaling: Llama3RopeScaling | None = None
) -> torch.Tensor:
    """Per-pair rotation frequencies [head_dim // 2], float32."""
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim))
    if scaling is None:
        return inv_freq
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
        self, head_dim: int, theta: float, scaling: Llama3RopeScaling | None, device: torch.device
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


class GatedMLP(nn.Module):
    """down(silu(gate(x)) * up(x))."""

    def __init__(
        self,
        hidden_size: int,
        intermediate_size: int,
        bias: bool,
        dtype: torch.dtype,
        device: torch.device,
    ) -> None:
        super().__init__()
        self.gate_proj = Linear(hidden_size, intermediate_size, bias, dtype, device)
        self.up_proj = Linear(hidden_size, intermediate_size, bias, dtype, device)
        self.down_proj = Linear(intermediate_size, hidden_size, bias, dtype, device)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))
