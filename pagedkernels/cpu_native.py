"""The CPU paged-attention kernel in C (pagedkernels/csrc/paged_attention_cpu.c), built with the
machine's C compiler at first use and cached, called through ctypes.

It reads K/V in place through the block table. The batched torch path (pagedkernels.cpu) copies
every key of a decode batch into a padded buffer and reads it again; for SmolLM2's decode
step of 64 requests that copy was half of the attention time. Without a compiler (or with
PAGEDSERVE_NATIVE_KERNELS=0) pagedkernels.cpu runs alone, with the same results.

The library links libgomp by soname; loaded into a process that already holds torch, it
shares torch's OpenMP runtime, so torch.set_num_threads (worker/cpu_threads.py) sizes its
parallel regions too and no second pool of spinning threads competes for the cores.
"""

from __future__ import annotations

import ctypes
import fcntl
import functools
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import tempfile
from pathlib import Path

import torch

from protocol import envs

log = logging.getLogger("pagedserve.kernels")

# One library: the attention kernel, the decoder's element-wise steps, small-batch products.
SOURCES = tuple(
    Path(__file__).resolve().parent / "csrc" / name
    for name in (
        "paged_attention_cpu.c",
        "paged_attention_fast.c",
        "elementwise_cpu.c",
        "gemm_cpu.c",
    )
)
# Included by the sources: part of what a build is cached by.
HEADERS = (Path(__file__).resolve().parent / "csrc" / "paged_attention_cpu.h",)
NATIVE_ENV = envs.NATIVE_KERNELS  # 0: never build or load the library
CACHE_ENV = envs.CACHE_DIR
# -march=native: the library is built on the machine that runs it. -fno-math-errno lets
# expf/tanhf become libmvec's vector calls; nothing else of -ffast-math is wanted (NaN and
# inf must behave as in the reference).
CFLAGS = ("-O3", "-march=native", "-fopenmp", "-fno-math-errno", "-fPIC", "-shared")
LIBS = ("-lmvec", "-lm") if platform.machine() == "x86_64" else ("-lm",)
DTYPES = {torch.float32: 0, torch.bfloat16: 1, torch.float16: 2}
MAX_GROUP, MAX_HEAD_DIM = 64, 512  # the C source's limits

_I64, _I32, _F32, _P = ctypes.c_int64, ctypes.c_int, ctypes.c_float, ctypes.c_void_p
_SIGNATURE = (
    [_P, _I64, _I64]  # query, token and head strides
    + [_P, _I64, _I64, _I64] * 2  # key and value caches with block, slot, head strides
    + [_I32, _P, _I64, _P, _I32, _P, _P]  # dtype, table, its stride, reqs, count, qsl, lens
    + [_I32, _I32, _I32, _I32, _F32, _I32, _F32]  # heads, kv heads, d, block, scale, window, cap
    + [_P, _I64, _I64]  # out and its strides
)


def cache_dir() -> Path:
    root = envs.cache_dir()
    if root:
        return Path(root) / "kernels"
    xdg = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(xdg) / "pagedserve" / "kernels"


def enabled() -> bool:
    return envs.native_kernels()


def library() -> ctypes.CDLL | None:
    """The built library, or None: turned off (read at each call, so a benchmark or test can
    switch), or not built (why is logged once)."""
    return _load() if enabled() else None


@functools.cache
def _load() -> ctypes.CDLL | None:
    """Build (once per source, flags, compiler and CPU model) and load."""
    compiler = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    if compiler is None:
        log.warning("no C compiler found: CPU attention runs the batched torch path only")
        return None
    try:
        path = _build(compiler)
        lib = ctypes.CDLL(str(path))
    except (OSError, subprocess.SubprocessError) as exc:
        log.warning("CPU attention kernel not built (%s): the batched torch path runs", exc)
        return None
    lib.ps_paged_attention.argtypes = _SIGNATURE
    lib.ps_paged_attention.restype = ctypes.c_int
    lib.ps_max_threads.restype = ctypes.c_int
    lib.ps_fast_path.argtypes = [_I32, _I32, _I32, _I32, _F32]
    lib.ps_fast_path.restype = ctypes.c_int
    lib.ps_set_fast_copies.argtypes = [_I32]
    lib.ps_set_fast_copies.restype = None
    if lib.ps_max_threads() != torch.get_num_threads():
        # Correct still, but a second pool of threads beside torch's that the thread tuner
        # does not size (a torch built with another OpenMP runtime).
        log.warning(
            "the CPU attention kernel has its own OpenMP runtime (%d threads, torch %d)",
            lib.ps_max_threads(),
            torch.get_num_threads(),
        )
    return lib


def _build(compiler: str) -> Path:
    version = subprocess.run(
        [compiler, "--version"], capture_output=True, text=True, check=True, timeout=60
    ).stdout
    key = hashlib.sha256()
    sources = b"".join(path.read_bytes() for path in (*SOURCES, *HEADERS))
    for part in (sources, " ".join(CFLAGS + LIBS).encode(), version.encode()):
        key.update(part)
    # -march=native differs per machine model; a shared home directory must not hand one
    # machine's build to another.
    key.update(_cpu_model().encode())
    target = cache_dir() / f"paged_attention_cpu-{key.hexdigest()[:16]}.so"
    if target.exists():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    with open(target.parent / "build.lock", "w") as lock:
        # Tensor-parallel ranks start together: one builds, the others wait and load it.
        fcntl.flock(lock, fcntl.LOCK_EX)
        if target.exists():
            return target
        log.info("building the CPU attention kernel (once per machine): %s", target)
        fd, tmp = tempfile.mkstemp(suffix=".so", dir=target.parent)
        os.close(fd)
        try:
            done = subprocess.run(
                [compiler, *CFLAGS, "-o", tmp, *map(str, SOURCES), *LIBS],
                capture_output=True,
                text=True,
                timeout=300,
            )
            if done.returncode != 0:
                raise OSError(f"{compiler} failed: {done.stderr.strip()[-2000:]}")
            # A reader never sees half a library: the finished file is renamed into place.
            os.replace(tmp, target)
        finally:
            if os.path.exists(tmp):
                os.unlink(tmp)
    log.info("built %s", target)
    return target


def _cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            return "".join(line for line in f if line.startswith(("model name", "flags")))
    except OSError:
        return platform.processor()


def supports(query: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor) -> bool:
    num_q_heads, head_dim = query.shape[1], query.shape[2]
    num_kv_heads = key_cache.shape[2]
    return (
        key_cache.dtype in DTYPES
        and value_cache.dtype == key_cache.dtype
        and key_cache.stride(3) == 1
        and value_cache.stride(3) == 1
        and num_q_heads // num_kv_heads <= MAX_GROUP
        and head_dim <= MAX_HEAD_DIM
    )


def fast_path(
    lib: ctypes.CDLL, query: torch.Tensor, key_cache: torch.Tensor, soft_cap: float | None
) -> bool:
    """Whether the library's AVX-512 copies take this call (float32, head size 64 or 128,
    blocks of a multiple of 16 slots, no soft cap): they run prefill chunks faster than the
    batched torch path, so every request of the call goes to the C kernel."""
    num_q_heads, head_dim = query.shape[1], query.shape[2]
    block_size, num_kv_heads = key_cache.shape[1], key_cache.shape[2]
    return _fast_path(
        lib, DTYPES[key_cache.dtype], head_dim, num_q_heads // num_kv_heads, block_size,
        soft_cap or 0.0,
    )  # fmt: skip


def set_fast_copies(lib: ctypes.CDLL, on: bool) -> None:
    """Turns the AVX-512 copies off or back on in this process (benchmarks time the generic
    copies against them)."""
    lib.ps_set_fast_copies(int(on))
    _fast_path.cache_clear()


@functools.cache
def _fast_path(
    lib: ctypes.CDLL, dtype: int, head_dim: int, group: int, block_size: int, soft_cap: float
) -> bool:
    return bool(lib.ps_fast_path(dtype, head_dim, group, block_size, soft_cap))


def paged_attention(
    lib: ctypes.CDLL,
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    block_table: torch.Tensor,
    query_start_loc: torch.Tensor,
    seq_lens: torch.Tensor,
    reqs: torch.Tensor,
    scale: float,
    sliding_window: int | None,
    soft_cap: float | None,
    out: torch.Tensor,
) -> None:
    """Attention of the requests `reqs` (int32) into their rows of `out`, with
    pagedkernels.reference.paged_attention's semantics. query and out: float32 [T, Hq, D], last
    dimension contiguous; block_table, query_start_loc, seq_lens: int32, rows contiguous."""
    num_q_heads, head_dim = query.shape[1], query.shape[2]
    block_size, num_kv_heads = key_cache.shape[1], key_cache.shape[2]
    kb, ks, kh, _ = key_cache.stride()
    vb, vs, vh, _ = value_cache.stride()
    code = lib.ps_paged_attention(
        query.data_ptr(), query.stride(0), query.stride(1),
        key_cache.data_ptr(), kb, ks, kh,
        value_cache.data_ptr(), vb, vs, vh,
        DTYPES[key_cache.dtype],
        block_table.data_ptr(), block_table.stride(0),
        reqs.data_ptr(), reqs.shape[0],
        query_start_loc.data_ptr(), seq_lens.data_ptr(),
        num_q_heads, num_kv_heads, head_dim, block_size,
        scale, sliding_window or 0, soft_cap or 0.0,
        out.data_ptr(), out.stride(0), out.stride(1),
    )  # fmt: skip
    if code != 0:
        raise RuntimeError(f"CPU paged attention refused its arguments (code {code})")
