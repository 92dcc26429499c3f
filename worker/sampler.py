"""Batched sampling: temperature, top-k, top-p and per-request seeds in one pass.

Sampling uses the exponential race: with q_i ~ Exponential(1) independent,
argmax_i(p_i / q_i) is distributed as Categorical(p). Its randomness is one row of
noise per request, so a seeded request fills its row from its own generator and gets
the same tokens whatever else shares the batch and whichever row it sits in.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from protocol.engine import GREEDY_TEMPERATURE, SamplingParams


@dataclass
class SamplingTensors:
    """Per-row sampling parameters of one batch, on the logits' device."""

    temperature: torch.Tensor  # [N] float32; 0 for greedy rows
    top_k: torch.Tensor  # [N] int64; 0 = off
    top_p: torch.Tensor  # [N] float32; 1.0 = off
    greedy: torch.Tensor  # [N] bool
    # Batch-level flags, known on the host, so whole stages are skipped without a sync.
    all_greedy: bool
    any_top_k: bool
    any_top_p: bool

    @classmethod
    def from_params(
        cls, params: Sequence[SamplingParams], device: torch.device | str
    ) -> SamplingTensors:
        # Unset fields as the core would fill them with no generation_config.
        params = [p.resolve() for p in params]
        temps = [p.temperature for p in params]
        top_ks = [p.top_k for p in params]
        top_ps = [p.top_p for p in params]
        greedy = [t < GREEDY_TEMPERATURE for t in temps]
        return cls(
            temperature=torch.tensor(temps, dtype=torch.float32, device=device),
            top_k=torch.tensor(top_ks, dtype=torch.int64, device=device),
            top_p=torch.tensor(top_ps, dtype=torch.float32, device=device),
            greedy=torch.tensor(greedy, dtype=torch.bool, device=device),
            all_greedy=all(greedy),
            # Greedy rows ignore k and p, so they need not trigger the sort.
            any_top_k=any(k > 0 and not g for k, g in zip(top_ks, greedy)),
            any_top_p=any(p < 1.0 and not g for p, g in zip(top_ps, greedy)),
        )

    @classmethod
    def from_arrays(
        cls,
        temperature: np.ndarray,
        top_k: np.ndarray,
        top_p: np.ndarray,
        device: torch.device | str,
    ) -> SamplingTensors:
        """The same from per-row numpy arrays (the persistent batch keeps them)."""
        greedy = temperature < GREEDY_TEMPERATURE
        sampled = ~greedy
        return cls(
            temperature=torch.from_numpy(temperature).to(device),
            top_k=torch.from_numpy(top_k).to(device),
            top_p=torch.from_numpy(top_p).to(device),
            greedy=torch.from_numpy(greedy).to(device),
            all_greedy=bool(greedy.all()),
            any_top_k=bool((top_k[sampled] > 0).any()),
            any_top_p=bool((top_p[sampled] < 1.0).any()),
        )


def make_generator(seed: int, device: torch.device | str) -> torch.Generator:
    """The per-request generator a caller keeps for a request with a seed."""
    gen = torch.Generator(device=device)
    gen.manual_seed(seed)
    return gen


def sample(
    logits: torch.Tensor,
    tensors: SamplingTensors,
    generators: Sequence[torch.Generator | None],
    shared_generator: torch.Generator | None = None,
) -> torch.Tensor:
    """Token ids [N] int64 for logits [N, V] float32.

    generators[i] is row i's own generator (requests with a seed) or None (the row
    draws from shared_generator, or torch's default generator when that is None).
    """
    greedy_tokens = logits.argmax(dim=-1)
    if tensors.all_greedy:
        return greedy_tokens

    # Greedy rows go through the sampling arithmetic with temperature 1 (harmless, their
    # result is replaced) so the whole batch stays one tensor program.
    temperature = torch.where(
        tensors.greedy, torch.ones_like(tensors.temperature), tensors.temperature
    )
    scaled = logits / temperature[:, None]
    if tensors.any_top_k or tensors.any_top_p:
        scaled = _apply_top_k_top_p(scaled, tensors)
    probs = torch.softmax(scaled, dim=-1)

    noise = torch.empty_like(probs)
    noise.exponential_(generator=shared_generator)
    for row, gen in enumerate(generators):
        if gen is not None:
            noise[row].exponential_(generator=gen)
    # An exact 0 draw would turn a zero-probability token's 0/0 into NaN, which argmax
    # would pick.
    noise.clamp_(min=torch.finfo(noise.dtype).tiny)
    sampled = (probs / noise).argmax(dim=-1)
    return torch.where(tensors.greedy, greedy_tokens, sampled)


def _apply_top_k_top_p(logits: torch.Tensor, tensors: SamplingTensors) -> torch.Tensor:
    """Set logits outside each row's top-k and then top-p set to -inf."""
    vocab = logits.shape[-1]
    sorted_logits, order = logits.sort(dim=-1, descending=True)
    rank = torch.arange(vocab, device=logits.device)[None, :]
    if tensors.any_top_k:
        k = torch.where(tensors.top_k > 0, tensors.top_k, vocab)
        # Rank, not value, decides: ties at the k-th value never let in more than k.
        sorted_logits = sorted_logits.masked_fill(rank >= k[:, None], float("-inf"))
    if tensors.any_top_p:
        sorted_probs = torch.softmax(sorted_logits, dim=-1)
        mass_before = sorted_probs.cumsum(dim=-1) - sorted_probs
        # Keep the smallest prefix whose mass reaches top_p (the first token always).
        # Rows with top_p = 1 are left alone so rounding in the cumulative sum cannot
        # drop their tail.
        drop = (mass_before >= tensors.top_p[:, None]) & (tensors.top_p < 1.0)[:, None]
        sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
    return torch.empty_like(logits).scatter_(-1, order, sorted_logits)
