"""recompute_failed: a step whose KV tier disk load failed, rewritten to recompute it.

The core scheduled each loaded block as computed. When a rank cannot read or verify
one (a damaged or vanished file), every rank agrees on it (worker/kv_host_tier.py) and
the step instead runs its request from that block's first token: the same sampled
token, the same state after the step, never KV of other tokens. The core kept room
for these tokens in the step's budget (KVTier.reserve), so the step's buffers fit.

Another request admitted in the same step may hold the loaded blocks as device hits
(they are published at admission). It reruns nothing for them: the loader's rerun
writes them in this same step, and every layer writes the step's KV before any
attention reads it. (Rerunning them too would exceed the budget the core kept.)
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import msgspec

from protocol.kv_cache import NULL_BLOCK_ID
from protocol.worker import SchedulerOutput


def _rerun(
    so: SchedulerOutput, start_of: Callable[[Sequence[Sequence[int]], int], int]
) -> SchedulerOutput:
    """so, with each admitted request scheduled from start_of(its tables, computed
    tokens), in the step's order (admission order for new requests)."""
    counts = list(so.num_scheduled_tokens)
    added = 0
    new_reqs = list(so.new_reqs)
    for i, req in enumerate(new_reqs):
        start = start_of(req.block_ids, req.num_computed_tokens)
        if start < req.num_computed_tokens:
            counts[i] += req.num_computed_tokens - start
            added += req.num_computed_tokens - start
            new_reqs[i] = msgspec.structs.replace(req, num_computed_tokens=start)
    cached = so.cached_reqs
    computed = list(cached.num_computed_tokens)
    for j, (ids, resumed) in enumerate(zip(cached.new_block_ids, cached.resumed)):
        if resumed and ids is not None:  # loads go only to admitted requests' full tables
            start = start_of(ids, computed[j])
            counts[len(new_reqs) + j] += computed[j] - start
            added += computed[j] - start
            computed[j] = start
    return msgspec.structs.replace(
        so,
        new_reqs=new_reqs,
        cached_reqs=msgspec.structs.replace(cached, num_computed_tokens=computed),
        num_scheduled_tokens=counts,
        total_num_scheduled_tokens=so.total_num_scheduled_tokens + added,
    )


def recompute_failed(so: SchedulerOutput, failed: set[int], block_size: int) -> SchedulerOutput:
    """so, with each request that loaded a failed block (one group) scheduled from it.
    The first request of the step holding a failed block is its loader (admitted
    first); a later one holding it only reads what that loader's rerun writes."""
    left = set(failed)

    def start_of(tables: Sequence[Sequence[int]], computed: int) -> int:
        table = tables[0][: computed // block_size]
        start = computed
        for k, block in enumerate(table):
            if block in left:
                start = k * block_size
                break
        left.difference_update(table)
        return start

    return _rerun(so, start_of)


def recompute_failed_groups(
    so: SchedulerOutput,
    failed: set[int],
    loaded: set[int],
    block_size: int,
    windows: Sequence[int | None],
) -> SchedulerOutput:
    """recompute_failed for several KV cache groups (windows: per group None for full
    attention, else its sliding window in tokens). The request that loaded a failed
    block runs from its first loaded block, its device boundary: a sliding window
    cannot recompute from the failed block itself, since the blocks it reads before it
    were never loaded; the core gave that request real blocks from its boundary on and
    kept its loaded tokens in the budget (enginecore/kv_tier.py).

    The boundary is the first loaded position from which a rerun can run: every
    sliding-window block it writes or reads is real. Blocks loaded before it were
    loaded by another request of the step, which found them as device hits (they are
    published at admission) and holds null blocks before its window: that loader
    reruns them in this same step, and its writes land before any attention reads.
    A request holding only such blocks reruns nothing."""
    full_group = list(windows).index(None)
    bs = block_size

    def runnable(tables: Sequence[Sequence[int]], start: int, end: int) -> bool:
        for table, w in zip(tables, windows):
            lo = 0 if w is None else max(0, start - w + 1) // bs
            if NULL_BLOCK_ID in table[lo:end]:
                return False
        return True

    def start_of(tables: Sequence[Sequence[int]], computed: int) -> int:
        held = computed // bs
        if not any(b in failed for table in tables for b in table[:held]):
            return computed
        end = -(-computed // bs)
        for k, block in enumerate(tables[full_group][:held]):
            if block in loaded and runnable(tables, k * bs, end):
                return k * bs
        return computed

    return _rerun(so, start_of)
