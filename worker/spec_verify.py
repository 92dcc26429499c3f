"""The worker's side of speculative decoding: a step's drafts written after their
requests' tokens, the logits rows they need, their verification, and the accepted
tokens recorded.

A request with d drafts runs d + 1 tokens (its last token, then the drafts) like a
chunk of prefill against its cached context; the logits of all d + 1 positions go to
the rejection sampler. Afterwards each drafted row's block tables are cut to the blocks
its tokens fill, as the core cuts its own (docs/protocol.md)."""

from __future__ import annotations

import numpy as np
import torch

from protocol.engine import GREEDY_TEMPERATURE, Logprobs
from protocol.worker import SchedulerOutput
from worker.input_batch import InputBatch
from worker.model_inputs import ModelInputs
from worker.rejection_sampler import verify_greedy, verify_sampled
from worker.sampler import (
    SamplingTensors,
    compute_logprobs,
    expand,
    processed_logits,
    sample,
    target_probs,
)
from worker.step_state import DraftPlan, StepInputs


def write_drafts(batch: InputBatch, so: SchedulerOutput, vocab_size: int) -> DraftPlan:
    """Put the step's drafts after their requests' tokens and count them as known, so
    prepare_inputs schedules and samples through them; end_drafts undoes the count."""
    rows, counts = [], []
    for rid, drafts in so.spec_token_ids.items():
        row = batch.row_of(rid)
        n = int(batch.num_tokens[row])
        d = len(drafts)
        if not d or n + d > batch.max_model_len:
            raise ValueError(f"step {so.step_id}: {d} drafts for request {rid!r} at {n} tokens")
        if min(drafts) < 0 or max(drafts) >= vocab_size:
            raise ValueError(f"step {so.step_id}: a draft of {rid!r} is outside the vocabulary")
        batch.token_ids[row, n : n + d] = drafts
        rows.append(row)
        counts.append(d)
    at = np.array(rows, dtype=np.int64)
    batch.num_tokens[at] += np.array(counts, dtype=np.int32)
    empty = np.empty(0, dtype=np.int64)
    return DraftPlan([], empty, empty, at, np.empty(0, dtype=np.float32))


def end_drafts(
    batch: InputBatch, so: SchedulerOutput, plan: DraftPlan, inputs: ModelInputs
) -> None:
    """Restore the token counts and find the logits rows of each sampling request."""
    counts = np.array([len(d) for d in so.spec_token_ids.values()], dtype=np.int32)
    batch.num_tokens[plan.rows] -= counts
    drafted = so.spec_token_ids
    plan.drafts = [drafted.get(rid) for rid in inputs.sampling_req_ids]
    plan.temperature = batch.temperature[inputs.sampling_rows]
    per = np.array([len(d) if d else 0 for d in plan.drafts], dtype=np.int64)
    if int(per.sum()) != int(counts.sum()):
        raise ValueError(f"step {so.step_id}: drafts for a request that does not sample")
    last = inputs.logits_indices
    sizes = per + 1
    ends = np.cumsum(sizes)
    plan.first_rows = ends - sizes
    # Request i's positions last[i] - per[i] .. last[i], in order.
    offsets = np.arange(int(ends[-1]) if len(ends) else 0) - np.repeat(plan.first_rows, sizes)
    plan.logits_indices = np.repeat(last - per, sizes) + offsets


def verify(
    logits: torch.Tensor,
    plan: DraftPlan,
    first: torch.Tensor,
    sampling: SamplingTensors,
    generators: list[torch.Generator | None],
    shared: torch.Generator | None,
) -> tuple[list[int], list[list[int]]]:
    """(each sampling request's first token, the tokens it emits after it). first: the
    tokens sample() drew at each request's first position (kept for the undrafted)."""
    tokens = first.tolist()
    extras: list[list[int]] = [[] for _ in tokens]
    greedy = plan.temperature < GREEDY_TEMPERATURE
    positions = plan.sampling
    if positions is None:
        positions = expand(sampling, plan.sizes())
    else:  # penalties, biases, masks, bans: each position as sample() would see it
        logits = processed_logits(logits, positions)
    probs = None
    if not bool(greedy[[i for i, d in enumerate(plan.drafts) if d]].all()):
        probs = target_probs(logits, positions)
    argmax = logits.argmax(dim=-1).tolist()
    for i, drafts in enumerate(plan.drafts):
        if not drafts:
            continue
        start = int(plan.first_rows[i])
        stop = start + len(drafts) + 1
        if greedy[i] or probs is None:
            out = verify_greedy(argmax[start:stop], drafts)
        else:
            gen = generators[i] if generators[i] is not None else shared
            out = verify_sampled(probs[start:stop], drafts, gen)
        tokens[i] = out[0]
        extras[i] = out[1:]
    return tokens, extras


def extra_logprobs(
    logits: torch.Tensor,
    plan: DraftPlan,
    extras: list[list[int]],
    asking: torch.Tensor,
    num_top: list[int],
) -> list[list[Logprobs]]:
    """Per sampling request, the logprobs of the tokens it emits after its first (only
    for the requests in `asking`, which asked for num_top alternatives each): token k
    was predicted at the request's position k + 1. Empty when there are none."""
    found: list[list[Logprobs]] = [[] for _ in extras]
    for i, top in zip(asking.tolist(), num_top, strict=True):
        extra = extras[i]
        if not extra:
            continue
        start = int(plan.first_rows[i]) + 1
        rows = torch.arange(start, start + len(extra), device=logits.device)
        targets = torch.zeros(len(logits), dtype=torch.int64, device=logits.device)
        targets[rows] = torch.tensor(extra, dtype=torch.int64, device=logits.device)
        found[i] = compute_logprobs(logits, rows, targets, [top] * len(extra))
    return found if any(found) else []


def record_accepted(
    batch: InputBatch, req_ids: list[str], extras: list[list[int]], plan: DraftPlan
) -> None:
    """After the first tokens are in (fill_reserved): append the rest, then cut every
    drafted row's tables to the blocks its tokens fill."""
    to_row = batch.req_id_to_row
    for rid, extra in zip(req_ids, extras):
        row = to_row.get(rid)
        if row is None or not extra:
            continue
        n = int(batch.num_tokens[row])
        batch.token_ids[row, n : n + len(extra)] = extra
        batch.num_tokens[row] = n + len(extra)
    for rid, drafts in zip(req_ids, plan.drafts):
        row = to_row.get(rid)
        if drafts and row is not None:
            batch.block_table.keep_tokens(row, int(batch.num_tokens[row]))


def run_verification(
    model: torch.nn.Module,
    hidden: torch.Tensor,
    step: StepInputs,
    shared: torch.Generator | None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, list[list[int]]]:
    """A drafted step's sampling: (hidden states and logits of each sampling request's
    first position, its first tokens, the tokens each emits after them)."""
    plan = step.drafts
    assert plan is not None
    device = hidden.device
    at = torch.from_numpy(plan.logits_indices).to(device)
    logits = model.compute_logits(hidden.index_select(0, at))
    first_rows = torch.from_numpy(plan.first_rows).to(device)
    first_logits = logits.index_select(0, first_rows)
    first = sample(first_logits, step.sampling, step.generators, shared)
    tokens, extras = verify(logits, plan, first, step.sampling, step.generators, shared)
    if step.logprob_rows is not None:
        plan.extra_logprobs = extra_logprobs(
            logits, plan, extras, step.logprob_rows, step.logprob_counts
        )
    selected = hidden.index_select(0, at.index_select(0, first_rows))
    return selected, first_logits, torch.tensor(tokens, device=device), extras
