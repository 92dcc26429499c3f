"""launch/client/prefix_router.py: the router hashes a prompt exactly as the core does, and
picks the replica holding its longest cached prefix, the least loaded among equals, and
never one far above the mean load (a load skip) or one not serving."""

from __future__ import annotations

import pytest

from enginecore.request import Request
from launch.client.prefix_router import LOAD_SLACK, PrefixRouter
from protocol.block_hash import BlockHasher
from protocol.kv_events import BlockStored, CachedPrefixView, KVEventBatch

BLOCK = 4
SEED = b"deployment secret"
PROMPT = list(range(100, 117))  # four full blocks and one token


def _router() -> PrefixRouter:
    return PrefixRouter(BLOCK, "xxh3_128", SEED)


def _holding(hashes: list[bytes]) -> CachedPrefixView:
    """A replica's view after it published these blocks as stored."""
    view = CachedPrefixView()
    stored = BlockStored(hashes, None, [0] * BLOCK * len(hashes), BLOCK, None, None, None)
    view.apply(KVEventBatch(0.0, [stored]))
    return view


@pytest.mark.parametrize("salt", [None, "tenant-a"])
def test_a_prompts_block_hashes_are_the_ones_the_core_caches_it_under(salt: str | None) -> None:
    core = Request("r", PROMPT, BlockHasher(BLOCK, "xxh3_128", SEED), cache_salt=salt)
    assert _router().block_hashes(PROMPT, salt) == core.block_hashes
    assert len(core.block_hashes) == 4


def test_a_salt_or_another_seed_changes_every_hash() -> None:
    plain = _router().block_hashes(PROMPT, None)
    salted = _router().block_hashes(PROMPT, "tenant-a")
    other = PrefixRouter(BLOCK, "xxh3_128", b"another deployment").block_hashes(PROMPT, None)
    assert not set(plain) & set(salted) and not set(plain) & set(other)


def test_the_replica_with_the_longest_cached_prefix_wins() -> None:
    router = _router()
    hashes = router.block_hashes(PROMPT, None)
    views = [_holding(hashes[:1]), _holding(hashes[:3]), CachedPrefixView()]
    assert router.choose(hashes, views, [0, 5, 0]) == (1, "prefix_hit", 3)
    assert router.decisions == {"prefix_hit": 1, "tie": 0, "load": 0}


def test_equal_prefixes_go_to_the_least_loaded_and_no_prefix_by_load_alone() -> None:
    router = _router()
    hashes = router.block_hashes(PROMPT, None)
    tied = [_holding(hashes[:2]), _holding(hashes[:2]), CachedPrefixView()]
    assert router.choose(hashes, tied, [3, 1, 0]) == (1, "tie", 2)
    empty = [CachedPrefixView() for _ in range(3)]
    assert router.choose(hashes, empty, [3, 1, 2]) == (1, "load", 0)
    # Equally loaded: turns, so an idle deployment spreads new prefixes.
    picks = {router.choose(hashes, empty, [0, 0, 0])[0] for _ in range(3)}
    assert picks == {0, 1, 2}
    assert router.decisions == {"prefix_hit": 0, "tie": 1, "load": 4}


def test_a_replica_far_above_the_mean_load_is_skipped_and_counted() -> None:
    router = _router()
    hashes = router.block_hashes(PROMPT, None)
    views = [_holding(hashes), _holding(hashes[:1])]
    # The others' mean is 0: more than LOAD_SLACK open requests is too many.
    index, reason, blocks = router.choose(hashes, views, [LOAD_SLACK + 1, 0])
    assert (index, reason, blocks) == (1, "prefix_hit", 1)
    assert router.load_skips == 1
    # Within the bound the prefix wins over load; with more replicas, twice their mean.
    assert router.choose(hashes, views, [LOAD_SLACK, 0])[0] == 0
    three = [*views, CachedPrefixView()]
    assert router.choose(hashes, three, [4 * LOAD_SLACK, 2 * LOAD_SLACK, 2 * LOAD_SLACK])[0] == 0
    assert (
        router.choose(hashes, three, [4 * LOAD_SLACK + 1, 2 * LOAD_SLACK, 2 * LOAD_SLACK])[0] == 1
    )
    assert router.load_skips == 2


def test_a_replica_not_serving_is_never_chosen_and_none_serving_is_an_error() -> None:
    router = _router()
    hashes = router.block_hashes(PROMPT, None)
    assert router.choose(hashes, [None, CachedPrefixView()], [0, 9])[0] == 1
    with pytest.raises(ValueError, match="no replica"):
        router.choose(hashes, [None, None], [0, 0])


def test_without_prefix_caching_every_choice_is_by_load() -> None:
    router = PrefixRouter(BLOCK, "xxh3_128", SEED, caching=False)
    assert router.block_hashes(PROMPT, None) == []
    assert router.choose([], [CachedPrefixView(), CachedPrefixView()], [2, 1])[1:] == ("load", 0)
