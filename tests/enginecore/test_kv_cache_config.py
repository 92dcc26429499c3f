"""enginecore/kv_cache_config.py: grouping layers by spec, pool sizing and unifying configs
from several workers (the specs themselves: tests/protocol/test_kv_cache.py)."""

from __future__ import annotations

import msgspec
import pytest

from enginecore import group_layers_by_spec, make_kv_cache_config, unify_kv_cache_configs
from protocol.kv_cache import KVCacheConfig, KVCacheSpec
from tests.helpers.kv_helpers import full, window


def test_configs_round_trip_on_the_wire() -> None:
    specs: dict[str, KVCacheSpec] = {"l0": full(16), "l1": window(64, 16), "l2": full(16)}
    config = make_kv_cache_config(specs, available_memory=1 << 20)
    data = msgspec.msgpack.encode(config)
    assert msgspec.msgpack.decode(data, type=KVCacheConfig) == config


def test_layers_group_by_spec_and_hybrid_groups_share_buffers() -> None:
    specs: dict[str, KVCacheSpec] = {
        "l0": window(64, 16),
        "l1": full(16),
        "l2": window(64, 16),
        "l3": full(16),
    }
    groups = group_layers_by_spec(specs)
    assert [g.layer_names for g in groups] == [["l0", "l2"], ["l1", "l3"]]
    page = full(16).page_size_bytes
    config = make_kv_cache_config(specs, available_memory=page * 2 * 100 + 5)
    assert config.num_blocks == 100
    assert [t.shared_by for t in config.kv_cache_tensors] == [["l0", "l1"], ["l2", "l3"]]
    assert all(t.size == page * 100 for t in config.kv_cache_tensors)


@pytest.mark.parametrize(
    ("kinds", "groups", "shared_by"),
    [
        # 5 sliding : 1 full (Gemma 3): six groups of one layer, one buffer for all.
        (
            "SSSSSF",
            [["l0"], ["l1"], ["l2"], ["l3"], ["l4"], ["l5"]],
            [["l0", "l1", "l2", "l3", "l4", "l5"]],
        ),
        # 3 : 2 does not divide: the sliding layers' second group is short (padded).
        ("SFSFS", [["l0", "l2"], ["l4"], ["l1", "l3"]], [["l0", "l4", "l1"], ["l2", "l3"]]),
        ("FFFF", [["l0", "l1", "l2", "l3"]], [["l0"], ["l1"], ["l2"], ["l3"]]),
    ],
)
def test_any_mix_of_layer_types_gets_equal_size_groups_that_share_buffers(
    kinds: str, groups: list[list[str]], shared_by: list[list[str]]
) -> None:
    specs: dict[str, KVCacheSpec] = {
        f"l{i}": window(64, 16) if k == "S" else full(16) for i, k in enumerate(kinds)
    }
    assert [g.layer_names for g in group_layers_by_spec(specs)] == groups
    page = full(16).page_size_bytes
    config = make_kv_cache_config(specs, available_memory=page * len(shared_by) * 50)
    assert config.num_blocks == 50  # a block id costs one page in each buffer
    assert [t.shared_by for t in config.kv_cache_tensors] == shared_by


def test_unify_takes_the_minimum_and_refuses_different_groups() -> None:
    specs: dict[str, KVCacheSpec] = {"l0": full(16), "l1": full(16)}
    a = make_kv_cache_config(specs, available_memory=full(16).page_size_bytes * 2 * 50)
    b = make_kv_cache_config(specs, available_memory=full(16).page_size_bytes * 2 * 40)
    assert unify_kv_cache_configs([a, b]).num_blocks == 40
    c = make_kv_cache_config({"l0": full(16), "l1": full(32)}, available_memory=1 << 22)
    with pytest.raises(ValueError, match="worker 1 reports KV cache groups that differ"):
        unify_kv_cache_configs([a, c])
    with pytest.raises(ValueError, match="at least 2 are needed"):
        make_kv_cache_config(specs, available_memory=10)
