"""The batched sampler: greedy, top-k, top-p, seeds and the sampled distribution."""

from __future__ import annotations

import torch

from protocol.engine import SamplingParams
from worker.sampler import SamplingTensors, make_generator, sample

CPU = torch.device("cpu")


def _sample(
    logits: torch.Tensor,
    params: list[SamplingParams],
    generators: list[torch.Generator | None] | None = None,
    shared: torch.Generator | None = None,
) -> torch.Tensor:
    tensors = SamplingTensors.from_params(params, CPU)
    return sample(logits, tensors, generators or [None] * len(params), shared)


def test_greedy_is_argmax() -> None:
    logits = torch.randn(6, 50, generator=torch.Generator().manual_seed(0))
    tokens = _sample(logits, [SamplingParams(temperature=0.0)] * 6)
    assert tokens.dtype == torch.int64
    assert torch.equal(tokens, logits.argmax(-1))


def test_greedy_rows_in_a_sampled_batch_stay_argmax() -> None:
    logits = torch.randn(8, 50, generator=torch.Generator().manual_seed(1))
    params = [SamplingParams(temperature=0.0 if i % 2 else 1.5) for i in range(8)]
    tokens = _sample(logits, params, shared=torch.Generator().manual_seed(2))
    assert torch.equal(tokens[1::2], logits[1::2].argmax(-1))


def test_top_k_one_and_tiny_top_p_are_argmax_at_any_temperature() -> None:
    gen = torch.Generator().manual_seed(3)
    logits = torch.randn(64, 100, generator=gen)
    for temperature in (0.5, 1.0, 5.0):
        top1 = _sample(logits, [SamplingParams(temperature=temperature, top_k=1)] * 64, shared=gen)
        assert torch.equal(top1, logits.argmax(-1))
        tiny_p = _sample(
            logits, [SamplingParams(temperature=temperature, top_p=1e-6)] * 64, shared=gen
        )
        assert torch.equal(tiny_p, logits.argmax(-1))


def test_top_k_never_leaves_the_k_largest() -> None:
    gen = torch.Generator().manual_seed(4)
    logits = torch.randn(512, 40, generator=gen)
    ks = [1 + i % 7 for i in range(512)]
    params = [
        SamplingParams(temperature=2.0, top_k=k, top_p=0.9 if i % 3 else 1.0)
        for i, k in enumerate(ks)
    ]
    tokens = _sample(logits, params, shared=gen)
    rank = (logits > logits.gather(1, tokens[:, None])).sum(-1)  # how many are larger
    assert torch.all(rank < torch.tensor(ks))


def test_seeded_rows_do_not_depend_on_neighbours_or_position() -> None:
    vocab = 64
    mine = torch.randn(vocab, generator=torch.Generator().manual_seed(5))
    seeded = SamplingParams(temperature=1.0, top_p=0.95, seed=1234)

    def run(row: int, batch: int, neighbour_seed: int) -> list[int]:
        noise = torch.Generator().manual_seed(neighbour_seed)
        gen = make_generator(1234, CPU)
        shared = torch.Generator().manual_seed(neighbour_seed + 1)
        out = []
        for _ in range(6):  # the request's generator carries over between steps
            logits = torch.randn(batch, vocab, generator=noise)
            logits[row] = mine
            params = [SamplingParams(temperature=0.7, top_k=5)] * batch
            params[row] = seeded
            gens: list[torch.Generator | None] = [None] * batch
            gens[row] = gen
            out.append(int(_sample(logits, params, gens, shared)[row]))
        return out

    reference = run(0, 1, 10)
    assert run(2, 5, 11) == reference
    assert run(6, 7, 12) == reference
    assert len(set(reference)) > 1  # it is really sampling, not collapsing to argmax


def test_temperature_one_matches_softmax_distribution() -> None:
    logits = torch.tensor([1.0, 0.0, -1.0, 0.5, -3.0])
    n = 40_000
    gen = torch.Generator().manual_seed(6)
    tokens = _sample(
        logits.expand(n, -1).clone(), [SamplingParams(temperature=1.0)] * n, shared=gen
    )
    _assert_distribution(tokens, torch.softmax(logits, -1), n)


def test_temperature_top_k_top_p_distribution() -> None:
    # temperature 0.5 doubles the logits; top_k=3 keeps tokens 0, 3, 1; top_p=0.9 then
    # drops token 1, whose mass starts past 0.9.
    logits = torch.tensor([1.0, 0.0, -1.0, 0.5, -3.0])
    n = 40_000
    gen = torch.Generator().manual_seed(7)
    params = [SamplingParams(temperature=0.5, top_k=3, top_p=0.9)] * n
    tokens = _sample(logits.expand(n, -1).clone(), params, shared=gen)
    kept = torch.tensor([2.0, float("-inf"), float("-inf"), 1.0, float("-inf")])
    probs_k = torch.softmax(torch.tensor([2.0, 0.0, float("-inf"), 1.0, float("-inf")]), -1)
    assert probs_k[0] + probs_k[3] >= 0.9 > probs_k[0]  # the setup is as described
    _assert_distribution(tokens, torch.softmax(kept, -1), n)


def _assert_distribution(tokens: torch.Tensor, expected: torch.Tensor, n: int) -> None:
    counts = torch.bincount(tokens, minlength=expected.numel()).double()
    assert torch.all(counts[expected == 0] == 0)
    support = expected > 0
    exp_counts = expected.double()[support] * n
    chi2 = float((((counts[support] - exp_counts) ** 2) / exp_counts).sum())
    # With <= 4 degrees of freedom, chi-square exceeds 25 with probability < 1e-4.
    assert chi2 < 25.0, (counts, exp_counts)


def test_from_arrays_matches_from_params() -> None:
    import numpy as np

    params = [
        SamplingParams(temperature=0.0, top_k=5),
        SamplingParams(temperature=0.7, top_p=0.9),
        SamplingParams(temperature=1.0, top_k=3, seed=4, min_p=0.2),
    ]
    a = SamplingTensors.from_params(params, "cpu")
    params = [p.resolve() for p in params]  # as the core sends them
    b = SamplingTensors.from_arrays(
        np.array([p.temperature for p in params], dtype=np.float32),
        np.array([p.top_k for p in params], dtype=np.int64),
        np.array([p.top_p for p in params], dtype=np.float32),
        "cpu",
        min_p=np.array([p.min_p for p in params], dtype=np.float32),
    )
    for name in ("temperature", "top_k", "top_p", "greedy", "min_p"):
        assert torch.equal(getattr(a, name), getattr(b, name)), name
    assert (a.all_greedy, a.any_top_k, a.any_top_p) == (b.all_greedy, b.any_top_k, b.any_top_p)


def test_min_p_never_samples_below_its_floor_and_leaves_other_rows_alone() -> None:
    gen = torch.Generator().manual_seed(5)
    logits = torch.randn(256, 30, generator=gen) * 2
    min_ps = [0.0 if i % 4 == 0 else 0.05 * (i % 4) for i in range(256)]
    params = [SamplingParams(temperature=1.3, min_p=m) for m in min_ps]
    tokens = _sample(logits, params, shared=torch.Generator().manual_seed(6))
    probs = torch.softmax(logits / 1.3, dim=-1)
    chosen = probs.gather(1, tokens[:, None])[:, 0]
    floor = torch.tensor(min_ps) * probs.amax(-1)
    assert torch.all(chosen >= floor)
    # The floor bites: without it, some rows would have drawn below it.
    free = _sample(
        logits, [SamplingParams(temperature=1.3)] * 256, shared=torch.Generator().manual_seed(6)
    )
    assert torch.any(probs.gather(1, free[:, None])[:, 0] < floor)
    # Rows without min_p draw exactly what they draw in a batch without it (same noise).
    assert torch.equal(tokens[::4], free[::4])
    # min_p 1 keeps only the likeliest token: greedy at any temperature.
    top = _sample(logits, [SamplingParams(temperature=5.0, min_p=1.0)] * 256, shared=gen)
    assert torch.equal(top, logits.argmax(-1))
    tensors = SamplingTensors.from_params([SamplingParams(temperature=0.0, min_p=0.5)], CPU)
    assert tensors.min_p is None  # greedy rows never need the stage
