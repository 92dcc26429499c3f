"""pagedkernels/selection.py: which kernel family a worker's attention choice gets on a device,
and every combination that cannot run refused by name (the environment's part is in
test_cpu.py and test_cuda_kernels.py)."""

from __future__ import annotations

import pytest
import torch

from pagedkernels import cpu, cuda_emulator, reference
from pagedkernels.selection import KERNELS_ENV, select_kernels

CPU = torch.device("cpu")


def test_the_reference_choice_gets_the_torch_reference_kernels() -> None:
    chosen = select_kernels(CPU, torch.float32, 64, "reference")
    assert chosen.name == "torch reference"
    assert chosen.write_kv_cache is reference.write_kv_cache
    assert chosen.paged_attention is reference.paged_attention


@pytest.mark.parametrize("choice", ["auto", "cpu"])
def test_on_the_cpu_auto_and_cpu_get_the_batched_kernels_without_native_if_told(
    choice: str,
) -> None:
    chosen = select_kernels(CPU, torch.bfloat16, 72, choice, native=False)  # type: ignore[arg-type]
    assert chosen.name == "torch cpu (batched)"
    assert chosen.write_kv_cache is cpu.write_kv_cache
    assert chosen.paged_attention.func is cpu.paged_attention  # type: ignore[attr-defined]
    assert chosen.paged_attention.keywords == {"allow_native": False}  # type: ignore[attr-defined]


def test_emulated_runs_the_cuda_sources_on_the_cpu_for_half_precision() -> None:
    chosen = select_kernels(CPU, torch.float16, 128, "emulated")
    assert chosen.paged_attention is cuda_emulator.paged_attention
    assert chosen.write_kv_cache is cuda_emulator.write_kv_cache


@pytest.mark.parametrize(
    ("device", "dtype", "choice", "message"),
    [
        (CPU, torch.float32, "tpu", f"{KERNELS_ENV} must be one of"),
        (CPU, torch.float32, "cuda", "=cuda needs a CUDA device, the worker runs on cpu"),
        (torch.device("meta"), torch.float32, "cpu", "=cpu needs the CPU device"),
        (CPU, torch.float32, "emulated", "the worker has torch.float32 with head_dim 64"),
    ],
)
def test_a_choice_the_device_or_dtype_cannot_run_is_refused_by_name(
    device: torch.device, dtype: torch.dtype, choice: str, message: str
) -> None:
    with pytest.raises(ValueError, match=message):
        select_kernels(device, dtype, 64, choice)  # type: ignore[arg-type]
