"""The --log-kv line of a step just scheduled."""

from __future__ import annotations

from enginecore.kv_cache_manager import KVCacheManager
from protocol.worker import SchedulerOutput


def describe_kv_step(kv: KVCacheManager, so: SchedulerOutput) -> str:
    """Per request, prefix-hit tokens (new requests), blocks new this step, blocks held
    per group, drafts verified; the free blocks left."""
    parts = []
    for new in so.new_reqs:
        held = [len(ids) for ids in kv.get_block_ids(new.req_id)]
        parts.append(f"{new.req_id} hit {new.num_computed_tokens} new {sum(held)} held {held}")
    cached = so.cached_reqs
    drafts = so.spec_token_ids
    for rid, ids, resumed in zip(cached.req_ids, cached.new_block_ids, cached.resumed):
        held = [len(b) for b in kv.get_block_ids(rid)]
        added = sum(len(b) for b in ids) if ids is not None else 0
        spec = f" drafts {len(drafts[rid])}" if rid in drafts else ""
        parts.append(f"{rid}{' resumed' if resumed else ''} new {added} held {held}{spec}")
    preempted = f" | preempted {so.preempted_req_ids}" if so.preempted_req_ids else ""
    return (
        f"step {so.step_id}: free {kv.num_free_blocks}/{kv.num_usable_blocks}{preempted}"
        f" | {' | '.join(parts) or 'nothing scheduled'}"
    )
