"""protocol/block_hash.py: each full block's hash chains to its parent, checked against
hashlib's sha256 over the documented bytes (parent, little-endian uint32 tokens, extra
keys); the bulk hasher equals the reference form."""

from __future__ import annotations

import hashlib
import struct

import pytest

from protocol.block_hash import (
    BlockHasher,
    hash_block_tokens,
    pack_token_ids,
    root_hash,
)


def _sha(data: bytes) -> bytes:
    return hashlib.sha256(data).digest()


def test_tokens_pack_as_little_endian_uint32() -> None:
    assert pack_token_ids([1, 2**32 - 1]) == struct.pack("<II", 1, 2**32 - 1)
    for bad in ([-1], [2**32], [1.5]):
        with pytest.raises(ValueError, match=r"token ids must be integers in \[0, 2\*\*32\)"):
            pack_token_ids(bad)  # type: ignore[arg-type]


def test_a_full_block_hash_chains_to_its_parent() -> None:
    hasher = BlockHasher(2, "sha256")
    root = _sha(b"pagedserve block-hash root v1")
    assert hasher.root == root == root_hash("sha256")
    hashes: list[bytes] = []
    inputs: list[bytes] = []
    hasher.extend(hashes, [1, 2, 3, 4, 5], hash_inputs=inputs)  # the 5th fills no block
    first = _sha(root + struct.pack("<II", 1, 2))
    second = _sha(first + struct.pack("<II", 3, 4))
    assert hashes == [first, second]
    assert inputs == [root + struct.pack("<II", 1, 2), first + struct.pack("<II", 3, 4)]


def test_growing_a_request_hashes_only_the_new_blocks_and_matches_the_reference() -> None:
    hasher = BlockHasher(3)
    tokens = list(range(20))
    grown: list[bytes] = []
    for n in range(1, len(tokens) + 1):
        hasher.extend(grown, tokens[:n])
    parent, want = hasher.root, []
    for i in range(0, 18, 3):
        parent = hash_block_tokens("xxh3_128", parent, tokens[i : i + 3])
        want.append(parent)
    assert grown == want


def test_equal_blocks_after_different_prefixes_hash_differently() -> None:
    hasher = BlockHasher(2)
    a: list[bytes] = []
    b: list[bytes] = []
    hasher.extend(a, [1, 2, 7, 8])
    hasher.extend(b, [1, 3, 7, 8])
    assert a[0] != b[0] and a[1] != b[1]


def test_extra_keys_and_the_seed_change_the_hash() -> None:
    hasher = BlockHasher(2, "sha256")
    plain: list[bytes] = []
    salted: list[bytes] = []
    hasher.extend(plain, [1, 2])
    hasher.extend(salted, [1, 2], lambda start, end: (("salt", "x"),) if start == 0 else None)
    assert salted[0] == _sha(hasher.root + struct.pack("<II", 1, 2) + b"\xff(('salt', 'x'),)")
    assert salted != plain
    assert BlockHasher(2, seed=b"s").root != BlockHasher(2).root
    assert BlockHasher(2, seed=b"s").root == BlockHasher(2, seed=b"s").root


def test_a_salt_enters_hashes_as_a_fixed_size_digest_keyed_by_the_root() -> None:
    hasher = BlockHasher(2)
    digest = hasher.salt_digest("x" * 100_000)
    assert len(digest) == 64 and digest == hasher.salt_digest("x" * 100_000)
    assert digest != hasher.salt_digest("x" * 99_999 + "y")
    # Without the deployment's secret, a subscriber cannot test a guess of the salt.
    assert BlockHasher(2, seed=b"s").salt_digest("t") != hasher.salt_digest("t")
    assert BlockHasher(2, seed=b"s").salt_digest("t") == BlockHasher(2, seed=b"s").salt_digest("t")


def test_bad_settings_are_refused_by_name() -> None:
    with pytest.raises(ValueError, match="block_size must be >= 1, got 0"):
        BlockHasher(0)
    with pytest.raises(ValueError, match="unknown block hash algorithm 'md5'"):
        BlockHasher(4, "md5")  # type: ignore[arg-type]
