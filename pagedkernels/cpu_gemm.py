"""Small-batch dense products in C on the CPU (pagedkernels/csrc/gemm_cpu.c): y = x W^T (+ b)
for a few rows of x, the weight packed once into panels of 16 output features. worker.gemm
runs decode-sized products through it where the native library is built for a CPU with
AVX-512, and oneDNN everywhere else; the results agree to float32 rounding (summation
order).
"""

from __future__ import annotations

import ctypes

import torch

from pagedkernels import cpu_native

_I64, _P = ctypes.c_int64, ctypes.c_void_p


class CpuGemm:
    """The library's product entry points, their argument types set once."""

    def __init__(self, lib: ctypes.CDLL) -> None:
        self._pack = lib.pg_pack
        self._pack.argtypes = [_P, _I64, _I64, _I64, _P]
        self._pack.restype = None
        self._linear = lib.pg_linear
        self._linear.argtypes = [_P, _I64, _I64, _I64, _P, _I64, _P, _P, _I64]
        self._linear.restype = ctypes.c_int

    def pack(self, weight: torch.Tensor) -> torch.Tensor:
        """weight [out, in] (float32) as panels [ceil(out / 16), in, 16], a new tensor."""
        w = weight.detach()
        if w.stride(1) != 1:
            w = w.contiguous()
        n, k = w.shape
        panels = torch.empty((n + 15) // 16, k, 16, dtype=torch.float32)
        self._pack(w.data_ptr(), n, k, w.stride(0), panels.data_ptr())
        return panels

    def linear(
        self, x: torch.Tensor, panels: torch.Tensor, out_features: int, bias: torch.Tensor | None
    ) -> torch.Tensor:
        """x [rows, in] (float32) times the weight packed in panels, plus bias: [rows, out]."""
        if x.stride(1) != 1:
            x = x.contiguous()
        rows, k = x.shape
        out = torch.empty(rows, out_features, dtype=torch.float32)
        code = self._linear(
            x.data_ptr(), rows, k, x.stride(0), panels.data_ptr(), out_features,
            None if bias is None else bias.data_ptr(), out.data_ptr(), out.stride(0),
        )  # fmt: skip
        if code != 0:
            raise MemoryError(f"the small-batch product could not allocate its scratch ({code})")
        return out


def load() -> CpuGemm | None:
    """The kernel, or None where the native library is off, not built, or built for a CPU
    without AVX-512."""
    lib = cpu_native.library()
    if lib is None:
        return None
    lib.pg_available.restype = ctypes.c_int
    return CpuGemm(lib) if lib.pg_available() else None
