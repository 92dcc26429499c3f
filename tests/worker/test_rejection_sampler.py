"""The rejection sampler: greedy keeps the longest prefix of drafts the argmax agrees
with; sampled verification emits tokens distributed exactly as the target's processed
distribution (a chi-square test over many seeded draws on a small vocabulary)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from worker.rejection_sampler import verify_greedy, verify_sampled
from worker.sampler import SamplingTensors, target_probs

V = 6
DRAWS = 20_000
# Chi-square 0.999 quantiles by degrees of freedom: a correct sampler exceeds one a seed
# in a thousand; the seed is fixed, so the test is deterministic.
CHI2_999 = {3: 16.27, 5: 20.52}


def fits(counts: np.ndarray, probs: np.ndarray) -> bool:
    """Whether counts drawn from probs pass the chi-square test (tokens of probability
    0 must never be drawn)."""
    support = probs > 0
    if counts[~support].any():
        return False
    expected = counts.sum() * probs[support]
    statistic = float(((counts[support] - expected) ** 2 / expected).sum())
    return statistic < CHI2_999[int(support.sum()) - 1]


@pytest.mark.parametrize(
    ("argmax", "drafts", "want"),
    [
        ([5, 7, 9], [5, 7], [5, 7, 9]),  # all accepted: the bonus token follows
        ([5, 8, 9], [5, 7], [5, 8]),  # second rejected: the argmax replaces it
        ([4, 7, 9], [5, 7], [4]),  # first rejected: nothing after the correction
    ],
)
def test_greedy_keeps_the_longest_agreeing_prefix_then_the_argmax(argmax, drafts, want) -> None:
    assert verify_greedy(argmax, drafts) == want


def processed_distribution() -> tuple[torch.Tensor, np.ndarray]:
    """Logits [3, V] and, by hand, the distribution temperature 0.7 and top-k 4 make of
    the first row."""
    logits = torch.tensor(
        [
            [1.0, 0.2, 0.9, -0.5, 0.4, 0.0],
            [0.1, 1.5, -0.3, 0.8, 0.0, 0.2],
            [0.3, 0.3, 0.3, 0.3, 0.3, 0.3],
        ]
    )
    row = logits[0].numpy() / 0.7
    kept = np.argsort(-row)[:4]
    p = np.zeros(V)
    p[kept] = np.exp(row[kept] - row[kept].max())
    return logits, p / p.sum()


def _processed_probs(logits: torch.Tensor) -> torch.Tensor:
    """The target's distribution per row at temperature 0.7 and top-k 4."""
    tensors = SamplingTensors.from_arrays(
        np.full(3, 0.7, dtype=np.float32),
        np.full(3, 4, dtype=np.int64),
        np.ones(3, dtype=np.float32),
        "cpu",
    )
    return target_probs(logits, tensors)


def test_sampled_tokens_follow_the_processed_target_distribution() -> None:
    """Draft token 2 (not the target's favourite) at the first position: the first
    emitted token must be distributed as the target's processed p, whatever the draft."""
    logits, p0 = processed_distribution()
    probs = _processed_probs(logits)
    np.testing.assert_allclose(probs[0].numpy(), p0, rtol=1e-5, atol=1e-7)
    gen = torch.Generator().manual_seed(1234)
    first = np.zeros(V)
    second_after_accept = np.zeros(V)
    for _ in range(DRAWS):
        out = verify_sampled(probs, [2, 3], gen)
        first[out[0]] += 1
        if out[0] == 2:  # the first draft accepted: the next token follows the second row
            second_after_accept[out[1]] += 1
    assert fits(first, p0)
    p1 = probs[1].numpy().astype(np.float64)
    assert fits(second_after_accept, p1 / p1.sum())
    # The draft is accepted with probability p0[2] exactly (2 standard errors' slack ~ 4).
    accepted = first[2] / DRAWS
    assert abs(accepted - p0[2]) < 4 * np.sqrt(p0[2] * (1 - p0[2]) / DRAWS)


def test_a_draft_outside_top_k_is_never_accepted() -> None:
    logits, p0 = processed_distribution()
    banned = int(np.flatnonzero(p0 == 0)[0])
    probs = _processed_probs(logits)
    gen = torch.Generator().manual_seed(5)
    assert all(verify_sampled(probs, [banned], gen)[0] != banned for _ in range(500))


def test_seeded_verification_is_reproducible() -> None:
    probs = torch.softmax(processed_distribution()[0], dim=-1)
    runs = []
    for _ in range(2):
        gen = torch.Generator().manual_seed(99)
        runs.append([verify_sampled(probs, [0, 1], gen) for _ in range(50)])
    assert runs[0] == runs[1]
