"""Chained block hashes: hash(parent_hash, block_token_ids, extra_keys) from a seeded root.

Block i of a request matches only if blocks 0..i all match, token for token and extra
key for extra key. Hashes are bytes, identical in every process (they are published in
KV events): tokens are packed as little-endian uint32, extra keys by a canonical repr.
It lives in protocol/ because both sides compute it: the core keys its cache by it, and a
KV-aware router hashes a prompt the same way to find the replica holding its prefix.
"""

from __future__ import annotations

import hashlib
import sys
from array import array
from collections.abc import Callable

from xxhash import xxh3_128_digest

from protocol.config import HashAlgo

HASH_ALGOS: tuple[str, ...] = ("xxh3_128", "sha256")

# Extra keys of one block: ("lora", id), ("mm", hash, offset), ("embeds", hash),
# ("salt", salt_digest(salt)); None when the block has none (the common case, kept free
# of work).
ExtraKeys = tuple[tuple, ...] | None

_NEED_BYTESWAP = sys.byteorder != "little"
# Separates the fixed-size token bytes from extra-key bytes.
_EXTRA_MARK = b"\xff"


def _sha256(data: bytes) -> bytes:
    return hashlib.sha256(data).digest()


_ALGOS: dict[str, Callable[[bytes], bytes]] = {"xxh3_128": xxh3_128_digest, "sha256": _sha256}


def root_hash(algo: HashAlgo, seed: bytes | None = None) -> bytes:
    """The parent of every first block. An engine passes a per-deployment secret seed
    (random at each start unless fixed), so nobody outside can predict block hashes and
    craft prompts that collide with another tenant's cached blocks; replicas behind one
    KV-aware router share a seed. Without one the root is fixed (tests, tools)."""
    return _ALGOS[algo](b"pagedserve block-hash root v1" + (seed or b""))


def salt_digest(salt: str, root: bytes = b"") -> str:
    """A cache salt as block hashes and KV events carry it: 64 hex digits of BLAKE2b-256
    keyed by the chain's root. A salt can be any size; cached blocks outlive requests, so
    they keep this instead. Collision-resistant whatever the block-hash algorithm (equal
    salts share blocks, different ones never do), and keyed so that a subscriber to the
    events cannot test guesses of a tenant's salt without the deployment's secret."""
    key = root[:64]  # BLAKE2b's longest key; roots are 16 or 32 bytes
    return hashlib.blake2b(
        salt.encode("utf-8", "surrogatepass"), digest_size=32, key=key
    ).hexdigest()


def pack_token_ids(token_ids: list[int]) -> bytes:
    """Token ids as little-endian uint32 bytes; a clear error for ids outside that range."""
    try:
        packed = array("I", token_ids)
    except (OverflowError, TypeError) as e:
        raise ValueError(f"token ids must be integers in [0, 2**32): {e}") from None
    if packed.itemsize != 4:  # pragma: no cover - every platform we ship to has 4-byte uint
        packed = array("L", token_ids)
    if _NEED_BYTESWAP:  # pragma: no cover - big-endian hosts
        packed.byteswap()
    return packed.tobytes()


def _discard(_data: bytes) -> None:
    pass


def encode_extra_keys(extra_keys: ExtraKeys) -> bytes:
    if extra_keys is None:
        return b""
    return _EXTRA_MARK + repr(extra_keys).encode()


def hash_block_tokens(
    algo: HashAlgo, parent_hash: bytes, token_ids: list[int], extra_keys: ExtraKeys = None
) -> bytes:
    """One block's hash (the reference form; BlockHasher does the same in bulk)."""
    return _ALGOS[algo](parent_hash + pack_token_ids(token_ids) + encode_extra_keys(extra_keys))


class BlockHasher:
    """Grows a request's block hashes as its blocks fill: each full block hashed once."""

    __slots__ = ("_fn", "algo", "block_size", "root")

    def __init__(
        self, block_size: int, algo: HashAlgo = "xxh3_128", seed: bytes | None = None
    ) -> None:
        if block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {block_size}")
        if algo not in _ALGOS:
            raise ValueError(f"unknown block hash algorithm {algo!r}; expected one of {HASH_ALGOS}")
        self.block_size = block_size
        self.algo = algo
        self._fn = _ALGOS[algo]
        self.root = root_hash(algo, seed)

    def salt_digest(self, salt: str) -> str:
        return salt_digest(salt, self.root)

    def extend(
        self,
        block_hashes: list[bytes],
        token_ids: list[int],
        extra_keys_of: Callable[[int, int], ExtraKeys] | None = None,
        hash_inputs: list[bytes] | None = None,
    ) -> None:
        """Append the hashes of the blocks of token_ids that became full since last time,
        and to hash_inputs the exact bytes each was hashed from (parent hash, tokens,
        extra keys): a prefix hit compares them, so equal digests alone never match.

        extra_keys_of(start, end) gives a block's extra keys; None means no block has any.
        """
        bs = self.block_size
        first = len(block_hashes)
        last = len(token_ids) // bs
        if last <= first:
            return
        packed = pack_token_ids(token_ids[first * bs : last * bs])
        width = 4 * bs
        fn = self._fn
        parent = block_hashes[-1] if first else self.root
        append = block_hashes.append
        keep = _discard if hash_inputs is None else hash_inputs.append
        if extra_keys_of is None:
            for off in range(0, (last - first) * width, width):
                data = parent + packed[off : off + width]
                parent = fn(data)
                append(parent)
                keep(data)
            return
        for i in range(first, last):
            off = (i - first) * width
            data = parent + packed[off : off + width]
            data += encode_extra_keys(extra_keys_of(i * bs, (i + 1) * bs))
            parent = fn(data)
            append(parent)
            keep(data)
