"""Step inputs to persistent device buffers (worker/staging.py), against the arrays."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from worker.staging import StagedBuffer

needs_cuda = pytest.mark.skipif(
    not torch.cuda.is_available(), reason="no CUDA GPU present: pinned staging needs one"
)


def test_cpu_upload_is_the_array_cast_in_place() -> None:
    buf = StagedBuffer((8,), torch.int64, torch.device("cpu"))
    src = np.array([3, 1, 4], dtype=np.int64)
    out = buf.upload(src)
    assert out.dtype == torch.int64 and out.tolist() == [3, 1, 4]
    assert out.data_ptr() == src.ctypes.data  # no copy on the CPU
    cast = buf.upload(np.array([7, 8], dtype=np.int32))
    assert cast.dtype == torch.int64 and cast.tolist() == [7, 8]


def test_persistent_cpu_buffer_keeps_its_address_and_bounds() -> None:
    buf = StagedBuffer((4, 2), torch.int32, torch.device("cpu"), persistent=True)
    assert buf.tensor is not None
    first = buf.upload(np.arange(6, dtype=np.int32).reshape(3, 2))
    second = buf.upload(np.ones((1, 2), dtype=np.int32))
    assert first.data_ptr() == second.data_ptr() == buf.tensor.data_ptr()
    assert buf.tensor.tolist() == [[1, 1], [2, 3], [4, 5], [0, 0]]
    with pytest.raises(ValueError, match="5 rows exceed the buffer's 4"):
        buf.upload(np.zeros((5, 2), dtype=np.int32))


@needs_cuda
def test_cuda_uploads_in_a_row_each_see_their_own_data() -> None:
    device = torch.device("cuda")
    buf = StagedBuffer((1024,), torch.int64, device)
    results = []
    for i in range(20):  # the staging buffer is reused while earlier copies may run
        src = np.arange(1000, dtype=np.int32) * (i + 1)
        out = buf.upload(src)
        results.append(out.clone())  # queued after the copy on the same stream
    torch.cuda.synchronize()
    for i, got in enumerate(results):
        assert got.dtype == torch.int64
        assert torch.equal(got.cpu(), torch.arange(1000) * (i + 1))
    assert buf.tensor is not None and out.data_ptr() == buf.tensor.data_ptr()
