"""CUDA launchers for the paged KV cache kernels, with pagedkernels.reference's signatures.

    from pagedkernels import cuda_kernels as K
    K.write_kv_cache(key, value, key_cache, value_cache, slot_mapping)
    out = K.paged_attention(query, key_cache, value_cache, block_table, query_start_loc,
                            seq_lens, scale, sliding_window=None, soft_cap=None)

The CUDA C sources in pagedkernels/cuda/ are compiled by CuPy's NVRTC at first use (one
module per element type and head dim) and cached by CuPy on disk; nothing is built at
install time. CuPy is imported inside the functions, never at module import, so this
module imports on a machine without CUDA. Tensors are passed by device address
(`tensor.data_ptr()`), so nothing is copied or converted, and every kernel runs on
`torch.cuda.current_stream()`; no launch synchronises with the host, so grids are sized
from tensor shapes and the kernels find their work on the device.

Supported: fp16 and bf16 (fp32 accumulate), the head dims of
pagedkernels.cuda_sources.ATTENTION_HEAD_DIMS (64/128/256 among them), any block size, GQA with
any group size, sliding window, soft cap, caches that are strided views (head_dim
contiguous, 16-byte aligned rows). `supports()` says whether a (dtype, head_dim) has a
kernel; callers fall back to pagedkernels.reference otherwise.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol

import torch

from pagedkernels.cuda_sources import (
    ATTENTION_HEAD_DIMS,
    ATTN_BLOCK_M,
    ATTN_THREADS,
    KV_WRITE_UNITS,
    REDUCE_MAX_SPLITS,
    KernelBuild,
    attention_build,
    attention_smem_bytes,
    base_options,
    cuda_include_dirs,
    kv_write_build,
)

LOG2E = 1.4426950408889634
KV_WRITE_THREADS = 128
# Split a tile's keys (flash-decoding) only while the grid fills less than this share of
# one wave of resident CTAs, and never into pieces shorter than MIN_KEYS_PER_SPLIT keys.
SPLIT_BELOW_WAVE_SHARE = 0.8
MIN_KEYS_PER_SPLIT = 256
# Among split counts, the fewest whose wave efficiency is within this share of the best.
SPLIT_EFFICIENCY_SHARE = 0.85
# Upper bound on the fp32 scratch of split partial outputs.
MAX_SPLIT_SCRATCH_BYTES = 512 << 20

_DTYPE_NAMES = {torch.float16: "float16", torch.bfloat16: "bfloat16"}


def supports(dtype: torch.dtype, head_dim: int) -> bool:
    """Whether paged_attention has a CUDA kernel for this element type and head size."""
    return dtype in _DTYPE_NAMES and head_dim in ATTENTION_HEAD_DIMS


# -- kernel arguments and backends ------------------------------------------------------


# Kernel arguments go to a backend as a flat tuple of values and a signature string, one
# character per argument: p (a tensor's device address, or None for NULL), i (int32),
# l (int64), f (float32). A launch then builds no object per argument: it is prepared
# once per layer per step on the host.
ATTENTION_SIGNATURE = "pllpp" + "lll" + "lll" + "pl" + "ppppp" + "iiiiii" + "fff" + "iiiii"
REDUCE_SIGNATURE = "pppp" + "iiii"
KV_WRITE_SIGNATURE = "ppppp" + "ii" + "l" * 10 + "i"


class Backend(Protocol):
    def launch(
        self,
        build: KernelBuild,
        kernel: str,
        grid: tuple[int, int, int],
        block: int,
        smem: int,
        signature: str,
        values: tuple[Any, ...],
        device: torch.device,
    ) -> None: ...

    def resident_ctas(
        self, build: KernelBuild, kernel: str, block: int, smem: int, device: torch.device
    ) -> int:
        """How many CTAs of this kernel the whole device runs at once (one wave)."""
        ...


class CupyBackend:
    """Compiles with CuPy (NVRTC) at first use and launches on torch's current stream."""

    def __init__(self) -> None:
        self._modules: dict[tuple[KernelBuild, int], Any] = {}
        self._functions: dict[tuple[KernelBuild, int, str], Any] = {}
        self._resident: dict[tuple[KernelBuild, int, str, int, int], int] = {}
        self._streams: dict[int, Any] = {}
        self._converters: dict[str, tuple[Any, ...]] = {}

    def resident_ctas(
        self, build: KernelBuild, kernel: str, block: int, smem: int, device: torch.device
    ) -> int:
        index = _device_index(device)
        key = (build, index, kernel, block, smem)
        resident = self._resident.get(key)
        if resident is None:
            import cupy

            fn = self._function(build, kernel, index, smem)
            with cupy.cuda.Device(index):
                per_sm = cupy.cuda.driver.occupancyMaxActiveBlocksPerMultiprocessor(
                    fn.kernel.ptr, block, smem
                )
            sms = torch.cuda.get_device_properties(index).multi_processor_count
            resident = self._resident[key] = max(1, per_sm) * sms
        return resident

    def _function(self, build: KernelBuild, kernel: str, index: int, smem: int) -> Any:
        key = (build, index, kernel)
        fn = self._functions.get(key)
        if fn is None:
            import cupy

            module = self._modules.get((build, index))
            if module is None:
                module = self._compile(cupy, build, index)
                self._modules[(build, index)] = module
            with cupy.cuda.Device(index):
                fn = module.get_function(kernel)
                if smem > 48 * 1024:
                    fn.max_dynamic_shared_size_bytes = smem
            self._functions[key] = fn
        return fn

    @staticmethod
    def _compile(cupy: Any, build: KernelBuild, index: int) -> Any:
        # CuPy adds the include path of the CUDA it runs on (it needs cuda_fp16.h itself);
        # only if that fails, try the headers of an installed nvidia-cuda-runtime wheel,
        # so that NVRTC and the headers normally come from the same CUDA.
        options = [*base_options(), *build.define_options()]
        with cupy.cuda.Device(index):
            try:
                module = cupy.RawModule(code=build.code(), options=tuple(options))
                module.compile()
                return module
            except Exception as exc:
                include = cuda_include_dirs()
                if not include or "cuda_" not in str(exc):
                    raise
            module = cupy.RawModule(code=build.code(), options=(*options, f"-I{include[0]}"))
            module.compile()
            return module

    def launch(
        self,
        build: KernelBuild,
        kernel: str,
        grid: tuple[int, int, int],
        block: int,
        smem: int,
        signature: str,
        values: tuple[Any, ...],
        device: torch.device,
    ) -> None:
        import cupy

        index = _device_index(device)
        fn = self._function(build, kernel, index, smem)
        converters = self._converters.get(signature)
        if converters is None:
            converters = self._converters[signature] = _numpy_converters(signature)
        if len(values) != len(converters):
            raise ValueError(f"{kernel}: {len(values)} arguments for signature {signature}")
        # numpy scalars carry the exact C types (NumPy 2 refuses an int32 out of range).
        args = tuple(convert(v) for convert, v in zip(converters, values))
        torch_stream = torch.cuda.current_stream(device)
        handle = torch_stream.cuda_stream
        stream = self._streams.get(handle)
        if stream is None:
            stream = self._streams[handle] = _wrap_stream(cupy, torch_stream, index)
        with cupy.cuda.Device(index), stream:
            fn(grid, (block, 1, 1), args, shared_mem=smem)


def _numpy_converters(signature: str) -> tuple[Any, ...]:
    import numpy as np

    def address(t: torch.Tensor | None) -> Any:
        return np.uint64(0 if t is None else t.data_ptr())

    kinds = {"p": address, "i": np.int32, "l": np.int64, "f": np.float32}
    return tuple(kinds[c] for c in signature)


def _wrap_stream(cupy: Any, torch_stream: torch.cuda.Stream, index: int) -> Any:
    """A CuPy view of torch's stream (torch keeps owning it): the CUDA stream protocol
    where CuPy has it (14+), else ExternalStream, which 14 deprecates."""
    from_external = getattr(cupy.cuda.Stream, "from_external", None)
    if from_external is not None and hasattr(torch_stream, "__cuda_stream__"):
        return from_external(torch_stream)
    return cupy.cuda.ExternalStream(torch_stream.cuda_stream, index)


def _device_index(device: torch.device) -> int:
    return device.index if device.index is not None else torch.cuda.current_device()


_CUPY_BACKEND: CupyBackend | None = None


def cuda_backend() -> CupyBackend:
    global _CUPY_BACKEND
    if _CUPY_BACKEND is None:
        _CUPY_BACKEND = CupyBackend()
    return _CUPY_BACKEND


# -- cache write ------------------------------------------------------------------------


def _check_last_dim_contiguous(name: str, t: torch.Tensor) -> None:
    if t.stride(-1) != 1:
        raise ValueError(f"{name} must be contiguous along head_dim, got strides {t.stride()}")


def _kv_write_unit(*sizes: int) -> int:
    """The widest access (16 bytes down to 1) that divides every size and address."""
    g = math.gcd(*sizes)
    return KV_WRITE_UNITS[0] if g == 0 else min(KV_WRITE_UNITS[0], g & -g)


def write_kv_cache_with(
    backend: Backend,
    key: torch.Tensor,
    value: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    num_tokens, num_heads, head_dim = key.shape
    if num_tokens == 0:
        return
    block_size = key_cache.shape[1]
    if key_cache.shape[2:] != (num_heads, head_dim) or value_cache.shape != key_cache.shape:
        raise ValueError(
            f"key {tuple(key.shape)} does not fit caches {tuple(key_cache.shape)} / "
            f"{tuple(value_cache.shape)}"
        )
    if value.shape != key.shape:
        raise ValueError(f"value {tuple(value.shape)} != key {tuple(key.shape)}")
    if slot_mapping.shape[0] < num_tokens:
        raise ValueError(f"slot_mapping has {slot_mapping.shape[0]} slots for {num_tokens} tokens")
    if value_cache.dtype != key_cache.dtype:
        raise ValueError("key_cache and value_cache dtypes differ")
    # As the reference: the new rows take the cache's dtype (a no-op in the worker).
    key = key.to(key_cache.dtype)
    value = value.to(key_cache.dtype)
    if key.stride(-1) != 1:
        key = key.contiguous()
    if value.stride(-1) != 1:
        value = value.contiguous()
    _check_last_dim_contiguous("key_cache", key_cache)
    _check_last_dim_contiguous("value_cache", value_cache)
    slots = slot_mapping[:num_tokens].to(torch.int64).contiguous()

    elem = key_cache.element_size()
    k0, k1 = key.stride(0) * elem, key.stride(1) * elem
    v0, v1 = value.stride(0) * elem, value.stride(1) * elem
    kc0, kc1, kc2, _ = key_cache.stride()
    vc0, vc1, vc2, _ = value_cache.stride()
    kc0, kc1, kc2 = kc0 * elem, kc1 * elem, kc2 * elem
    vc0, vc1, vc2 = vc0 * elem, vc1 * elem, vc2 * elem
    unit = _kv_write_unit(
        head_dim * elem, k0, k1, v0, v1, kc0, kc1, kc2, vc0, vc1, vc2,
        key.data_ptr(), value.data_ptr(), key_cache.data_ptr(), value_cache.data_ptr(),
    )  # fmt: skip
    values = (
        key, value, key_cache, value_cache, slots,
        num_heads, head_dim * elem // unit,
        k0, k1, v0, v1, kc0, kc1, kc2, vc0, vc1, vc2,
        block_size,
    )  # fmt: skip
    backend.launch(
        kv_write_build(),
        _KV_WRITE_KERNELS[unit],
        (num_tokens, 1, 1),
        KV_WRITE_THREADS,
        0,
        KV_WRITE_SIGNATURE,
        values,
        key.device,
    )


_KV_WRITE_KERNELS = {unit: f"kv_cache_write_u{8 * unit}" for unit in KV_WRITE_UNITS}


# -- paged attention --------------------------------------------------------------------


@dataclass(frozen=True)
class AttentionPlan:
    """How one paged_attention call is laid out on the GPU (see paged_attention.cu)."""

    heads_per_cta: int  # query heads of one GQA group that one CTA packs into its rows
    head_chunks: int  # CTAs along a group with more heads than fit one tile
    tokens_per_tile: int
    grid: tuple[int, int, int]  # (tiles upper bound, kv heads * head_chunks, splits)
    num_splits: int


def choose_splits(ctas: int, resident_ctas: int, max_splits: int) -> int:
    """How many pieces to split each tile's keys into, for a grid of `ctas` CTAs on a
    device that runs `resident_ctas` at once.

    A grid that fills most of a wave stays whole. Otherwise more splits fill more of the
    device, but each adds a partial output to reduce, and a last wave that is only partly
    full leaves SMs idle while it runs: take the fewest splits whose wave efficiency
    (CTAs / (waves rounded up * resident)) is close to the best one on offer."""
    if max_splits <= 1 or ctas >= SPLIT_BELOW_WAVE_SHARE * resident_ctas:
        return 1

    def efficiency(splits: int) -> float:
        waves = ctas * splits / resident_ctas
        return waves / math.ceil(waves)

    best = max(efficiency(s) for s in range(1, max_splits + 1))
    return next(
        s for s in range(1, max_splits + 1) if efficiency(s) >= SPLIT_EFFICIENCY_SHARE * best
    )


@functools.lru_cache(maxsize=256)  # every layer of a step asks the same question
def plan_attention(
    num_tokens: int,
    num_reqs: int,
    num_q_heads: int,
    num_kv_heads: int,
    head_dim: int,
    max_context: int,
    sliding_window: int | None,
    resident_ctas: int,
    num_splits: int | None = None,
) -> AttentionPlan:
    """Grid and split count from shapes alone (no device values, so no synchronisation).

    max_context bounds every request's length (block table width * block size);
    resident_ctas is how many attention CTAs the device runs at once; num_splits, when
    given, overrides the choice (benchmarks compare split counts with it).
    """
    group = num_q_heads // num_kv_heads
    heads_per_cta = min(group, ATTN_BLOCK_M)
    head_chunks = math.ceil(group / heads_per_cta)
    tpt = ATTN_BLOCK_M // heads_per_cta
    # Tiles: sum_b ceil(n_b / tpt) <= (T + B (tpt - 1)) / tpt, and never more than T.
    tiles = max(1, min(num_tokens, (num_tokens + num_reqs * (tpt - 1)) // tpt))
    ctas = tiles * num_kv_heads * head_chunks
    span = max_context if sliding_window is None else min(max_context, sliding_window + tpt - 1)
    per_split_bytes = num_tokens * num_q_heads * (head_dim + 1) * 4
    max_splits = min(
        math.ceil(span / MIN_KEYS_PER_SPLIT),
        REDUCE_MAX_SPLITS,
        MAX_SPLIT_SCRATCH_BYTES // max(1, per_split_bytes),
    )
    if num_splits is None:
        splits = choose_splits(ctas, resident_ctas, max_splits)
    elif 1 <= num_splits <= REDUCE_MAX_SPLITS:
        splits = num_splits
    else:
        raise ValueError(f"num_splits must be in [1, {REDUCE_MAX_SPLITS}], got {num_splits}")
    grid = (tiles, num_kv_heads * head_chunks, splits)
    return AttentionPlan(heads_per_cta, head_chunks, tpt, grid, splits)


def plan_for(
    backend: Backend,
    query: torch.Tensor,
    key_cache: torch.Tensor,
    block_table: torch.Tensor,
    seq_lens: torch.Tensor,
    sliding_window: int | None = None,
    num_splits: int | None = None,
) -> AttentionPlan:
    """The plan paged_attention_with launches for these arguments."""
    num_tokens, num_q_heads, head_dim = query.shape
    _, block_size, num_kv_heads, _ = key_cache.shape
    build = attention_build(_DTYPE_NAMES[query.dtype], head_dim)
    smem = attention_smem_bytes(head_dim)
    return plan_attention(
        num_tokens,
        seq_lens.shape[0],
        num_q_heads,
        num_kv_heads,
        head_dim,
        block_table.shape[1] * block_size,
        sliding_window,
        backend.resident_ctas(build, "paged_attention", ATTN_THREADS, smem, query.device),
        num_splits,
    )


def _aligned_rows(t: torch.Tensor) -> bool:
    """Last dim contiguous; every row of head_dim starts on a 16-byte boundary."""
    *outer, last = t.stride()
    return last == 1 and math.gcd(t.data_ptr(), t.element_size() * math.gcd(*outer)) % 16 == 0


def paged_attention_with(
    backend: Backend,
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
    num_splits: int | None = None,
) -> torch.Tensor:
    _check_attention_args(query, key_cache, value_cache, sliding_window, soft_cap)
    num_tokens, num_q_heads, head_dim = query.shape
    _, block_size, num_kv_heads, _ = key_cache.shape
    num_reqs = seq_lens.shape[0]
    out = torch.empty(query.shape, dtype=query.dtype, device=query.device)
    if num_tokens == 0:
        return out
    if num_reqs == 0:
        return out.zero_()
    if block_table.shape[0] < num_reqs or query_start_loc.shape[0] < num_reqs + 1:
        raise ValueError("block_table / query_start_loc have fewer rows than seq_lens")

    if not _aligned_rows(query):
        query = query.contiguous()
    for name, cache in (("key_cache", key_cache), ("value_cache", value_cache)):
        if not _aligned_rows(cache):
            raise ValueError(
                f"{name} rows must be contiguous and 16-byte aligned, strides {cache.stride()}"
            )
    block_table = block_table.to(torch.int32)
    if block_table.stride(1) != 1:
        block_table = block_table.contiguous()
    query_start_loc = query_start_loc.to(torch.int32).contiguous()
    seq_lens = seq_lens.to(torch.int32).contiguous()

    build = attention_build(_DTYPE_NAMES[query.dtype], head_dim)
    smem = attention_smem_bytes(head_dim)
    plan = plan_for(backend, query, key_cache, block_table, seq_lens, sliding_window, num_splits)
    part_o, part_lse = _split_partials(plan.num_splits, query)

    cap_scale = 0.0 if soft_cap is None else scale / soft_cap
    cap_log2 = 0.0 if soft_cap is None else soft_cap * LOG2E
    kc0, kc1, kc2, _ = key_cache.stride()
    vc0, vc1, vc2, _ = value_cache.stride()
    values = (
        query, query.stride(0), query.stride(1), key_cache, value_cache,
        kc0, kc1, kc2, vc0, vc1, vc2,
        block_table, block_table.stride(0),
        query_start_loc, seq_lens, out, part_o, part_lse,
        num_reqs, num_tokens, num_q_heads, num_kv_heads, block_size,
        block_size.bit_length() - 1 if block_size & (block_size - 1) == 0 else -1,
        scale * LOG2E, cap_scale, cap_log2,
        sliding_window or 0, plan.num_splits, plan.tokens_per_tile, plan.heads_per_cta,
        plan.head_chunks,
    )  # fmt: skip
    backend.launch(
        build,
        "paged_attention",
        plan.grid,
        ATTN_THREADS,
        smem,
        ATTENTION_SIGNATURE,
        values,
        query.device,
    )
    if plan.num_splits > 1:
        reduce_values = (
            part_o, part_lse, out, query_start_loc,
            num_reqs, num_tokens, num_q_heads, plan.num_splits,
        )  # fmt: skip
        grid = (num_tokens * num_q_heads, 1, 1)
        args = (build, "paged_attention_reduce", grid, head_dim, 0, REDUCE_SIGNATURE)
        backend.launch(*args, reduce_values, query.device)
    return out


def _split_partials(
    num_splits: int, query: torch.Tensor
) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """Split-K partial outputs [splits, T, H, D] and log-sum-exps [splits, T, H], float32;
    none without splits."""
    if num_splits <= 1:
        return None, None
    num_tokens, num_q_heads, head_dim = query.shape
    shape = (num_splits, num_tokens, num_q_heads)
    part_o = torch.empty((*shape, head_dim), dtype=torch.float32, device=query.device)
    return part_o, torch.empty(shape, dtype=torch.float32, device=query.device)


def _check_attention_args(
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    sliding_window: int | None,
    soft_cap: float | None,
) -> None:
    """ValueError (NotImplementedError for what no kernel covers) unless the shapes,
    dtypes and options fit the CUDA kernel."""
    _, num_q_heads, head_dim = query.shape
    _, _, num_kv_heads, cache_head_dim = key_cache.shape
    if num_q_heads % num_kv_heads != 0:
        raise ValueError(f"query heads ({num_q_heads}) not a multiple of kv heads ({num_kv_heads})")
    if cache_head_dim != head_dim or value_cache.shape != key_cache.shape:
        raise ValueError(
            f"query {tuple(query.shape)} does not fit caches {tuple(key_cache.shape)} / "
            f"{tuple(value_cache.shape)}"
        )
    if not (query.dtype == key_cache.dtype == value_cache.dtype):
        raise ValueError(
            f"query, key_cache, value_cache dtypes differ: {query.dtype}, {key_cache.dtype}, "
            f"{value_cache.dtype}"
        )
    if not supports(query.dtype, head_dim):
        raise NotImplementedError(
            f"no CUDA paged_attention for {query.dtype} with head_dim {head_dim}; "
            "use pagedkernels.reference"
        )
    if sliding_window is not None and sliding_window < 1:
        raise ValueError(f"sliding_window must be >= 1, got {sliding_window}")
    if soft_cap is not None and not soft_cap > 0:
        raise ValueError(f"soft_cap must be > 0, got {soft_cap}")


@dataclass(frozen=True)
class BoundKernels:
    """The kernels with pagedkernels.reference's signatures, launched through one backend
    (looked up at each call, so it is made at first use)."""

    backend: Callable[[], Backend]

    def write_kv_cache(
        self,
        key: torch.Tensor,
        value: torch.Tensor,
        key_cache: torch.Tensor,
        value_cache: torch.Tensor,
        slot_mapping: torch.Tensor,
    ) -> None:
        """Store token t's K/V [T, Hkv, D] in flat slot slot_mapping[t]; slot -1 is padding."""
        write_kv_cache_with(self.backend(), key, value, key_cache, value_cache, slot_mapping)

    def paged_attention(
        self,
        query: torch.Tensor,
        key_cache: torch.Tensor,
        value_cache: torch.Tensor,
        block_table: torch.Tensor,
        query_start_loc: torch.Tensor,
        seq_lens: torch.Tensor,
        scale: float,
        sliding_window: int | None = None,
        soft_cap: float | None = None,
    ) -> torch.Tensor:
        """Causal attention of a mixed batch over paged K/V; see
        pagedkernels.reference.paged_attention."""
        return paged_attention_with(
            self.backend(),
            query,
            key_cache,
            value_cache,
            block_table,
            query_start_loc,
            seq_lens,
            scale,
            sliding_window,
            soft_cap,
        )


_CUDA = BoundKernels(cuda_backend)
write_kv_cache = _CUDA.write_kv_cache
paged_attention = _CUDA.paged_attention
