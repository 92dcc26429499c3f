"""The engine core's host memory for KV-cache bookkeeping: checked by the client before
any process starts and by the core when it sizes the pool."""

from __future__ import annotations

from protocol.config import available_host_memory

# Host memory the core spends per KV block (the block object and its free-queue links),
# rounded up from a tracemalloc measurement.
CORE_BYTES_PER_BLOCK = 128
# The share of available host memory the core's block bookkeeping may take.
CORE_MEMORY_SHARE = 0.5


def core_memory_error(num_blocks: int) -> str | None:
    """Why managing num_blocks would take more than CORE_MEMORY_SHARE of the host's
    available memory, with numbers; None if it fits (or the memory is unknown). Refusing
    early beats minutes of building block objects before failing, or being killed."""
    needed = num_blocks * CORE_BYTES_PER_BLOCK
    available = available_host_memory()
    if available is None or needed <= CORE_MEMORY_SHARE * available:
        return None
    gib = 1 << 30
    return (
        f"{num_blocks} KV cache blocks need ~{needed / gib:.1f} GiB of the engine core's "
        f"memory for their bookkeeping, more than {CORE_MEMORY_SHARE:.0%} of the "
        f"{available / gib:.1f} GiB this machine has available: lower --num-gpu-blocks"
    )
