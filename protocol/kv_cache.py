"""KV-cache specs and the KVCacheConfig: wire types that workers report and the core answers.

A worker describes each attention layer with a spec; layers with equal specs form one
KV cache group, and the core builds one block pool for all groups from these.
"""

from __future__ import annotations

import msgspec

# The block id both sides reserve as the null block: a permanent placeholder for positions
# a sliding window has left (never allocated, freed, hashed, written or read).
NULL_BLOCK_ID = 0

_DTYPE_SIZES = {"float32": 4, "float16": 2, "bfloat16": 2, "float8_e4m3fn": 1, "float8_e5m2": 1}


def dtype_size(dtype: str) -> int:
    try:
        return _DTYPE_SIZES[dtype]
    except KeyError:
        raise ValueError(
            f"unsupported KV-cache dtype {dtype!r}; expected one of {sorted(_DTYPE_SIZES)}"
        ) from None


class FullAttentionSpec(msgspec.Struct, frozen=True, tag="full_attention"):
    """Every token's K/V is kept for the life of the request."""

    block_size: int
    num_kv_heads: int
    head_size: int
    dtype: str

    def __post_init__(self) -> None:
        _check_attention_spec(self)

    @property
    def page_size_bytes(self) -> int:
        """Bytes one block occupies in one layer: K and V for block_size tokens."""
        return 2 * self.block_size * self.num_kv_heads * self.head_size * dtype_size(self.dtype)


class SlidingWindowSpec(msgspec.Struct, frozen=True, tag="sliding_window"):
    """A query at position p reads keys at positions p - sliding_window + 1 .. p only."""

    block_size: int
    num_kv_heads: int
    head_size: int
    dtype: str
    sliding_window: int

    def __post_init__(self) -> None:
        _check_attention_spec(self)
        if self.sliding_window < 1:
            raise ValueError(f"sliding_window must be >= 1, got {self.sliding_window}")

    @property
    def page_size_bytes(self) -> int:
        return 2 * self.block_size * self.num_kv_heads * self.head_size * dtype_size(self.dtype)


KVCacheSpec = FullAttentionSpec | SlidingWindowSpec


def _check_attention_spec(spec: FullAttentionSpec | SlidingWindowSpec) -> None:
    for name in ("block_size", "num_kv_heads", "head_size"):
        value = getattr(spec, name)
        if value < 1:
            raise ValueError(f"{type(spec).__name__}.{name} must be >= 1, got {value}")
    dtype_size(spec.dtype)


class KVCacheGroupSpec(msgspec.Struct, frozen=True):
    """Layers that share one spec, and so one block table per request."""

    layer_names: list[str]
    kv_cache_spec: KVCacheSpec


class KVCacheTensor(msgspec.Struct, frozen=True):
    """One buffer of `size` bytes on a worker, shared by the layers named (one per group)."""

    size: int
    shared_by: list[str]


class KVCacheConfig(msgspec.Struct, frozen=True):
    """What the core tells every worker to allocate: num_blocks counts the null block 0."""

    num_blocks: int
    kv_cache_groups: list[KVCacheGroupSpec]
    kv_cache_tensors: list[KVCacheTensor] = []

    def __post_init__(self) -> None:
        if self.num_blocks < 2:
            raise ValueError(
                f"KVCacheConfig.num_blocks must be >= 2 (block 0 is the null block), "
                f"got {self.num_blocks}"
            )
        if not self.kv_cache_groups:
            raise ValueError("KVCacheConfig needs at least one KV cache group")
