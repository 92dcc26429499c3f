"""Run the CUDA kernel sources on the CPU, for tests on machines without a GPU.

The .cu files build as C++ with -DPS_EMULATE (pagedkernels/cuda/ps_emulate.h stands in for
the CUDA intrinsics: threads as fibers, real barriers, warp shuffles and mma.sync through
an exchange buffer with the PTX fragment layouts, cp.async deferred to its wait). The
launchers are pagedkernels.cuda_kernels' own, so the grid planning, the split-K reduction and
every index the kernels compute are exercised; only speed and the hardware itself are
not. Slow (every thread is a fiber): keep problems small.

    from pagedkernels import cuda_emulator as E
    out = E.paged_attention(...)   # CPU fp16/bf16 tensors, same signature as the reference
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import shutil
import subprocess
import tempfile
from pathlib import Path
from typing import Any

import torch

from pagedkernels.cuda_kernels import BoundKernels
from pagedkernels.cuda_sources import CUDA_DIR, KernelBuild

# A small device, so that tests reach the split-K path with little work: 8 SMs that each
# hold 2 attention CTAs, as an H100's shared memory allows for head_dim 128.
EMULATED_SMS = 8
EMULATED_CTAS_PER_SM = 2
EMULATED_RESIDENT_CTAS = EMULATED_SMS * EMULATED_CTAS_PER_SM


MISSING_COMPILER = (
    "the CPU emulator of the CUDA kernels needs a C++17 compiler and found none: install "
    "g++ (Debian/Ubuntu: apt-get install g++) or point CXX at one"
)


def compiler() -> str | None:
    return os.environ.get("CXX") or shutil.which("g++") or shutil.which("c++")


class EmulatorBackend:
    def __init__(self) -> None:
        self._libs: dict[KernelBuild, ctypes.CDLL] = {}

    def resident_ctas(
        self, build: KernelBuild, kernel: str, block: int, smem: int, device: torch.device
    ) -> int:
        return EMULATED_RESIDENT_CTAS

    def _library(self, build: KernelBuild) -> ctypes.CDLL:
        lib = self._libs.get(build)
        if lib is not None:
            return lib
        cxx = compiler()
        if cxx is None:
            raise RuntimeError(MISSING_COMPILER)
        unit = f'#include "{build.source}"\n' + "".join(
            f"PS_EMU_EXPORT({k})\n" for k in build.kernels
        )
        digest = hashlib.sha256(unit.encode())
        for path in sorted(CUDA_DIR.iterdir()):
            digest.update(path.name.encode() + path.read_bytes())
        digest.update(" ".join(build.define_options()).encode())
        cache = Path(tempfile.gettempdir()) / "pagedserve-emulator"
        cache.mkdir(exist_ok=True)
        so = cache / f"{build.path.stem}-{digest.hexdigest()[:16]}.so"
        if not so.exists():
            src = cache / f"{so.stem}.cpp"
            src.write_text(unit)
            tmp = so.with_suffix(f".{os.getpid()}.tmp")
            cmd = [
                cxx,
                "-std=c++17",
                "-O1",
                "-g",
                "-fPIC",
                "-shared",
                "-fno-strict-aliasing",
                "-DPS_EMULATE",
                *build.define_options(),
                f"-I{CUDA_DIR}",
                str(src),
                "-o",
                str(tmp),
            ]
            proc = subprocess.run(cmd, capture_output=True, text=True)
            if proc.returncode != 0:
                raise RuntimeError(f"emulator build of {build.label()} failed:\n{proc.stderr}")
            os.replace(tmp, so)
        lib = ctypes.CDLL(str(so))
        lib.emu_error.restype = ctypes.c_char_p
        lib.emu_add_range.argtypes = [ctypes.c_ulonglong, ctypes.c_ulonglong]
        self._libs[build] = lib
        return lib

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
        if len(values) != len(signature):
            raise ValueError(f"{kernel}: {len(values)} arguments for signature {signature}")
        lib = self._library(build)
        lib.emu_clear_ranges()
        c_values: list[ctypes._SimpleCData] = []
        for kind, value in zip(signature, values):
            if kind == "p":
                if value is not None:
                    if value.device.type != "cpu":
                        raise ValueError("the emulator runs on CPU tensors")
                    storage = value.untyped_storage()
                    lib.emu_add_range(storage.data_ptr(), storage.nbytes())
                c_values.append(ctypes.c_void_p(0 if value is None else value.data_ptr()))
            elif kind == "i":
                if not -(2**31) <= value < 2**31:  # ctypes would wrap it silently
                    raise OverflowError(f"{value} does not fit a 32-bit kernel argument")
                c_values.append(ctypes.c_int32(value))
            elif kind == "l":
                c_values.append(ctypes.c_int64(value))
            else:
                c_values.append(ctypes.c_float(value))
        argv = (ctypes.c_void_p * len(c_values))(*(ctypes.addressof(v) for v in c_values))
        fn = getattr(lib, f"emu_{kernel}")
        fn.argtypes = [
            ctypes.c_uint,
            ctypes.c_uint,
            ctypes.c_uint,
            ctypes.c_uint,
            ctypes.c_ulonglong,
            ctypes.c_void_p,
        ]
        rc = fn(*grid, block, smem, argv)
        if rc != 0:
            raise RuntimeError(f"emulated {kernel}: {lib.emu_error().decode()}")


_BACKEND: EmulatorBackend | None = None


def backend() -> EmulatorBackend:
    global _BACKEND
    if _BACKEND is None:
        _BACKEND = EmulatorBackend()
    return _BACKEND


_EMULATED = BoundKernels(backend)
write_kv_cache = _EMULATED.write_kv_cache
paged_attention = _EMULATED.paged_attention
