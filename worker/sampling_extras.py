"""The sampling settings that only some requests use (penalties, logit biases, token
masks from structured outputs and allowed_token_ids, bans from bad words and
min_tokens), gathered into a step's SamplingTensors only when a row of the step uses
one."""

from __future__ import annotations

import numpy as np
import torch

from worker.input_batch import InputBatch
from worker.sampler import (
    PenaltyTensors,
    SamplingTensors,
    expand,
    logit_bias_tensors,
    token_bans,
)
from worker.step_state import DraftPlan
from worker.structured_output import GrammarMatchers


class SamplingExtras:
    """Fills a step's SamplingTensors with what its rows ask for beyond temperature,
    top-k, top-p and min-p."""

    def __init__(
        self,
        batch: InputBatch,
        grammars: GrammarMatchers,
        eos_token_ids: tuple[int, ...],
        vocab_size: int,
        device: torch.device,
        answers: bool,
    ) -> None:
        self.batch = batch
        self.grammars = grammars
        self.eos_token_ids = eos_token_ids
        self.vocab = vocab_size
        self.device = device
        self.answers = answers  # rank 0: the only rank that answers the core (logprobs)

    def fill(
        self,
        sampling: SamplingTensors,
        rows: np.ndarray,
        req_ids: list[str],
        drafts: DraftPlan | None = None,
    ) -> tuple[torch.Tensor | None, list[int]]:
        """Logit biases, penalties, token masks and bans into sampling; the logprob rows
        and counts. Only for a step in which some row uses one of them. With drafts, the
        same for every verified position too (drafts.sampling): a position reads the
        drafts before it as generated tokens."""
        batch = self.batch
        self._fill_rows(sampling, rows, req_ids, batch.num_tokens[rows])
        if drafts is not None:
            sizes = drafts.sizes()
            at = np.repeat(rows, sizes)
            offsets = np.arange(len(at)) - np.repeat(drafts.first_rows, sizes)
            drafts.sampling = expand(sampling, sizes)
            every = [rid for rid, n in zip(req_ids, sizes.tolist()) for _ in range(n)]
            self._fill_rows(drafts.sampling, at, every, batch.num_tokens[at] + offsets)
        if not self.answers:
            return None, []
        wanted = batch.num_logprobs[rows]
        asking = np.flatnonzero(wanted >= 0)
        if not asking.size:
            return None, []
        return torch.from_numpy(asking).to(self.device), wanted[asking].tolist()

    def _fill_rows(
        self,
        sampling: SamplingTensors,
        rows: np.ndarray,
        req_ids: list[str],
        num_tokens: np.ndarray,
    ) -> None:
        """sampling's extras for rows (a row may repeat: the positions of a drafted
        request), each reading the first num_tokens tokens of its row as known."""
        self._penalties_and_bias(sampling, rows, req_ids, num_tokens)
        limited = np.flatnonzero(self.batch.token_limited[rows]).tolist()
        sampling.token_masks = self.token_masks(req_ids, limited)
        ban_rows, ban_tokens = self._bad_word_bans(rows, req_ids, limited, num_tokens)
        self._min_tokens_bans(rows, req_ids, ban_rows, ban_tokens, num_tokens)
        if ban_rows:
            sampling.banned = (
                torch.tensor(ban_rows, dtype=torch.int64, device=self.device),
                torch.tensor(ban_tokens, dtype=torch.int64, device=self.device),
            )

    def _penalties_and_bias(
        self,
        sampling: SamplingTensors,
        rows: np.ndarray,
        req_ids: list[str],
        num_tokens: np.ndarray,
    ) -> None:
        batch = self.batch
        presence = batch.presence_penalty[rows]
        frequency = batch.frequency_penalty[rows]
        repetition = batch.repetition_penalty[rows]
        if presence.any() or frequency.any() or (repetition != 1.0).any():
            sampling.penalties = PenaltyTensors.build(
                batch.token_ids[rows, : int(num_tokens.max())],
                batch.num_prompt_tokens[rows],
                num_tokens,
                presence,
                frequency,
                repetition,
                self.vocab,
                self.device,
            )
        biased = np.flatnonzero(batch.logit_biased[rows])
        if biased.size:
            sampling.bias = logit_bias_tensors(
                [
                    (i, batch.requests[req_ids[i]].sampling_params.logit_bias or {})
                    for i in biased.tolist()
                ],
                self.device,
            )

    def _bad_word_bans(
        self, rows: np.ndarray, req_ids: list[str], limited: list[int], num_tokens: np.ndarray
    ) -> tuple[list[int], list[int]]:
        """A bad word's last token, wherever the output ends with the rest of it."""
        batch = self.batch
        ban_rows: list[int] = []
        ban_tokens: list[int] = []
        for i in limited:
            params = batch.requests[req_ids[i]].sampling_params
            row = int(rows[i])
            end = int(num_tokens[i])
            output = batch.token_ids[row, int(batch.num_prompt_tokens[row]) : end]
            for seq in params.bad_words_token_ids:
                k = len(seq) - 1
                if k <= len(output) and (k == 0 or output[len(output) - k :].tolist() == seq[:k]):
                    ban_rows.append(i)
                    ban_tokens.append(seq[-1])
        return ban_rows, ban_tokens

    def _min_tokens_bans(
        self,
        rows: np.ndarray,
        req_ids: list[str],
        ban_rows: list[int],
        ban_tokens: list[int],
        num_tokens: np.ndarray,
    ) -> None:
        """Below min_tokens nothing that would stop the request may be sampled."""
        batch = self.batch
        produced = num_tokens - batch.num_prompt_tokens[rows]
        early = np.flatnonzero(batch.min_tokens[rows] > produced)
        for i in early.tolist():
            params = batch.requests[req_ids[i]].sampling_params
            stops = list(params.stop_token_ids)
            if not params.ignore_eos:
                stops += self.eos_token_ids
            stops = [t for t in stops if t < self.vocab]
            ban_rows += [i] * len(stops)
            ban_tokens += stops

    def token_masks(
        self, req_ids: list[str], limited: list[int]
    ) -> tuple[torch.Tensor, torch.Tensor] | None:
        """SamplingTensors.token_masks: the tokens the step's constrained rows (structured
        outputs) and allowed_token_ids rows may not sample; a row with both, the union."""
        device, vocab = self.device, self.vocab
        parts: list[tuple[list[int], torch.Tensor]] = []
        if self.grammars:
            found = self.grammars.fill_bitmask(req_ids)
            if found is not None:
                parts.append((found[0], token_bans(found[1], vocab, device)))
        requests = self.batch.requests
        allowed = [
            (i, ids)
            for i in limited
            if (ids := requests[req_ids[i]].sampling_params.allowed_token_ids) is not None
        ]
        if allowed:
            bans = torch.ones((len(allowed), vocab), dtype=torch.bool, device=device)
            for k, (_, ids) in enumerate(allowed):
                bans[k, torch.tensor(ids, dtype=torch.int64, device=device)] = False
            parts.append(([i for i, _ in allowed], bans))
        if not parts:
            return None
        if len(parts) == 1:
            rows, bans = parts[0]
            return torch.tensor(rows, dtype=torch.int64, device=device), bans
        every = sorted({i for rows, _ in parts for i in rows})
        at = {i: k for k, i in enumerate(every)}
        union = torch.zeros((len(every), vocab), dtype=torch.bool, device=device)
        for rows, bans in parts:
            union[[at[i] for i in rows]] |= bans
        return torch.tensor(every, dtype=torch.int64, device=device), union
