"""Host arrays to persistent device tensors, one copy each per step.

A step's inputs are built on the host with numpy. On a GPU each one goes through a pinned
staging tensor (allocated once), so its host-to-device copy is asynchronous on the
current stream and kernels queued after it see the data; the dtype cast (int32 token
ids to int64, say) happens while filling the staging tensor, not as a separate pass. On
the CPU the "device" is the host: the array is used in place (no copy at all), cast only
when its dtype differs, unless the buffer is persistent (its address must not change).
"""

from __future__ import annotations

import numpy as np
import torch


class StagedBuffer:
    """A device tensor of at most `shape`, filled from a host array's leading rows."""

    def __init__(
        self,
        shape: tuple[int, ...],
        dtype: torch.dtype,
        device: torch.device,
        persistent: bool = False,
    ) -> None:
        self.dtype = dtype
        self.device = device
        self.np_dtype = torch.empty((), dtype=dtype).numpy().dtype
        self._staging: torch.Tensor | None = None
        self._staging_np: np.ndarray | None = None
        self._copy_done: torch.cuda.Event | None = None
        self.tensor: torch.Tensor | None = None
        if device.type != "cpu" or persistent:
            # Allocated once: kernels and CUDA graphs may hold on to its address.
            self.tensor = torch.zeros(shape, dtype=dtype, device=device)
        if device.type != "cpu":
            pinned = device.type == "cuda"
            self._staging = torch.zeros(shape, dtype=dtype, pin_memory=pinned)
            self._staging_np = self._staging.numpy()

    def upload(self, src: np.ndarray) -> torch.Tensor:
        """The device tensor's first len(src) rows, holding src (cast to this dtype)."""
        n = len(src)
        if self.tensor is None:
            return torch.from_numpy(src.astype(self.np_dtype, copy=False))
        if n > len(self.tensor):
            raise ValueError(f"upload: {n} rows exceed the buffer's {len(self.tensor)}")
        staging = self._staging_np
        if staging is None:  # a persistent CPU buffer
            dst = self.tensor[:n]
            dst.copy_(torch.from_numpy(src))
            return dst
        assert self._staging is not None
        if self._copy_done is not None:
            # The previous copy may still be reading the staging rows about to change.
            self._copy_done.synchronize()
        np.copyto(staging[:n], src, casting="unsafe")
        dst = self.tensor[:n]
        dst.copy_(self._staging[:n], non_blocking=True)
        if self.device.type == "cuda":
            self._copy_done = torch.cuda.Event()
            self._copy_done.record()
        return dst


class StepBuffers:
    """The persistent buffers of one step's inputs, sized for the largest step."""

    def __init__(
        self, max_num_tokens: int, max_num_reqs: int, num_groups: int, device: torch.device
    ) -> None:
        def buf(n: int, dtype: torch.dtype) -> StagedBuffer:
            return StagedBuffer((n,), dtype, device)

        self.input_ids = buf(max_num_tokens, torch.int64)
        self.positions = buf(max_num_tokens, torch.int64)
        self.slot_mappings = [buf(max_num_tokens, torch.int64) for _ in range(num_groups)]
        self.query_start_loc = buf(max_num_reqs + 1, torch.int32)
        self.seq_lens = buf(max_num_reqs, torch.int32)
        self.block_table_rows = buf(max_num_reqs, torch.int64)
        self.logits_indices = buf(max_num_reqs, torch.int64)
        # temperature, top_k, top_p, greedy: SamplingTensors.from_arrays' order.
        self.sampling = (
            buf(max_num_reqs, torch.float32),
            buf(max_num_reqs, torch.int64),
            buf(max_num_reqs, torch.float32),
            buf(max_num_reqs, torch.bool),
        )
