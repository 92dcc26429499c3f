"""enginecore/kv_invariants.py: check_invariants passes consistent bookkeeping and names
the rule when a block's count, the free queue, the hash index or a table is broken."""

from __future__ import annotations

import pytest

from enginecore.block_pool import BlockPool
from enginecore.kv_invariants import BrokenInvariant, check_invariants
from enginecore.request import Request
from enginecore.single_type_kv_cache_manager import make_single_type_manager
from protocol.block_hash import BlockHasher
from protocol.kv_cache import FullAttentionSpec

BS = 4


def _state() -> tuple[BlockPool, list, dict[str, Request]]:
    """One request holding two cached blocks of a six-block pool."""
    pool = BlockPool(6)
    m = make_single_type_manager(FullAttentionSpec(BS, 1, 8, "float32"), pool, 0, BS)
    r = Request("r", list(range(8)), BlockHasher(BS))
    r.holds_kv_blocks = True
    m.allocate_new_blocks("r", 8)
    m.cache_blocks(r, 8)
    r.num_computed_tokens = 8
    return pool, [m], {"r": r}


def test_consistent_bookkeeping_passes() -> None:
    pool, managers, requests = _state()
    check_invariants(pool, managers, requests)
    managers[0].free("r")
    check_invariants(pool, managers, {})


def _break_ref_count(pool: BlockPool, managers: list, requests: dict) -> None:
    pool.blocks[1].ref_cnt += 1


def _break_index(pool: BlockPool, managers: list, requests: dict) -> None:
    pool.cached_block_hash_to_block[0].clear()


def _break_owner(pool: BlockPool, managers: list, requests: dict) -> None:
    requests.clear()


def _break_computed(pool: BlockPool, managers: list, requests: dict) -> None:
    requests["r"].num_computed_tokens = 9


def _break_null(pool: BlockPool, managers: list, requests: dict) -> None:
    pool.null_block.ref_cnt = 1


@pytest.mark.parametrize(
    ("corrupt", "rule", "says"),
    [
        (_break_ref_count, 1, "block 1 has ref_cnt 2 but 1 request references"),
        (_break_index, 2, "carries a hash the index does not know"),
        (_break_owner, 3, "holds blocks of unknown request r"),
        (_break_computed, 3, "9 computed tokens but group 0 holds only 2 blocks"),
        (_break_null, 1, "null block changed"),
    ],
)
def test_a_broken_rule_is_named(corrupt: object, rule: int, says: str) -> None:
    pool, managers, requests = _state()
    corrupt(pool, managers, requests)  # type: ignore[operator]
    with pytest.raises(BrokenInvariant, match=f"KV invariant {rule} violated: .*{says}"):
        check_invariants(pool, managers, requests)


def test_a_broken_invariant_is_an_assertion_not_a_bad_request() -> None:
    assert issubclass(BrokenInvariant, AssertionError)
    assert not issubclass(BrokenInvariant, ValueError)
