"""protocol/kv_cache.py: a spec's page is K and V of a block in one layer, bad specs and
configs are refused by field, and a config round-trips on the wire with its spec tags."""

from __future__ import annotations

import msgspec
import pytest

from protocol.kv_cache import (
    FullAttentionSpec,
    KVCacheConfig,
    KVCacheGroupSpec,
    KVCacheTensor,
    SlidingWindowSpec,
    dtype_size,
)


def test_a_page_is_k_and_v_for_every_token_head_and_channel() -> None:
    # 2 (K, V) * 16 tokens * 4 heads * 64 channels * 2 bytes.
    assert FullAttentionSpec(16, 4, 64, "bfloat16").page_size_bytes == 16384
    assert SlidingWindowSpec(16, 4, 64, "float32", 128).page_size_bytes == 32768
    assert FullAttentionSpec(8, 1, 8, "float8_e4m3fn").page_size_bytes == 128
    # Llama-2-13B: 40 KV heads of 128 channels in float16, blocks of 16 tokens.
    assert FullAttentionSpec(16, 40, 128, "float16").page_size_bytes == 327_680
    assert dtype_size("float16") == 2


def test_a_config_round_trips_with_its_spec_kinds() -> None:
    config = KVCacheConfig(
        10,
        [
            KVCacheGroupSpec(["a"], FullAttentionSpec(16, 2, 64, "float16")),
            KVCacheGroupSpec(["b"], SlidingWindowSpec(16, 2, 64, "float16", 32)),
        ],
        [KVCacheTensor(1 << 20, ["a", "b"])],
    )
    wire = msgspec.msgpack.encode(config)
    assert msgspec.msgpack.decode(wire, type=KVCacheConfig) == config
    loose = msgspec.json.decode(msgspec.json.encode(config))
    kinds = [g["kv_cache_spec"]["type"] for g in loose["kv_cache_groups"]]
    assert kinds == ["full_attention", "sliding_window"]


@pytest.mark.parametrize(
    ("make", "message"),
    [
        (
            lambda: FullAttentionSpec(0, 1, 8, "float16"),
            "FullAttentionSpec.block_size must be >= 1",
        ),
        (lambda: FullAttentionSpec(4, 0, 8, "float16"), "num_kv_heads must be >= 1, got 0"),
        (lambda: FullAttentionSpec(4, 1, 8, "int4"), "unsupported KV-cache dtype 'int4'"),
        (lambda: SlidingWindowSpec(4, 1, 8, "float16", 0), "sliding_window must be >= 1, got 0"),
        (
            lambda: KVCacheConfig(
                1, [KVCacheGroupSpec(["a"], FullAttentionSpec(4, 1, 8, "float16"))]
            ),
            "num_blocks must be >= 2 \\(block 0 is the null block\\), got 1",
        ),
        (lambda: KVCacheConfig(4, []), "needs at least one KV cache group"),
    ],
)
def test_bad_specs_and_configs_are_refused_by_field(make: object, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        make()  # type: ignore[operator]


def test_a_bad_spec_is_refused_on_decode_too() -> None:
    wire = msgspec.json.encode(
        {
            "type": "full_attention",
            "block_size": 0,
            "num_kv_heads": 1,
            "head_size": 8,
            "dtype": "float16",
        }
    )
    with pytest.raises(msgspec.ValidationError, match="block_size must be >= 1"):
        msgspec.json.decode(wire, type=FullAttentionSpec)
