"""glibc malloc settings for a CPU worker: memory a step frees stays for the next step.

A prefill step's activations are large (SmolLM2-135M, 8000 tokens: [8000 x 1536] float32,
49 MB per MLP product), above the largest mmap threshold glibc allows (32 MB). Each is
then mapped fresh, its pages faulted in on first touch (slow in a virtual machine) and
unmapped when freed, several times per layer. With mmap off for the heap's allocations
and the heap never trimmed, the next tensor reuses those pages: an 8000-token prefill
step on one core, 13.1 -> 10.1 s. The worker's resident memory is then its peak step's,
kept, which a caching allocator does on a GPU too.
"""

from __future__ import annotations

import ctypes
import logging

log = logging.getLogger("pagedserve.worker")

# From glibc's malloc.h.
M_TRIM_THRESHOLD = -1
M_MMAP_MAX = -4


def keep_freed_memory() -> bool:
    """Turn off mmap-backed allocations and heap trimming, where glibc is the allocator.
    False (and nothing changed) elsewhere."""
    try:
        libc = ctypes.CDLL("libc.so.6")
        mallopt = libc.mallopt
    except (OSError, AttributeError):
        log.info("host memory: not glibc; malloc settings left alone")
        return False
    mallopt.argtypes = (ctypes.c_int, ctypes.c_int)
    mallopt.restype = ctypes.c_int
    # mallopt returns 1 on success. A trim threshold of -1 turns trimming off.
    if mallopt(M_MMAP_MAX, 0) != 1 or mallopt(M_TRIM_THRESHOLD, -1) != 1:
        log.warning("host memory: mallopt refused; large steps will fault their pages in")
        return False
    return True
