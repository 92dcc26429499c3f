"""EngineArgs: every setting of an engine, checked before any process starts, and the
configs of the core and the workers built from them (plus the environment switches that
feed their defaults)."""

from __future__ import annotations

import importlib.util
import os
import re
from dataclasses import dataclass, field
from typing import Any, Literal, cast, get_args

import msgspec

from launch.client.ray_executor import INSTALL_HINT, PlacementStrategy
from protocol import envs
from protocol.config import (
    DType,
    EngineCoreConfig,
    GenerationConfigMode,
    HashAlgo,
    LogLevel,
    SchedulingPolicy,
    WorkerConfig,
)
from protocol.cpu_placement import DEFAULT_CPU_PLACEMENT, DEFAULT_RESERVED_CORES, CpuPlacement
from protocol.kv_memory import core_memory_error
from protocol.recording import FRAMES, MANIFEST
from protocol.speculative import SpeculativeConfig, parse_speculative_config
from protocol.zmq_security import KeysError, load_client_keys, load_server_keys

# Who starts the workers: "mp", processes of this machine; "ray", actors on a Ray
# cluster (launch/client/ray_executor.py). vLLM's names.
ExecutorBackend = Literal["mp", "ray"]

# vLLM's default share of a GPU: the rest stays for other processes and the allocator.
DEFAULT_GPU_MEMORY_UTILIZATION = 0.9
# What every launcher logs at unless told otherwise (LLM, AsyncLLM, the CLI, replay).
DEFAULT_LOG_LEVEL: LogLevel = "WARNING"


# Worker settings that EngineArgs and `pagedserve worker`'s flags both carry, by name.
WORKER_SETTINGS = (
    "block_size",
    "dtype",
    "device",
    "kv_cache_memory",
    "gpu_memory_utilization",
    "max_num_batched_tokens",
    "max_num_seqs",
    "seed",
    "generation_config",
    "zmq_curve_keys",
)


def worker_config(settings: object, **fields: Any) -> WorkerConfig:
    """A worker's config: WORKER_SETTINGS read from settings (EngineArgs or parsed flags),
    plus the fields that differ per rank or launch."""
    return WorkerConfig(**{name: getattr(settings, name) for name in WORKER_SETTINGS}, **fields)


def runner_config(args: EngineArgs, rank: int = 0, world_size: int = 1) -> WorkerConfig:
    """The config of a ModelRunner made in this process (tests, benchmarks): no core to
    connect to, and the process's own logging, so the log level given is never read."""
    return worker_config(
        args,
        model=args.model,
        rank=rank,
        world_size=world_size,
        core_address="",
        log_level=DEFAULT_LOG_LEVEL,
    )


# EngineArgs settings that EngineCoreConfig carries under the same name.
CORE_SETTINGS = (
    "max_num_batched_tokens",
    "prefill_tokens_per_request",
    "max_num_seqs",
    "max_model_len",
    "enable_prefix_caching",
    "hash_algo",
    "scheduling_policy",
    "prefix_cache_hash_seed",
    "num_gpu_blocks",
    "step_timeout_s",
    "block_size",
    "kv_events_endpoint",
    "kv_events_replay_endpoint",
    "log_kv",
    "async_scheduling",
    "check_invariants",
    "spin_us",
    "zmq_curve_keys",
    "speculative_config",
    "kv_offload_memory",
    "kv_cache_dir",
    "kv_cache_dir_size",
    "kv_tier_load_bytes",
)


def core_config(args: EngineArgs, **fields: Any) -> EngineCoreConfig:
    """The core's config: args' settings, plus the fields that differ per launch (its
    sockets, log level, parent, recording)."""
    return EngineCoreConfig(
        **{name: getattr(args, name) for name in CORE_SETTINGS},
        world_size=args.tensor_parallel_size,
        handshake_timeout_s=args.startup_timeout_s,
        **fields,
    )


def _check_choice(name: str, value: object, choices: object) -> None:
    """ValueError unless value is one of the Literal type's choices."""
    allowed = get_args(choices)
    if value not in allowed:
        raise ValueError(f"{name} must be {' or '.join(map(str, allowed))}, not {value!r}")


def log_level_name(level: str) -> LogLevel:
    """level as the processes' configs spell it (any case in); ValueError naming the
    choices, before any process starts."""
    name = level.upper() if isinstance(level, str) else level
    _check_choice("log_level (any case)", name, LogLevel)
    return cast(LogLevel, name)


@dataclass(frozen=True)
class EngineArgs:
    model: str
    tensor_parallel_size: int = 1
    block_size: int = 16
    num_gpu_blocks: int | None = None
    # Tokens per step; None: the device's default (protocol.config.max_num_batched_tokens_for:
    # 8192 on a GPU, 512 on the CPU).
    max_num_batched_tokens: int | None = None
    # In a step that decodes, prefill tokens per open request (0: no cap); None: the
    # device's default (protocol.config.prefill_tokens_per_request_for: 8 on the CPU, none
    # on a GPU), so that decodes beside a new prompt keep their pace.
    prefill_tokens_per_request: int | None = None
    max_num_seqs: int = 256
    max_model_len: int | None = None
    enable_prefix_caching: bool = True
    hash_algo: HashAlgo = "xxh3_128"
    # The waiting queue's order: "fcfs" (arrival) or "priority" (each request's priority,
    # lower first, ties by arrival; preemption takes the lowest priority first).
    scheduling_policy: SchedulingPolicy = "fcfs"
    # The block hashes' secret root (None: random at each start); it travels to the core
    # on its stdin, never in argv.
    prefix_cache_hash_seed: str | None = None
    seed: int = 0
    dtype: DType = "auto"
    device: str = "auto"
    kv_cache_memory: int | None = None
    # Host memory per worker for the second KV tier (docs/kv_tier.md); None: off.
    kv_offload_memory: int | None = None
    # The tier's disk level (with or without host memory), indexed again at start-up.
    kv_cache_dir: str | None = None
    kv_cache_dir_size: int | None = None  # the disk level's bytes per worker; None: 16 GiB
    # Disk tier bytes per worker a step loads ahead of computing (docs/kv_tier.md);
    # None: 64 MiB.
    kv_tier_load_bytes: int | None = None
    # The share of each GPU the engine's worker may hold (vLLM's per-instance rule).
    gpu_memory_utilization: float = DEFAULT_GPU_MEMORY_UTILIZATION
    # "auto": generation_config.json's EOS ids and sampling defaults apply; "none": not.
    generation_config: GenerationConfigMode = "auto"
    startup_timeout_s: float = 300.0
    step_timeout_s: float = 300.0
    # Where CPU workers and the front (API server, core) run (protocol/cpu_placement.py).
    cpu_placement: CpuPlacement = DEFAULT_CPU_PLACEMENT
    cpu_reserved_cores: int = DEFAULT_RESERVED_CORES
    # The launching process (the CLI's API server) goes on the front's cores too; a
    # program that embeds the engine keeps its own.
    pin_launcher: bool = False
    # Workers started elsewhere (`pagedserve worker`) connect to worker_address instead
    # of being spawned here; dist_init is their torch.distributed rendezvous.
    external_workers: bool = False
    worker_address: str | None = None
    dist_init: str | None = None
    distributed_executor_backend: ExecutorBackend = "mp"
    # Ray only: how the ranks' bundles spread over nodes, and the cluster to join (None:
    # RAY_ADDRESS, else a cluster started on this machine, else a new local one).
    placement_strategy: PlacementStrategy = "PACK"
    ray_address: str | None = None
    # Whole engine replicas behind one KV-aware router (DataParallelLLM; 1: one engine),
    # and who starts their workers (None: distributed_executor_backend; "ray": actors,
    # a placement group per replica).
    data_parallel_size: int = 1
    data_parallel_backend: ExecutorBackend | None = None
    # KV-cache events for routers (docs/protocol.md): PUB endpoint (tcp://*:PORT binds;
    # tcp://HOST:0 binds a free port, reported in EngineReady), and the replay ROUTER.
    kv_events_endpoint: str | None = None
    kv_events_replay_endpoint: str | None = None
    log_kv: bool = False  # one core log line per step with each request's blocks
    # The core sends step N+1 while the workers run step N (False: one step at a time).
    async_scheduling: bool = True
    # Record every frame the core sends its workers, and rank 0's answers, into this new
    # directory (`pagedserve replay DIR` plays it back; protocol/recording.py).
    record_dir: str | None = None
    # The core walks the KV invariants after every step (slow; debugging and tests).
    # Read when the args are made, so a test's environment applies to the engines it starts.
    check_invariants: bool = field(default_factory=envs.check_invariants)
    # Microseconds the processes poll for a due message (None: each machine's default).
    spin_us: float | None = field(default_factory=envs.spin_us)
    # A keys directory (`pagedserve keys DIR`): every tcp:// engine socket speaks CURVE
    # and admits only its client keys (docs/security.md); None: no CURVE.
    zmq_curve_keys: str | None = None
    # Draft-free speculative decoding (protocol/speculative.py): a config, its JSON or
    # a dict of vLLM's keys (made a config here); None: off.
    speculative_config: SpeculativeConfig | None = None

    def __post_init__(self) -> None:
        spec: Any = self.speculative_config
        if isinstance(spec, dict):
            spec = msgspec.json.encode(spec).decode()
        if isinstance(spec, str):
            object.__setattr__(self, "speculative_config", parse_speculative_config(spec))
        elif spec is not None and not isinstance(spec, SpeculativeConfig):
            raise ValueError(f"speculative_config must be a JSON object, not {spec!r}")

    def validate(self) -> None:
        for name in ("tensor_parallel_size", "block_size", "max_num_seqs", "cpu_reserved_cores"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.max_num_batched_tokens is not None and self.max_num_batched_tokens < 1:
            raise ValueError(
                f"max_num_batched_tokens must be >= 1, got {self.max_num_batched_tokens}"
            )
        if self.prefill_tokens_per_request is not None and self.prefill_tokens_per_request < 0:
            raise ValueError(
                f"prefill_tokens_per_request must be >= 0, got {self.prefill_tokens_per_request}"
            )
        for name in ("startup_timeout_s", "step_timeout_s"):
            if not getattr(self, name) > 0:
                raise ValueError(f"{name} must be > 0, got {getattr(self, name)}")
        if self.num_gpu_blocks is not None:
            if self.num_gpu_blocks < 2:
                raise ValueError(f"num_gpu_blocks must be >= 2, got {self.num_gpu_blocks}")
            error = core_memory_error(self.num_gpu_blocks)  # before any process starts
            if error is not None:
                raise ValueError(error)
        if self.spin_us is not None and not 0 <= self.spin_us <= 1e6:
            raise ValueError(
                f"spin_us must be in [0, 1000000] microseconds ({envs.SPIN_US}), got {self.spin_us}"
            )
        if not 0 < self.gpu_memory_utilization <= 1:
            raise ValueError(
                f"gpu_memory_utilization must be in (0, 1], got {self.gpu_memory_utilization}"
            )
        if self.kv_offload_memory is not None and self.kv_offload_memory < 1:
            raise ValueError(f"kv_offload_memory must be >= 1 byte, got {self.kv_offload_memory}")
        if self.kv_cache_dir_size is not None and self.kv_cache_dir_size < 1:
            raise ValueError(f"kv_cache_dir_size must be >= 1 byte, got {self.kv_cache_dir_size}")
        if self.kv_tier_load_bytes is not None and self.kv_tier_load_bytes < 1:
            raise ValueError(f"kv_tier_load_bytes must be >= 1 byte, got {self.kv_tier_load_bytes}")
        tiered = self.kv_offload_memory is not None or self.kv_cache_dir is not None
        if tiered and not self.enable_prefix_caching:
            raise ValueError("a KV tier keeps prefix-cache blocks: enable prefix caching")
        if self.kv_cache_memory is not None and self.kv_cache_memory < 1:
            raise ValueError(f"kv_cache_memory must be >= 1 byte, got {self.kv_cache_memory}")
        if self.max_model_len is not None and self.max_model_len < 1:
            raise ValueError(f"max_model_len must be >= 1, got {self.max_model_len}")
        _check_choice("dtype", self.dtype, DType)
        _check_choice("cpu_placement", self.cpu_placement, CpuPlacement)
        if not re.fullmatch(r"auto|cpu|cuda(:\d+)?", self.device):
            raise ValueError(f"device must be auto, cpu, cuda or cuda:N, not {self.device!r}")
        for name in ("kv_events_endpoint", "kv_events_replay_endpoint"):
            endpoint = getattr(self, name)
            if endpoint is not None and not re.fullmatch(r"(tcp|ipc)://\S+", endpoint):
                raise ValueError(f"{name} must be tcp://HOST:PORT or ipc://PATH, not {endpoint!r}")
        if self.kv_events_replay_endpoint is not None and self.kv_events_endpoint is None:
            raise ValueError("kv_events_replay_endpoint needs kv_events_endpoint")
        _check_choice("generation_config", self.generation_config, GenerationConfigMode)
        self._check_executor()
        self._check_data_parallel()
        self._check_keys()
        _check_choice("hash_algo", self.hash_algo, HashAlgo)
        _check_choice("scheduling_policy", self.scheduling_policy, SchedulingPolicy)
        if self.record_dir is not None and any(
            os.path.exists(os.path.join(self.record_dir, f)) for f in (MANIFEST, FRAMES)
        ):
            # Before any process starts; the core's recorder would refuse it too.
            raise ValueError(
                f"{self.record_dir} already holds a recording: record into a new directory"
            )

    def _check_executor(self) -> None:
        """The Ray backend's settings, and Ray itself, before any process starts."""
        _check_choice(
            "distributed_executor_backend", self.distributed_executor_backend, ExecutorBackend
        )
        _check_choice("placement_strategy", self.placement_strategy, PlacementStrategy)
        if self.distributed_executor_backend != "ray":
            if self.ray_address is not None:
                raise ValueError("ray_address needs distributed_executor_backend ray")
            return
        for name in ("external_workers", "worker_address", "dist_init"):
            if getattr(self, name):
                raise ValueError(
                    f"{name} does not go with distributed_executor_backend ray: Ray places "
                    "the workers and gives them their addresses"
                )
        if re.fullmatch(r"cuda:\d+", self.device):
            raise ValueError(
                f"device {self.device!r} with distributed_executor_backend ray: Ray gives "
                "each rank its GPU; use cuda or auto"
            )
        if importlib.util.find_spec("ray") is None:
            raise ValueError(f"distributed_executor_backend ray needs Ray: {INSTALL_HINT}")

    def _check_data_parallel(self) -> None:
        """Settings that cannot be shared by several replicas, before any process starts."""
        if self.data_parallel_size < 1:
            raise ValueError(f"data_parallel_size must be >= 1, got {self.data_parallel_size}")
        if self.data_parallel_backend is not None:
            _check_choice("data_parallel_backend", self.data_parallel_backend, ExecutorBackend)
            if self.data_parallel_backend == "ray" and importlib.util.find_spec("ray") is None:
                raise ValueError(f"data_parallel_backend ray needs Ray: {INSTALL_HINT}")
        if self.data_parallel_size == 1:
            return
        for name in ("external_workers", "worker_address", "dist_init", "record_dir"):
            if getattr(self, name):
                raise ValueError(
                    f"{name} does not go with data_parallel_size > 1: each replica starts "
                    "its own workers at addresses of its own"
                )
        for name in ("kv_events_endpoint", "kv_events_replay_endpoint"):
            endpoint = getattr(self, name)
            free_port = endpoint is not None and re.fullmatch(r"tcp://\S+:0", endpoint)
            if endpoint is not None and not free_port:
                raise ValueError(
                    f"{name} {endpoint!r} with data_parallel_size > 1: every replica binds "
                    "its own; give tcp://HOST:0 (a free port each) or leave it unset"
                )

    def _check_keys(self) -> None:
        """The keys each side will load, read once here so a bad directory fails before
        any process starts."""
        if self.zmq_curve_keys is None:
            return
        try:
            load_server_keys(self.zmq_curve_keys)
            address = self.worker_address or ""
            ray = self.distributed_executor_backend == "ray"  # tcp:// to the core, always
            if (address.startswith("tcp://") or ray) and not self.external_workers:
                load_client_keys(self.zmq_curve_keys)  # the spawned workers' keys
        except KeysError as e:
            raise ValueError(f"zmq_curve_keys: {e}") from None
