"""worker.gemm: oneDNN products with prepacked weights, and the small-batch C kernel's
(pagedkernels.cpu_gemm), equal F.linear (the oracle)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from pagedkernels import cpu_gemm, cpu_native
from worker import gemm

# The library is built with -march=native: the small-batch kernel exists where the CPU has
# AVX-512 (and a C compiler, part of the setup).
HAS_AVX512 = " avx512f" in Path("/proc/cpuinfo").read_text()

needs_onednn = pytest.mark.skipif(
    not torch.backends.mkldnn.is_available(), reason="this torch build has no oneDNN"
)


@needs_onednn
@pytest.mark.parametrize("rows", [1, 3, 16, 129, 600])
@pytest.mark.parametrize("bias", [False, True])
def test_packed_products_equal_f_linear(rows: int, bias: bool) -> None:
    torch.manual_seed(rows)
    weight = torch.randn(96, 40)
    b = torch.randn(96) if bias else None
    packed = gemm.pack(weight)
    for x in (torch.randn(rows, 40), torch.randn(rows, 50)[:, 5:45], torch.randn(2, rows, 40)):
        got = gemm.packed_linear(x, packed, b)
        torch.testing.assert_close(got, F.linear(x, weight, b), rtol=1e-5, atol=1e-5)
    with torch.inference_mode():
        got = gemm.packed_linear(torch.ones(rows, 40), packed, b)
    torch.testing.assert_close(got, F.linear(torch.ones(rows, 40), weight, b))


def test_choice(monkeypatch: pytest.MonkeyPatch) -> None:
    cpu = torch.device("cpu")
    assert not gemm.use_onednn(torch.device("meta"), torch.float32)
    monkeypatch.setenv(gemm.CPU_GEMM_ENV, "torch")
    assert not gemm.use_onednn(cpu, torch.float32)
    monkeypatch.setenv(gemm.CPU_GEMM_ENV, "auto")
    assert gemm.use_onednn(cpu, torch.float32) == torch.backends.mkldnn.is_available()
    assert not gemm.use_onednn(cpu, torch.float16)
    monkeypatch.setenv(gemm.CPU_GEMM_ENV, "onednn")
    with pytest.raises(ValueError, match=r"cannot run torch\.float16"):
        gemm.use_onednn(cpu, torch.float16)
    monkeypatch.setenv(gemm.CPU_GEMM_ENV, "mkl")
    with pytest.raises(ValueError, match="must be one of auto, onednn, torch"):
        gemm.use_onednn(cpu, torch.float32)


@pytest.fixture
def small(monkeypatch: pytest.MonkeyPatch) -> cpu_gemm.CpuGemm:
    monkeypatch.setenv(cpu_native.NATIVE_ENV, "1")
    kernel = cpu_gemm.load()
    assert (kernel is not None) == HAS_AVX512
    if kernel is None:
        pytest.skip("no AVX-512 on this CPU: the small-batch kernel is not built here")
    return kernel


@needs_onednn
@pytest.mark.parametrize("rows", [1, 3, 16, 17, 40, gemm.SMALL_BATCH_ROWS, 65])
@pytest.mark.parametrize("shape", [(96, 40), (37, 200), (16, 1), (576, 1536)])
def test_small_batch_products_equal_f_linear(
    small: cpu_gemm.CpuGemm, rows: int, shape: tuple[int, int]
) -> None:
    # Output features past the last whole panel of 16 (37), rows past a block of 16, rows
    # of x strided, with and without a bias.
    torch.manual_seed(rows)
    out_features, in_features = shape
    weight = torch.randn(out_features, in_features)
    packed = gemm.pack(weight, small)
    assert packed.panels is not None and packed.panels.shape == (
        -(-out_features // 16),
        in_features,
        16,
    )
    for b in (None, torch.randn(out_features)):
        wide = torch.randn(rows, in_features + 7)
        for x in (torch.randn(rows, in_features), wide[:, 3 : 3 + in_features]):
            got = small.linear(x, packed.panels, out_features, b)
            torch.testing.assert_close(got, F.linear(x, weight, b), rtol=1e-5, atol=5e-4)
            torch.testing.assert_close(
                gemm.packed_linear(x, packed, b), F.linear(x, weight, b), rtol=1e-5, atol=5e-4
            )


@needs_onednn
def test_decode_sized_products_take_the_small_batch_kernel(
    small: cpu_gemm.CpuGemm, monkeypatch: pytest.MonkeyPatch
) -> None:
    weight = torch.randn(48, 32)
    packed = gemm.pack(weight, small)
    calls: list[int] = []
    real = small.linear

    def counted(x: torch.Tensor, *args: object) -> torch.Tensor:
        calls.append(x.shape[0])
        return real(x, *args)  # type: ignore[arg-type]

    monkeypatch.setattr(small, "linear", counted)
    for rows in (1, gemm.SMALL_BATCH_ROWS, gemm.SMALL_BATCH_ROWS + 1):
        gemm.packed_linear(torch.randn(rows, 32), packed, None)
    gemm.packed_linear(torch.randn(2, 3, 32), packed, None)  # not 2-D: oneDNN
    assert calls == [1, gemm.SMALL_BATCH_ROWS]


def test_the_small_batch_kernel_only_under_auto_for_float32(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv(cpu_native.NATIVE_ENV, "1")
    built = gemm.small_batch_kernel(torch.float32, "auto", True)
    assert (built is not None) == HAS_AVX512
    assert gemm.small_batch_kernel(torch.float32, "onednn", True) is None
    assert gemm.small_batch_kernel(torch.float32, "torch", True) is None
    assert gemm.small_batch_kernel(torch.bfloat16, "auto", True) is None
    assert gemm.small_batch_kernel(torch.float32, "auto", False) is None
    # Its copy of the weights may take a quarter of the available memory, not more.
    fits = gemm.small_batch_kernel(torch.float32, "auto", True, 1 << 30, 4 << 30)
    assert (fits is not None) == HAS_AVX512
    assert gemm.small_batch_kernel(torch.float32, "auto", True, (1 << 30) + 1, 4 << 30) is None
    monkeypatch.setenv(cpu_native.NATIVE_ENV, "0")
    assert gemm.small_batch_kernel(torch.float32, "auto", True) is None


@needs_onednn
def test_the_gemm_benchmark_times_both_paths_and_they_agree() -> None:
    bench = Path(__file__).resolve().parents[2] / "benchmarks" / "cpu_gemm_bench.py"
    done = subprocess.run(
        [sys.executable, str(bench), "--quick", "--shapes", "64x48,96x40", "--threads", "1"],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert done.returncode == 0, done.stderr
    report = json.loads(done.stdout.strip().splitlines()[-1])
    assert report["small_batch_kernel"] == HAS_AVX512
    assert [r["rows"] for r in report["results"]] == [1, 16]
    for row in report["results"]:
        assert row["onednn_ms"] > 0
        if HAS_AVX512:
            assert row["max_abs_err"] < 1e-4 and row["ratio"] > 0, row
        else:
            assert row["small_ms"] is None
