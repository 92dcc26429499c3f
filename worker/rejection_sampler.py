"""Verifying drafts against the target model's distributions.

Greedy: the longest prefix of drafts that equals the argmax at each position, then the
argmax after it. Sampled, for a deterministic draft d (the drafter proposes one token
with probability 1): accept d with probability p(d), where p is the target's processed
distribution at that position; on rejection draw from p with d removed, renormalised,
and stop. Each emitted token is then distributed exactly as p (the standard
distribution-preserving rule). All drafts accepted: a bonus token from the last
position's p.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch


def verify_greedy(argmax: list[int], drafts: Sequence[int]) -> list[int]:
    """Tokens emitted for drafts (len(drafts) + 1 argmax values, one per position)."""
    accepted = 0
    for token, draft in zip(argmax, drafts):
        if token != draft:
            break
        accepted += 1
    return argmax[: accepted + 1]


def verify_sampled(
    probs: torch.Tensor, drafts: Sequence[int], generator: torch.Generator | None
) -> list[int]:
    """Tokens emitted for drafts, given the target's distributions probs
    [len(drafts) + 1, V] at each draft's position and after the last."""
    out: list[int] = []
    for j, draft in enumerate(drafts):
        p = probs[j]
        u = torch.rand((), generator=generator, device=p.device).item()
        if u < p[draft].item():
            out.append(draft)
            continue
        residual = p.clone()
        residual[draft] = 0.0
        mass = residual.sum()
        # p(d) < 1 after a rejection, so some mass remains; float rounding aside.
        if mass.item() <= 0.0:
            out.append(draft)
            continue
        out.append(_draw(residual / mass, generator))
        return out
    out.append(_draw(probs[len(drafts)], generator))
    return out


def _draw(p: torch.Tensor, generator: torch.Generator | None) -> int:
    return int(torch.multinomial(p, 1, generator=generator).item())
