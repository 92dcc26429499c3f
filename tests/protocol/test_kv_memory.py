"""protocol/kv_memory.py: the core's bookkeeping for a block count fits in half the
host's available memory, or the refusal says how much it needs and what to lower."""

from __future__ import annotations

import re

from protocol.config import available_host_memory
from protocol.kv_memory import CORE_BYTES_PER_BLOCK, CORE_MEMORY_SHARE, core_memory_error


def test_a_block_count_within_the_share_fits_and_one_past_it_is_refused() -> None:
    available = available_host_memory()
    assert available is not None and available > 0  # Linux: /proc/meminfo
    fits = int(CORE_MEMORY_SHARE * available) // CORE_BYTES_PER_BLOCK
    assert core_memory_error(1000) is None
    # Memory moves between the two reads: leave a margin of 10% either side.
    assert core_memory_error(fits * 9 // 10) is None
    too_many = fits * 11 // 10
    error = core_memory_error(too_many)
    assert error is not None
    match = re.fullmatch(
        rf"{too_many} KV cache blocks need ~([\d.]+) GiB of the engine core's memory for "
        r"their bookkeeping, more than 50% of the ([\d.]+) GiB this machine has available: "
        r"lower --num-gpu-blocks",
        error,
    )
    assert match, error
    need_gib = too_many * CORE_BYTES_PER_BLOCK / (1 << 30)
    assert float(match.group(1)) == round(need_gib, 1)
