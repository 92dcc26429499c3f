"""Start-up configuration that launch hands to the core and worker processes (as JSON on
their standard input, never on their command line: the hash seed is a secret), and the
socket address helpers they share."""

from __future__ import annotations

import os
import sys
import tempfile
from typing import Literal, TypeVar

import msgspec

from protocol import envs
from protocol.envs import AttentionChoice, CpuGemmChoice
from protocol.speculative import SpeculativeConfig

ConfigT = TypeVar("ConfigT", "EngineCoreConfig", "WorkerConfig")

# The choices of the start-up settings, checked when a process decodes its config.
HashAlgo = Literal["xxh3_128", "sha256"]
DType = Literal["auto", "float32", "float16", "bfloat16"]
GenerationConfigMode = Literal["auto", "none"]
# The waiting queue's order (enginecore/request_queue.py): arrival, or each request's
# priority (lower first), ties by arrival.
SchedulingPolicy = Literal["fcfs", "priority"]
# logging's level names, upper case: the launcher normalises what the user typed.
LogLevel = Literal["DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL"]

# Tokens per step when none is configured, by device. A GPU step costs about the same up
# to thousands of tokens. A CPU step's time grows linearly past a few hundred (the knee;
# docs/benchmarks.md has the figures), so a larger step only makes every request of a
# burst, and every decode sharing the step, wait longer for the same throughput.
GPU_MAX_NUM_BATCHED_TOKENS = 8192
CPU_MAX_NUM_BATCHED_TOKENS = 512
# Prefill tokens a step that decodes may carry per open request (running or waiting), by
# device (0: no cap). Every decode in a CPU step waits for the step's prefill tokens, whose
# time is linear in their count: a prompt arriving beside a few running requests is cut
# into small chunks, so their inter-token latency stays bounded, while a long queue (a
# burst, an offline batch) still gets the whole budget. A GPU step's time barely grows.
GPU_PREFILL_TOKENS_PER_REQUEST = 0
CPU_PREFILL_TOKENS_PER_REQUEST = 8


def max_num_batched_tokens_for(device: str, configured: int | None) -> int:
    """The step's token budget on device ("cpu", "cuda", "cuda:N"): the configured one,
    else that device's default."""
    if configured is not None:
        return configured
    return CPU_MAX_NUM_BATCHED_TOKENS if device == "cpu" else GPU_MAX_NUM_BATCHED_TOKENS


def prefill_tokens_per_request_for(device: str, configured: int | None) -> int:
    """The prefill tokens a step may carry per open request on device: the configured number,
    else that device's default (0: no cap)."""
    if configured is not None:
        return configured
    return CPU_PREFILL_TOKENS_PER_REQUEST if device == "cpu" else GPU_PREFILL_TOKENS_PER_REQUEST


# Which fields have a default. A setting that has a default in EngineArgs (or another
# launcher default, like the log level) is required here: a second copy of that default
# would silently win whenever a launcher forgot to pass the setting, while a missing
# field fails the process at start-up, naming it. Only two kinds of field default: None
# where it means "this launch has none" (no parent to watch, no rendezvous, no recording,
# no events socket, no spin override), never a tuned value; and the few settings that
# EngineArgs lacks, whose only copy is this one (kv_events_buffer_steps, kv_events_topic;
# core_timeout_s, which `pagedserve worker --core-timeout` takes as its default). A third
# kind: the process-wide switches of protocol/envs.py, whose one reader is their default,
# so that the launcher's environment decides them and the worker obeys its config.
# kw_only: a required field can stay next to the fields it belongs with.
class EngineCoreConfig(msgspec.Struct, frozen=True, forbid_unknown_fields=True, kw_only=True):
    input_address: str  # client -> core (the client binds)
    output_address: str  # core -> client (the client binds)
    worker_address: str  # where the core binds for its workers (see worker_sockets)
    world_size: int
    max_num_batched_tokens: int | None  # None: the workers' device's default
    # A decoding step's prefill tokens per open request (0: no cap); None: device default.
    prefill_tokens_per_request: int | None
    max_num_seqs: int
    max_model_len: int | None  # None: the model's own limit
    enable_prefix_caching: bool
    hash_algo: HashAlgo
    scheduling_policy: SchedulingPolicy
    # Fixes the secret root of the block hashes (None: random at each start). Replicas
    # behind one KV-aware router need the same one; keep it private.
    prefix_cache_hash_seed: str | None
    num_gpu_blocks: int | None  # None: what the workers' memory allows
    handshake_timeout_s: float
    # A step rank 0 has not answered after this long fails the open requests (a stopped
    # or stuck rank would otherwise hang the engine without a word).
    step_timeout_s: float
    # Workers must have been started with this block size (external ones may differ);
    # None: not checked.
    block_size: int | None
    parent_pid: int | None = None  # exit when this process is gone
    # The launcher's socket folder; the core removes it when it exits (the launcher may
    # have been killed outright).
    private_dir: str | None = None
    # KV-cache events (protocol/kv_events.py) on a ZeroMQ PUB socket, off when None; a
    # ROUTER socket answers replay requests from the last kv_events_buffer_steps batches.
    kv_events_endpoint: str | None = None
    kv_events_replay_endpoint: str | None = None
    kv_events_buffer_steps: int = 10_000
    kv_events_topic: str = ""
    # One log line per step: each scheduled request's hits, blocks per group, new blocks.
    log_kv: bool
    # Send step N+1 before step N's answer arrives, so the workers never wait for the
    # core's host path (False: strictly one step at a time).
    async_scheduling: bool
    # Record every core<->worker frame here (protocol/recording.py); None: off.
    record_dir: str | None = None
    # The settings the workers were started with (rank 0's), kept in the recording's
    # header so that replay starts equal workers.
    record_worker: WorkerConfig | None = None
    log_level: LogLevel
    # Walk the KV invariants after every step, and require every block back in the pool
    # whenever no request is open: a debugging aid that costs time per step (the
    # launcher sets it from PAGEDSERVE_CHECK_INVARIANTS=1).
    check_invariants: bool
    # Microseconds to poll for a step's answer before blocking (protocol/sockets.py);
    # None: the default for the machine the core runs on.
    spin_us: float | None = None
    # A keys directory (protocol/zmq_security.py): every tcp:// socket of the core is a
    # CURVE server admitting its client keys; None: no CURVE.
    zmq_curve_keys: str | None = None
    # Drafts proposed in the core and verified by the workers (protocol/speculative.py);
    # None: no speculation.
    speculative_config: SpeculativeConfig | None = None
    # Host memory per worker for the second KV tier (evicted prefix-cache blocks are kept
    # there and loaded back instead of recomputed); None: no tier.
    kv_offload_memory: int | None
    # The tier's disk level: each worker keeps blocks under this directory (one file
    # per slot), indexed again at start-up; None: no disk level.
    kv_cache_dir: str | None
    kv_cache_dir_size: int | None  # the disk level's bytes per worker; None: 16 GiB
    # Bytes per worker a step loads for requests whose disk tier hit loads before they
    # compute (enginecore/kv_tier_loads.py); None: 64 MiB.
    kv_tier_load_bytes: int | None


# The same rule for which fields default as EngineCoreConfig's (above).
class WorkerConfig(msgspec.Struct, frozen=True, forbid_unknown_fields=True, kw_only=True):
    model: str  # a local Hugging Face directory
    rank: int
    world_size: int
    core_address: str  # the core's worker address (see worker_sockets)
    block_size: int
    dtype: DType
    device: str
    kv_cache_memory: int | None  # bytes; None: a default (CPU) or what the GPU has
    # The share of a GPU's memory this worker may hold (weights, a step's peak, KV
    # cache); other processes' memory is not counted. Unused on the CPU and with
    # kv_cache_memory.
    gpu_memory_utilization: float
    # The largest step the core schedules: a GPU worker profiles one to keep its
    # activations out of the KV budget. None: the device's default.
    max_num_batched_tokens: int | None
    max_num_seqs: int
    seed: int
    dist_init: str | None = None  # torch.distributed init method when world_size > 1
    parent_pid: int | None = None
    # How long to wait for the core to answer the connection before giving up.
    core_timeout_s: float = 300.0
    # "auto": generation_config.json's EOS ids stop requests too and its sampling values
    # are the defaults; "none": the file is ignored.
    generation_config: GenerationConfigMode
    log_level: LogLevel
    # Microseconds to poll for the next step before blocking (protocol/sockets.py);
    # None: the default for the machine the worker runs on.
    spin_us: float | None = None
    # Attention kernel family and the CPU C kernel (pagedkernels/selection.py), and the CPU
    # dense products (worker/gemm.py).
    attention: AttentionChoice = msgspec.field(default_factory=envs.attention)
    native_kernels: bool = msgspec.field(default_factory=envs.native_kernels)
    cpu_gemm: CpuGemmChoice = msgspec.field(default_factory=envs.cpu_gemm)
    # FILE.py:FUNCTION that a benchmark installs on the runner (worker/step_hooks.py);
    # None: the worker runs as it is.
    step_hooks: str | None = msgspec.field(default_factory=envs.worker_hooks)
    # A keys directory: a tcp:// core address is reached as a CURVE client; None: no CURVE.
    zmq_curve_keys: str | None = None
    # The cores this worker's threads run on, one torch thread each, when it runs on the
    # CPU (protocol/cpu_placement.py); None: any core, the thread count tuned by timing.
    cpus: list[int] | None = None
    # Where the launcher placed this rank (a Ray node), named when it is lost; None: the
    # machine's host name.
    node: str | None = None


def read_config(module: str, kind: type[ConfigT], argv: list[str]) -> ConfigT | str:
    """A process's config: `-` reads its JSON from standard input (how launch starts
    every process, keeping secrets out of the process list), else argv's one JSON
    argument (by hand; visible to every user of ps); a usage or decoding error as text."""
    if len(argv) != 1:
        return f"usage: python -m {module} - < CONFIG.json  (or one JSON argument)"
    text = sys.stdin.buffer.read() if argv[0] == "-" else argv[0].encode()
    try:
        return msgspec.json.decode(text, type=kind)
    except msgspec.DecodeError as e:
        return f"bad configuration: {e}"


def ipc_dir() -> str:
    """A private directory for this engine's ipc:// socket files."""
    return tempfile.mkdtemp(prefix="pagedserve-")


def ipc_address(directory: str, name: str) -> str:
    return f"ipc://{os.path.join(directory, name)}"


def worker_sockets(address: str, world_size: int) -> tuple[str, list[str]]:
    """(results address, per-rank step addresses), all derived from one address.

    tcp://HOST:PORT: results on PORT, rank r's steps on PORT + 1 + r. ipc://PATH:
    PATH.results and PATH.rank<r>. One address is all a worker needs to be told, and
    one socket per rank lets the core name the rank that disconnects. Port 0 asks the
    core to pick free ports itself (see any_port); workers need the real one."""
    if world_size < 1:
        raise ValueError(f"world_size must be >= 1, got {world_size}")
    if address.startswith("tcp://"):
        host, sep, port = address[len("tcp://") :].rpartition(":")
        if not sep or not port.isdigit() or not host:
            raise ValueError(f"worker address {address!r} is not tcp://HOST:PORT")
        base = int(port)
        if not 0 <= base <= 65535 - world_size - 1:
            raise ValueError(f"worker address {address!r}: port out of range")
        return address, [f"tcp://{host}:{base + 1 + r}" for r in range(world_size)]
    if address.startswith("ipc://"):
        return f"{address}.results", [f"{address}.rank{r}" for r in range(world_size)]
    raise ValueError(f"worker address {address!r} must start with tcp:// or ipc://")


def any_port(address: str) -> str | None:
    """The host of a tcp://HOST:0 address (the core binds free ports and reports them),
    else None. Binding is the only race-free way to find a free port: a port picked
    free and bound later may be taken in between."""
    if address.startswith("tcp://"):
        host, _, port = address[len("tcp://") :].rpartition(":")
        if port == "0":
            return host
    return None


def parent_alive(parent_pid: int | None) -> bool:
    """False once the launching process is gone (we were re-parented)."""
    return parent_pid is None or os.getppid() == parent_pid


def available_host_memory() -> int | None:
    """Bytes of host memory available to new allocations (MemAvailable), None if unknown."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    try:
        return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError):
        return None
