"""Paged-attention kernels (CuPy RawKernel) and their torch references (later issues)."""
