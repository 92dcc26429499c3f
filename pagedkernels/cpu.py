"""Batched CPU paged attention: pagedkernels.reference's semantics and signatures, without a
Python loop per request in every layer.

Decode requests (one query row each) are sorted by key count and cut into chunks of about
CHUNK_BYTES of K; each chunk is one index_select of K's blocks, one of V's (whole blocks,
into reused scratch buffers) and one `scaled_dot_product_attention` call over the padded
[Bc, L] keys. Prefill/extend requests are a chunk each, gathered key by key (padding them
together never paid, see _build_chunks). A soft cap, which SDPA cannot express, takes an
explicit float32 path. Only blocks a request owns are read (released window blocks point
at a NaN-poisoned null block and lie before its first visible key); padding repeats the
request's own last block or key; a mask hides what is not a visible key, and the masked
keys of whole blocks are zeroed after the gather (a block's tail past the request's keys
may hold anything).

Where the C kernel (pagedkernels.cpu_native) is built, requests with at most
NATIVE_MAX_QUERIES queries (decodes, speculative verifies) skip all of that: it reads their
keys in place through the block table, without the copy, in one call for all of them.
Where its AVX-512 copies apply (float32, head size 64 or 128), every request does.

The plan (chunks, gather rows, masks) depends only on the batch layout, which every layer
of a forward shares; it is built once and reused while the metadata's contents match.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from pagedkernels import cpu_native
from pagedkernels.reference import write_kv_cache as _reference_write_kv_cache

# Gathered K (and again V) per decode chunk, bytes: the gathered K/V are still in cache
# when attention reads them, and the scratch buffers stay small. One layer, 32/8 heads,
# d 128, ms by chunk size 1/4/16/64 MiB: 256 x 512 keys 162/164/237/259, 32 x 264 keys
# 7.3/6.5/12.4/15.1 (one chunk for all, 64 MiB, is the slowest).
CHUNK_BYTES = 4 << 20
# Explicit (soft-cap) path: float32 logits per query slice, elements.
LOGITS_ELEMENTS = 16 << 20
# Requests with at most this many queries run in the C kernel when it is built: decodes,
# and speculative verifies of up to 8 drafts (a verify is its last token and its drafts),
# which it runs as one multi-query request, each key read once for all of its queries. The
# torch path gathers and pads each such request alone and calls SDPA for it; past about
# this many queries its matrix products win on long contexts (docs/benchmarks.md, "CPU
# attention").
NATIVE_MAX_QUERIES = 9
# Where the C kernel's AVX-512 copies apply (cpu_native.fast_path), every request goes to
# it, prefill chunks too: they beat this path at every length measured (docs/benchmarks.md,
# "CPU attention").
ALL_QUERIES = 1 << 30
# Plans kept: a step with full and sliding-window layers needs one per (table, window).
PLAN_CACHE_SIZE = 4


@dataclass
class _Chunk:
    """Requests attended together, padded to `num_queries` rows and `num_keys` keys."""

    num_reqs: int
    num_queries: int
    num_keys: int
    query_rows: torch.Tensor  # [Bc * N] int64 rows of `query`; padding repeats a real row
    out_rows: torch.Tensor  # [R] int64 rows of the output the valid queries fill
    valid: torch.Tensor | None  # [Bc * N] int64 indices of valid padded rows; None: all
    # [Bc * L] int64 per key (padding repeats the request's last key), with offsets; or,
    # with whole_blocks, [Bc * L / block_size] per block (offsets unused, empty).
    block_ids: torch.Tensor
    offsets: torch.Tensor
    mask: torch.Tensor | None  # [Bc, 1, N, L] bool visible; None: all visible
    is_causal: bool  # mask is the top-left causal triangle, which SDPA can skip blocks of
    # Decode chunks gather whole blocks, the keys of a request's partly visible first and
    # last blocks masked.
    whole_blocks: bool = False
    # Rows of the gathered [Bc * L] keys that are masked: zeroed after the gather, so
    # whatever a slot beyond a request's keys holds (a stale NaN or inf) never meets its
    # probability of 0 (0 * NaN is NaN).
    masked_rows: torch.Tensor | None = None
    _rows: dict[int, torch.Tensor] = field(default_factory=dict)

    def cache_rows(self, rows_per_block: int) -> torch.Tensor:
        rows = self._rows.get(rows_per_block)
        if rows is None:
            rows = self.block_ids * rows_per_block + self.offsets
            self._rows[rows_per_block] = rows
        return rows


@dataclass
class _Plan:
    query_start_loc: torch.Tensor
    seq_lens: torch.Tensor
    block_table: torch.Tensor
    # (query rows, block size, window, chunk tokens, most queries of a native request)
    key: tuple[int, int, int | None, int, int]
    chunks: list[_Chunk]
    # Requests the C kernel attends (int32), or None; the metadata as it takes it.
    native_reqs: torch.Tensor | None = None
    native_args: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None


_PLANS: list[_Plan] = []
_SCRATCH: dict[tuple[str, torch.dtype], torch.Tensor] = {}
# (slot mapping, (block size, rows per block), valid token indices or None, cache rows)
_SLOT_ROWS: list[tuple[torch.Tensor, tuple[int, int], torch.Tensor | None, torch.Tensor]] = []


def write_kv_cache(
    key: torch.Tensor,
    value: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    """Store token t's K/V [T, Hkv, D] in flat slot slot_mapping[t]; slot -1 is padding.

    One index_copy_ per cache into its row view, with the cache rows (and the valid
    tokens) derived once per step, not per layer: the reference's mask, division and
    two-index put cost 0.11 ms a layer for 32 decode tokens (3.4 ms a step over 30
    layers), 0.6 ms on two threads."""
    k_rows, v_rows = _row_view(key_cache), _row_view(value_cache)
    if k_rows is None or v_rows is None or k_rows[1] != v_rows[1]:
        _reference_write_kv_cache(key, value, key_cache, value_cache, slot_mapping)
        return
    valid, rows = _slot_rows(slot_mapping, key_cache.shape[1], k_rows[1])
    if valid is not None:
        key, value = key.index_select(0, valid), value.index_select(0, valid)
    k_rows[0].index_copy_(0, rows, key.to(key_cache.dtype))
    v_rows[0].index_copy_(0, rows, value.to(value_cache.dtype))


def _slot_rows(
    slot_mapping: torch.Tensor, block_size: int, rows_per_block: int
) -> tuple[torch.Tensor | None, torch.Tensor]:
    """(indices of the valid tokens, None when all are; their rows in _row_view), memoized
    on the slot mapping's contents like the plans (every layer of a group shares it)."""
    for i, (slots, key, valid, rows) in enumerate(_SLOT_ROWS):
        if key == (block_size, rows_per_block) and torch.equal(slots, slot_mapping):
            if i:
                _SLOT_ROWS.insert(0, _SLOT_ROWS.pop(i))
            return valid, rows
    slots = slot_mapping.long()
    valid_mask = slots >= 0
    valid = None if bool(valid_mask.all()) else torch.nonzero(valid_mask).flatten()
    if valid is not None:
        slots = slots.index_select(0, valid)
    rows = slots // block_size * rows_per_block + slots % block_size
    _SLOT_ROWS.insert(0, (slot_mapping.clone(), (block_size, rows_per_block), valid, rows))
    del _SLOT_ROWS[PLAN_CACHE_SIZE:]
    return valid, rows


def paged_attention(
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    block_table: torch.Tensor,
    query_start_loc: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    sliding_window: int | None = None,
    soft_cap: float | None = None,
    *,
    allow_native: bool = True,
) -> torch.Tensor:
    """pagedkernels.reference.paged_attention, batched (see the module docstring); allow_native
    False never calls the C kernel (the worker's config turned it off)."""
    _, num_q_heads, head_dim = query.shape
    block_size, num_kv_heads = key_cache.shape[1], key_cache.shape[2]
    if num_q_heads % num_kv_heads != 0:
        raise ValueError(f"query heads ({num_q_heads}) not a multiple of kv heads ({num_kv_heads})")
    chunk_tokens = max(1, CHUNK_BYTES // (num_kv_heads * head_dim * key_cache.element_size()))
    lib = cpu_native.library() if allow_native else None
    native = lib is not None and cpu_native.supports(query, key_cache, value_cache)
    native_max = 0
    if native:
        assert lib is not None
        fast = cpu_native.fast_path(lib, query, key_cache, soft_cap)
        native_max = ALL_QUERIES if fast else NATIVE_MAX_QUERIES
    plan = _plan_for(
        query_start_loc,
        seq_lens,
        block_table,
        (
            query.shape[0],
            block_size,
            sliding_window,
            chunk_tokens,
            native_max,
        ),
    )
    qf = query.float()
    if qf.stride(2) != 1:
        qf = qf.contiguous()
    if plan.native_reqs is not None:
        # Straight into the output when it is float32; other rows stay zero for the chunks.
        out32 = torch.zeros_like(qf) if query.dtype == torch.float32 else torch.zeros(qf.shape)
        table, starts, lens = plan.native_args
        cpu_native.paged_attention(
            lib, qf, key_cache, value_cache, table, starts, lens, plan.native_reqs,
            scale, sliding_window, soft_cap, out32,
        )  # fmt: skip
        out = out32 if query.dtype == torch.float32 else out32.to(query.dtype)
    else:
        out = torch.zeros_like(query)
    for chunk in plan.chunks:
        k = _gather(key_cache, chunk, "k")
        v = _gather(value_cache, chunk, "v")
        q = qf.index_select(0, chunk.query_rows)
        if soft_cap is not None:
            attended = _soft_capped(q, k, v, chunk, scale, soft_cap)
        elif chunk.num_queries == 1:
            attended = _decode(q, k, v, chunk, scale)
        else:
            attended = _prefill(q, k, v, chunk, scale)
        if chunk.valid is not None:
            attended = attended.index_select(0, chunk.valid)
        out.index_copy_(0, chunk.out_rows, attended.to(query.dtype))
    return out


def _decode(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, chunk: _Chunk, scale: float
) -> torch.Tensor:
    # One query row per request: its query heads that share a kv head become the rows of
    # one [group, L] problem, so K/V are read once per kv head without enable_gqa.
    bc, num_q_heads, head_dim = q.shape
    num_kv_heads = k.shape[2]
    q = q.view(bc, num_kv_heads, num_q_heads // num_kv_heads, head_dim)
    out = F.scaled_dot_product_attention(
        q, k.transpose(1, 2), v.transpose(1, 2), attn_mask=chunk.mask, scale=scale
    )
    return out.reshape(bc, num_q_heads, head_dim)


def _prefill(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, chunk: _Chunk, scale: float
) -> torch.Tensor:
    bc, n = chunk.num_reqs, chunk.num_queries
    num_q_heads, head_dim = q.shape[1], q.shape[2]
    q = q.view(bc, n, num_q_heads, head_dim).transpose(1, 2)
    out = F.scaled_dot_product_attention(
        q,
        k.transpose(1, 2),
        v.transpose(1, 2),
        attn_mask=chunk.mask,
        is_causal=chunk.is_causal,
        scale=scale,
        enable_gqa=True,
    )
    return out.transpose(1, 2).reshape(bc * n, num_q_heads, head_dim)


def _soft_capped(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    chunk: _Chunk,
    scale: float,
    soft_cap: float,
) -> torch.Tensor:
    # SDPA cannot cap logits. Grouped views as in the reference; query slices bound the
    # [Bc, Hq, n, L] logits.
    bc, n, length = chunk.num_reqs, chunk.num_queries, chunk.num_keys
    num_q_heads, head_dim = q.shape[1], q.shape[2]
    num_kv_heads = k.shape[2]
    q = q.view(bc, n, num_kv_heads, num_q_heads // num_kv_heads, head_dim)
    mask = chunk.mask
    if chunk.is_causal:
        mask = _tril(n).view(1, 1, n, n)
    if mask is not None:
        mask = mask.unsqueeze(1)  # [Bc, 1, 1, N, L]
    step = max(1, LOGITS_ELEMENTS // (bc * num_q_heads * length))
    parts = []
    for lo in range(0, n, step):
        logits = torch.einsum("bnhgd,blhd->bhgnl", q[:, lo : lo + step], k) * scale
        logits = soft_cap * torch.tanh(logits / soft_cap)
        if mask is not None:
            logits = logits.masked_fill(~mask[..., lo : lo + step, :], float("-inf"))
        probs = torch.softmax(logits, dim=-1)
        parts.append(torch.einsum("bhgnl,blhd->bnhgd", probs, v))
    out = parts[0] if len(parts) == 1 else torch.cat(parts, dim=1)
    return out.reshape(bc * n, num_q_heads, head_dim)


def _gather(cache: torch.Tensor, chunk: _Chunk, name: str) -> torch.Tensor:
    """The chunk's keys (or values) as float32 [Bc, L, Hkv, D], in a reused buffer:
    allocating it fresh each layer costs more than the gather (page faults)."""
    _, block_size, num_kv_heads, head_dim = cache.shape
    shape = (chunk.num_reqs, chunk.num_keys, num_kv_heads, head_dim)
    numel = shape[0] * shape[1] * num_kv_heads * head_dim
    dst = _scratch(name, numel, cache.dtype).view(-1, num_kv_heads, head_dim)
    rows = _row_view(cache)
    if chunk.whole_blocks:
        # One copy of block_size * Hkv * D contiguous values per block: a quarter less
        # time than row by row (13 MB of float32 K: 1.08 vs 1.42-1.57 ms, one thread).
        blocks = dst.view(-1, block_size, num_kv_heads, head_dim)
        torch.index_select(cache, 0, chunk.block_ids, out=blocks)
        if chunk.masked_rows is not None:
            dst.index_fill_(0, chunk.masked_rows, 0.0)
    elif rows is not None:
        view, rows_per_block = rows
        torch.index_select(view, 0, chunk.cache_rows(rows_per_block), out=dst)
    else:
        dst.copy_(cache[chunk.block_ids, chunk.offsets])
    if cache.dtype != torch.float32:
        # Half-precision caches are computed in float32, as the reference does.
        dst = _scratch(name + "32", numel, torch.float32).view_as(dst).copy_(dst)
    return dst.view(shape)


def _row_view(cache: torch.Tensor) -> tuple[torch.Tensor, int] | None:
    """The cache as [rows, Hkv, D] with slot (block, offset) at row block * m + offset,
    without a copy, also for strided views into a shared buffer (K and V interleaved per
    block); None when the block stride is not a multiple of the slot stride."""
    num_blocks, block_size, num_kv_heads, head_dim = cache.shape
    block_stride, slot_stride, head_stride, dim_stride = cache.stride()
    if block_size == 1:
        slot_stride = block_stride
    if num_blocks == 0 or slot_stride == 0 or block_stride % slot_stride != 0:
        return None
    m = block_stride // slot_stride
    size = ((num_blocks - 1) * m + block_size, num_kv_heads, head_dim)
    view = cache.as_strided(size, (slot_stride, head_stride, dim_stride), cache.storage_offset())
    return view, m


def _scratch(name: str, numel: int, dtype: torch.dtype) -> torch.Tensor:
    buf = _SCRATCH.get((name, dtype))
    if buf is None or buf.numel() < numel:
        # A normal tensor even when first made under inference_mode (the worker's
        # forward): written in place later outside it (tests, tools), an inference
        # tensor would refuse.
        with torch.inference_mode(False):
            buf = torch.empty(numel, dtype=dtype)
        _SCRATCH[(name, dtype)] = buf
    return buf[:numel]


def _plan_for(
    query_start_loc: torch.Tensor,
    seq_lens: torch.Tensor,
    block_table: torch.Tensor,
    key: tuple[int, int, int | None, int, int],
) -> _Plan:
    # Built once per step, not per layer: a plan costs 1.5 ms for 32 decode requests and
    # 14 ms for 256 (x 30 layers: 13% of a 32-request decode step), a hit 2-5 us. Matched
    # by contents, not identity: the worker's tensors share numpy memory that can change
    # without torch seeing it.
    for i, p in enumerate(_PLANS):
        if (
            p.key == key
            and torch.equal(p.query_start_loc, query_start_loc)
            and torch.equal(p.seq_lens, seq_lens)
            and torch.equal(p.block_table, block_table)
        ):
            if i:
                _PLANS.insert(0, _PLANS.pop(i))
            return p
    native_max = key[4]
    num_queries = query_start_loc[1:] - query_start_loc[:-1]
    native = (num_queries >= 1) & (num_queries <= native_max)
    plan = _Plan(
        query_start_loc.clone(),
        seq_lens.clone(),
        block_table.clone(),
        key,
        _build_chunks(query_start_loc, seq_lens, block_table, *key[1:4], skip=native),
    )
    if bool(native.any()):
        plan.native_reqs = torch.nonzero(native).flatten().to(torch.int32)
        # From the plan's own copies: the caller's tensors may share memory that the
        # worker rewrites for another step while this plan stays cached.
        plan.native_args = tuple(
            t.to(torch.int32).contiguous()
            for t in (plan.block_table, plan.query_start_loc, plan.seq_lens)
        )
    _PLANS.insert(0, plan)
    del _PLANS[PLAN_CACHE_SIZE:]
    return plan


def _build_chunks(
    query_start_loc: torch.Tensor,
    seq_lens: torch.Tensor,
    block_table: torch.Tensor,
    block_size: int,
    window: int | None,
    chunk_tokens: int,
    skip: torch.Tensor,
) -> list[_Chunk]:
    """The chunks of every request but those `skip` marks (the C kernel's)."""
    starts = query_start_loc[:-1].long()
    num_queries = query_start_loc[1:].long() - starts
    lens = seq_lens.long()
    first_query = lens - num_queries
    # Keys older than every query's window are never read: their blocks may be released.
    first_key = torch.zeros_like(lens)
    if window is not None:
        first_key = (first_query - window + 1).clamp(min=0)
    num_keys = lens - first_key
    table = block_table.long()
    reqs = (starts, num_queries, first_query, first_key, num_keys, table, block_size, window)

    chunks = []
    decode = torch.nonzero((num_queries == 1) & ~skip).flatten()
    # Blocks a decode request reads: its visible keys rounded out to whole blocks.
    first_block = first_key // block_size
    span = (lens + block_size - 1) // block_size - first_block
    decode = decode[torch.argsort(span[decode], descending=True, stable=True)]
    spans = span[decode].tolist()
    i = 0
    while i < len(spans):
        # Sorted longest first: spans[i] blocks is the chunk's padded length.
        n = max(1, chunk_tokens // (spans[i] * block_size))
        chunks.append(
            _decode_chunk(
                decode[i : i + n],
                starts,
                first_query,
                first_key,
                first_block,
                span,
                table,
                block_size,
            )
        )
        i += n
    # Prefill/extend requests: one chunk each. Padding them into one chunk never paid
    # (one thread, 32/8 heads, d 128, ms loop vs padded): 4 prefills x 128 21.5 vs 23.2,
    # 8 extends of 32 on 500 60 vs 68, 16 prefills x 16 2.3 vs 4.5, prefills of 16..256
    # 186 vs 600, 2048 prefill + extend 16 934 vs 3128. Padding costs masked work, and a
    # masked SDPA cannot skip the blocks above the diagonal as is_causal does.
    for b in torch.nonzero((num_queries > 1) & ~skip).flatten():
        chunks.append(_chunk(b.view(1), *reqs))
    return chunks


def _chunk(
    reqs: torch.Tensor,
    starts: torch.Tensor,
    num_queries: torch.Tensor,
    first_query: torch.Tensor,
    first_key: torch.Tensor,
    num_keys: torch.Tensor,
    table: torch.Tensor,
    block_size: int,
    window: int | None,
) -> _Chunk:
    n_req, count = num_queries[reqs, None], num_keys[reqs, None]  # [Bc, 1]
    n, length = int(n_req.max()), int(count.max())
    # Padding repeats the last real key / query, so it reads only what the request owns.
    key_idx = torch.arange(length).view(1, -1)
    key_pos = first_key[reqs, None] + torch.minimum(key_idx, count - 1)  # [Bc, L]
    block_ids = table[reqs].gather(1, key_pos // block_size)
    query_idx = torch.arange(n).view(1, -1)
    clamped = torch.minimum(query_idx, n_req - 1)  # [Bc, N]
    query_rows = starts[reqs, None] + clamped
    query_pos = first_query[reqs, None] + clamped

    distance = query_pos[:, :, None] - key_pos[:, None, :]  # [Bc, N, L]
    visible = (distance >= 0) & (key_idx < count)[:, None, :]
    if window is not None:
        visible &= distance < window
    is_causal = len(reqs) == 1 and n == length and torch.equal(visible[0], _tril(n))
    mask = None if is_causal or bool(visible.all()) else visible.unsqueeze(1)
    valid = (query_idx < n_req).flatten()
    all_valid = bool(valid.all())
    return _Chunk(
        num_reqs=len(reqs),
        num_queries=n,
        num_keys=length,
        query_rows=query_rows.flatten(),
        out_rows=query_rows.flatten()[valid],
        valid=None if all_valid else torch.nonzero(valid).flatten(),
        block_ids=block_ids.flatten(),
        offsets=(key_pos % block_size).flatten(),
        mask=mask,
        is_causal=is_causal,
    )


def _decode_chunk(
    reqs: torch.Tensor,
    starts: torch.Tensor,
    first_query: torch.Tensor,
    first_key: torch.Tensor,
    first_block: torch.Tensor,
    span: torch.Tensor,
    table: torch.Tensor,
    block_size: int,
) -> _Chunk:
    """Decode requests (one query each) over whole blocks: each request's blocks from the
    one holding its first visible key to the one holding its query, padded by repeating
    its last block; keys before the first visible one, after the query, and padding are
    masked. Only blocks the request owns are read (released window blocks lie before its
    first block), and the masked keys are zeroed after the gather: a slot beyond the
    request's keys may hold anything (NaN in tests, a previous owner's inf)."""
    count = span[reqs, None]  # [Bc, 1] blocks
    nb = int(count.max())
    block_idx = torch.arange(nb).view(1, -1)
    block_cols = first_block[reqs, None] + torch.minimum(block_idx, count - 1)
    whole_blocks = table[reqs].gather(1, block_cols)  # [Bc, nb]
    key_pos = first_block[reqs, None] * block_size + torch.arange(nb * block_size).view(1, -1)
    visible = (key_pos >= first_key[reqs, None]) & (key_pos <= first_query[reqs, None])
    visible &= (torch.arange(nb * block_size) < count * block_size).view(len(reqs), -1)
    rows = starts[reqs]
    all_visible = bool(visible.all())
    return _Chunk(
        num_reqs=len(reqs),
        num_queries=1,
        num_keys=nb * block_size,
        query_rows=rows,
        out_rows=rows,
        valid=None,
        block_ids=whole_blocks.flatten(),
        offsets=torch.empty(0, dtype=torch.int64),
        mask=None if all_visible else visible.view(len(reqs), 1, 1, -1),
        is_causal=False,
        whole_blocks=True,
        masked_rows=None if all_visible else torch.nonzero(~visible.flatten()).flatten(),
    )


def _tril(n: int) -> torch.Tensor:
    return torch.ones(n, n, dtype=torch.bool).tril()
