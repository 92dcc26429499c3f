"""The persistent batch: the worker's state implied by the stream of SchedulerOutputs.

Each running request owns one row, stable across steps, of per-row numpy arrays and of
the block tables. The core sends only deltas, so this state is the only place a
request's tokens (including the ones this worker sampled) and block ids live; `apply()`
must therefore follow the delta exactly and fail loudly on anything inconsistent.
After every `apply()` the live rows are dense: 0 .. num_reqs - 1.
"""

from __future__ import annotations

import heapq
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from itertools import compress, repeat
from operator import is_not
from typing import TYPE_CHECKING, TypeVar

import numpy as np

from protocol.engine import GREEDY_TEMPERATURE, SamplingParams
from protocol.worker import SchedulerOutput
from worker.block_table import MultiGroupBlockTable

if TYPE_CHECKING:
    import torch

T = TypeVar("T")


@dataclass
class CachedRequestState:
    """Everything the worker knows about one request, in the batch or preempted. Its
    block ids live only in the block table (a preempted request holds none).

    While the request holds a row, the row is the truth for its sampled tokens and its
    progress (a step touches no per-request object); num_computed_tokens and
    output_token_ids here are as of its admission and are brought up to date when it
    leaves the batch (InputBatch.output_token_ids reads either)."""

    req_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    num_computed_tokens: int
    output_token_ids: list[int] = field(default_factory=list)
    # Room for a per-request RNG (seeded sampling), so it lives and dies with the request.
    generator: torch.Generator | None = None

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)


class InputBatch:
    def __init__(
        self,
        max_num_reqs: int,
        max_model_len: int,
        block_sizes: Sequence[int],
        device: torch.device | str = "cpu",
    ) -> None:
        self.max_num_reqs = max_num_reqs
        self.max_model_len = max_model_len
        self.requests: dict[str, CachedRequestState] = {}
        self.req_id_to_row: dict[str, int] = {}
        self._row_to_req: list[str | None] = [None] * max_num_reqs
        # Rows [0, _end) may be occupied; _holes are the empty rows below _end. Both are
        # only non-trivial inside apply(): it ends dense with _end == num_reqs.
        self._end = 0
        self._holes: list[int] = []
        # Rows emptied or moved so far: a step launched before an apply() finds its
        # sampling rows where it left them while this is unchanged.
        self.row_changes = 0
        # The scheduled requests' rows as the last apply() found them, for that step's
        # prepare_inputs (a step of running requests only, no row moved since).
        self._step_rows: tuple[SchedulerOutput, np.ndarray] | None = None

        self.token_ids = np.zeros((max_num_reqs, max_model_len), dtype=np.int32)
        self.num_tokens = np.zeros(max_num_reqs, dtype=np.int32)
        self.num_computed_tokens = np.zeros(max_num_reqs, dtype=np.int32)
        self.num_prompt_tokens = np.zeros(max_num_reqs, dtype=np.int32)
        # Sampling parameters per row, so a step gathers them with one index per array
        # instead of walking every request's SamplingParams.
        self.temperature = np.zeros(max_num_reqs, dtype=np.float32)
        self.top_k = np.zeros(max_num_reqs, dtype=np.int64)
        self.top_p = np.ones(max_num_reqs, dtype=np.float32)
        self.min_p = np.zeros(max_num_reqs, dtype=np.float32)
        self.seeded = np.zeros(max_num_reqs, dtype=bool)
        self.presence_penalty = np.zeros(max_num_reqs, dtype=np.float32)
        self.frequency_penalty = np.zeros(max_num_reqs, dtype=np.float32)
        self.repetition_penalty = np.ones(max_num_reqs, dtype=np.float32)
        self.min_tokens = np.zeros(max_num_reqs, dtype=np.int64)
        self.num_logprobs = np.full(max_num_reqs, -1, dtype=np.int32)  # -1: not asked
        self.logit_biased = np.zeros(max_num_reqs, dtype=bool)
        self.token_limited = np.zeros(max_num_reqs, dtype=bool)  # allowed ids or bad words
        # The row's embedding is due with its first sampled token (SamplingParams.embedding).
        self.wants_embedding = np.zeros(max_num_reqs, dtype=bool)
        self.num_embeddings = 0  # rows with wants_embedding set
        self.num_prompt_logprobs = np.full(max_num_reqs, -1, dtype=np.int32)  # -1: not asked
        # The row uses penalties, min_tokens, logprobs, prompt logprobs or a logit bias: a
        # step whose rows all say no skips that work after one check.
        self.extras = np.zeros(max_num_reqs, dtype=bool)
        self.num_extras = 0  # rows with extras set: 0 skips even that check
        self._row_arrays = (
            self.num_tokens,
            self.num_computed_tokens,
            self.num_prompt_tokens,
            self.temperature,
            self.top_k,
            self.top_p,
            self.min_p,
            self.seeded,
            self.presence_penalty,
            self.frequency_penalty,
            self.repetition_penalty,
            self.min_tokens,
            self.num_logprobs,
            self.logit_biased,
            self.token_limited,
            self.wants_embedding,
            self.num_prompt_logprobs,
            self.extras,
        )
        self.block_table = MultiGroupBlockTable(block_sizes, max_num_reqs, max_model_len, device)

    # -- queries ------------------------------------------------------------------

    @property
    def num_reqs(self) -> int:
        return len(self.req_id_to_row)

    @property
    def req_ids(self) -> list[str]:
        """Live requests in row order."""
        return [r for r in self._row_to_req[: self._end] if r is not None]

    def row_of(self, req_id: str) -> int:
        try:
            return self.req_id_to_row[req_id]
        except KeyError:
            raise ValueError(f"request {req_id!r} is not in the batch") from None

    def rows_of(self, req_ids: Sequence[str]) -> np.ndarray:
        """Batch rows of req_ids, in order (int32)."""
        try:
            return np.fromiter(
                map(self.req_id_to_row.__getitem__, req_ids), dtype=np.int32, count=len(req_ids)
            )
        except KeyError as e:
            raise ValueError(f"request {e.args[0]!r} is not in the batch") from None

    def output_token_ids(self, req_id: str) -> list[int]:
        """The tokens sampled for req_id so far (its row's, while it has one)."""
        row = self.req_id_to_row.get(req_id)
        if row is None:
            return list(self.requests[req_id].output_token_ids)
        return self.token_ids[row, self.num_prompt_tokens[row] : self.num_tokens[row]].tolist()

    def num_computed_of(self, req_id: str) -> int:
        """req_id's computed tokens (its row's, while it has one)."""
        row = self.req_id_to_row.get(req_id)
        if row is None:
            return self.requests[req_id].num_computed_tokens
        return int(self.num_computed_tokens[row])

    def block_ids_of(self, req_id: str) -> list[list[int]]:
        """The request's live block-table rows, per group."""
        row = self.row_of(req_id)
        return [table.row(row).tolist() for table in self.block_table.tables]

    # -- the delta ----------------------------------------------------------------

    def apply(self, so: SchedulerOutput) -> None:
        """Bring the batch to the state the step's delta describes.

        Order matters: removals first so their rows can be reused by this step's
        admissions, and a request preempted and resumed in the same step works.
        A ValueError means the stream is corrupt; the batch is then unusable (the
        worker reports the failure rather than guess)."""
        scheduled = [r.req_id for r in so.new_reqs] + list(so.cached_reqs.req_ids)
        if len(set(scheduled)) != len(scheduled):
            dup = next(r for r in scheduled if scheduled.count(r) > 1)
            raise ValueError(f"step {so.step_id}: request {dup!r} is scheduled twice")
        self._step_rows = None
        self._apply_finished(so)
        self._apply_preempted(so)
        self._apply_new(so)
        self._apply_cached(so)
        moved = self.row_changes
        self._condense()
        if self.row_changes != moved:
            self._step_rows = None

    def scheduled_rows(self, so: SchedulerOutput, req_ids: Sequence[str]) -> np.ndarray:
        """Rows of so's scheduled req_ids (new, then cached), after apply(so): the ones
        apply() looked up when it could keep them, else rows_of(req_ids)."""
        kept = self._step_rows
        if kept is not None and kept[0] is so:
            return kept[1]
        return self.rows_of(req_ids)

    def _apply_finished(self, so: SchedulerOutput) -> None:
        """Drop every trace of the finished requests."""
        for req_id in so.finished_req_ids:
            if req_id not in self.requests:
                raise ValueError(f"finished request {req_id!r} is unknown to the worker")
            if req_id in self.req_id_to_row:
                self._remove(req_id)
            del self.requests[req_id]

    def _apply_preempted(self, so: SchedulerOutput) -> None:
        """Take preempted requests out of the batch; their tokens stay."""
        for req_id in so.preempted_req_ids:
            if req_id not in self.requests:
                raise ValueError(f"preempted request {req_id!r} is unknown to the worker")
            if req_id not in self.req_id_to_row:
                raise ValueError(f"preempted request {req_id!r} is not in the batch")
            # The core freed its blocks (the row's table goes with the row); its tokens
            # stay for the recompute on resume.
            state = self.requests[req_id]
            state.output_token_ids = self.output_token_ids(req_id)
            state.num_computed_tokens = self.num_computed_of(req_id)
            self._remove(req_id)

    def _apply_new(self, so: SchedulerOutput) -> None:
        """Give each new request its state and a row holding its prompt and table."""
        for new in so.new_reqs:
            if new.req_id in self.requests:
                raise ValueError(f"new request {new.req_id!r} already exists in the worker")
            if not 0 <= new.num_computed_tokens <= len(new.prompt_token_ids):
                raise ValueError(
                    f"new request {new.req_id!r}: num_computed_tokens="
                    f"{new.num_computed_tokens} outside [0, {len(new.prompt_token_ids)}]"
                )
            self._check_groups(new.req_id, new.block_ids)
            state = CachedRequestState(
                req_id=new.req_id,
                prompt_token_ids=list(new.prompt_token_ids),
                # Complete already when the core sent it; filled with the built-in
                # defaults when a caller (a test, a replay) left fields unset.
                sampling_params=new.sampling_params.resolve(),
                num_computed_tokens=new.num_computed_tokens,
            )
            self._admit(state, new.block_ids)
            self.requests[new.req_id] = state

    def _apply_cached(self, so: SchedulerOutput) -> None:
        """Running requests: new blocks, windows' skipped blocks, progress; resumed ones
        come back with their whole table."""
        cached = so.cached_reqs
        n = len(cached.req_ids)
        if not (
            len(cached.new_block_ids)
            == len(cached.num_computed_tokens)
            == len(cached.resumed)
            == len(cached.num_skipped_blocks)
            == n
        ):
            raise ValueError(
                f"step {so.step_id}: cached_reqs lists differ in length: req_ids={n}, "
                f"new_block_ids={len(cached.new_block_ids)}, "
                f"num_computed_tokens={len(cached.num_computed_tokens)}, "
                f"resumed={len(cached.resumed)}"
            )
        req_ids, computed = cached.req_ids, cached.num_computed_tokens
        if any(cached.resumed):
            self._apply_resumed(so)
            running = [i for i, resumed in enumerate(cached.resumed) if not resumed]
            req_ids = [req_ids[i] for i in running]
            computed = [computed[i] for i in running]
        if not req_ids:
            return
        # A decode step touches every running request: look their rows up in one pass
        # and visit only the few that got blocks or lost some to a window.
        rows = list(map(self.req_id_to_row.get, req_ids))
        if None in rows:
            req_id = req_ids[rows.index(None)]
            if req_id not in self.requests:
                raise ValueError(f"cached request {req_id!r} is unknown to the worker")
            raise ValueError(f"cached request {req_id!r} is not in the batch")
        table, to_row = self.block_table, self.req_id_to_row
        num_groups = len(table)
        grown_rows: list[int] = []
        grown_ids: list[Sequence[Sequence[int]]] = []
        for req_id, new_ids, resumed in _where_set(
            cached.new_block_ids, cached.req_ids, cached.resumed
        ):
            if not resumed:  # a resumed request's ids were its whole table
                if len(new_ids) != num_groups:
                    self._check_groups(req_id, new_ids)
                grown_rows.append(to_row[req_id])
                grown_ids.append(new_ids)
        if grown_rows:  # distinct rows: apply() refused a request scheduled twice
            table.append_rows(grown_rows, grown_ids)
        for req_id, skipped, resumed in _where_set(
            cached.num_skipped_blocks, cached.req_ids, cached.resumed
        ):
            if not resumed:
                # The core freed blocks a sliding window left behind: forget their ids
                # here too, so nothing can read blocks now owned by other requests.
                table.null_prefix(skipped, to_row[req_id])
        # One vectorised bounds check and write for every running request.
        row_arr = np.array(rows, dtype=np.int32)
        if not so.new_reqs and len(rows) == n:  # nothing new or resumed: all the step's rows
            self._step_rows = (so, row_arr)
        num_computed = np.array(computed, dtype=np.int64)
        bad = (num_computed < 0) | (num_computed > self.num_tokens[row_arr])
        if bad.any():
            i = int(np.flatnonzero(bad)[0])
            self._check_computed(req_ids[i], int(num_computed[i]), int(self.num_tokens[rows[i]]))
        self.num_computed_tokens[row_arr] = num_computed

    def _apply_resumed(self, so: SchedulerOutput) -> None:
        """Resumed requests come back with their whole table and their progress."""
        cached = so.cached_reqs
        for req_id, new_ids, num_computed, resumed in zip(
            cached.req_ids, cached.new_block_ids, cached.num_computed_tokens, cached.resumed
        ):
            if not resumed:
                continue
            state = self.requests.get(req_id)
            if state is None:
                raise ValueError(f"cached request {req_id!r} is unknown to the worker")
            self._check_computed(req_id, num_computed, state.num_tokens)
            if req_id in self.req_id_to_row:
                raise ValueError(f"resumed request {req_id!r} is already in the batch")
            if new_ids is None:
                raise ValueError(f"resumed request {req_id!r} came without its block table")
            self._check_groups(req_id, new_ids)
            state.num_computed_tokens = num_computed
            self._admit(state, new_ids)

    @staticmethod
    def _check_computed(req_id: str, num_computed: int, num_tokens: int) -> None:
        if not 0 <= num_computed <= num_tokens:
            raise ValueError(
                f"cached request {req_id!r}: num_computed_tokens={num_computed} outside "
                f"[0, {num_tokens}]"
            )

    def append_sampled(
        self,
        req_ids: Sequence[str],
        token_ids: Sequence[int],
        rows: np.ndarray | None = None,
    ) -> None:
        """Record the tokens this worker sampled: the core never resends them.

        rows, when given, are the requests' batch rows as prepare_inputs found them
        (distinct by construction), which saves a lookup pass per step."""
        if len(req_ids) != len(token_ids):
            raise ValueError(
                f"append_sampled: {len(req_ids)} request ids but {len(token_ids)} tokens"
            )
        if not req_ids:
            return
        if rows is None:
            if len(set(req_ids)) != len(req_ids):
                raise ValueError("append_sampled: a request id appears twice")
            rows = self.rows_of(req_ids).astype(np.int64)
        self.reserve(rows)
        self.fill_reserved(req_ids, token_ids, rows)

    def embedded(self, rows: np.ndarray) -> None:
        """These rows' embeddings are being computed: no later step computes them again."""
        self.num_embeddings -= int(self.wants_embedding[rows].sum())
        self.wants_embedding[rows] = False

    def reserve(self, rows: np.ndarray) -> None:
        """Count one more token in each row, its value to come (fill_reserved): a step
        planned meanwhile sees the right lengths and positions."""
        full = self.num_tokens[rows] >= self.max_model_len
        if full.any():
            req_id = self._row_to_req[int(rows[int(np.flatnonzero(full)[0])])]
            raise ValueError(
                f"append_sampled: request {req_id!r} already holds "
                f"max_model_len={self.max_model_len} tokens"
            )
        self.num_tokens[rows] += 1

    def fill_reserved(
        self, req_ids: Sequence[str], token_ids: Sequence[int], rows: np.ndarray | None
    ) -> None:
        """The tokens of the slots reserve() counted. rows: where they were reserved, or
        None when apply() ran since (rows may have moved; requests it finished are gone,
        and a request's reserved slot is its last)."""
        if rows is None:
            # The requests still here (one the core finished meanwhile is gone, and the
            # core drops its token too), wherever apply() moved them.
            to_row = self.req_id_to_row
            found = [(to_row[r], t) for r, t in zip(req_ids, token_ids) if r in to_row]
            if not found:
                return
            row_list, kept = zip(*found)
            rows = np.array(row_list, dtype=np.int64)
            token_ids = kept
        # One fancy-indexed write for the whole step: the rows hold the sampled tokens.
        self.token_ids[rows, self.num_tokens[rows] - 1] = np.asarray(token_ids, dtype=np.int32)

    # -- rows ---------------------------------------------------------------------

    def _admit(self, state: CachedRequestState, block_ids: Sequence[Sequence[int]]) -> None:
        """Give a request a free row holding its prompt, its outputs so far and its table."""
        if state.num_tokens > self.max_model_len:
            raise ValueError(
                f"request {state.req_id!r}: {state.num_tokens} tokens exceed "
                f"max_model_len={self.max_model_len}"
            )
        if self._holes:
            row = heapq.heappop(self._holes)
        elif self._end < self.max_num_reqs:
            row = self._end
            self._end += 1
        else:
            raise ValueError(
                f"request {state.req_id!r}: the batch is full (max_num_reqs={self.max_num_reqs})"
            )
        num_prompt = len(state.prompt_token_ids)
        self.token_ids[row, :num_prompt] = state.prompt_token_ids
        self.token_ids[row, num_prompt : state.num_tokens] = state.output_token_ids
        self.num_prompt_tokens[row] = num_prompt
        self.num_tokens[row] = state.num_tokens
        self.num_computed_tokens[row] = state.num_computed_tokens
        params = state.sampling_params
        self.temperature[row] = params.temperature
        self.top_k[row] = params.top_k
        self.top_p[row] = params.top_p
        self.min_p[row] = params.min_p or 0.0
        self.seeded[row] = params.seed is not None and params.temperature >= GREEDY_TEMPERATURE
        self.presence_penalty[row] = params.presence_penalty
        self.frequency_penalty[row] = params.frequency_penalty
        self.repetition_penalty[row] = params.repetition_penalty
        self.min_tokens[row] = params.min_tokens
        self.num_logprobs[row] = -1 if params.logprobs is None else params.logprobs
        biased = bool(params.logit_bias)
        self.logit_biased[row] = biased
        limited = params.allowed_token_ids is not None or bool(params.bad_words_token_ids)
        self.token_limited[row] = limited
        prompt_lp = params.prompt_logprobs
        self.num_prompt_logprobs[row] = -1 if prompt_lp is None else prompt_lp
        extras = (
            params.has_penalties
            or params.min_tokens > 0
            or params.logprobs is not None
            or biased
            or prompt_lp is not None
            or params.structured_outputs is not None
            or limited
        )
        self.extras[row] = extras
        self.num_extras += extras
        # Once: a request that already sampled (resumed after a preemption) had it.
        embed = params.embedding is not None and not state.output_token_ids
        self.wants_embedding[row] = embed
        self.num_embeddings += embed
        self.block_table.add_row(block_ids, row)
        self._row_to_req[row] = state.req_id
        self.req_id_to_row[state.req_id] = row

    def _remove(self, req_id: str) -> None:
        row = self.req_id_to_row.pop(req_id)
        self.row_changes += 1
        self._row_to_req[row] = None
        self.num_extras -= bool(self.extras[row])
        self.num_embeddings -= bool(self.wants_embedding[row])
        for arr in self._row_arrays:
            arr[row] = 0
        self._neutral(row)
        self.block_table.clear_row(row)
        heapq.heappush(self._holes, row)

    def _move(self, src: int, dst: int) -> None:
        req_id = self._row_to_req[src]
        assert req_id is not None and self._row_to_req[dst] is None
        self.row_changes += 1
        n = int(self.num_tokens[src])
        self.token_ids[dst, :n] = self.token_ids[src, :n]
        for arr in self._row_arrays:
            arr[dst] = arr[src]
            arr[src] = 0
        self._neutral(src)
        self.block_table.move_row(src, dst)
        self._row_to_req[dst] = req_id
        self._row_to_req[src] = None
        self.req_id_to_row[req_id] = dst

    def _neutral(self, row: int) -> None:
        """The settings an empty row holds where 0 is not neutral."""
        self.top_p[row] = 1.0
        self.repetition_penalty[row] = 1.0
        self.num_logprobs[row] = -1
        self.num_prompt_logprobs[row] = -1

    def _condense(self) -> None:
        """Fill each hole, lowest first, with the last live row."""
        while self._holes:
            hole = heapq.heappop(self._holes)
            while self._end > 0 and self._row_to_req[self._end - 1] is None:
                self._end -= 1
            if hole >= self._end:
                continue  # the hole was in the empty tail: nothing to move
            self._move(self._end - 1, hole)
            self._end -= 1
        while self._end > 0 and self._row_to_req[self._end - 1] is None:
            self._end -= 1
        assert self._end == len(self.req_id_to_row)

    def _check_groups(self, req_id: str, block_ids: Sequence[Sequence[int]]) -> None:
        if len(block_ids) != len(self.block_table):
            raise ValueError(
                f"request {req_id!r}: block ids for {len(block_ids)} KV cache groups, "
                f"expected {len(self.block_table)}"
            )


def _where_set(
    values: Sequence[T | None], req_ids: Sequence[str], resumed: Sequence[bool]
) -> Iterator[tuple[str, T, bool]]:
    """(req_id, value, resumed) where value is not None, found without a Python-level
    test per request (most decode steps set a handful of a few hundred)."""
    return compress(zip(req_ids, values, resumed), map(is_not, values, repeat(None)))
