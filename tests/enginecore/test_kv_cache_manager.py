"""Prefix-cache rules of seeds 001 and 003: what may hit, what may be published."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from typing import Any

import pytest

from enginecore import KVCacheManager, MultiModalPlaceholder, Request
from protocol.block_hash import BlockHasher, hash_block_tokens, root_hash
from protocol.kv_events import AllBlocksCleared, BlockRemoved, BlockStored
from tests.helpers.kv_helpers import (
    admit,
    check,
    check_stored_hashes,
    decode,
    make_manager,
    tokens,
)

PROMPT = list(range(100, 133))  # 8 full blocks of 4 and one token more


def cached_then(m: KVCacheManager, prompt: list[int], **kwargs: Any) -> None:
    first = Request("first", prompt, m.block_hasher, **kwargs)
    admit(m, first)
    m.free(first)


@pytest.mark.parametrize("algo", ["xxh3_128", "sha256"])
def test_cache_salt_isolates_tenants(algo: str) -> None:
    m = make_manager(64, hash_algo=algo)
    cached_then(m, PROMPT, cache_salt="tenant-a")
    for salt, expected in (("tenant-a", 32), ("tenant-b", 0), (None, 0)):
        r = Request(f"r-{salt}", PROMPT, m.block_hasher, cache_salt=salt)
        assert m.get_computed_blocks(r)[1] == expected, salt
    # The salt sits in the first block only, and the chain carries it to every block.
    a = Request("a", PROMPT, m.block_hasher, cache_salt="tenant-a")
    b = Request("b", PROMPT, m.block_hasher, cache_salt="tenant-b")
    assert all(x != y for x, y in zip(a.block_hashes, b.block_hashes))
    assert a.extra_keys(0, 4) == (("salt", m.block_hasher.salt_digest("tenant-a")),)
    assert a.extra_keys(4, 8) is None


def test_lora_and_multimodal_inputs_change_the_hash() -> None:
    base = Request("x", PROMPT, BlockHasher(4))
    lora = Request("y", PROMPT, BlockHasher(4), lora_id=3)
    image = MultiModalPlaceholder("img-1", offset=9, length=6)  # blocks 2 and 3
    mm = Request("z", PROMPT, BlockHasher(4), mm_placeholders=[image])
    mm2 = Request("w", PROMPT, BlockHasher(4), mm_placeholders=[image._replace(identifier="img-2")])
    assert all(x != y for x, y in zip(base.block_hashes, lora.block_hashes))
    assert mm.block_hashes[:2] == base.block_hashes[:2]
    assert mm.block_hashes[2] != base.block_hashes[2]
    assert mm.block_hashes[2:] != mm2.block_hashes[2:]
    assert mm.extra_keys(8, 12) == (("mm", "img-1", 9),)


def test_prompt_logprobs_skip_the_cache() -> None:
    m = make_manager(64)
    cached_then(m, PROMPT)
    r = Request("r", PROMPT, m.block_hasher, wants_prompt_logprobs=True)
    assert m.get_computed_blocks(r) == (((),), 0)
    assert m.get_computed_blocks(Request("s", PROMPT, m.block_hasher))[1] == 32


def test_caching_off_never_hits() -> None:
    m = make_manager(64, enable_caching=False)
    cached_then(m, PROMPT)
    assert m.block_hasher is None
    assert m.get_computed_blocks(Request("r", PROMPT))[1] == 0
    assert all(b.block_hash is None for b in m.block_pool.blocks)


def test_full_hit_still_recomputes_the_last_token() -> None:
    m = make_manager(64)
    prompt = PROMPT[:32]  # exactly 8 blocks
    cached_then(m, prompt)
    r = Request("r", prompt, m.block_hasher)
    hits, num_hit = m.get_computed_blocks(r)
    # At most 31 tokens, block aligned: the whole last block runs again.
    assert num_hit == 28
    new = m.allocate_slots(r, 4, num_hit, hits)
    assert len(new[0]) == 1
    r.num_computed_tokens = 32
    # The recomputed block duplicates a cached one; both stay findable, no table rewritten.
    index = dict(m.block_pool.cached_entries(0))
    assert len(index[r.block_hashes[7]]) == 2
    check(m, r)
    m.free(r)
    check(m, r)


def test_uncached_prompt_tokens_counts_what_a_prefill_would_compute() -> None:
    """The scheduler's estimate of a waiting prompt's work: past its cached prefix, and
    past the blocks that requests ahead of it compute first (each computed once)."""
    m = make_manager(64)
    cached_then(m, PROMPT[:16])  # 4 blocks
    shared: set[bytes] = set()
    r = Request("r", PROMPT, m.block_hasher)  # 33 tokens: 8 full blocks and one token
    assert m.uncached_prompt_tokens(r, shared) == 33 - 16
    s = Request("s", PROMPT, m.block_hasher)
    assert m.uncached_prompt_tokens(s, shared) == 1  # r computes its 8 blocks first
    t = Request("t", PROMPT[:32], m.block_hasher)
    assert m.uncached_prompt_tokens(t, shared) == 4  # a full hit recomputes its last block
    other = Request("o", [7, *PROMPT[1:]], m.block_hasher)
    assert m.uncached_prompt_tokens(other, set()) == 33  # no prefix in common
    assert m.get_computed_blocks(Request("x", PROMPT, m.block_hasher))[1] == 16  # untouched
    off = make_manager(64, enable_caching=False)
    assert off.uncached_prompt_tokens(Request("u", PROMPT), set()) == 33


def test_lookahead_slots_are_never_cached() -> None:
    m = make_manager(64)
    r = Request("r", PROMPT[:6], m.block_hasher)
    new = m.allocate_slots(r, 6, num_lookahead_tokens=10)  # slots for 16 tokens
    assert len(new[0]) == 4
    r.num_computed_tokens = 6
    hashed = [b.block_hash is not None for b in m.coordinator.managers[0].req_to_blocks["r"]]
    assert hashed == [True, False, False, False]
    # Draft tokens accepted later are cached only once they are real tokens.
    for t in (7, 8):
        decode(m, r, t)
    hashed = [b.block_hash is not None for b in m.coordinator.managers[0].req_to_blocks["r"]]
    assert hashed == [True, True, False, False]
    check(m, r)


def test_delayed_caching_publishes_only_when_told() -> None:
    m = make_manager(64)
    r = Request("r", PROMPT, m.block_hasher)
    m.allocate_slots(r, 1, num_external_computed_tokens=32, delay_cache_blocks=True)
    assert all(b.block_hash is None for b in m.coordinator.managers[0].req_to_blocks["r"])
    assert m.get_computed_blocks(Request("s", PROMPT, m.block_hasher))[1] == 0
    m.cache_blocks(r, 32)  # the external KV has arrived
    assert m.get_computed_blocks(Request("t", PROMPT, m.block_hasher))[1] == 32


def test_hashes_grow_incrementally_and_match_the_reference_chain() -> None:
    hasher = BlockHasher(4)
    r = Request("r", PROMPT[:6], hasher)
    assert len(r.block_hashes) == 1
    first = r.block_hashes[0]
    for t in (1, 2, 3, 4, 5, 6):
        r.append_output_token_ids(t)
    assert r.block_hashes[0] is first  # never recomputed
    assert len(r.block_hashes) == 3
    parent = root_hash("xxh3_128")
    ids = r.all_token_ids
    for i, h in enumerate(r.block_hashes):
        parent = hash_block_tokens("xxh3_128", parent, ids[4 * i : 4 * i + 4])
        assert h == parent


_CHILD = textwrap.dedent(
    """
    import json, sys
    from enginecore import Request, MultiModalPlaceholder
    from protocol.block_hash import BlockHasher
    out = {}
    for algo in ("xxh3_128", "sha256"):
        r = Request("x", list(range(40)), BlockHasher(16, algo), cache_salt="s", lora_id=2,
                    mm_placeholders=[MultiModalPlaceholder("img", 3, 20)])
        out[algo] = [h.hex() for h in r.block_hashes]
    print(json.dumps(out))
    """
)


def test_hashes_are_equal_across_processes() -> None:
    results = []
    for seed in ("1", "2"):
        env = dict(os.environ, PYTHONHASHSEED=seed)
        out = subprocess.run(
            [sys.executable, "-c", _CHILD], capture_output=True, text=True, env=env, check=True
        )
        results.append(json.loads(out.stdout))
    assert results[0] == results[1]
    assert len(results[0]["sha256"][0]) == 64 and len(results[0]["xxh3_128"][0]) == 32


def test_kv_events_describe_blocks() -> None:
    m = make_manager(6, enable_kv_events=True)
    r = Request("r", tokens("ABCDEFGHI"), m.block_hasher)
    admit(m, r)
    m.free(r)
    (stored,) = m.take_events()
    assert isinstance(stored, BlockStored) and stored.parent_block_hash is None
    assert stored.block_hashes == r.block_hashes and stored.token_ids == tokens("ABCDEFGH")
    assert stored.block_size == 4 and stored.group_idx == 0 and stored.medium == "GPU"
    check_stored_hashes(stored, m.block_hasher)
    # Filling the pool with new content evicts both cached blocks.
    s = Request("s", list(range(900, 920)), m.block_hasher)
    admit(m, s)
    events = m.take_events()
    removed = [e for e in events if isinstance(e, BlockRemoved)]
    assert sorted(h for e in removed for h in e.block_hashes) == sorted(r.block_hashes)
    m.free(s)
    assert m.reset_prefix_cache()
    (cleared,) = m.take_events()
    assert isinstance(cleared, AllBlocksCleared)


def test_stored_events_skip_blocks_already_cached_without_mixing_tokens() -> None:
    """Two requests fill equal blocks side by side; the second's first block is already
    cached when it is stored, so its event starts after it, with the right parent and
    tokens (one list skipping a block the other did not would misname every hash)."""
    m = make_manager(16, enable_kv_events=True)
    a = Request("a", [*tokens("ABCDEFGH"), 1], m.block_hasher)
    b = Request("b", [*tokens("ABCDEFGHIJKL"), 2], m.block_hasher)
    admit(m, a)
    m.take_events()
    # No prefix lookup: b gets fresh blocks, whose first two hash like a's cached ones.
    assert m.allocate_slots(b, b.num_tokens) is not None
    (event,) = m.take_events()
    check_stored_hashes(event, m.block_hasher)
    assert event.block_hashes == b.block_hashes[2:3]
    assert event.parent_block_hash == b.block_hashes[1]
    assert event.token_ids == tokens("IJKL")


def test_reset_prefix_cache_refuses_while_blocks_are_in_use() -> None:
    m = make_manager(16)
    r = Request("r", PROMPT[:9], m.block_hasher)
    admit(m, r)
    assert m.reset_prefix_cache() is False
    assert any(b.block_hash is not None for b in m.block_pool.blocks)
    m.free(r)
    assert m.reset_prefix_cache() is True
    assert all(b.block_hash is None for b in m.block_pool.blocks)
    assert m.get_computed_blocks(Request("s", PROMPT[:9], m.block_hasher))[1] == 0


def test_usage_in_blocks_and_tokens() -> None:
    m = make_manager(11)  # 10 usable blocks of 4
    assert m.usage == 0.0 and m.token_usage({}) == 0.0
    r = Request("r", list(range(9)), m.block_hasher)  # 3 blocks, 9 of 12 slots
    admit(m, r)
    assert m.usage == pytest.approx(0.3)
    assert m.token_usage({"r": r}) == pytest.approx(9 / 4 / 10)


def test_prefix_cache_stats_count_preempted_lookups_apart() -> None:
    m = make_manager(64)
    r = Request("r", PROMPT, m.block_hasher)
    admit(m, r)
    m.free(r)  # preempted: recomputed later
    r.num_computed_tokens = 0
    r.num_preemptions += 1
    admit(m, r)
    stats = m.prefix_cache_stats
    assert (stats.requests, stats.queries, stats.hits) == (1, 33, 0)
    assert (stats.preempted_requests, stats.preempted_queries, stats.preempted_hits) == (1, 33, 32)


def test_the_hash_root_is_a_per_deployment_secret() -> None:
    """Without a seed each engine start draws its own root, so block hashes cannot be
    predicted (or collisions crafted) from outside; equal seeds give equal hashes."""
    from enginecore.core import hash_seed
    from launch.client.engine_args import EngineArgs, core_config
    from protocol.config import EngineCoreConfig

    def config(seed: str | None) -> EngineCoreConfig:
        args = EngineArgs(model="unused", prefix_cache_hash_seed=seed)
        sockets = {f"{name}_address": f"ipc://{name}" for name in ("input", "output", "worker")}
        return core_config(args, **sockets, log_level="WARNING")

    unseeded, seeded = config(None), config("s3cret")
    starts = [hash_seed(unseeded) for _ in range(2)] + [hash_seed(seeded) for _ in range(2)]
    hashes = [Request("r", PROMPT, BlockHasher(4, seed=seed)).block_hashes for seed in starts]
    assert hashes[0] != hashes[1]  # two starts without a seed
    assert hashes[2] == hashes[3]  # two replicas with the same seed
    assert hashes[0][0] != Request("r", PROMPT, BlockHasher(4)).block_hashes[0]


def test_a_digest_collision_is_never_a_hit(monkeypatch: pytest.MonkeyPatch) -> None:
    """Test hook: every block hashes to one digest. Blocks still hit only their own
    content (parent, tokens, extra keys), so another prompt can neither read nor poison
    them, even when several cached blocks share the digest."""
    from protocol import block_hash

    monkeypatch.setitem(block_hash._ALGOS, "xxh3_128", lambda data: b"\x00" * 16)
    m = make_manager(32)
    a = Request("a", tokens("ABCDEFGHI"), m.block_hasher)
    b = Request("b", tokens("JKLMNOPQR"), m.block_hasher)
    assert a.block_hashes == b.block_hashes  # the collision
    admit(m, a)
    assert m.get_computed_blocks(b)[1] == 0  # same digests, other tokens
    admit(m, b)  # b's blocks are cached under the same digest beside a's
    again = Request("a2", tokens("ABCDEFGHI"), m.block_hasher)
    hits, num = m.get_computed_blocks(again)
    assert num == 8 and [blk.block_id for blk in hits[0]] == m.get_block_ids("a")[0][:2]
    salted = Request("s", tokens("ABCDEFGHI"), m.block_hasher, cache_salt="t2")
    assert m.get_computed_blocks(salted)[1] == 0  # extra keys are content too
