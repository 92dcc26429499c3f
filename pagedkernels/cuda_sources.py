"""Where the CUDA kernel sources live and how each one is built.

One place for the build matrix, shared by the CuPy launchers (pagedkernels.cuda_kernels), the
compile check that CI runs without a GPU (pagedkernels.nvrtc_check) and the CPU emulator the
tests use (pagedkernels.cuda_emulator). Nothing here imports CuPy or needs a GPU.
"""

from __future__ import annotations

import functools
import os
import re
import sys
from dataclasses import dataclass
from pathlib import Path

CUDA_DIR = Path(__file__).resolve().parent / "cuda"

# Element types the attention kernel is built for, by torch dtype name.
SCALAR_TYPES: dict[str, str] = {"float16": "__half", "bfloat16": "__nv_bfloat16"}
# The head sizes paged_attention is built (and CI compile-checked) for: 64/128/256 and the
# other sizes common models use, plus 16 and 32 for the tests' tiny checkpoints. The source
# compiles for any multiple of 16 up to 256; the launchers refuse what CI does not check.
ATTENTION_HEAD_DIMS: tuple[int, ...] = (16, 32, 64, 80, 96, 128, 256)
CHECK_ARCHS: tuple[str, ...] = ("sm_80", "sm_90")

# Mirrors of the constants in paged_attention.cu (the launcher sizes grids with them).
ATTN_THREADS = 128
ATTN_BLOCK_M = 64
REDUCE_MAX_SPLITS = 64

KV_WRITE_UNITS: tuple[int, ...] = (16, 8, 4, 2, 1)  # bytes; kernel kv_cache_write_u{8*n}


def attention_block_n(head_dim: int) -> int:
    return 32 if head_dim > 128 else 64


def attention_smem_bytes(head_dim: int) -> int:
    """Dynamic shared memory of paged_attention: Q tile and two K and V stages, 2-byte elements."""
    pitch = head_dim + 8
    return (ATTN_BLOCK_M + 4 * attention_block_n(head_dim)) * pitch * 2


@dataclass(frozen=True)
class KernelBuild:
    """One compilation unit: a source file, its -D macros and the kernels it defines."""

    source: str
    defines: tuple[tuple[str, str], ...]
    kernels: tuple[str, ...]

    @property
    def path(self) -> Path:
        return CUDA_DIR / self.source

    def label(self) -> str:
        macros = " ".join(f"{k}={v}" for k, v in self.defines)
        return f"{self.source} [{macros}]" if macros else self.source

    def define_options(self) -> list[str]:
        return [f"-D{k}={v}" for k, v in self.defines]

    def code(self) -> str:
        """The source with local headers inlined (see expand_source)."""
        return expand_source(self.path)


# Headers that only the CPU emulator reads; left as #include lines for NVRTC.
_EMULATOR_ONLY = {"ps_emulate.h"}
_LOCAL_INCLUDE = re.compile(r'^\s*#\s*include\s+"([^"]+)"\s*$')


def expand_source(path: Path, _seen: set[Path] | None = None) -> str:
    """Inline `#include "x"` of files in CUDA_DIR, each once.

    The launchers hand CuPy one self-contained string: CuPy's on-disk kernel cache keys on
    the code and options, so a header edit must change the code it sees.
    """
    seen = set() if _seen is None else _seen
    seen.add(path)
    out: list[str] = []
    for line in path.read_text().splitlines():
        if line.strip() == "#pragma once":
            continue
        match = _LOCAL_INCLUDE.match(line)
        if match and match.group(1) not in _EMULATOR_ONLY:
            header = CUDA_DIR / match.group(1)
            if header not in seen:
                out.append(f"// ---- begin {match.group(1)}")
                out.append(expand_source(header, seen))
                out.append(f"// ---- end {match.group(1)}")
            continue
        out.append(line)
    return "\n".join(out) + "\n"


@functools.cache
def kv_write_build() -> KernelBuild:
    names = tuple(f"kv_cache_write_u{8 * n}" for n in KV_WRITE_UNITS)
    return KernelBuild("kv_cache_write.cu", (), names)


@functools.cache
def attention_build(dtype_name: str, head_dim: int) -> KernelBuild:
    if dtype_name not in SCALAR_TYPES:
        raise ValueError(f"paged_attention has no CUDA build for {dtype_name}")
    if head_dim not in ATTENTION_HEAD_DIMS:
        raise ValueError(
            f"paged_attention is built for head_dim in {ATTENTION_HEAD_DIMS}, got {head_dim}"
        )
    defines = (("PS_SCALAR", SCALAR_TYPES[dtype_name]), ("PS_HEAD_DIM", str(head_dim)))
    return KernelBuild("paged_attention.cu", defines, ("paged_attention", "paged_attention_reduce"))


def all_builds() -> list[KernelBuild]:
    """Every build the launchers can ask for: what CI compiles."""
    builds = [kv_write_build()]
    for dtype_name in SCALAR_TYPES:
        for head_dim in ATTENTION_HEAD_DIMS:
            builds.append(attention_build(dtype_name, head_dim))
    return builds


def base_options() -> list[str]:
    return ["--std=c++17"]


def cuda_include_dirs() -> list[Path]:
    """Directories that hold cuda_fp16.h / cuda_bf16.h, most specific first.

    NVRTC has no default include path: the headers come from the nvidia-cuda-runtime wheel
    (CUDA 13 lays them out as nvidia/cu13/include, CUDA 12 as nvidia/cuda_runtime/include),
    or from a toolkit named by CUDA_PATH / CUDA_HOME, or /usr/local/cuda.
    """
    candidates: list[Path] = []
    for entry in sys.path:
        base = Path(entry or ".") / "nvidia"
        candidates += [base / "cu13" / "include", base / "cuda_runtime" / "include"]
    for var in ("CUDA_PATH", "CUDA_HOME"):
        if os.environ.get(var):
            candidates.append(Path(os.environ[var]) / "include")
    candidates.append(Path("/usr/local/cuda/include"))
    found: list[Path] = []
    for path in candidates:
        if (path / "cuda_fp16.h").is_file() and path not in found:
            found.append(path)
    return found
