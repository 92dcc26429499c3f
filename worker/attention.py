"""Per-step attention metadata, shared by every attention layer of one forward."""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class AttentionMetadata:
    """Where each request's queries sit in the flat batch and where its K/V live.

    Requests are laid out back to back: request b's tokens are rows
    query_start_loc[b]:query_start_loc[b+1], at positions ending at seq_lens[b] - 1.
    Block tables and slot mappings come one per KV cache group, because layers in
    different groups (full vs sliding window) hold different blocks for the same
    request; each attention layer reads the entry of its `kv_group`.
    """

    query_start_loc: torch.Tensor  # [B + 1] int32
    seq_lens: torch.Tensor  # [B] int32, tokens in the cache after this step
    block_tables: list[torch.Tensor]  # per group: [B, max_blocks] int32
    slot_mappings: list[torch.Tensor]  # per group: [T] int64, -1 for padding tokens

    @property
    def num_reqs(self) -> int:
        return self.seq_lens.shape[0]
