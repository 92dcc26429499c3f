"""The CUDA-free control plane: requests, block hashing, KV-cache ownership, scheduling.

Nothing in this package may import torch or cupy (tests/enginecore/test_enginecore_imports.py).
"""

from enginecore.block_pool import BlockPool
from enginecore.errors import InvariantViolation
from enginecore.kv_cache_block import FreeKVCacheBlockQueue, KVCacheBlock
from enginecore.kv_cache_config import (
    group_layers_by_spec,
    make_kv_cache_config,
    unify_kv_cache_configs,
)
from enginecore.kv_cache_coordinator import KVCacheBlocks
from enginecore.kv_cache_manager import KVCacheManager, PrefixCacheStats
from enginecore.kv_invariants import BrokenInvariant
from enginecore.request import MultiModalPlaceholder, Request
from protocol.block_hash import BlockHasher

__all__ = [
    "BlockHasher",
    "BlockPool",
    "BrokenInvariant",
    "FreeKVCacheBlockQueue",
    "InvariantViolation",
    "KVCacheBlock",
    "KVCacheBlocks",
    "KVCacheManager",
    "MultiModalPlaceholder",
    "PrefixCacheStats",
    "Request",
    "group_layers_by_spec",
    "make_kv_cache_config",
    "unify_kv_cache_configs",
]
