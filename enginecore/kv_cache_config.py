"""Building one KVCacheConfig: group layers by spec, size the pool, unify across workers."""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from protocol.kv_cache import KVCacheConfig, KVCacheGroupSpec, KVCacheSpec, KVCacheTensor


def group_layers_by_spec(layer_specs: Mapping[str, KVCacheSpec]) -> list[KVCacheGroupSpec]:
    """KV cache groups (one block table per request each), in first-seen order of their
    spec, so every worker derives the same groups from the same model.

    Layers of one spec go together. With several specs, each spec's layers are cut into
    groups of one common size, the smallest spec's layer count: then groups can share
    buffers (tensor k serves layer k of every group, see plan_kv_cache_tensors) whatever
    the mix. A 5:1 sliding/full model gets five sliding groups and one full group of one
    layer each; where a count does not divide, the last group of that spec is short and
    its missing slots stay unused (padding, a little memory, instead of no sharing)."""
    if not layer_specs:
        raise ValueError("the model reported no attention layers")
    by_spec: dict[KVCacheSpec, list[str]] = {}
    for name, spec in layer_specs.items():
        by_spec.setdefault(spec, []).append(name)
    size = min(len(names) for names in by_spec.values())
    return [
        KVCacheGroupSpec(layer_names=names[i : i + size], kv_cache_spec=spec)
        for spec, names in by_spec.items()
        for i in range(0, len(names), size)
    ]


def make_kv_cache_config(
    layer_specs: Mapping[str, KVCacheSpec], available_memory: int
) -> KVCacheConfig:
    """The most blocks that fit in available_memory bytes (buffers as plan_kv_cache_tensors
    lays them out)."""
    groups = group_layers_by_spec(layer_specs)
    bytes_per_block = sum(t.size for t in plan_kv_cache_tensors(groups, 1))
    num_blocks = available_memory // bytes_per_block
    if num_blocks < 2:
        raise ValueError(
            f"{available_memory} bytes of KV-cache memory hold {num_blocks} blocks of "
            f"{bytes_per_block} bytes; at least 2 are needed (block 0 is the null block)"
        )
    return with_num_blocks(groups, num_blocks)


def with_num_blocks(groups: Sequence[KVCacheGroupSpec], num_blocks: int) -> KVCacheConfig:
    """The config of num_blocks blocks for these groups, buffers sized to match."""
    return KVCacheConfig(
        num_blocks=num_blocks,
        kv_cache_groups=list(groups),
        kv_cache_tensors=plan_kv_cache_tensors(groups, num_blocks),
    )


def plan_kv_cache_tensors(
    groups: Sequence[KVCacheGroupSpec], num_blocks: int
) -> list[KVCacheTensor]:
    """The worker buffers. Groups of equal page size share them: tensor k serves layer k
    of every group that has one, since a block id belongs to one group at a time (so a
    sliding-window group's freed blocks become full-attention capacity). Pages of
    different sizes cannot share: then every layer gets its own buffer."""
    page_sizes = {g.kv_cache_spec.page_size_bytes for g in groups}
    if len(page_sizes) == 1:
        page = page_sizes.pop()
        return [
            KVCacheTensor(
                size=page * num_blocks,
                shared_by=[g.layer_names[k] for g in groups if k < len(g.layer_names)],
            )
            for k in range(max(len(g.layer_names) for g in groups))
        ]
    return [
        KVCacheTensor(size=g.kv_cache_spec.page_size_bytes * num_blocks, shared_by=[name])
        for g in groups
        for name in g.layer_names
    ]


def unify_kv_cache_configs(configs: Sequence[KVCacheConfig]) -> KVCacheConfig:
    """One config for all workers: identical groups required, the minimum block count
    (buffers sized for it)."""
    if not configs:
        raise ValueError("no KV cache configs to unify")
    first = configs[0]
    for rank, config in enumerate(configs[1:], start=1):
        if config.kv_cache_groups != first.kv_cache_groups:
            raise ValueError(
                f"worker {rank} reports KV cache groups that differ from worker 0: "
                f"{_describe_difference(first.kv_cache_groups, config.kv_cache_groups)}"
            )
    return with_num_blocks(first.kv_cache_groups, min(c.num_blocks for c in configs))


def _describe_difference(a: list[KVCacheGroupSpec], b: list[KVCacheGroupSpec]) -> str:
    if len(a) != len(b):
        return f"{len(a)} groups vs {len(b)}"
    for i, (ga, gb) in enumerate(zip(a, b)):
        if ga.kv_cache_spec != gb.kv_cache_spec:
            return f"group {i} spec {ga.kv_cache_spec} vs {gb.kv_cache_spec}"
        if ga.layer_names != gb.layer_names:
            return f"group {i} layers {ga.layer_names} vs {gb.layer_names}"
    return "unknown difference"


def describe_spec_difference(
    a: Mapping[str, KVCacheSpec], b: Mapping[str, KVCacheSpec], limit: int = 3
) -> str | None:
    """How two workers' per-layer KV specs differ (None when equal), naming layers and
    fields, so a misconfigured rank is obvious from the message alone."""
    diffs = []
    for name in sorted(set(a) | set(b)):
        x, y = a.get(name), b.get(name)
        if x == y:
            continue
        if x is None or y is None:
            diffs.append(f"layer {name} only on {'the second' if x is None else 'the first'}")
        elif type(x) is not type(y):
            diffs.append(f"layer {name}: {type(x).__name__} vs {type(y).__name__}")
        else:
            fields = [
                f"{f} {getattr(x, f)} vs {getattr(y, f)}"
                for f in x.__struct_fields__
                if getattr(x, f) != getattr(y, f)
            ]
            diffs.append(f"layer {name}: {', '.join(fields)}")
    if not diffs:
        return None
    more = f" (and {len(diffs) - limit} more)" if len(diffs) > limit else ""
    return "; ".join(diffs[:limit]) + more
