"""A Hypothesis state machine over the KV-cache manager: 1 to 3 groups (full attention
and sliding window, block sizes multiples of one hash unit), a small pool, prompts built
from shared prefixes, arrivals, chunked prefills, decode steps, frees, preemptions,
readmissions, prefix-cache resets and allocation failures.

After every step it calls ``check_invariants()`` and compares the manager against a
reference model written here, independent of the hashing code: the reference keys a
cached block by (group, cache salt, LoRA id, token prefix up to the block's end), learns
what is cached from the block tables it observes after each allocation, and forgets a
block when the block is handed out again. From it the test predicts every prefix hit
(the longest block-aligned boundary every group can restore), checks which blocks share
a hash, which blocks an allocation takes from the free queue, where freed blocks go, and
that a refused allocation changed nothing. At the end every non-null block is free.

PAGEDSERVE_KV_SM_EXAMPLES and PAGEDSERVE_KV_SM_STEPS (defaults 150 and 50) raise the
number of examples and steps for a longer bug hunt.
"""

from __future__ import annotations

import dataclasses
import functools
import os
from collections import Counter
from collections.abc import Callable
from math import lcm
from typing import Any, TypeVar

from hypothesis import HealthCheck, event, settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    initialize,
    invariant,
    rule,
)

from enginecore import KVCacheManager, Request
from protocol.kv_cache import (
    FullAttentionSpec,
    KVCacheConfig,
    KVCacheGroupSpec,
    KVCacheSpec,
    SlidingWindowSpec,
)
from protocol.kv_events import AllBlocksCleared, BlockRemoved, BlockStored
from tests.helpers.kv_helpers import check_stored_hashes

NULL = 0
VOCAB = st.integers(0, 3)
# Shared prefixes (some extending others) so that prefix hits are common.
PREFIXES: tuple[tuple[int, ...], ...] = (
    (0, 1, 2, 3, 0, 1, 2, 3),
    (0, 1, 2, 3, 0, 1, 2, 3, 3, 2, 1, 0),
    (0, 1, 2, 3, 0, 1, 2, 3, 3, 2, 1, 0, 1, 1, 2, 2, 3, 3),
    (2, 3) * 8,
    (),
)
SALTS = st.sampled_from([None] * 8 + ["tenant-a", "tenant-b"])
LORAS = st.sampled_from([None] * 7 + [7])
PROMPT_LOGPROBS = st.sampled_from([False] * 7 + [True])
CHUNKS = st.one_of(st.none(), st.integers(1, 16))
LOOKAHEAD = st.sampled_from([0, 0, 0, 1, 3])

# One group: (sliding window or None for full attention, block size multiplier).
GROUP = st.tuples(st.one_of(st.none(), st.integers(1, 12)), st.sampled_from([1, 2]))

# (group, cache salt's digest, LoRA id, token ids up to the end of the block)
Key = tuple[int, str | None, int | None, tuple[int, ...]]

F = TypeVar("F", bound=Callable[..., None])


def _step(fn: F) -> F:
    """Marks the machine dirty while a step runs, so that teardown does not pile a second
    error on top of the first one."""

    @functools.wraps(fn)
    def wrapper(self: KVStateMachine, *args: Any, **kwargs: Any) -> None:
        self.clean = False
        fn(self, *args, **kwargs)
        self.clean = True

    return wrapper  # type: ignore[return-value]


def _ceil_div(a: int, b: int) -> int:
    return -(-a // b)


class ReferenceCache:
    """Which blocks hold which content, as the test believes: block id <-> Key."""

    def __init__(self) -> None:
        self.key_of: dict[int, Key] = {}
        self.blocks_of: dict[Key, set[int]] = {}

    def store(self, block_id: int, key: Key) -> None:
        assert block_id not in self.key_of
        self.key_of[block_id] = key
        self.blocks_of.setdefault(key, set()).add(block_id)

    def evict(self, block_id: int) -> None:
        key = self.key_of.pop(block_id, None)
        if key is None:
            return
        holders = self.blocks_of[key]
        holders.discard(block_id)
        if not holders:
            del self.blocks_of[key]

    def clear(self) -> None:
        self.key_of.clear()
        self.blocks_of.clear()

    def partition(self, group: int) -> set[frozenset[int]]:
        return {frozenset(ids) for key, ids in self.blocks_of.items() if key[0] == group}


class KVStateMachine(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.m: KVCacheManager | None = None
        self.clean = True

    # -- configuration ------------------------------------------------------------------
    @initialize(
        groups=st.lists(GROUP, min_size=1, max_size=3),
        base=st.sampled_from([2, 4]),
        num_blocks=st.sampled_from(range(8, 41)),
        caching=st.sampled_from([True, True, True, False]),
        short_context=st.booleans(),
        kv_events=st.booleans(),
    )
    @_step
    def setup(
        self,
        groups: list[tuple[int | None, int]],
        base: int,
        num_blocks: int,
        caching: bool,
        short_context: bool,
        kv_events: bool,
    ) -> None:
        specs: list[KVCacheSpec] = []
        for window, mult in groups:
            bs = base * mult
            if window is None:
                specs.append(
                    FullAttentionSpec(block_size=bs, num_kv_heads=1, head_size=1, dtype="float16")
                )
            else:
                specs.append(
                    SlidingWindowSpec(
                        block_size=bs,
                        num_kv_heads=1,
                        head_size=1,
                        dtype="float16",
                        sliding_window=window,
                    )
                )
        config = KVCacheConfig(
            num_blocks=num_blocks,
            kv_cache_groups=[KVCacheGroupSpec([f"layer{i}"], s) for i, s in enumerate(specs)],
        )
        self.block_sizes = [s.block_size for s in specs]
        self.windows: list[int | None] = [
            s.sliding_window if isinstance(s, SlidingWindowSpec) else None for s in specs
        ]
        self.num_groups = len(specs)
        self.caching = caching
        self.kv_events = kv_events
        self.max_model_len = 40 if short_context else 8 * num_blocks + 8
        self.m = KVCacheManager(
            config,
            max_model_len=self.max_model_len,
            enable_caching=caching,
            enable_kv_events=kv_events,
        )
        self.ref = ReferenceCache()
        self.running: dict[str, Request] = {}  # hold blocks
        self.waiting: dict[str, Request] = {}  # hold nothing, num_computed_tokens == 0
        self.reads_cache: dict[str, bool] = {}  # False: wants prompt logprobs
        self.history: list[tuple[int, ...]] = []  # token ids of past requests, to share
        self.next_id = 0
        self.event_hashes: list[set[bytes]] = [set() for _ in specs]

    @property
    def mgr(self) -> KVCacheManager:
        assert self.m is not None
        return self.m

    # -- observation helpers ------------------------------------------------------------
    def key(self, r: Request, group: int, index: int) -> Key:
        end = (index + 1) * self.block_sizes[group]
        assert end <= r.num_tokens
        return (group, r.salt_digest, r.lora_id, tuple(r.all_token_ids[:end]))

    def snapshot(self) -> dict[str, Any]:
        m = self.mgr
        pool = m.block_pool
        index = [
            {h: sorted(b.block_id for b in blocks) for h, blocks in pool.cached_entries(g)}
            for g in range(pool.num_groups)
        ]
        return {
            "queue": pool.free_block_queue.block_ids(),
            "num_free": pool.get_num_free_blocks(),
            "blocks": [(b.ref_cnt, b.block_hash, b.group_id) for b in pool.blocks],
            "index": index,
            "tables": [
                {rid: [b.block_id for b in bl] for rid, bl in mgr.req_to_blocks.items()}
                for mgr in m.coordinator.managers
            ],
            "num_cached": [dict(mgr.num_cached_block) for mgr in m.coordinator.managers],
            "stats": dataclasses.astuple(m.prefix_cache_stats),
            "evictions": pool.num_evictions,
        }

    def tables(self, rid: str) -> list[list[int]]:
        return [list(t) for t in self.mgr.get_block_ids(rid)]

    def expected_hit(self, r: Request) -> int:
        """The longest boundary L <= num_tokens - 1 that every group can restore: L is a
        multiple of the group's block size and the group has cached every block holding
        a position that a query at L reads (all of 0..L-1 for full attention, the
        window L - w + 1 .. L - 1 for a sliding window)."""
        if not self.caching or not self.reads_cache[r.request_id]:
            return 0
        step = lcm(*self.block_sizes)
        boundary = (r.num_tokens - 1) // step * step
        while boundary > 0:
            if all(self.restorable(r, g, boundary) for g in range(self.num_groups)):
                return boundary
            boundary -= step
        return 0

    def restorable(self, r: Request, group: int, boundary: int) -> bool:
        bs = self.block_sizes[group]
        window = self.windows[group]
        first_pos = 0 if window is None else max(0, boundary - window + 1)
        return all(
            self.key(r, group, i) in self.ref.blocks_of
            for i in range(first_pos // bs, boundary // bs)
        )

    def lookup(self, r: Request) -> tuple[Any, int]:
        m = self.mgr
        before = self.snapshot()
        hits, n_hit = m.get_computed_blocks(r)
        after = self.snapshot()
        stats_before, stats_after = before.pop("stats"), after.pop("stats")
        assert after == before, "get_computed_blocks changed pool state"
        if self.caching and self.reads_cache[r.request_id]:
            d = [a - b for a, b in zip(stats_after, stats_before)]
            if r.num_preemptions:
                assert d == [0, 0, 0, 1, r.num_tokens, n_hit]
            else:
                assert d == [1, r.num_tokens, n_hit, 0, 0, 0]
        else:
            assert stats_after == stats_before

        assert n_hit == self.expected_hit(r), (n_hit, self.expected_hit(r))
        if n_hit:
            sliding = any(w is not None for w in self.windows)
            event("prefix hit" + (" with a sliding window" if sliding else ""))
        assert 0 <= n_hit <= r.num_tokens - 1
        assert len(hits) == self.num_groups
        for g, group_hits in enumerate(hits):
            bs = self.block_sizes[g]
            assert len(group_hits) * bs == n_hit
            window = self.windows[g]
            first_read = 0 if window is None else max(0, n_hit - window + 1) // bs
            for i, block in enumerate(group_hits):
                if block.block_id == NULL:
                    assert i < first_read, f"group {g}: null hit block {i} inside the window"
                    continue
                assert block.block_id in self.ref.blocks_of.get(self.key(r, g, i), ()), (
                    f"group {g} hit block {i} (id {block.block_id}) holds "
                    f"{self.ref.key_of.get(block.block_id)}, not {self.key(r, g, i)}"
                )
        return hits, n_hit

    def check_release(
        self,
        queue_before: list[int],
        released: list[list[int]],
        hashed_before: set[int],
        taken: set[int] | None = None,
        ordered: bool = False,
    ) -> None:
        """Blocks whose last reference went away joined the free queue: unhashed ones at
        the front, hashed ones at the back; ``taken`` blocks left it again since. With
        ``ordered``, each group's blocks keep the order of ``released`` (a request frees
        in reverse table order, so that a chain's tail is reused before its head)."""
        taken = taken or set()
        queue = self.mgr.block_pool.free_block_queue.block_ids()
        flat = [b for group in released for b in group if b not in taken]
        front = {b for b in flat if b not in hashed_before}
        back = {b for b in flat if b in hashed_before}
        middle = [b for b in queue_before if b not in taken]
        assert len(queue) == len(front) + len(middle) + len(back)
        assert set(queue[: len(front)]) == front
        assert queue[len(front) : len(front) + len(middle)] == middle
        assert set(queue[len(front) + len(middle) :]) == back
        if not ordered:
            return
        pos = {b: i for i, b in enumerate(queue)}
        for group in released:
            for part in (front, back):
                order = [pos[b] for b in group if b in part]
                assert order == sorted(order), "a chain's tail must be reused before its head"

    # -- the two operations that change blocks -----------------------------------------
    def allocate(
        self,
        r: Request,
        num_new: int,
        hits: Any = None,
        n_hit: int = 0,
        lookahead: int = 0,
    ) -> bool:
        """allocate_slots plus every check of its outcome; advances num_computed_tokens."""
        m = self.mgr
        pool = m.block_pool
        rid = r.request_id
        is_new = rid not in self.running
        before = self.snapshot()
        queue_before = before["queue"]
        refs_before = [ref for ref, _, _ in before["blocks"]]
        hashed_before = {i for i, (_, h, _) in enumerate(before["blocks"]) if h is not None}
        computed = r.num_computed_tokens

        # What the manager should do, derived from the rules alone.
        if is_new:
            assert not any(self.tables(rid))
            base = [[b.block_id for b in group_hits] for group_hits in hits] if n_hit else []
            base = base or [[] for _ in range(self.num_groups)]
            skipped: list[list[int]] = [[] for _ in range(self.num_groups)]
        else:
            base = self.tables(rid)
            skipped = [[] for _ in range(self.num_groups)]
            for g, window in enumerate(self.windows):
                if window is None:
                    continue
                boundary = max(0, computed - window + 1) // self.block_sizes[g]
                for i in range(boundary - 1, -1, -1):
                    if base[g][i] != NULL:
                        skipped[g].append(base[g][i])
                        base[g][i] = NULL
        released = [[b for b in group if refs_before[b] == 1] for group in skipped]
        touched_free = [b for group in base for b in group if b != NULL and refs_before[b] == 0]
        if not is_new:
            assert not touched_free
        num_slots = min(computed + n_hit + num_new + lookahead, self.max_model_len)
        num_new_blocks = [
            max(0, _ceil_div(num_slots, bs) - len(base[g])) for g, bs in enumerate(self.block_sizes)
        ]
        free_after_skip = len(queue_before) + sum(len(group) for group in released)
        short = sum(num_new_blocks) + len(touched_free) > free_after_skip

        new = m.allocate_slots(r, num_new, n_hit, hits if n_hit else None, lookahead)

        assert (new is None) == short, (new, num_new_blocks, touched_free, free_after_skip)
        after = self.snapshot()
        if new is None:
            # Nothing changed, but for sliding-window blocks no query can read anymore.
            expected = before
            if any(released) or any(skipped):
                expected = dict(before)
                blocks = list(before["blocks"])
                for group in skipped:
                    for b in group:
                        ref, h, gid = blocks[b]
                        blocks[b] = (ref - 1, h, gid)
                expected["blocks"] = blocks
                expected["tables"] = [dict(t) for t in before["tables"]]
                for g in range(self.num_groups):
                    if rid in expected["tables"][g]:
                        expected["tables"][g][rid] = base[g]
                expected["num_free"] = free_after_skip
                self.check_release(queue_before, released, hashed_before)
                expected["queue"] = after["queue"]
            assert after == expected, "a refused allocation changed the pool"
            event("allocation refused" + (" after freeing skipped blocks" if any(skipped) else ""))
            return False

        # New blocks come from the front of the free queue once the hits are out of it:
        # first freed unhashed blocks, then the old queue in order, then freed hashed ones.
        tables = self.tables(rid)
        taken_by_group: list[list[int]] = []
        for g in range(self.num_groups):
            assert tables[g][: len(base[g])] == base[g], (g, tables[g], base[g])
            assert len(tables[g]) == len(base[g]) + num_new_blocks[g]
            taken_by_group.append(tables[g][len(base[g]) :])
            assert [b.block_id for b in new[g]] == taken_by_group[g]
        taken = [b for group in taken_by_group for b in group]
        assert len(set(taken)) == len(taken)
        assert NULL not in taken
        touched = set(touched_free)
        flat_released = [b for group in released for b in group]
        segments: list[tuple[list[int], bool]] = [
            ([b for b in flat_released if b not in hashed_before], False),
            ([b for b in queue_before if b not in touched], True),
            ([b for b in flat_released if b in hashed_before], False),
        ]
        remaining = set(taken)
        n = len(taken)
        for ids, ordered in segments:
            if n >= len(ids):
                assert remaining.issuperset(ids)
                remaining.difference_update(ids)
                n -= len(ids)
                continue
            if ordered:
                assert remaining.issuperset(ids[:n]), "new blocks skipped the queue front"
                remaining.difference_update(ids[:n])
            else:
                assert len(remaining & set(ids)) == n
                remaining.difference_update(ids)
            n = 0
            break
        assert not remaining, f"blocks {remaining} handed out but not free before"
        self.check_release(
            [b for b in queue_before if b not in touched], released, hashed_before, set(taken)
        )
        for b in taken:  # free before, or freed just now as out of every window
            assert refs_before[b] == 0 or b in flat_released
        assert after["evictions"] - before["evictions"] == len(hashed_before & set(taken))

        # The reference learns: handed-out blocks lost their content; full blocks up to
        # the real tokens (never lookahead) hold the request's prefix.
        for b in taken:
            if b in self.ref.key_of:
                event("cached block evicted")
            self.ref.evict(b)
        end = min(computed + n_hit + num_new, r.num_tokens)
        for g, bs in enumerate(self.block_sizes):
            for i, b in enumerate(tables[g]):
                if b == NULL:
                    continue
                if self.caching and i < end // bs:
                    key = self.key(r, g, i)
                    if b in self.ref.key_of:
                        assert self.ref.key_of[b] == key, (b, self.ref.key_of[b], key)
                    else:
                        self.ref.store(b, key)
                else:
                    assert b not in self.ref.key_of
                    assert pool.blocks[b].block_hash is None, f"block {b} hashed past {end}"
        r.num_computed_tokens = computed + n_hit + num_new
        if is_new:
            self.running[rid] = r
        return True

    def free(self, r: Request) -> None:
        m = self.mgr
        rid = r.request_id
        before = self.snapshot()
        refs_before = [ref for ref, _, _ in before["blocks"]]
        hashed_before = {i for i, (_, h, _) in enumerate(before["blocks"]) if h is not None}
        tables = self.tables(rid)
        m.free(r)
        del self.running[rid]
        released = [[b for b in reversed(t) if b != NULL and refs_before[b] == 1] for t in tables]
        self.check_release(before["queue"], released, hashed_before, ordered=True)
        after = self.snapshot()
        assert not any(self.tables(rid))
        assert after["index"] == before["index"], "free is not evict"
        assert after["evictions"] == before["evictions"]
        counts = Counter(b for t in tables for b in t if b != NULL)
        for b, (ref, h, gid) in enumerate(after["blocks"]):
            assert (ref + counts[b], h, gid) == before["blocks"][b]

    def admit(self, r: Request, chunk: int | None, lookahead: int) -> bool:
        hits, n_hit = self.lookup(r)
        remaining = r.num_tokens - n_hit
        num_new = remaining if chunk is None else min(chunk, remaining)
        return self.allocate(r, num_new, hits, n_hit, lookahead)

    def preempt(self, r: Request) -> None:
        event("preemption")
        self.free(r)
        r.num_computed_tokens = 0
        r.num_preemptions += 1
        self.waiting[r.request_id] = r

    def new_request(
        self, prompt: list[int], salt: str | None, lora: int | None, lp: bool
    ) -> Request:
        rid = f"r{self.next_id}"
        self.next_id += 1
        r = Request(
            rid,
            prompt,
            self.mgr.block_hasher,
            cache_salt=salt,
            lora_id=lora,
            wants_prompt_logprobs=lp,
        )
        self.reads_cache[rid] = not lp
        return r

    # -- rules --------------------------------------------------------------------------
    def arrival(self, data: st.DataObject, share: bool = False) -> None:
        """A new request whose prompt is a shared prefix or a past request's tokens (cut
        short sometimes), then a few random tokens; admitted in full or a first chunk.
        Sharing arrivals start with the tokens of a running or finished request."""
        sources = [list(p) for p in PREFIXES] + [list(h) for h in self.history[-8:]]
        if share and (self.running or self.history):
            sources = [r.all_token_ids[:] for r in self.running.values()] + [
                list(h) for h in self.history[-8:]
            ]
        prefix = data.draw(st.sampled_from(sources), label="prefix")
        cut = data.draw(st.one_of(st.just(0), st.integers(0, len(prefix))), label="cut")
        tail = data.draw(st.lists(VOCAB, max_size=12), label="tail")
        prompt = (prefix[: len(prefix) - cut] + tail)[: self.max_model_len] or [0]
        r = self.new_request(
            prompt,
            data.draw(SALTS, label="salt"),
            data.draw(LORAS, label="lora"),
            data.draw(PROMPT_LOGPROBS, label="prompt_logprobs"),
        )
        chunk = data.draw(CHUNKS, label="chunk")
        if not self.admit(r, chunk, data.draw(LOOKAHEAD, label="lookahead")) and data.draw(
            st.booleans(), label="keep_waiting"
        ):
            self.waiting[r.request_id] = r

    @rule(data=st.data())
    @_step
    def arrive(self, data: st.DataObject) -> None:
        self.arrival(data)

    @rule(data=st.data())
    @_step
    def arrive_sharing(self, data: st.DataObject) -> None:
        self.arrival(data, share=True)

    @rule(data=st.data())
    @_step
    def arrive_too_large(self, data: st.DataObject) -> None:
        """A prompt that cannot fit even in an empty pool: refused, nothing changes.

        Full-attention groups need a block per block_size tokens whatever the hits (a hit
        block is either free, and counts, or held, and so not free); sliding-window hits
        are mostly the null block, so without a full-attention group the prompt skips
        the cache (prompt logprobs) to be sure not to fit."""
        usable = self.mgr.block_pool.num_usable_blocks
        full = [bs for bs, w in zip(self.block_sizes, self.windows) if w is None]
        sizes = full or self.block_sizes
        length = 1
        while sum(_ceil_div(length, bs) for bs in sizes) <= usable:
            length += 1
        if length > self.max_model_len:
            return
        prefix = list(data.draw(st.sampled_from(PREFIXES), label="prefix"))
        length = data.draw(st.integers(length, self.max_model_len), label="length")
        prompt = (prefix + [i % 4 for i in range(length)])[:length]
        r = self.new_request(prompt, data.draw(SALTS, label="salt"), None, not full)
        assert not self.admit(r, None, 0)
        if data.draw(st.booleans(), label="keep_waiting"):
            self.waiting[r.request_id] = r  # a chunked readmission may still get through

    def schedule(self, data: st.DataObject) -> None:
        """One scheduler step for a running request: the next prefill chunk, or a decode
        step (append the sampled token, allocate its slot). When the pool is short,
        preempt requests until it fits or the request itself is preempted. With nothing
        running, a request arrives instead."""
        if not self.running:
            self.arrival(data)
            return
        r = self.running[data.draw(st.sampled_from(sorted(self.running)), label="request")]
        if r.num_computed_tokens == r.num_tokens:
            if r.num_tokens >= self.max_model_len:
                self.free(r)
                return
            r.append_output_token_ids(data.draw(VOCAB, label="token"))
        num_new = min(r.num_tokens - r.num_computed_tokens, data.draw(st.integers(1, 16)))
        lookahead = data.draw(LOOKAHEAD, label="lookahead")
        while not self.allocate(r, num_new, lookahead=lookahead):
            if not data.draw(st.booleans(), label="preempt"):
                return
            victim = self.running[data.draw(st.sampled_from(sorted(self.running)), label="v")]
            self.preempt(victim)
            if victim is r:
                return

    @rule(data=st.data())
    @_step
    def step(self, data: st.DataObject) -> None:
        self.schedule(data)

    @rule(data=st.data())
    @_step
    def step_again(self, data: st.DataObject) -> None:
        self.schedule(data)

    @rule(data=st.data())
    @_step
    def verify_drafts(self, data: st.DataObject) -> None:
        """A decode step's drafts verified (speculative decoding): a of the lookahead
        slots' tokens accepted (their KV is now computed), a bonus token appended, then
        the blocks past the request's tokens freed: they held only rejected drafts, so
        none carries a hash, and each goes to the free queue; the blocks the accepted
        tokens filled are published."""
        ready = [r for r in self.running.values() if r.num_computed_tokens == r.num_tokens]
        if not ready:
            self.schedule(data)
            return
        r = data.draw(st.sampled_from(sorted(ready, key=lambda q: q.request_id)), label="req")
        tables = self.tables(r.request_id)
        slots = min(len(t) * bs for t, bs in zip(tables, self.block_sizes))
        room = min(slots, self.max_model_len - 1) - r.num_tokens
        if room < 0:
            return
        for _ in range(data.draw(st.integers(0, room), label="accepted")):
            r.append_output_token_ids(data.draw(VOCAB, label="draft"))
            r.num_computed_tokens += 1
        r.append_output_token_ids(data.draw(VOCAB, label="bonus"))
        pool = self.mgr.block_pool
        free_before = pool.get_num_free_blocks()
        self.mgr.free_lookahead(r)
        after = self.tables(r.request_id)
        dropped = [b for t, u in zip(tables, after) for b in t[len(u) :] if b != NULL]
        for t, u, bs in zip(tables, after, self.block_sizes):
            assert len(u) == min(len(t), _ceil_div(r.num_tokens, bs)) and u == t[: len(u)]
        assert all(pool.blocks[b].block_hash is None for b in dropped)
        assert pool.get_num_free_blocks() == free_before + len(dropped)
        if dropped:
            event("rejected drafts' block freed")
        # The blocks the accepted tokens filled are published now (a decode's fast path
        # only publishes the block its own token fills).
        self.mgr.cache_blocks(r, r.num_computed_tokens)
        for g, bs in enumerate(self.block_sizes):
            for i, b in enumerate(after[g]):
                full = b != NULL and self.caching and i < r.num_computed_tokens // bs
                if full and b not in self.ref.key_of:
                    self.ref.store(b, self.key(r, g, i))

    @rule(data=st.data())
    @_step
    def finish(self, data: st.DataObject) -> None:
        if not self.running:
            self.arrival(data)
            return
        r = self.running[data.draw(st.sampled_from(sorted(self.running)))]
        self.history.append(tuple(r.all_token_ids))
        self.free(r)

    @rule(data=st.data())
    @_step
    def preempt_one(self, data: st.DataObject) -> None:
        if not self.running:
            self.arrival(data)
            return
        self.preempt(self.running[data.draw(st.sampled_from(sorted(self.running)))])

    @rule(data=st.data())
    @_step
    def readmit(self, data: st.DataObject) -> None:
        if not self.waiting:
            self.arrival(data)
            return
        r = self.waiting[data.draw(st.sampled_from(sorted(self.waiting)))]
        if self.admit(r, data.draw(CHUNKS, label="chunk"), data.draw(LOOKAHEAD)):
            del self.waiting[r.request_id]

    @rule(data=st.data())
    @_step
    def drop_waiting(self, data: st.DataObject) -> None:
        if not self.waiting:
            self.arrival(data)
            return
        del self.waiting[data.draw(st.sampled_from(sorted(self.waiting)))]

    @rule(really=st.sampled_from([False, False, True]))
    @_step
    def reset_prefix_cache(self, really: bool) -> None:
        if not really:  # a reset empties the cache: rarer than other steps
            return
        in_use = any(b != NULL for rid in self.running for t in self.tables(rid) for b in t)
        before = self.snapshot()
        ok = self.mgr.reset_prefix_cache()
        assert ok == (not in_use)
        event(f"reset_prefix_cache -> {ok}")
        if not ok:
            assert self.snapshot() == before
            return
        self.ref.clear()
        after = self.snapshot()
        assert after["queue"] == before["queue"]
        assert all(not index for index in after["index"])
        assert all(h is None for _, h, _ in after["blocks"])

    # -- after every step ---------------------------------------------------------------
    @invariant()
    @_step
    def consistent(self) -> None:
        if self.m is None:
            return
        m = self.m
        pool = m.block_pool
        m.check_invariants(self.running)
        assert all(set(g.req_to_blocks) == set(self.running) for g in m.coordinator.managers)
        for rid in self.waiting:
            assert self.waiting[rid].num_computed_tokens == 0
            assert not any(self.tables(rid))
        refs: Counter[int] = Counter()
        for rid, r in self.running.items():
            tables = self.tables(rid)
            refs.update(b for t in tables for b in t if b != NULL)
            for g, bs in enumerate(self.block_sizes):
                assert r.num_computed_tokens <= len(tables[g]) * bs
        for block in pool.blocks[1:]:
            assert block.ref_cnt == refs[block.block_id]
        assert pool.get_num_free_blocks() == pool.num_usable_blocks - len(refs)
        # Hash-free blocks are always reused before cached ones.
        hashed = [b.block_hash is not None for b in pool.free_block_queue]
        assert hashed == sorted(hashed), "an unhashed free block sits behind a cached one"
        # Blocks share a hash exactly when the reference says they share a token prefix.
        assert set(self.ref.key_of) == {b.block_id for b in pool.blocks if b.block_hash}
        for g in range(pool.num_groups):
            actual = set()
            for _, blocks in pool.cached_entries(g):
                assert all(b.group_id == g for b in blocks)
                actual.add(frozenset(b.block_id for b in blocks))
            assert actual == self.ref.partition(g)
        if not self.caching:
            assert not self.ref.key_of
        # Replaying the KV events gives the index's hashes.
        for kv_event in m.take_events():
            assert self.kv_events
            if isinstance(kv_event, BlockStored):
                assert len(kv_event.token_ids) == len(kv_event.block_hashes) * kv_event.block_size
                check_stored_hashes(kv_event, m.block_hasher)
                self.event_hashes[kv_event.group_idx].update(kv_event.block_hashes)
            elif isinstance(kv_event, BlockRemoved):
                for h in kv_event.block_hashes:
                    self.event_hashes[kv_event.group_idx].remove(h)
            else:
                assert isinstance(kv_event, AllBlocksCleared)
                for hashes in self.event_hashes:
                    hashes.clear()
        if self.kv_events:
            for g in range(pool.num_groups):
                assert self.event_hashes[g] == {h for h, _ in pool.cached_entries(g)}

    def teardown(self) -> None:
        if self.m is None or not self.clean:
            return
        for r in list(self.running.values()):
            self.free(r)
        self.m.check_invariants(self.running)
        pool = self.m.block_pool
        assert pool.get_num_free_blocks() == pool.num_usable_blocks
        assert self.m.usage == 0.0
        assert self.m.reset_prefix_cache()
        self.m.check_invariants(self.running)


KVStateMachine.TestCase.settings = settings(
    max_examples=int(os.environ.get("PAGEDSERVE_KV_SM_EXAMPLES", "150")),
    stateful_step_count=int(os.environ.get("PAGEDSERVE_KV_SM_STEPS", "50")),
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
TestKVCacheStateMachine = KVStateMachine.TestCase
