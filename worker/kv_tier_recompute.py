"""recompute_failed: a step whose KV tier disk load failed, rewritten to recompute it.

The core scheduled each loaded block as computed. When a rank cannot read or verify
one (a damaged or vanished file), every rank agrees on it (worker/kv_host_tier.py) and
the step instead runs its request from that block's first token: the same sampled
token, the same state after the step, never KV of other tokens. The core kept room
for these tokens in the step's budget (KVTier.reserve), so the step's buffers fit.
"""

from __future__ import annotations

from collections.abc import Sequence

import msgspec

from protocol.worker import SchedulerOutput


def _first_failed(table: Sequence[int], failed: set[int], computed: int, bs: int) -> int:
    """The first token of the first failed block before `computed`, else `computed`."""
    for k in range(computed // bs):
        if table[k] in failed:
            return k * bs
    return computed


def recompute_failed(so: SchedulerOutput, failed: set[int], block_size: int) -> SchedulerOutput:
    """so, with each request holding a failed block (first group) scheduled from it."""
    counts = list(so.num_scheduled_tokens)
    added = 0
    new_reqs = list(so.new_reqs)
    for i, req in enumerate(new_reqs):
        start = _first_failed(req.block_ids[0], failed, req.num_computed_tokens, block_size)
        if start < req.num_computed_tokens:
            counts[i] += req.num_computed_tokens - start
            added += req.num_computed_tokens - start
            new_reqs[i] = msgspec.structs.replace(req, num_computed_tokens=start)
    cached = so.cached_reqs
    computed = list(cached.num_computed_tokens)
    for j, (ids, resumed) in enumerate(zip(cached.new_block_ids, cached.resumed)):
        if resumed and ids is not None:  # loads go only to admitted requests' full tables
            start = _first_failed(ids[0], failed, computed[j], block_size)
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
