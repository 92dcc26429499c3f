"""The decoder's element-wise steps in C on the CPU (pagedkernels/csrc/elementwise_cpu.c):
RMSNorm (with the residual add before it), the rotary embedding in place, and silu(gate) *
up, for float32 tensors whose rows are contiguous. worker.layers calls them where a model
runs float32 on the CPU with the native library built (pagedkernels.cpu_native), and the
torch operators everywhere else; the results agree to float32 rounding.
"""

from __future__ import annotations

import ctypes

import torch

from pagedkernels import cpu_native

_I64, _F32, _P = ctypes.c_int64, ctypes.c_float, ctypes.c_void_p


class CpuElementwise:
    """The library's element-wise entry points, their argument types set once."""

    def __init__(self, lib: ctypes.CDLL) -> None:
        self._norm = lib.ps_rms_norm
        self._norm.argtypes = [_P, _I64, _P, _I64, _P, _I64, _I64, _F32, _P, _I64]
        self._norm.restype = None
        self._rope = lib.ps_rope
        self._rope.argtypes = [_P, _I64, _I64, _I64, _I64, _I64, _P, _P, _I64]
        self._rope.restype = None
        self._silu_mul = lib.ps_silu_mul
        self._silu_mul.argtypes = [_P, _I64, _P, _I64, _I64, _I64, _P, _I64]
        self._silu_mul.restype = None

    def rms_norm(
        self, x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None
    ) -> torch.Tensor:
        """x [rows, dim] normalised and scaled by weight, a new tensor; with residual
        [rows, dim], residual += x first (in place) and the sum is normalised."""
        rows, dim = x.shape
        out = torch.empty_like(x)
        res_ptr, res_stride = (None, 0)
        if residual is not None:
            res_ptr, res_stride = residual.data_ptr(), residual.stride(0)
        self._norm(
            x.data_ptr(), x.stride(0), res_ptr, res_stride,
            weight.data_ptr(), rows, dim, eps, out.data_ptr(), out.stride(0),
        )  # fmt: skip
        return out

    def rope_(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """x [T, H, D] (each head's D contiguous) rotated in place by cos/sin [T, D]."""
        tokens, heads, dim = x.shape
        self._rope(
            x.data_ptr(), tokens, heads, dim, x.stride(0), x.stride(1),
            cos.data_ptr(), sin.data_ptr(), cos.stride(0),
        )  # fmt: skip
        return x

    def silu_mul(self, gate: torch.Tensor, up: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
        """silu(gate) * up [rows, dim] into out (which may be gate); out."""
        rows, dim = gate.shape
        self._silu_mul(
            gate.data_ptr(), gate.stride(0), up.data_ptr(), up.stride(0),
            rows, dim, out.data_ptr(), out.stride(0),
        )  # fmt: skip
        return out


def load() -> CpuElementwise | None:
    """The kernels, or None where the native library is off or not built."""
    lib = cpu_native.library()
    return CpuElementwise(lib) if lib is not None else None
