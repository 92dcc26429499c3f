"""TierLoads: requests whose KV tier hit loads over several steps before they compute.

A disk load may fail (a damaged file). Loaded in the step that computes the request,
a failed block would have to be recomputed within that step, with every block after it
and in every other request of the step that hits it on the device: the step's budget
would cap what a request loads. So a request whose tier hit has a disk block is
admitted into a loading state instead (the idea of vLLM's requests waiting for remote
KV): its device blocks are allocated but not published as cached, its loads go out over
the next steps (at most `load_blocks` a step, so the decodes of others stall little),
and it is computed only after rank 0 answered the last step that carried its loads (a
step of loads alone is answered too: protocol.worker.is_answered). Answers
name the disk slots that failed; the request then starts from its verified prefix, the
blocks before the first failed one, which are published then; the others are computed
over. A loading request preempted or aborted frees everything; loads already sent land
in freed, unpublished blocks, which the worker overwrites before any later step reads.

Promotion: with host memory and disk, a verified block loaded from disk is copied into
host memory by the next step's stores, while the device block still holds that content
(its hash is unchanged), so the next hit is a host hit.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from enginecore.kv_cache_coordinator import KVCacheBlocks
from enginecore.kv_cache_manager import KVCacheManager
from enginecore.kv_tier import KVTier
from enginecore.request import Request
from protocol.worker import KVTierOps, ModelRunnerOutput, TierOutput

# Blocks a step loads for loading requests when the engine does not say: with the
# disk's read speed (docs/benchmarks.md) a few tens of milliseconds of a step.
DEFAULT_LOAD_BYTES = 64 << 20


@dataclass
class Loading:
    """One loading request: its tier blocks (hash, slot, from disk, group, position),
    after num_hit tokens found on the device, and how far they went."""

    request: Request
    num_hit: int
    block_ids: list[int]
    found: list[tuple[bytes, int, bool, int, int]]  # KVTier._found's
    sent: int = 0  # entries of found whose loads went out
    last_step: int = 0  # the last step that carried its loads
    first_bad: int = 1 << 62  # index in found of the first block a worker failed
    disk_slots: dict[int, int] = field(default_factory=dict)  # disk slot -> index in found


class TierLoads:
    def __init__(self, kv: KVCacheManager, load_bytes: int = 0) -> None:
        if load_bytes < 0:
            raise ValueError(f"a step's tier load budget must be >= 0 bytes, got {load_bytes}")
        assert kv.tier is not None
        self.kv = kv
        self.tier: KVTier = kv.tier
        per_block = max(self.tier.block_bytes, 1)
        # Blocks a step loads ahead: at least one, so a load always moves.
        self.load_blocks = max(1, (load_bytes or DEFAULT_LOAD_BYTES) // per_block)
        self.loading: dict[str, Loading] = {}  # in admission order
        # Loaded and verified, holding their blocks: admitted before any waiting request
        # (one waiting for these blocks would wait forever).
        self.ready: deque[Request] = deque()
        # (device block, hash) loaded from disk and verified: into host memory next step.
        self._promote: list[tuple[int, bytes]] = []

    @classmethod
    def make(cls, kv: KVCacheManager, load_bytes: int = 0) -> TierLoads | None:
        """Two-phase loads for kv's tier; None without a tier, or for several KV cache
        groups (a hybrid model's disk loads go with the step that computes them, which
        recomputes a failed read from the request's device boundary)."""
        if kv.tier is None or kv.tier.hybrid:
            return None
        return cls(kv, load_bytes)

    def __len__(self) -> int:
        return len(self.loading) + len(self.ready)

    def requests(self) -> list[Request]:
        return [*self.ready, *(st.request for st in self.loading.values())]

    def admit(
        self, request: Request, num_hit: int, hits: KVCacheBlocks | None, num_tier: int
    ) -> bool:
        """After the tier lookup found num_tier tokens: allocate the request's blocks for
        its whole prompt (unpublished) and queue its loads; False (nothing changed) when
        the pool is short."""
        kv = self.kv
        num_new = request.num_tokens - num_hit - num_tier
        blocks = kv.allocate_slots(
            request, num_new, num_hit, hits if num_hit else None, 0, num_tier, True
        )
        if blocks is None:
            return False
        found = self.tier.take_found()
        table = kv.get_block_ids(request.request_id)[0]
        st = Loading(request, num_hit, [table[entry[4]] for entry in found], found)
        st.first_bad = len(found)
        request.num_computed_tokens = num_hit
        self.loading[request.request_id] = st
        return True

    def drop(self, request_id: str) -> None:
        """Forget a loading or ready request (aborted, preempted, failed); the caller
        frees its blocks. Its loads already sent land in those freed, unpublished blocks."""
        if self.loading.pop(request_id, None) is None:
            for request in self.ready:
                if request.request_id == request_id:
                    self.ready.remove(request)
                    break

    def last(self) -> Request | None:
        """A preemption's first victim: the latest admitted loading request (it made
        the least progress), else the last ready one."""
        if self.loading:
            return next(reversed(self.loading.values())).request
        return self.ready[-1] if self.ready else None

    # -- per step ---------------------------------------------------------------------
    def emit(self, step_id: int) -> None:
        """Before the step's ops are taken: this step's share of the loads, and the
        promotions of blocks loaded from disk by earlier steps."""
        tier, pool = self.tier, self.kv.block_pool.blocks
        for block_id, block_hash in self._promote:
            if pool[block_id].block_hash == block_hash:  # still that content
                tier.promote(block_id, block_hash)
        self._promote = []
        room = self.load_blocks
        for st in self.loading.values():
            if room <= 0:
                break
            end = min(len(st.found), st.sent + room)
            for k in range(st.sent, end):
                block_hash, slot, on_disk = st.found[k][:3]
                tier.queue_load(block_hash, slot, on_disk, st.block_ids[k])
                if on_disk:
                    st.disk_slots[slot] = k
            if end > st.sent:
                room -= end - st.sent
                st.sent = end
                st.last_step = step_id

    def take_ops(self, step_id: int) -> KVTierOps | None:
        """The step's tier transfers (KVTier.take_ops), with its share of the loads."""
        self.emit(step_id)
        ops = self.tier.take_ops()
        self.after_ops()
        return ops

    def after_ops(self) -> None:
        """After the step's ops were taken: hold the slots of loads not sent yet, so no
        store takes them before they are read."""
        tier = self.tier
        for st in self.loading.values():
            for _, slot, on_disk, *_ in st.found[st.sent :]:
                level = tier.disk if on_disk else tier.host
                assert level is not None
                level.busy.add(slot)

    def answered(self, step_id: int, output: ModelRunnerOutput) -> None:
        """Rank 0's answer to step_id (it reports failed loads of this step and earlier
        ones): each request whose loads are all known now is ready, set to compute from
        its verified prefix (published now)."""
        failed = output.failed_disk_slots if isinstance(output, TierOutput) else ()
        for slot in failed:
            for st in self.loading.values():
                k = st.disk_slots.get(slot)
                if k is not None and k < st.first_bad:
                    st.first_bad = k
        ready = [
            st
            for st in self.loading.values()
            if st.sent == len(st.found) and st.last_step <= step_id
        ]
        bs = self.tier.block_size
        for st in ready:
            del self.loading[st.request.request_id]
            good = min(st.first_bad, len(st.found))
            verified = st.num_hit + good * bs
            self.kv.cache_blocks(st.request, verified)
            st.request.num_computed_tokens = verified
            if self.tier.host is not None:
                self._promote += (
                    (st.block_ids[k], st.found[k][0]) for k in range(good) if st.found[k][2]
                )
            self.ready.append(st.request)
