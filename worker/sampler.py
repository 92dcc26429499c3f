"""Batched sampling: logit biases, penalties, min-token masks, temperature, top-k, top-p
and per-request seeds in one pass; logprobs for the rows that ask.

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

from protocol.engine import GREEDY_TEMPERATURE, Logprobs, SamplingParams
from worker.staging import StagedBuffer


@dataclass
class PenaltyTensors:
    """Per-row penalties and the token counts they apply to (built only for a batch in
    which some row uses a penalty; neutral rows come out bit-identical)."""

    presence: torch.Tensor  # [N] float32; 0 = off
    frequency: torch.Tensor  # [N] float32; 0 = off
    repetition: torch.Tensor  # [N] float32; 1 = off
    output_counts: torch.Tensor  # [N, V] float32: how often each token was generated
    in_prompt: torch.Tensor  # [N, V] bool: the token occurs in the prompt

    @classmethod
    def build(
        cls,
        token_ids: np.ndarray,
        num_prompt_tokens: np.ndarray,
        num_tokens: np.ndarray,
        presence: np.ndarray,
        frequency: np.ndarray,
        repetition: np.ndarray,
        vocab_size: int,
        device: torch.device | str,
    ) -> PenaltyTensors:
        """token_ids [N, L] int32 holds each row's prompt then its generated tokens
        (num_tokens of them, the first num_prompt_tokens the prompt; past them anything)."""
        tokens = torch.from_numpy(token_ids).to(device, torch.int64)
        n, length = tokens.shape
        pos = torch.arange(length, device=device)[None, :]
        prompt_len = torch.from_numpy(num_prompt_tokens).to(device, torch.int64)[:, None]
        total = torch.from_numpy(num_tokens).to(device, torch.int64)[:, None]
        # Positions that do not count go to an extra column, dropped after.
        spill = torch.full_like(tokens, vocab_size)
        generated = torch.where((pos >= prompt_len) & (pos < total), tokens, spill)
        counts = torch.zeros((n, vocab_size + 1), dtype=torch.float32, device=device)
        counts.scatter_add_(1, generated, torch.ones_like(generated, dtype=torch.float32))
        prompt = torch.where(pos < prompt_len, tokens, spill)
        in_prompt = torch.zeros((n, vocab_size + 1), dtype=torch.bool, device=device)
        in_prompt.scatter_(1, prompt, True)
        return cls(
            presence=torch.from_numpy(presence).to(device),
            frequency=torch.from_numpy(frequency).to(device),
            repetition=torch.from_numpy(repetition).to(device),
            output_counts=counts[:, :vocab_size],
            in_prompt=in_prompt[:, :vocab_size],
        )


def apply_penalties(logits: torch.Tensor, p: PenaltyTensors) -> torch.Tensor:
    """A new [N, V] tensor: repetition (HF's: a seen token's logit divided by the penalty
    when positive, multiplied when negative), then frequency and presence (OpenAI's:
    minus frequency * count minus presence * [count > 0], over generated tokens)."""
    generated = p.output_counts > 0
    seen = p.in_prompt | generated
    rep = p.repetition[:, None]
    penalized = torch.where(logits > 0, logits / rep, logits * rep)
    logits = torch.where(seen, penalized, logits)
    logits = logits - p.frequency[:, None] * p.output_counts
    return logits - p.presence[:, None] * generated


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
    # Only for batches that need them (None costs nothing): penalties, and the (row,
    # token) pairs that may not be sampled yet (EOS and stop tokens below min_tokens).
    penalties: PenaltyTensors | None = None
    banned: tuple[torch.Tensor, torch.Tensor] | None = None
    # (rows, token ids, values) added to the logits first (SamplingParams.logit_bias).
    bias: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None
    # (rows [K] int64, banned [K, V] bool): tokens those rows may not sample (structured
    # outputs: what their languages cannot continue with, token_bans; allowed_token_ids).
    token_masks: tuple[torch.Tensor, torch.Tensor] | None = None
    # [N] float32, only when some sampled row sets min_p (else None: the stage is skipped).
    min_p: torch.Tensor | None = None

    @classmethod
    def from_params(
        cls, params: Sequence[SamplingParams], device: torch.device | str
    ) -> SamplingTensors:
        # Unset fields as the core would fill them with no generation_config.
        params = [p.resolve() for p in params]
        temps = [p.temperature for p in params]
        top_ks = [p.top_k for p in params]
        top_ps = [p.top_p for p in params]
        min_ps = [p.min_p or 0.0 for p in params]
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
            min_p=torch.tensor(min_ps, dtype=torch.float32, device=device)
            if any(m > 0.0 and not g for m, g in zip(min_ps, greedy))
            else None,
        )

    @classmethod
    def from_arrays(
        cls,
        temperature: np.ndarray,
        top_k: np.ndarray,
        top_p: np.ndarray,
        device: torch.device | str,
        staged: Sequence[StagedBuffer] | None = None,
        min_p: np.ndarray | None = None,
    ) -> SamplingTensors:
        """The same from per-row numpy arrays (the persistent batch keeps them); staged:
        the step's persistent buffers for temperature, top_k, top_p and greedy (min_p is
        copied only in a step that uses it)."""
        greedy = temperature < GREEDY_TEMPERATURE
        sampled = ~greedy
        arrays = (temperature, top_k, top_p, greedy)
        if staged is None:
            tensors = [torch.from_numpy(a).to(device) for a in arrays]
        else:
            tensors = [b.upload(a) for b, a in zip(staged, arrays, strict=True)]
        return cls(
            temperature=tensors[0],
            top_k=tensors[1],
            top_p=tensors[2],
            greedy=tensors[3],
            all_greedy=bool(greedy.all()),
            any_top_k=bool((top_k[sampled] > 0).any()),
            any_top_p=bool((top_p[sampled] < 1.0).any()),
            min_p=torch.from_numpy(min_p).to(device)
            if min_p is not None and (min_p[sampled] > 0.0).any()
            else None,
        )


def logit_bias_tensors(
    biases: Sequence[tuple[int, dict[int, float]]], device: torch.device | str
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """SamplingTensors.bias from (row, logit_bias) pairs."""
    rows: list[int] = []
    token_ids: list[int] = []
    values: list[float] = []
    for row, bias in biases:
        rows += [row] * len(bias)
        token_ids += bias.keys()
        values += bias.values()
    return (
        torch.tensor(rows, dtype=torch.int64, device=device),
        torch.tensor(token_ids, dtype=torch.int64, device=device),
        torch.tensor(values, dtype=torch.float32, device=device),
    )


def token_bans(words: np.ndarray, vocab_size: int, device: torch.device) -> torch.Tensor:
    """[K, vocab_size] bool, True where bit t % 32 of words[k, t // 32] is clear (and past
    the bitmask's width): the tokens each row may not sample. On a GPU the words cross
    to the device, 32x smaller than the mask, and are unpacked there."""
    k, width = words.shape[0], words.shape[1] * 32
    if device.type == "cpu":
        banned = np.ones((k, vocab_size), dtype=bool)
        n = min(width, vocab_size)
        clear = np.invert(words).view(np.uint8)
        banned[:, :n] = np.unpackbits(clear, axis=1, count=n, bitorder="little")
        return torch.from_numpy(banned)
    bits = unpack_bans(torch.from_numpy(words).to(device))
    if width >= vocab_size:
        return bits[:, :vocab_size]
    rest = torch.ones((k, vocab_size - width), dtype=torch.bool, device=device)
    return torch.cat([bits, rest], dim=1)


def unpack_bans(words: torch.Tensor) -> torch.Tensor:
    """token_bans' unpacking with tensor ops, for bitmask words already on the device."""
    shifts = torch.arange(32, dtype=torch.int32, device=words.device)
    return ((words[:, :, None] >> shifts) & 1).reshape(words.shape[0], -1) == 0


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
    logits is left unchanged (logprobs are taken from it after).
    """
    logits = _biased_penalized_banned(logits, tensors)
    greedy_tokens = logits.argmax(dim=-1)
    masks = tensors.token_masks
    if masks is not None:
        # Only the constrained rows are masked (a copy of them), not the whole batch.
        rows, banned = masks
        constrained = logits.index_select(0, rows).masked_fill_(banned, float("-inf"))
        greedy_tokens.index_copy_(0, rows, constrained.argmax(dim=-1))
    if tensors.all_greedy:
        return greedy_tokens

    # Greedy rows go through the sampling arithmetic with temperature 1 (harmless, their
    # result is replaced) so the whole batch stays one tensor program.
    temperature = torch.where(
        tensors.greedy, torch.ones_like(tensors.temperature), tensors.temperature
    )
    scaled = logits / temperature[:, None]
    if masks is not None:
        scaled.index_copy_(0, rows, constrained / temperature.index_select(0, rows)[:, None])
    probs = _truncated_probs(scaled, tensors)

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


def _biased_penalized_banned(logits: torch.Tensor, tensors: SamplingTensors) -> torch.Tensor:
    """logits after the logit biases, penalties and bans (a new tensor if any applies)."""
    if tensors.bias is not None:
        rows, token_ids, values = tensors.bias
        logits = logits.index_put((rows, token_ids), values, accumulate=True)
    if tensors.penalties is not None:
        logits = apply_penalties(logits, tensors.penalties)
    if tensors.banned is not None:
        logits = logits.index_put(tensors.banned, torch.tensor(float("-inf"), device=logits.device))
    return logits


def processed_logits(logits: torch.Tensor, tensors: SamplingTensors) -> torch.Tensor:
    """What sample() takes its greedy argmax and its distribution from: logits after
    biases, penalties, bans and token masks (before temperature)."""
    logits = _biased_penalized_banned(logits, tensors)
    if tensors.token_masks is not None:
        rows, banned = tensors.token_masks
        masked = logits.index_select(0, rows).masked_fill_(banned, float("-inf"))
        logits = logits.index_copy(0, rows, masked)
    return logits


def expand(tensors: SamplingTensors, sizes: np.ndarray) -> SamplingTensors:
    """Each row's temperature, top-k, top-p and min-p repeated sizes[i] times (the
    verified positions of a drafted request); no extras."""
    n = torch.from_numpy(sizes).to(tensors.temperature.device)
    return SamplingTensors(
        temperature=tensors.temperature.repeat_interleave(n),
        top_k=tensors.top_k.repeat_interleave(n),
        top_p=tensors.top_p.repeat_interleave(n),
        greedy=tensors.greedy.repeat_interleave(n),
        all_greedy=tensors.all_greedy,
        any_top_k=tensors.any_top_k,
        any_top_p=tensors.any_top_p,
        min_p=None if tensors.min_p is None else tensors.min_p.repeat_interleave(n),
    )


def target_probs(logits: torch.Tensor, tensors: SamplingTensors) -> torch.Tensor:
    """The distribution sample() draws a sampled row's token from ([N, V] float32):
    temperature, min_p, top-k, top-p (greedy rows get temperature 1)."""
    temperature = torch.where(
        tensors.greedy, torch.ones_like(tensors.temperature), tensors.temperature
    )
    return _truncated_probs(logits / temperature[:, None], tensors)


def _truncated_probs(scaled: torch.Tensor, tensors: SamplingTensors) -> torch.Tensor:
    """softmax of tempered logits after min_p, top-k and top-p."""
    if tensors.min_p is not None:
        # vLLM's order: min_p on the tempered distribution, then top-k and top-p.
        probs = torch.softmax(scaled, dim=-1)
        floor = tensors.min_p[:, None] * probs.amax(dim=-1, keepdim=True)
        scaled = scaled.masked_fill(probs < floor, float("-inf"))
    if tensors.any_top_k or tensors.any_top_p:
        scaled = _apply_top_k_top_p(scaled, tensors)
    return torch.softmax(scaled, dim=-1)


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


def compute_logprobs(
    logits: torch.Tensor, rows: torch.Tensor, tokens: torch.Tensor, num_top: list[int]
) -> list[Logprobs]:
    """Logprobs of the sampled tokens of rows (and each row's num_top most likely).

    "Raw" logprobs, as vLLM returns by default: a log-softmax of the float32 logits the
    sampler got, before penalties, masks and temperature, so they describe the model and
    do not change with the sampling settings."""
    logprobs = torch.log_softmax(logits.index_select(0, rows).float(), dim=-1)
    chosen = logprobs.gather(1, tokens.index_select(0, rows)[:, None])[:, 0].tolist()
    k = max(num_top)
    if k == 0:
        return [Logprobs(c, [], []) for c in chosen]
    top_values, top_ids = logprobs.topk(k, dim=-1)
    values, ids = top_values.tolist(), top_ids.tolist()
    return [Logprobs(c, i[:n], v[:n]) for c, i, v, n in zip(chosen, ids, values, num_top)]
