"""Start the EngineCore and worker processes, talk to the core, and take them down.

The core and each worker are separate interpreters (`python -m enginecore.core`,
`python -m worker.main`) that speak only ZeroMQ. This process owns the client sockets,
watches its children, and on Ctrl-C or exit stops them all (no orphans: children also
exit by themselves when this process disappears).
"""

from __future__ import annotations

import logging
import os
import re
import shutil
import subprocess
import sys
import time
from dataclasses import dataclass, field
from typing import Any, cast, get_args

import msgspec
import zmq

from protocol.codec import Codec
from protocol.config import (
    DType,
    EngineCoreConfig,
    GenerationConfigMode,
    HashAlgo,
    LogLevel,
    SchedulingPolicy,
    WorkerConfig,
    ipc_address,
    ipc_dir,
    worker_sockets,
)
from protocol.engine import (
    AbortRequests,
    AddRequest,
    ClientMessage,
    CoreMessage,
    EngineDead,
    EngineOutputs,
    EngineReady,
    ResetPrefixCache,
    SamplingParams,
    ShutdownCore,
    priority_error,
)
from protocol.kv_memory import core_memory_error
from protocol.recording import FRAMES, MANIFEST

log = logging.getLogger("pagedserve.launch")

DEFAULT_EXTERNAL_WORKER_ADDRESS = "tcp://127.0.0.1:29550"
# vLLM's default share of a GPU: the rest stays for other processes and the allocator.
DEFAULT_GPU_MEMORY_UTILIZATION = 0.9
# How long a client waits for the core to report a worker's death before giving up on it
# (the core reports within its own poll interval; this only bounds a wedged core).
CORE_REPORT_TIMEOUT_S = 60.0


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


def spawn(module: str, config: msgspec.Struct) -> subprocess.Popen:
    """`python -m module '<config as JSON>'`: how every engine process starts (in this
    process's environment, unchanged)."""
    return subprocess.Popen(
        [sys.executable, "-m", module, msgspec.json.encode(config).decode()],
        stdin=subprocess.DEVNULL,
    )


def _check_choice(name: str, value: object, choices: object) -> None:
    """ValueError unless value is one of the Literal type's choices."""
    allowed = get_args(choices)
    if value not in allowed:
        raise ValueError(f"{name} must be {' or '.join(map(str, allowed))}, not {value!r}")


# What every launcher logs at unless told otherwise (LLM, AsyncLLM, the CLI, replay).
DEFAULT_LOG_LEVEL: LogLevel = "WARNING"


def log_level_name(level: str) -> LogLevel:
    """level as the processes' configs spell it (any case in); ValueError naming the
    choices, before any process starts."""
    name = level.upper() if isinstance(level, str) else level
    _check_choice("log_level (any case)", name, LogLevel)
    return cast(LogLevel, name)


# The user's switch for the core's invariant checks (tests set it). Read here only: the
# core gets it in EngineCoreConfig.check_invariants.
CHECK_INVARIANTS_ENV = "PAGEDSERVE_CHECK_INVARIANTS"


def invariant_checks_requested() -> bool:
    return os.environ.get(CHECK_INVARIANTS_ENV) == "1"


# A machine-tuning override of how long the core and workers poll for a due message
# before blocking (protocol/sockets.py), in microseconds; 0 turns polling off.
SPIN_ENV = "PAGEDSERVE_SPIN_US"


def spin_requested() -> float | None:
    """SPIN_ENV as a number (its range is checked with the other args, in validate)."""
    value = os.environ.get(SPIN_ENV)
    if value is None:
        return None
    try:
        return float(value)
    except ValueError:
        raise ValueError(f"{SPIN_ENV} must be a number of microseconds, got {value!r}") from None


class EngineDeadError(RuntimeError):
    """The engine stopped; the message says which process and why."""


@dataclass(frozen=True)
class EngineArgs:
    model: str
    tensor_parallel_size: int = 1
    block_size: int = 16
    num_gpu_blocks: int | None = None
    max_num_batched_tokens: int = 8192
    max_num_seqs: int = 256
    max_model_len: int | None = None
    enable_prefix_caching: bool = True
    hash_algo: HashAlgo = "xxh3_128"
    # The waiting queue's order: "fcfs" (arrival) or "priority" (each request's priority,
    # lower first, ties by arrival; preemption takes the lowest priority first).
    scheduling_policy: SchedulingPolicy = "fcfs"
    prefix_cache_hash_seed: str | None = None
    seed: int = 0
    dtype: DType = "auto"
    device: str = "auto"
    kv_cache_memory: int | None = None
    # The share of each GPU the engine's worker may hold (vLLM's per-instance rule).
    gpu_memory_utilization: float = DEFAULT_GPU_MEMORY_UTILIZATION
    # "auto": generation_config.json's EOS ids and sampling defaults apply; "none": not.
    generation_config: GenerationConfigMode = "auto"
    startup_timeout_s: float = 300.0
    step_timeout_s: float = 300.0
    # Workers started elsewhere (`pagedserve worker`) connect to worker_address instead
    # of being spawned here; dist_init is their torch.distributed rendezvous.
    external_workers: bool = False
    worker_address: str | None = None
    dist_init: str | None = None
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
    check_invariants: bool = field(default_factory=invariant_checks_requested)
    # Microseconds the processes poll for a due message (None: each machine's default).
    spin_us: float | None = field(default_factory=spin_requested)

    def validate(self) -> None:
        for name in (
            "tensor_parallel_size",
            "block_size",
            "max_num_batched_tokens",
            "max_num_seqs",
        ):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
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
                f"spin_us must be in [0, 1000000] microseconds ({SPIN_ENV}), got {self.spin_us}"
            )
        if not 0 < self.gpu_memory_utilization <= 1:
            raise ValueError(
                f"gpu_memory_utilization must be in (0, 1], got {self.gpu_memory_utilization}"
            )
        if self.kv_cache_memory is not None and self.kv_cache_memory < 1:
            raise ValueError(f"kv_cache_memory must be >= 1 byte, got {self.kv_cache_memory}")
        if self.max_model_len is not None and self.max_model_len < 1:
            raise ValueError(f"max_model_len must be >= 1, got {self.max_model_len}")
        _check_choice("dtype", self.dtype, DType)
        if not re.fullmatch(r"auto|cpu|cuda(:\d+)?", self.device):
            raise ValueError(f"device must be auto, cpu, cuda or cuda:N, not {self.device!r}")
        for name in ("kv_events_endpoint", "kv_events_replay_endpoint"):
            endpoint = getattr(self, name)
            if endpoint is not None and not re.fullmatch(r"(tcp|ipc)://\S+", endpoint):
                raise ValueError(f"{name} must be tcp://HOST:PORT or ipc://PATH, not {endpoint!r}")
        if self.kv_events_replay_endpoint is not None and self.kv_events_endpoint is None:
            raise ValueError("kv_events_replay_endpoint needs kv_events_endpoint")
        _check_choice("generation_config", self.generation_config, GenerationConfigMode)
        _check_choice("hash_algo", self.hash_algo, HashAlgo)
        _check_choice("scheduling_policy", self.scheduling_policy, SchedulingPolicy)
        if self.record_dir is not None and any(
            os.path.exists(os.path.join(self.record_dir, f)) for f in (MANIFEST, FRAMES)
        ):
            # Before any process starts; the core's recorder would refuse it too.
            raise ValueError(
                f"{self.record_dir} already holds a recording: record into a new directory"
            )


class EngineProcesses:
    """A running engine: core + workers, and the client side of the core's sockets."""

    def __init__(self, args: EngineArgs, log_level: str = DEFAULT_LOG_LEVEL) -> None:
        args.validate()
        self.args = args
        self.log_level = log_level_name(log_level)
        self._dir = ipc_dir()
        self.ctx = zmq.Context()
        self.procs: dict[str, subprocess.Popen] = {}
        try:
            self.ready: EngineReady = self._start()
        except BaseException:
            # Ctrl-C, a signal or a failure at any moment of start-up: nothing we spawned
            # outlives us, and the socket folder goes.
            self.shutdown()
            raise

    def _start(self) -> EngineReady:
        args = self.args
        self.to_core = self.ctx.socket(zmq.PUSH)
        self.to_core.setsockopt(zmq.LINGER, 0)
        # No send high-water mark: a send never blocks, so an event loop can send from
        # its own thread (the client bounds how many requests it has in flight).
        self.to_core.setsockopt(zmq.SNDHWM, 0)
        self.from_core = self.ctx.socket(zmq.PULL)
        self.from_client: Codec[ClientMessage] = Codec(ClientMessage, "client->core")
        self.to_client: Codec[CoreMessage] = Codec(CoreMessage, "core->client")
        input_address = ipc_address(self._dir, "input")
        output_address = ipc_address(self._dir, "output")
        self.to_core.bind(input_address)
        self.from_core.bind(output_address)
        n = args.tensor_parallel_size
        worker_address = args.worker_address or (
            DEFAULT_EXTERNAL_WORKER_ADDRESS
            if args.external_workers
            else ipc_address(self._dir, "workers")
        )
        worker_sockets(worker_address, n)  # a bad address fails here, with its reason
        dist_init = args.dist_init
        if dist_init is None and n > 1:
            # Local ranks meet through a file in the engine's private directory: no port
            # to pick, so none that another process can take first.
            dist_init = f"file://{os.path.join(self._dir, 'dist-store')}"
        workers = [
            worker_config(
                args,
                model=args.model,
                rank=rank,
                world_size=n,
                core_address=worker_address,
                dist_init=dist_init,
                parent_pid=os.getpid(),
                log_level=self.log_level,
                spin_us=args.spin_us,
            )
            for rank in range(n)
        ]
        core = core_config(
            args,
            input_address=input_address,
            output_address=output_address,
            worker_address=worker_address,
            parent_pid=os.getpid(),
            private_dir=self._dir,
            record_dir=None if args.record_dir is None else os.path.abspath(args.record_dir),
            # Without this launch's pid and rendezvous: replay gives its own.
            record_worker=msgspec.structs.replace(workers[0], parent_pid=None, dist_init=None)
            if args.record_dir is not None
            else None,
            log_level=self.log_level,
        )
        log.info("starting the engine core and %d worker(s); sockets in %s", n, self._dir)
        self.procs["engine core"] = spawn("enginecore.core", core)
        for rank in range(0 if args.external_workers else n):
            self.procs[f"worker rank {rank}"] = spawn("worker.main", workers[rank])
        return self._wait_ready()

    def _wait_ready(self) -> EngineReady:
        deadline = time.monotonic() + self.args.startup_timeout_s + 30
        while time.monotonic() < deadline:
            msg = self._recv(500)
            if isinstance(msg, EngineReady):
                return msg
        self.shutdown()
        raise EngineDeadError("the engine did not start in time")

    # -- requests ---------------------------------------------------------------------
    def add_request(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        sampling_params: SamplingParams,
        cache_salt: str | None = None,
        priority: int = 0,
    ) -> None:
        msg = AddRequest(request_id, prompt_token_ids, sampling_params, cache_salt, priority)
        self._check_open()
        self.to_core.send(self.from_client.encode(msg), copy=False)

    def check_priority(self, priority: object) -> None:
        """ValueError unless this engine's scheduling policy can serve the priority: the
        launchers' check before sending, so that a caller hears it at once."""
        error = priority_error(priority, self.args.scheduling_policy)
        if error is not None:
            raise ValueError(error)

    def abort(self, request_ids: list[str]) -> None:
        self._check_open()
        self.to_core.send(self.from_client.encode(AbortRequests(request_ids)))

    def reset_prefix_cache(self) -> None:
        """Ask the core to forget every cached block (refused, and logged, while any
        request holds blocks); subscribers to KV events see AllBlocksCleared."""
        self._check_open()
        self.to_core.send(self.from_client.encode(ResetPrefixCache()))

    @property
    def closed(self) -> bool:
        """Shut down (by shutdown(), or after the engine died)."""
        return self.ctx.closed

    def _check_open(self) -> None:
        if self.ctx.closed:
            raise EngineDeadError("the engine was shut down; start a new one")

    def get_outputs(self, timeout_ms: int = 500) -> EngineOutputs | None:
        """The next batch of outputs, or None after timeout_ms; EngineDeadError if the
        engine went down (open requests were failed first and come before it)."""
        msg = self._recv(timeout_ms)
        if msg is None or isinstance(msg, EngineOutputs):
            return msg
        raise EngineDeadError(f"unexpected {type(msg).__name__} from the engine core")

    def dead_reason(self, wait_ms: int = 200) -> str | None:
        """Why the engine stopped, if it did (open requests already failed with it)."""
        try:
            while self._recv(wait_ms) is not None:
                pass
        except EngineDeadError as e:
            return str(e)
        return None

    def _recv(self, timeout_ms: int) -> CoreMessage | None:
        if self.from_core.poll(timeout_ms):
            msg = self.decode(self.from_core.recv())
            if isinstance(msg, EngineDead):
                raise self.stopped(msg.reason)
            return msg
        if self.lost_processes():
            # A worker is gone but the core lives: it notices too and fails the open
            # requests with the reason before it stops. Wait for that (or for the core
            # to exit), however slow a loaded machine makes it.
            deadline = time.monotonic() + CORE_REPORT_TIMEOUT_S
            while self.awaiting_core_report(deadline):
                if self.from_core.poll(100):
                    return self._recv(0)
            if self.from_core.poll(0):
                return self._recv(0)
            raise self.stopped()
        return None

    # The pieces of _recv, for clients that wait on the output socket their own way
    # (AsyncLLM awaits it on an event loop).
    def decode(self, frame: bytes) -> CoreMessage:
        """A message from the core (EngineDead: call stopped() with its reason)."""
        return self.to_client.decode(frame)

    def lost_processes(self) -> list[str]:
        """Names of the engine processes that have exited."""
        return [name for name, p in self.procs.items() if p.poll() is not None]

    def awaiting_core_report(self, deadline: float) -> bool:
        """After a lost process: whether the core may still report why (it lives and
        the deadline has not passed)."""
        return self.procs["engine core"].poll() is None and time.monotonic() < deadline

    def stopped(self, reason: str = "") -> EngineDeadError:
        """Shut everything down; the error names the reason and every process that
        failed, with its exit status."""
        self.shutdown()
        return EngineDeadError(
            f"engine stopped:{' ' if reason else ''}{reason}{self._exit_codes()}"
        )

    def _exit_codes(self) -> str:
        parts = []
        for name, p in self.procs.items():
            code = p.poll()
            if code is not None and code != 0:
                how = f"killed by signal {-code}" if code < 0 else f"exit status {code}"
                parts.append(f"{name} (pid {p.pid}) {how}")
        return (" [" + "; ".join(parts) + "]") if parts else ""

    # -- shutdown ---------------------------------------------------------------------
    def shutdown(self) -> None:
        """Ask the core to stop, then make sure every child is gone."""
        core = self.procs.get("engine core")
        if core is not None and core.poll() is None:
            try:
                self.to_core.send(self.from_client.encode(ShutdownCore()), zmq.NOBLOCK)
            except zmq.ZMQError:
                pass
        deadline = time.monotonic() + 5
        for p in self.procs.values():
            try:
                p.wait(max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                p.terminate()
        for p in self.procs.values():
            try:
                p.wait(3)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()
        if not self.ctx.closed:
            self.ctx.destroy(linger=0)
        shutil.rmtree(self._dir, ignore_errors=True)

    def __enter__(self) -> EngineProcesses:
        return self

    def __exit__(self, *exc: object) -> None:
        self.shutdown()
