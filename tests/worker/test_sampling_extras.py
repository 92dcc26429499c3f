"""worker/sampling_extras.py: what a step's rows ask beyond temperature and top-k/p, as
the sampler gets it: bad words' last tokens, stop tokens held back below min_tokens,
allowed_token_ids as a mask, logit biases, and which rows want logprobs."""

from __future__ import annotations

import numpy as np
import torch

from protocol.engine import SamplingParams
from protocol.worker import CachedRequestData, NewRequestData, SchedulerOutput
from worker.input_batch import InputBatch
from worker.sampler import SamplingTensors
from worker.sampling_extras import SamplingExtras
from worker.structured_output import GrammarMatchers

VOCAB = 16
EOS = 3
PARAMS = {
    "plain": SamplingParams(logprobs=2),
    "limited": SamplingParams(bad_words_token_ids=[[7], [5, 9], [6, 9]], allowed_token_ids=[1, 9]),
    "early": SamplingParams(min_tokens=3, stop_token_ids=[4, 999], logit_bias={6: 5.0}),
}


def _batch_after_one_token() -> tuple[InputBatch, np.ndarray, list[str]]:
    """Each request: prompt [1, 2], then 5 sampled."""
    batch = InputBatch(4, 32, [4])
    new = [NewRequestData(r, [1, 2], p, [[i + 1]], 0) for i, (r, p) in enumerate(PARAMS.items())]
    empty = CachedRequestData([], [], [], [], [])
    batch.apply(SchedulerOutput(0, new, empty, [2, 2, 2], 6, [], []))
    req_ids = list(PARAMS)
    batch.append_sampled(req_ids, [5, 5, 5])
    return batch, batch.rows_of(req_ids), req_ids


def _fill(answers: bool) -> tuple[SamplingTensors, torch.Tensor | None, list[int]]:
    batch, rows, req_ids = _batch_after_one_token()
    grammars = GrammarMatchers(".", [EOS])  # no constrained request
    extras = SamplingExtras(batch, grammars, (EOS,), VOCAB, torch.device("cpu"), answers)
    sampling = SamplingTensors.from_params(list(PARAMS.values()), "cpu")
    logprob_rows, counts = extras.fill(sampling, rows, req_ids)
    return sampling, logprob_rows, counts


def test_bad_words_and_min_tokens_ban_the_tokens_that_would_complete_or_stop() -> None:
    sampling, _, _ = _fill(answers=True)
    assert sampling.banned is not None
    pairs = list(zip(sampling.banned[0].tolist(), sampling.banned[1].tolist()))
    # limited (row 1): [7] always, [5, 9] after the output's 5; [6, 9] not (no 6 before).
    # early (row 2), 1 of 3 tokens: its stop token 4 and EOS; 999 is past the vocabulary.
    assert sorted(pairs) == [(1, 7), (1, 9), (2, 3), (2, 4)]


def test_allowed_token_ids_mask_every_other_token_of_that_row() -> None:
    sampling, _, _ = _fill(answers=True)
    assert sampling.token_masks is not None
    rows, bans = sampling.token_masks
    assert rows.tolist() == [1]
    assert torch.nonzero(~bans[0]).flatten().tolist() == [1, 9]


def test_logit_biases_are_gathered_by_row_and_no_penalties_are_built() -> None:
    sampling, _, _ = _fill(answers=True)
    assert sampling.bias is not None
    rows, ids, values = sampling.bias
    assert (rows.tolist(), ids.tolist(), values.tolist()) == ([2], [6], [5.0])
    assert sampling.penalties is None


def test_only_the_answering_rank_reports_who_wants_logprobs() -> None:
    _, logprob_rows, counts = _fill(answers=True)
    assert logprob_rows is not None and logprob_rows.tolist() == [0] and counts == [2]
    assert _fill(answers=False)[1:] == (None, [])
