"""pagedkernels/testing.py: the random paged batches kernels are checked on hold what their
docstring promises: pages no two requests share, a NaN null block, poisoned tails."""

from __future__ import annotations

import torch

from pagedkernels.testing import random_paged_batch

BLOCK = 4


def _batch(**options: object) -> tuple[torch.Tensor, ...]:
    gen = torch.Generator().manual_seed(0)
    return random_paged_batch(gen, [9, 4, 1], [3, 4, 1], BLOCK, 2, 4, 8, torch.float32, **options)  # type: ignore[arg-type]


def test_shapes_offsets_and_lengths_follow_the_requests() -> None:
    query, key_cache, value_cache, table, qsl, lens = _batch(pad_rows=2)
    # 3 + 1 + 1 blocks, the null block and one never referenced.
    assert key_cache.shape == value_cache.shape == (7, BLOCK, 2, 8)
    assert query.shape == (3 + 4 + 1 + 2, 4, 8)
    assert qsl.tolist() == [0, 3, 7, 8] and lens.tolist() == [9, 4, 1]
    assert table.shape == (3, 4) and table.dtype == torch.int32


def test_each_request_owns_its_own_pages_and_the_null_block_is_nan() -> None:
    _, key_cache, value_cache, table, _, _ = _batch()
    pages = [table[0, :3].tolist(), table[1, :1].tolist(), table[2, :1].tolist()]
    owned = [p for row in pages for p in row]
    assert len(set(owned)) == len(owned) == 5 and 0 not in owned
    assert table[0, 3:].tolist() == [0] and table[1, 1:].tolist() == [0, 0, 0]
    assert key_cache[0].isnan().all() and value_cache[0].isnan().all()
    assert not key_cache[owned].isnan().any()


def test_a_released_window_points_unreached_blocks_at_the_null_block() -> None:
    _, _, _, table, _, _ = _batch(released_window=2)
    # Request 0: keys 0..8, queries at 6..8, window 2: the first key needed is 5, in block 1.
    assert table[0, 0].item() == 0 and table[0, 1].item() != 0


def test_poisoned_tails_fill_the_slots_past_each_request_s_keys() -> None:
    _, key_cache, value_cache, table, _, _ = _batch(poison_tails=True)
    last = int(table[0, 2])  # request 0's 9 keys end at slot 0 of its third block
    assert not key_cache[last, :1].isinf().any()
    assert key_cache[last, 1:].isinf().all() and value_cache[last, 1:].isnan().all()
    full = int(table[1, 0])  # request 1's 4 keys fill its block: nothing poisoned
    assert not key_cache[full].isinf().any()
