"""Block tables: per request row, the physical block id of each logical block.

The table is edited on the CPU (a numpy int32 mirror) because the control plane does
many small row edits per step; `commit()` then ships the live rows to the device in one
copy, where attention kernels read them. Slot mapping turns (row, position) pairs into
the flat KV slot each new token's K/V is written to.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

from protocol.kv_cache import NULL_BLOCK_ID
from worker.staging import StagedBuffer

PAD_SLOT = -1  # kernels skip tokens whose slot is negative
# Fewer rows than this append one by one: the batched write's fixed cost (a handful of
# numpy calls) is what three or four appends cost.
BATCHED_APPEND_MIN = 4


class BlockTable:
    """The block table of one KV cache group."""

    def __init__(
        self,
        block_size: int,
        max_num_reqs: int,
        max_num_blocks_per_req: int,
        device: torch.device | str = "cpu",
    ) -> None:
        if block_size < 1 or max_num_reqs < 1 or max_num_blocks_per_req < 1:
            raise ValueError(
                f"BlockTable sizes must be >= 1: block_size={block_size}, "
                f"max_num_reqs={max_num_reqs}, max_num_blocks_per_req={max_num_blocks_per_req}"
            )
        self.block_size = block_size
        self.max_num_reqs = max_num_reqs
        self.max_num_blocks_per_req = max_num_blocks_per_req
        self.device = torch.device(device)
        shape = (max_num_reqs, max_num_blocks_per_req)
        self.table = np.zeros(shape, dtype=np.int32)
        self.num_blocks_per_row = np.zeros(max_num_reqs, dtype=np.int32)
        # Persistent: kernels and CUDA graphs may hold on to its address. On a GPU its
        # pinned staging copy is separate from `table`, so the CPU can edit the next
        # step's rows while the copy is still in flight.
        self._device = StagedBuffer(shape, torch.int32, self.device, persistent=True)
        assert self._device.tensor is not None
        self.device_table = self._device.tensor

    # -- row edits ---------------------------------------------------------------

    def add_row(self, block_ids: Sequence[int], row: int) -> None:
        """Write a whole row (a new request, or a resumed one whose table is replaced)."""
        self._check_row(row)
        n = len(block_ids)
        if n > self.max_num_blocks_per_req:
            raise ValueError(
                f"row {row}: {n} blocks exceed max_num_blocks_per_req={self.max_num_blocks_per_req}"
            )
        self.table[row, :n] = block_ids
        # Zero the tail so a shorter replacement leaves no stale ids behind.
        self.table[row, n:] = 0
        self.num_blocks_per_row[row] = n

    def append_row(self, block_ids: Sequence[int], row: int) -> None:
        """Append blocks to a row (a running request that grew)."""
        self._check_row(row)
        n = len(block_ids)
        if n == 0:
            return
        start = int(self.num_blocks_per_row[row])
        if start + n > self.max_num_blocks_per_req:
            raise ValueError(
                f"row {row}: appending {n} blocks to {start} exceeds "
                f"max_num_blocks_per_req={self.max_num_blocks_per_req}"
            )
        self.table[row, start : start + n] = block_ids
        self.num_blocks_per_row[row] = start + n

    def append_rows(self, rows: Sequence[int], block_ids: Sequence[Sequence[int]]) -> None:
        """append_row(block_ids[i], rows[i]) for distinct rows. A decode step grows a
        sixteenth of its requests by one block each (block size 16): one indexed write
        for all of them instead of a few microseconds of checks and slicing per row."""
        if len(rows) < BATCHED_APPEND_MIN or set(map(len, block_ids)) != {1}:
            for ids, row in zip(block_ids, rows):
                self.append_row(ids, row)
            return
        at = np.array(rows, dtype=np.int64)
        outside = (at < 0) | (at >= self.max_num_reqs)
        if outside.any():
            self._check_row(int(at[int(np.flatnonzero(outside)[0])]))
        start = self.num_blocks_per_row[at]
        full = start >= self.max_num_blocks_per_req
        if full.any():
            i = int(np.flatnonzero(full)[0])
            raise ValueError(
                f"row {rows[i]}: appending 1 blocks to {int(start[i])} exceeds "
                f"max_num_blocks_per_req={self.max_num_blocks_per_req}"
            )
        self.table[at, start] = [ids[0] for ids in block_ids]
        self.num_blocks_per_row[at] = start + 1

    def move_row(self, src: int, dst: int) -> None:
        """Copy row src to dst and clear src, so nothing can follow stale ids from src."""
        self._check_row(src)
        self._check_row(dst)
        if src == dst:
            return
        n = int(self.num_blocks_per_row[src])
        self.table[dst, :n] = self.table[src, :n]
        self.table[dst, n:] = 0
        self.num_blocks_per_row[dst] = n
        self.clear_row(src)

    def null_prefix(self, row: int, count: int) -> None:
        """The first count entries of row become the null block."""
        if count > self.num_blocks_per_row[row]:
            raise ValueError(
                f"row {row}: {count} leading null blocks, but it holds "
                f"{self.num_blocks_per_row[row]}"
            )
        self.table[row, :count] = NULL_BLOCK_ID

    def keep_tokens(self, row: int, num_tokens: int) -> None:
        """Drop the row's blocks past num_tokens slots (the core freed them)."""
        keep = -(-num_tokens // self.block_size)
        if self.num_blocks_per_row[row] > keep:
            self.table[row, keep:] = 0
            self.num_blocks_per_row[row] = keep

    def clear_row(self, row: int) -> None:
        self._check_row(row)
        self.table[row] = 0
        self.num_blocks_per_row[row] = 0

    def row(self, row: int) -> np.ndarray:
        """A view of the allocated part of one row."""
        self._check_row(row)
        return self.table[row, : self.num_blocks_per_row[row]]

    # -- slot mapping -------------------------------------------------------------

    def compute_slot_mapping(
        self,
        req_rows: np.ndarray,
        positions: np.ndarray,
        out: np.ndarray,
        padded: bool = True,
    ) -> None:
        """out[i] = table[row, pos // block_size] * block_size + pos % block_size for
        token i at (req_rows[i], positions[i]); -1 where the row or position is negative
        (padding). A position past the row's allocated blocks is an error, not block 0:
        writing there would corrupt another request's KV. padded=False: the caller
        vouches that no token is padding (every row and position >= 0), which spares
        the masks (a third of the work at a decode step's size)."""
        if not (len(req_rows) == len(positions) == len(out)):
            raise ValueError(
                f"compute_slot_mapping: req_rows ({len(req_rows)}), positions "
                f"({len(positions)}) and out ({len(out)}) must have the same length"
            )
        bs = self.block_size
        valid = None
        if padded:
            valid = (req_rows >= 0) & (positions >= 0)
            rows = np.where(valid, req_rows, 0).astype(np.int64, copy=False)
            pos = np.where(valid, positions, 0).astype(np.int64, copy=False)
        else:
            rows = req_rows.astype(np.int64, copy=False)
            pos = positions.astype(np.int64, copy=False)
        if rows.size and int(rows.max()) >= self.max_num_reqs:
            raise ValueError(
                f"compute_slot_mapping: row {int(rows.max())} is outside the table "
                f"(max_num_reqs={self.max_num_reqs})"
            )
        block_idx = pos // bs
        beyond = block_idx >= self.num_blocks_per_row[rows]
        if valid is not None:
            beyond &= valid
        if beyond.any():
            i = int(np.flatnonzero(beyond)[0])
            raise ValueError(
                f"compute_slot_mapping: row {int(rows[i])} position {int(pos[i])} needs "
                f"block {int(block_idx[i])} but the row has "
                f"{int(self.num_blocks_per_row[rows[i]])} blocks"
            )
        block_ids = self.table.reshape(-1).take(rows * self.max_num_blocks_per_req + block_idx)
        slots = block_ids.astype(np.int64) * bs + pos % bs
        if valid is not None:
            slots = np.where(valid, slots, PAD_SLOT)
        np.copyto(out, slots, casting="unsafe")

    # -- device copy --------------------------------------------------------------

    def commit(self, num_rows: int) -> torch.Tensor:
        """Copy rows [:num_rows] to the persistent device tensor; return that view.

        On CUDA the copy is asynchronous on the current stream: kernels queued after it
        on the same stream see the new rows."""
        if not 0 <= num_rows <= self.max_num_reqs:
            raise ValueError(f"commit: num_rows={num_rows} outside [0, {self.max_num_reqs}]")
        return self._device.upload(self.table[:num_rows])

    def _check_row(self, row: int) -> None:
        if not 0 <= row < self.max_num_reqs:
            raise ValueError(f"row {row} outside the block table [0, {self.max_num_reqs})")


class MultiGroupBlockTable:
    """One BlockTable per KV cache group (block sizes may differ); block_ids arguments
    are per group, in group order."""

    def __init__(
        self,
        block_sizes: Sequence[int],
        max_num_reqs: int,
        max_model_len: int,
        device: torch.device | str = "cpu",
    ) -> None:
        if not block_sizes:
            raise ValueError("MultiGroupBlockTable needs at least one KV cache group")
        # Every group covers the whole context: sliding-window groups keep the null
        # block in skipped positions, so their rows are as long as full-attention ones.
        self.tables = [
            BlockTable(bs, max_num_reqs, -(-max_model_len // bs), device) for bs in block_sizes
        ]

    def __len__(self) -> int:
        return len(self.tables)

    def __getitem__(self, group: int) -> BlockTable:
        return self.tables[group]

    def add_row(self, block_ids: Sequence[Sequence[int]], row: int) -> None:
        self._check_groups(block_ids)
        for table, ids in zip(self.tables, block_ids):
            table.add_row(ids, row)

    def append_row(self, block_ids: Sequence[Sequence[int]], row: int) -> None:
        self._check_groups(block_ids)
        for table, ids in zip(self.tables, block_ids):
            table.append_row(ids, row)

    def append_rows(
        self, rows: Sequence[int], block_ids: Sequence[Sequence[Sequence[int]]]
    ) -> None:
        """append_row for distinct rows (block_ids[i] is row i's ids per group; the
        caller checked their group counts)."""
        for g, table in enumerate(self.tables):
            table.append_rows(rows, [ids[g] for ids in block_ids])

    def move_row(self, src: int, dst: int) -> None:
        for table in self.tables:
            table.move_row(src, dst)

    def null_prefix(self, counts: Sequence[int], row: int) -> None:
        self._check_groups(counts)
        for table, count in zip(self.tables, counts):
            if count:
                table.null_prefix(row, count)

    def keep_tokens(self, row: int, num_tokens: int) -> None:
        for t in self.tables:
            t.keep_tokens(row, num_tokens)

    def clear_row(self, row: int) -> None:
        for table in self.tables:
            table.clear_row(row)

    def compute_slot_mapping(
        self,
        req_rows: np.ndarray,
        positions: np.ndarray,
        out: Sequence[np.ndarray],
        padded: bool = True,
    ) -> None:
        """out[g] receives group g's slot mapping."""
        if len(out) != len(self.tables):
            raise ValueError(f"expected {len(self.tables)} slot-mapping outputs, got {len(out)}")
        for table, o in zip(self.tables, out):
            table.compute_slot_mapping(req_rows, positions, o, padded)

    def commit(self, num_rows: int) -> list[torch.Tensor]:
        return [table.commit(num_rows) for table in self.tables]

    def _check_groups(self, block_ids: Sequence[Sequence[int]]) -> None:
        if len(block_ids) != len(self.tables):
            raise ValueError(
                f"expected block ids for {len(self.tables)} KV cache groups, got {len(block_ids)}"
            )
