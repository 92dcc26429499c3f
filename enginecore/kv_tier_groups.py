"""The KV tier's rules for several KV cache groups (hybrid models, sliding windows).

A block id in group g holds group g's layers only, and a tier slot holds one group's
layers for one block position: the index keys a slot by the block's hash and its group
(tier_key). A full-attention group needs every block before a prefix boundary; a
sliding-window group only the blocks its window reads before it (the device prefix
cache's rule, enginecore/kv_cache_coordinator.py), so it stores only blocks a later
boundary's window may read, and loads only the window before the boundary it restores.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

# A position's place in the tier: (slot, from disk), or None when no level holds it.
Found = tuple[int, bool] | None


def tier_key(block_hash: bytes, group: int) -> bytes:
    """The index key of a block of `group` in a model of several groups: the same hash
    names the same tokens in every group, but each group keeps its own layers."""
    return block_hash + group.to_bytes(2, "little")


def split_key(key: bytes) -> tuple[bytes, int]:
    """(block hash, group) of a tier_key."""
    return key[:-2], int.from_bytes(key[-2:], "little")


def window_blocks(sliding_window: int, block_size: int) -> int:
    """Blocks a sliding window reads before a boundary: a query at token L reads
    L - window + 1 .. L - 1 (as SlidingWindowManager counts them)."""
    return -(-(sliding_window - 1) // block_size)


def longest_boundary(
    first: int,
    last: int,
    windows: Sequence[int | None],
    find: Callable[[int, int], Found],
    device: int = 0,
) -> tuple[int, list[tuple[int, int, int, bool]]]:
    """The largest block boundary b in first..last that every group restores from the
    device and the tier together, and the loads it needs as (group, position, slot,
    from disk). Every group holds its device hits before `first`; full attention also
    its cached device blocks before `device` (a window's may be gone, evicted in
    another order), and loads every other block before b; a sliding window loads the
    blocks it reads before b. windows[g]: None for full attention, else the blocks its
    window reads. find(g, i): where group g's block i is in the tier."""
    if first >= last:
        return first, []
    n = last - first
    full = [g for g, w in enumerate(windows) if w is None]
    found: list[list[Found]] = [[] for _ in windows]
    # Full attention bounds b by its run of blocks from `first`, device or tier.
    bound = last
    for i in range(max(first, device), last):
        column = [find(g, i) for g in full]
        if None in column:
            bound = i
            break
        for g, where in zip(full, column):
            found[g].append(where)
    # A window's blocks: a run of found blocks ending just before b, long enough.
    runs = []
    for g, w in enumerate(windows):
        if w is None:
            continue
        run, counts = 0, []
        for i in range(first, min(bound, first + n)):
            where = find(g, i)
            found[g].append(where)
            run = run + 1 if where is not None else 0
            counts.append(run)
        runs.append((counts, w))
    b = bound
    while b > first and not all(counts[b - 1 - first] >= min(w, b - first) for counts, w in runs):
        b -= 1
    loads = []
    for g, w in enumerate(windows):
        start = max(first, device) if w is None else max(first, b - w)
        offset = start if w is None else first
        for i in range(start, b):
            where = found[g][i - offset]
            assert where is not None
            loads.append((g, i, where[0], where[1]))
    return b, loads
