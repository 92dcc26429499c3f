"""The block ids a recording says the core assigned, rebuilt from its SchedulerOutputs alone.

Replay compares these with every worker's BlockTable rows after each step, and checks the
recording against itself as it goes: a block handed to a request as new (not a prefix
hit) must not be held by another running request. Each SchedulerOutput is read as the
worker reads it: removals first (finished, preempted, blocks a sliding window left
behind), then new requests, then running and resumed ones, in list order.
"""

from __future__ import annotations

from collections.abc import Sequence

from protocol.kv_cache import NULL_BLOCK_ID
from protocol.worker import SchedulerOutput


class ReplayMismatch(Exception):
    """Replay differs from the recording; the message names the step and the request."""


class CoreBlockTables:
    def __init__(self, block_sizes: Sequence[int]) -> None:
        self.block_sizes = list(block_sizes)
        # request id -> per group, its block ids (NULL_BLOCK_ID where a window skipped)
        self.tables: dict[str, list[list[int]]] = {}

    def apply(self, so: SchedulerOutput) -> None:
        """Advance by one step; ReplayMismatch if the step contradicts the recording."""
        step = so.step_id
        for req_id in (*so.finished_req_ids, *so.preempted_req_ids):
            self.tables.pop(req_id, None)
        cached = so.cached_reqs
        for req_id, resumed, skipped in zip(
            cached.req_ids, cached.resumed, cached.num_skipped_blocks
        ):
            if not resumed and skipped is not None:
                self._null_prefix(step, req_id, skipped)
        # Who holds each block once this step's frees are done: new blocks must be free.
        held: dict[int, str] = {}
        for req_id, groups in self.tables.items():
            for ids in groups:
                for block_id in ids:
                    held.setdefault(block_id, req_id)
        held.pop(NULL_BLOCK_ID, None)
        for new in so.new_reqs:
            self._check_groups(step, new.req_id, new.block_ids)
            self._take(step, new.req_id, new.block_ids, new.num_computed_tokens, held)
            self.tables[new.req_id] = [list(ids) for ids in new.block_ids]
        for req_id, new_ids, num_computed, resumed, skipped in zip(
            cached.req_ids,
            cached.new_block_ids,
            cached.num_computed_tokens,
            cached.resumed,
            cached.num_skipped_blocks,
        ):
            if resumed:
                if new_ids is None:
                    raise ReplayMismatch(
                        f"step {step}: resumed request {req_id!r} comes without its block table"
                    )
                self._check_groups(step, req_id, new_ids)
                self._take(step, req_id, new_ids, num_computed, held)
                self.tables[req_id] = [list(ids) for ids in new_ids]
                continue
            table = self._running(step, req_id)
            if new_ids is not None:
                self._check_groups(step, req_id, new_ids)
                self._take(step, req_id, new_ids, 0, held)
                for ids, more in zip(table, new_ids):
                    ids.extend(more)
            if skipped is not None:  # again: "now null" holds after this step's appends
                self._null_prefix(step, req_id, skipped)

    def compare(self, step: int, rank: int, worker: dict[str, list[list[int]]]) -> None:
        """ReplayMismatch naming the first request whose worker rows differ."""
        if set(worker) != set(self.tables):
            extra = sorted(set(worker) - set(self.tables))
            missing = sorted(set(self.tables) - set(worker))
            raise ReplayMismatch(
                f"step {step}: worker rank {rank}'s batch holds requests the core does not "
                f"run: {extra}, and lacks requests the core runs: {missing}"
            )
        for req_id, want in self.tables.items():
            got = worker[req_id]
            for group, (g, w) in enumerate(zip(got, want)):
                if g != w:
                    raise ReplayMismatch(
                        f"step {step}, request {req_id!r}, KV cache group {group}: worker "
                        f"rank {rank}'s block table row is {g}, the core assigned {w}"
                    )

    def _running(self, step: int, req_id: str) -> list[list[int]]:
        table = self.tables.get(req_id)
        if table is None:
            raise ReplayMismatch(
                f"step {step}: request {req_id!r} continues but the recording never "
                "started or resumed it"
            )
        return table

    def _null_prefix(self, step: int, req_id: str, counts: Sequence[int]) -> None:
        table = self._running(step, req_id)
        for ids, count in zip(table, counts):
            ids[: min(count, len(ids))] = [NULL_BLOCK_ID] * min(count, len(ids))

    def _take(
        self,
        step: int,
        req_id: str,
        block_ids: Sequence[Sequence[int]],
        num_computed: int,
        held: dict[int, str],
    ) -> None:
        """Claim the request's new blocks; those past its prefix hit must be free."""
        for group, (ids, block_size) in enumerate(zip(block_ids, self.block_sizes)):
            num_hit = num_computed // block_size
            for block_id in ids[num_hit:]:
                if block_id == NULL_BLOCK_ID:
                    continue
                holder = held.get(block_id)
                if holder is not None:
                    raise ReplayMismatch(
                        f"step {step}, request {req_id!r}, KV cache group {group}: the "
                        f"recording hands it block {block_id} as new while request "
                        f"{holder!r} still holds it (a corrupt recording, or a core bug)"
                    )
                held[block_id] = req_id
            for block_id in ids[:num_hit]:
                held.setdefault(block_id, req_id)
        held.pop(NULL_BLOCK_ID, None)

    def _check_groups(self, step: int, req_id: str, block_ids: Sequence[Sequence[int]]) -> None:
        if len(block_ids) != len(self.block_sizes):
            raise ReplayMismatch(
                f"step {step}, request {req_id!r}: block ids for {len(block_ids)} KV cache "
                f"groups, the recording's KV cache config has {len(self.block_sizes)}"
            )
