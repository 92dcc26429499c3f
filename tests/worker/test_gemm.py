"""worker.gemm: oneDNN products with prepacked weights equal F.linear (the oracle)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from worker import gemm

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
