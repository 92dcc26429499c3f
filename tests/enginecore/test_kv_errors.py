"""Bad input raises a clear error and changes nothing."""

from __future__ import annotations

import pytest

from enginecore import BlockPool, Request
from enginecore.errors import InvariantViolation
from tests.helpers.kv_helpers import admit, make_manager, snapshot

BAD_CALLS = {
    "negative tokens": (lambda m, r, other: m.allocate_slots(r, -1), "num_new_tokens must be >= 0"),
    "negative lookahead": (
        lambda m, r, other: m.allocate_slots(r, 1, num_lookahead_tokens=-2),
        "num_lookahead_tokens",
    ),
    "nothing to allocate": (lambda m, r, other: m.allocate_slots(r, 0), "nothing to allocate"),
    "past the prompt": (lambda m, r, other: m.allocate_slots(r, 5), "slots up to token 15"),
    "duplicate id": (lambda m, r, other: m.allocate_slots(other, 1), "duplicate request id"),
    "unknown id": (
        lambda m, r, other: m.free(Request("ghost", [1, 2], m.block_hasher)),
        "unknown request id",
    ),
    "another object": (lambda m, r, other: m.free(other), "another request object"),
    "hits twice": (
        lambda m, r, other: m.allocate_slots(r, 1, 4, m.get_computed_blocks(r)[0]),
        "already holds",
    ),
}


@pytest.mark.parametrize("case", list(BAD_CALLS))
def test_bad_calls_raise_and_leave_state_alone(case: str) -> None:
    m = make_manager(16, max_model_len=64)
    r = Request("r", list(range(10)), m.block_hasher)
    admit(m, r)
    before = snapshot(m)
    other = Request("r", list(range(10)), m.block_hasher)
    call, message = BAD_CALLS[case]
    with pytest.raises((ValueError, KeyError), match=message):
        call(m, r, other)
    assert snapshot(m) == before


def test_prompt_past_max_model_len_is_refused() -> None:
    m = make_manager(64, max_model_len=16)
    r = Request("r", list(range(20)), m.block_hasher)
    before = snapshot(m)
    with pytest.raises(ValueError, match="exceed max_model_len 16"):
        m.allocate_slots(r, 20)
    assert snapshot(m) == before


def test_bad_requests_are_refused_at_creation() -> None:
    m = make_manager(16)
    with pytest.raises(ValueError, match="empty prompt"):
        Request("r", [], m.block_hasher)
    with pytest.raises(ValueError, match=r"token ids must be integers in \[0, 2\*\*32\)"):
        Request("r", [1, 2, -3, 4], m.block_hasher)
    with pytest.raises(ValueError, match="request id"):
        Request("", [1], m.block_hasher)
    with pytest.raises(ValueError, match="token ids"):
        Request("r", [1, 2**40])


def test_a_block_freed_twice_is_refused_whole() -> None:
    pool = BlockPool(8)
    blocks = pool.get_new_blocks(3)
    pool.free_blocks([blocks[0]])
    queue = pool.free_block_queue.block_ids()
    with pytest.raises(InvariantViolation, match=f"block {blocks[0].block_id} freed more often"):
        pool.free_blocks([blocks[1], blocks[0]])
    assert blocks[1].ref_cnt == 1
    assert pool.free_block_queue.block_ids() == queue


def test_a_list_naming_a_block_twice_is_refused_whole() -> None:
    pool = BlockPool(8)
    blocks = pool.get_new_blocks(3)  # one reference each
    queue = pool.free_block_queue.block_ids()
    with pytest.raises(InvariantViolation, match=f"block {blocks[2].block_id} freed more often"):
        pool.free_blocks([blocks[0], blocks[2], blocks[1], blocks[2]])
    assert [b.ref_cnt for b in blocks] == [1, 1, 1]
    assert pool.free_block_queue.block_ids() == queue


def test_freeing_a_request_twice_is_refused() -> None:
    m = make_manager(16)
    r = Request("r", list(range(10)), m.block_hasher)
    admit(m, r)
    m.free(r)
    before = snapshot(m)
    with pytest.raises(KeyError, match="unknown request id"):
        m.free(r)
    assert snapshot(m) == before


def test_pool_too_small_and_oversized_requests() -> None:
    with pytest.raises(ValueError, match="null block"):
        BlockPool(1)
    pool = BlockPool(4)
    with pytest.raises(ValueError, match="cannot get 4 blocks: 3 free"):
        pool.get_new_blocks(4)
    assert pool.get_num_free_blocks() == 3
    with pytest.raises(ValueError, match="in use"):
        pool.evict_cached_blocks([pool.null_block])
