"""Start-up configuration that launch hands to the core and worker processes (as JSON on
their command line), and the socket address helpers they share."""

from __future__ import annotations

import os
import tempfile

import msgspec


class EngineCoreConfig(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    input_address: str  # client -> core (the client binds)
    output_address: str  # core -> client (the client binds)
    worker_addresses: list[str]  # core -> worker rank r (the core binds)
    result_address: str  # workers -> core (the core binds)
    max_num_batched_tokens: int = 8192
    max_num_seqs: int = 256
    max_model_len: int | None = None  # None: the model's own limit
    enable_prefix_caching: bool = True
    hash_algo: str = "xxh3_128"
    num_gpu_blocks: int | None = None  # None: what the workers' memory allows
    handshake_timeout_s: float = 300.0
    parent_pid: int | None = None  # exit when this process is gone


class WorkerConfig(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    model: str  # a local Hugging Face directory
    rank: int
    world_size: int
    core_address: str  # the core's socket for this rank
    result_address: str
    block_size: int = 16
    dtype: str = "auto"
    device: str = "auto"
    kv_cache_memory: int | None = None  # bytes on CPU; None: a default
    seed: int = 0
    parent_pid: int | None = None


def ipc_dir() -> str:
    """A private directory for this engine's ipc:// socket files."""
    return tempfile.mkdtemp(prefix="pagedserve-")


def ipc_address(directory: str, name: str) -> str:
    return f"ipc://{os.path.join(directory, name)}"


def parent_alive(parent_pid: int | None) -> bool:
    """False once the launching process is gone (we were re-parented)."""
    return parent_pid is None or os.getppid() == parent_pid
