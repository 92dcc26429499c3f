"""Flat model inputs for one step, built from the persistent batch with numpy.

Ordering: every per-request array here (query_start_loc, seq_lens, block_table_rows,
...) is in the SCHEDULED order of the SchedulerOutput (new requests, then cached ones),
which is also the token order of input_ids. It is not the batch's row order: a row is
only where a request's state lives. Attention gathers block tables in scheduled order
with `device_table[block_table_rows]`.

The work is per request in Python (a handful of operations each) and per token only
inside numpy, so a step's cost does not grow with its token count in the interpreter.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from protocol.worker import SchedulerOutput
from worker.input_batch import InputBatch


@dataclass
class ModelInputs:
    """B scheduled requests, T scheduled tokens padded to T_pad, K requests that sample."""

    req_ids: list[str]  # [B] scheduled order
    num_tokens: int  # T: real tokens; entries [T:T_pad] are padding
    input_ids: np.ndarray  # [T_pad] int32; 0 in padding
    positions: np.ndarray  # [T_pad] int64; 0 in padding
    req_rows: np.ndarray  # [T_pad] int32 batch row of each token; -1 in padding
    query_start_loc: np.ndarray  # [B+1] int32 token offset of each request
    seq_lens: np.ndarray  # [B] int32 num_computed + scheduled: the keys each request sees
    num_computed_tokens: np.ndarray  # [B] int32 tokens already in the KV cache
    block_table_rows: np.ndarray  # [B] int32 batch row of each scheduled request
    slot_mappings: list[np.ndarray]  # per KV group, [T_pad] int64; -1 in padding
    logits_indices: np.ndarray  # [K] int64 index into the T tokens of each sampling request
    sampling_req_ids: list[str]  # [K] requests that sample this step, scheduled order
    sampling_rows: np.ndarray  # [K] int64 their batch rows (for append_sampled)
    max_query_len: int
    max_seq_len: int

    @property
    def num_reqs(self) -> int:
        return len(self.req_ids)

    @property
    def num_padded_tokens(self) -> int:
        return len(self.input_ids)

    def gather_token_ids(self, batch: InputBatch) -> None:
        """input_ids from the batch's tokens. Separate from prepare_inputs: a step planned
        while its predecessor runs gathers them at launch, once that step's tokens are in."""
        n = self.num_tokens
        self.input_ids[:n] = batch.token_ids[self.req_rows[:n], self.positions[:n]]


def prepare_inputs(
    batch: InputBatch, so: SchedulerOutput, pad_to: int | None = None, token_ids: bool = True
) -> ModelInputs:
    """Inputs for the step `so`, after `batch.apply(so)`. token_ids=False leaves input_ids
    to gather_token_ids (a step planned before its predecessor's tokens are known).

    A request's scheduled tokens are positions num_computed .. num_computed + n - 1, and
    each must already be known to the batch (a prompt token or one sampled earlier). A
    request samples when its scheduled tokens reach its last known token; one in the
    middle of a chunked prefill does not."""
    req_ids = [r.req_id for r in so.new_reqs] + list(so.cached_reqs.req_ids)
    num_reqs = len(req_ids)
    if len(so.num_scheduled_tokens) != num_reqs:
        raise ValueError(
            f"step {so.step_id}: {len(so.num_scheduled_tokens)} num_scheduled_tokens "
            f"entries for {num_reqs} scheduled requests"
        )
    rows = batch.scheduled_rows(so, req_ids)
    num_scheduled, total, padded = _scheduled_counts(so, num_reqs, pad_to)
    num_computed = batch.num_computed_tokens[rows]
    seq_lens = num_computed + num_scheduled
    known = batch.num_tokens[rows]
    _check_known(so, req_ids, seq_lens, known)
    max_query_len = int(num_scheduled.max(initial=0))
    query_start_loc, req_rows, positions = _token_layout(
        rows, num_computed, num_scheduled, total, padded, max_query_len
    )
    input_ids = np.zeros(padded, dtype=np.int32)

    slot_mappings = [np.empty(padded, dtype=np.int64) for _ in range(len(batch.block_table))]
    # Padding has row -1, so the block tables give it slot -1.
    batch.block_table.compute_slot_mapping(
        req_rows, positions, slot_mappings, padded=padded != total
    )

    samples = (seq_lens == known) & (num_scheduled > 0)
    sampling = np.flatnonzero(samples)
    logits_indices = query_start_loc[1:][sampling].astype(np.int64) - 1

    inputs = ModelInputs(
        req_ids=req_ids,
        num_tokens=total,
        input_ids=input_ids,
        positions=positions,
        req_rows=req_rows,
        query_start_loc=query_start_loc,
        seq_lens=seq_lens.astype(np.int32, copy=False),
        num_computed_tokens=num_computed,
        block_table_rows=rows,
        slot_mappings=slot_mappings,
        logits_indices=logits_indices,
        # A decode step samples every request: no list built per step for that.
        sampling_req_ids=(
            req_ids if len(sampling) == num_reqs else [req_ids[i] for i in sampling.tolist()]
        ),
        sampling_rows=rows[sampling].astype(np.int64),
        max_query_len=max_query_len,
        max_seq_len=int(seq_lens.max(initial=0)),
    )
    if token_ids:
        inputs.gather_token_ids(batch)
    return inputs


def _scheduled_counts(
    so: SchedulerOutput, num_reqs: int, pad_to: int | None
) -> tuple[np.ndarray, int, int]:
    """(tokens per scheduled request, their total, the padded total), checked against
    the step's own counts."""
    num_scheduled = np.asarray(so.num_scheduled_tokens, dtype=np.int32).reshape(num_reqs)
    if num_reqs and int(num_scheduled.min()) < 0:
        raise ValueError(f"step {so.step_id}: negative num_scheduled_tokens")
    total = int(num_scheduled.sum())
    if total != so.total_num_scheduled_tokens:
        raise ValueError(
            f"step {so.step_id}: num_scheduled_tokens sum to {total}, but "
            f"total_num_scheduled_tokens={so.total_num_scheduled_tokens}"
        )
    padded = total if pad_to is None else pad_to
    if padded < total:
        raise ValueError(f"step {so.step_id}: pad_to={pad_to} is below the {total} tokens")
    return num_scheduled, total, padded


def _check_known(
    so: SchedulerOutput, req_ids: list[str], seq_lens: np.ndarray, known: np.ndarray
) -> None:
    """ValueError unless every scheduled position holds a token the batch knows."""
    unknown = seq_lens > known
    if unknown.any():
        i = int(np.flatnonzero(unknown)[0])
        raise ValueError(
            f"step {so.step_id}: request {req_ids[i]!r} is scheduled up to position "
            f"{int(seq_lens[i]) - 1} but the worker knows only {int(known[i])} tokens"
        )


def _token_layout(
    rows: np.ndarray,
    num_computed: np.ndarray,
    num_scheduled: np.ndarray,
    total: int,
    padded: int,
    max_query_len: int,
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(query_start_loc, each token's batch row, each token's position); padding tokens
    have row -1 and position 0."""
    num_reqs = len(rows)
    if max_query_len == 1 and total == num_reqs and padded == total:
        # A decode step: each request's one token at its next position. A third of the
        # general case's numpy calls.
        return np.arange(num_reqs + 1, dtype=np.int32), rows, num_computed.astype(np.int64)
    query_start_loc = np.zeros(num_reqs + 1, dtype=np.int32)
    np.cumsum(num_scheduled, out=query_start_loc[1:])
    # Token i belongs to scheduled request req_index[i] and sits at offset
    # i - query_start_loc[req_index[i]] within that request's chunk.
    req_index = np.repeat(np.arange(num_reqs, dtype=np.int32), num_scheduled)
    offsets = np.arange(total, dtype=np.int64) - query_start_loc[req_index]
    req_rows = np.full(padded, -1, dtype=np.int32)
    req_rows[:total] = rows[req_index]
    positions = np.zeros(padded, dtype=np.int64)
    positions[:total] = num_computed[req_index] + offsets
    return query_start_loc, req_rows, positions
