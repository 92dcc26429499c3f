"""Small builders shared by the KV-cache tests (configs, token strings, pool snapshots)."""

from __future__ import annotations

from typing import Any

from enginecore import KVCacheManager, Request
from enginecore.core import scheduler_config
from enginecore.kv_cache_config import with_num_blocks
from enginecore.scheduler import Scheduler, SchedulerConfig
from launch.client.engine_args import EngineArgs
from protocol.block_hash import BlockHasher, hash_block_tokens
from protocol.kv_cache import (
    FullAttentionSpec,
    KVCacheConfig,
    KVCacheGroupSpec,
    KVCacheSpec,
    SlidingWindowSpec,
)
from protocol.kv_events import BlockStored


def sched_config(max_model_len: int, **settings: Any) -> SchedulerConfig:
    """The scheduler config the core would make from these EngineArgs settings (its
    defaults for the rest); the scheduler reads no model."""
    return scheduler_config(EngineArgs(model="unused", **settings), max_model_len=max_model_len)


# The vocabulary of make_scheduler's schedulers.
SCHEDULER_VOCAB = 100


def make_scheduler(
    num_blocks: int, *specs: KVCacheSpec, max_model_len: int = 64, chunk: int = 64
) -> Scheduler:
    """A Scheduler over num_blocks blocks of the given groups (one full-attention group
    of 4-token blocks by default), chunk tokens a step, up to 8 requests."""
    groups = [KVCacheGroupSpec([f"l{i}"], spec) for i, spec in enumerate(specs or (full(),))]
    config = sched_config(max_model_len, max_num_batched_tokens=chunk, max_num_seqs=8)
    return Scheduler(config, with_num_blocks(groups, num_blocks), SCHEDULER_VOCAB)


def full(block_size: int = 4) -> FullAttentionSpec:
    return FullAttentionSpec(block_size=block_size, num_kv_heads=1, head_size=8, dtype="float16")


def window(sliding_window: int, block_size: int = 4) -> SlidingWindowSpec:
    return SlidingWindowSpec(
        block_size=block_size,
        num_kv_heads=1,
        head_size=8,
        dtype="float16",
        sliding_window=sliding_window,
    )


def make_manager(
    num_blocks: int, *specs: KVCacheSpec, max_model_len: int = 4096, **kwargs: Any
) -> KVCacheManager:
    groups = [KVCacheGroupSpec([f"layer{i}"], spec) for i, spec in enumerate(specs or (full(),))]
    config = KVCacheConfig(num_blocks=num_blocks, kv_cache_groups=groups)
    return KVCacheManager(config, max_model_len=max_model_len, **kwargs)


def tokens(text: str) -> list[int]:
    """Letters as token ids, so a test reads like the seed document's A-P examples."""
    return [ord(c) for c in text]


def admit(manager: KVCacheManager, request: Request, num_new_tokens: int | None = None) -> Any:
    """Prefix lookup then allocation of the whole prompt (or num_new_tokens of it)."""
    hits, num_hit = manager.get_computed_blocks(request)
    n = request.num_tokens - num_hit if num_new_tokens is None else num_new_tokens
    new = manager.allocate_slots(request, n, num_hit, hits if num_hit else None)
    if new is not None:
        request.num_computed_tokens = num_hit + n
    return new


def decode(manager: KVCacheManager, request: Request, token: int) -> Any:
    request.append_output_token_ids(token)
    new = manager.allocate_slots(request, 1)
    if new is not None:
        request.num_computed_tokens += 1
    return new


def check(manager: KVCacheManager, *requests: Request) -> None:
    """check_invariants, told the test's requests (those holding no blocks are ignored)."""
    manager.check_invariants({r.request_id: r for r in requests})


def snapshot(manager: KVCacheManager) -> dict[str, Any]:
    """Everything allocation may touch, as plain data."""
    pool = manager.block_pool
    return {
        "free_queue": pool.free_block_queue.block_ids(),
        "num_free": pool.get_num_free_blocks(),
        "blocks": [(b.block_id, b.ref_cnt, b.block_hash, b.group_id) for b in pool.blocks],
        "index": [
            {
                h: sorted(b.block_id for b in blocks) if len(blocks) > 1 else blocks[0].block_id
                for h, blocks in pool.cached_entries(g)
            }
            for g in range(pool.num_groups)
        ],
        "tables": [
            {rid: [b.block_id for b in blocks] for rid, blocks in m.req_to_blocks.items()}
            for m in manager.coordinator.managers
        ],
        "num_cached": [dict(m.num_cached_block) for m in manager.coordinator.managers],
        "events": list(pool._events),
    }


def check_stored_hashes(event: BlockStored, hasher: BlockHasher) -> None:
    """A stored event's hashes are the chain from its parent over its own token ids (and
    extra keys), as a subscriber recomputing them would find. Groups whose blocks span
    several hash blocks chain over those."""
    hbs = hasher.block_size
    if event.block_size != hbs and event.extra_keys:
        # Extra keys are listed per group block, but hashed per hash block (a salt only
        # in the first): not recomputable from the event. Engines run one block size.
        return
    parent = event.parent_block_hash or hasher.root
    for i, block_hash in enumerate(event.block_hashes):
        tokens = event.token_ids[i * event.block_size : (i + 1) * event.block_size]
        extra = event.extra_keys[i] if event.extra_keys else None
        for j in range(0, event.block_size, hbs):
            parent = hash_block_tokens(hasher.algo, parent, tokens[j : j + hbs], extra)
        assert parent == block_hash, f"block {i} of a stored event: hash does not match tokens"
