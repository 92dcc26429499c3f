"""TierLevel: one level of the second KV tier (host memory or disk), hash -> slot.

A level has its own capacity and LRU. The core's KVTier (enginecore/kv_tier.py) keeps
one per medium; a block may sit in both (the disk is written through), and leaves each
on its own. Slots are handed out lazily, so a disk level of millions of slots costs
nothing until it fills.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Iterable

NO_SLOT = -1  # offer: the block is there already (or a digest collision keeps the first)
NO_ROOM = -2  # offer: every slot is in use by this step's transfers


class TierLevel:
    def __init__(self, num_slots: int, on_removed: Callable[[bytes], None] | None = None) -> None:
        if num_slots < 1:
            raise ValueError(f"a KV tier level needs at least one slot, got {num_slots}")
        self.num_slots = num_slots
        # hash -> (slot, hash input); first = least recently stored or loaded.
        self.index: OrderedDict[bytes, tuple[int, bytes]] = OrderedDict()
        self._freed: list[int] = []
        self._next = 0  # slots >= _next were never used
        # Slots this step already stores into or loads from: never reused within the
        # step, so the workers' order (stores, then loads) reads what the core meant.
        self.busy: set[int] = set()
        self.on_removed = on_removed

    def __len__(self) -> int:
        return len(self.index)

    def find(self, block_hash: bytes, hash_input: bytes) -> int:
        """The slot holding exactly this content, or NO_SLOT."""
        entry = self.index.get(block_hash)
        if entry is None or entry[1] != hash_input:
            return NO_SLOT
        return entry[0]

    def touch(self, block_hash: bytes) -> None:
        self.index.move_to_end(block_hash)

    def offer(self, block_hash: bytes, hash_input: bytes) -> int:
        """A slot to store this block into (now indexed and busy), NO_SLOT when it is
        here already (made most recent), NO_ROOM when no slot is free this step."""
        entry = self.index.get(block_hash)
        if entry is not None:
            if entry[1] == hash_input:
                self.index.move_to_end(block_hash)
            return NO_SLOT  # equal content kept, or a digest collision: keep the first
        slot = self._take_slot()
        if slot < 0:
            return NO_ROOM
        self.index[block_hash] = (slot, hash_input)
        self.busy.add(slot)
        return slot

    def _take_slot(self) -> int:
        if self._freed:
            return self._freed.pop()
        if self._next < self.num_slots:
            self._next += 1
            return self._next - 1
        busy = self.busy
        for block_hash, (slot, _) in self.index.items():  # oldest first
            if slot not in busy:
                del self.index[block_hash]
                if self.on_removed is not None:
                    self.on_removed(block_hash)
                return slot
        return NO_ROOM

    def drop_slots(self, slots: Iterable[int]) -> int:
        """Forget what these slots hold (a worker found them unreadable); how many."""
        bad = set(slots)
        gone = [h for h, (slot, _) in self.index.items() if slot in bad]
        for block_hash in gone:
            self._freed.append(self.index.pop(block_hash)[0])
            if self.on_removed is not None:
                self.on_removed(block_hash)
        return len(gone)

    def restore(self, entries: Iterable[tuple[int, bytes, bytes]]) -> list[tuple[bytes, bytes]]:
        """Index (slot, hash, hash input) entries read back at start-up (before any
        store); the (hash, hash input) of each one taken."""
        taken = []
        for slot, block_hash, hash_input in sorted(entries):
            if 0 <= slot < self.num_slots and block_hash not in self.index:
                self.index[block_hash] = (slot, hash_input)
                taken.append((block_hash, hash_input))
        used = {slot for slot, _ in self.index.values()}
        self._next = max(used, default=-1) + 1
        self._freed = [s for s in range(self._next - 1, -1, -1) if s not in used]
        return taken

    def check_invariants(self) -> None:
        """Debugging and tests: every slot below _next is free or indexed once."""
        used = [slot for slot, _ in self.index.values()]
        if len(set(used)) != len(used):
            raise AssertionError("a tier slot is indexed twice")
        if set(used) & set(self._freed) or len(used) + len(self._freed) != self._next:
            raise AssertionError("tier slots are lost or both free and indexed")
        if self._next > self.num_slots:
            raise AssertionError("a tier slot past the level's capacity")
