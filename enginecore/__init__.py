"""The CUDA-free control plane: requests, block hashing, KV-cache ownership, scheduling.

Nothing in this package may import torch or cupy (tests/test_enginecore_imports.py).
"""
