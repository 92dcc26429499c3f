"""Start the EngineCore and worker processes, talk to the core, and take them down.

The core and each worker are separate interpreters (`python -m enginecore.core`,
`python -m worker.main`) that speak only ZeroMQ. This process owns the client sockets,
watches its children, and on Ctrl-C or exit stops them all (no orphans: children also
exit by themselves when this process disappears).
"""

from __future__ import annotations

import contextlib
import logging
import os
import shutil
import subprocess
import sys
import time
from collections.abc import Iterable

import msgspec
import zmq

from launch.client.engine_args import (
    DEFAULT_LOG_LEVEL,
    EngineArgs,
    core_config,
    log_level_name,
    worker_config,
)
from launch.client.ray_executor import RayRank, RayWorkers
from launch.client.signals import hurried, stop_signals_deferred
from protocol.codec import Codec
from protocol.config import ipc_address, ipc_dir, worker_sockets
from protocol.cpu_placement import CpuPlan, describe, pin_process, plan_cpus, usable_cpus
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
)

log = logging.getLogger("pagedserve.launch")

DEFAULT_EXTERNAL_WORKER_ADDRESS = "tcp://127.0.0.1:29550"
# How long a client waits for the core to report a worker's death before giving up on it
# (the core reports within its own poll interval; this only bounds a wedged core).
CORE_REPORT_TIMEOUT_S = 60.0
# Before EngineReady: how long the core may take to explain a lost worker (it knows at
# once about one that had connected), and how often the launcher looks at its children.
STARTUP_REPORT_S = 1.0
STARTUP_POLL_MS = 100
# Shutdown: how long the processes get to stop in order, then after SIGTERM before SIGKILL.
SHUTDOWN_GRACE_S = 5.0
SHUTDOWN_KILL_S = 3.0
EXIT_POLL_S = 0.02


def spawn(module: str, config: msgspec.Struct) -> subprocess.Popen:
    """`python -m module -` with the config as JSON on its standard input: how every
    engine process starts (in this process's environment, unchanged). Not in argv: the
    config holds the hash seed, and every user can read a process's command line."""
    proc = subprocess.Popen([sys.executable, "-m", module, "-"], stdin=subprocess.PIPE)
    assert proc.stdin is not None
    # A child that died at once closed the pipe: its exit status tells the watcher.
    with contextlib.suppress(BrokenPipeError):
        proc.stdin.write(msgspec.json.encode(config))
    with contextlib.suppress(BrokenPipeError):
        proc.stdin.close()  # the child reads to the end
    return proc


class EngineDeadError(RuntimeError):
    """The engine stopped; the message says which process and why."""


class EngineProcesses:
    """A running engine: core + workers, and the client side of the core's sockets."""

    def __init__(self, args: EngineArgs, log_level: str = DEFAULT_LOG_LEVEL) -> None:
        args.validate()
        if args.data_parallel_size != 1:
            raise ValueError(
                f"data_parallel_size {args.data_parallel_size} needs several engines behind "
                "a router: DataParallelLLM (serve and run-batch take --data-parallel-size)"
            )
        self.args = args
        self.label = ""  # names this engine among several in errors ("replica 1")
        self._last_word: str | None = None  # EngineDead's reason, once its outputs are out
        self.log_level = log_level_name(log_level)
        self._dir = ipc_dir()
        self.ctx = zmq.Context()
        self.procs: dict[str, subprocess.Popen | RayRank] = {}
        self.configs: dict[str, msgspec.Struct] = {}  # what each process was started with
        self.ray: RayWorkers | None = None  # the workers' actors, with that backend
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
        worker_address, dist_init = self._worker_endpoints()
        self.cpu_plan = self._cpu_plan()
        workers = [
            worker_config(
                args,
                model=args.model,
                rank=rank,
                world_size=n,
                core_address=worker_address,
                dist_init=dist_init,
                # A Ray actor's parent is Ray's: it leaves when the core goes away.
                parent_pid=None if self.ray is not None else os.getpid(),
                log_level=self.log_level,
                spin_us=args.spin_us,
                cpus=None if self.cpu_plan is None else self.cpu_plan.workers[rank],
                node=None if self.ray is None else self.ray.places[rank].describe(),
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
            record_worker=msgspec.structs.replace(
                workers[0], parent_pid=None, dist_init=None, node=None
            )
            if args.record_dir is not None
            else None,
            log_level=self.log_level,
        )
        log.info("starting the engine core and %d worker(s); sockets in %s", n, self._dir)
        self.configs["engine core"] = core
        self.procs["engine core"] = spawn("enginecore.core", core)
        if self.ray is not None:
            self.configs.update((f"worker rank {r}", w) for r, w in enumerate(workers))
            self.procs.update(self.ray.launch(workers))
        for rank in range(0 if args.external_workers or self.ray is not None else n):
            self.configs[f"worker rank {rank}"] = workers[rank]
            self.procs[f"worker rank {rank}"] = spawn("worker.main", workers[rank])
        ready = self._wait_ready()
        if self.cpu_plan is not None and ready.device == "cpu":
            # The workers pinned themselves (a GPU worker ignores its cores); the front
            # leaves their cores to them.
            pin_process(self.procs["engine core"].pid, self.cpu_plan.front)
            if self.args.pin_launcher:
                pin_process(os.getpid(), self.cpu_plan.front)
            log.info(describe(self.cpu_plan))
        return ready

    def _worker_endpoints(self) -> tuple[str, str | None]:
        """Where the core listens for the workers, and their torch.distributed meeting
        point (None for one rank). With Ray the actors are placed first: ranks on other
        nodes need TCP addresses on the nodes Ray chose; ranks all on this node take the
        private sockets and rendezvous spawned workers take, the same path per step."""
        args = self.args
        n = args.tensor_parallel_size
        if args.distributed_executor_backend == "ray":
            self.ray = RayWorkers(
                n, args.device, args.placement_strategy, args.ray_address, args.startup_timeout_s
            )
            self.ray.place()
            if not self.ray.all_on_this_node():
                return self.ray.core_address(), self.ray.rendezvous() if n > 1 else None
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
        return worker_address, dist_init

    def _cpu_plan(self) -> CpuPlan | None:
        """Cores for the workers and the front when the placement reserves them, the
        workers are ours to start and there are enough cores (else None: all shared)."""
        args = self.args
        if (
            args.cpu_placement != "reserve"
            or args.external_workers
            or args.distributed_executor_backend == "ray"  # Ray gives each rank its cores
            or (args.device != "auto" and args.device != "cpu")
        ):
            return None
        plan = plan_cpus(usable_cpus(), args.tensor_parallel_size, args.cpu_reserved_cores)
        if plan is None:
            log.info(
                "CPU placement: %d usable core(s) cannot keep %d for the front and one per "
                "worker; every process shares them",
                len(usable_cpus()),
                args.cpu_reserved_cores,
            )
        return plan

    def _wait_ready(self) -> EngineReady:
        deadline = time.monotonic() + self.args.startup_timeout_s + 30
        while time.monotonic() < deadline:
            if self.from_core.poll(STARTUP_POLL_MS):
                msg = self._take()
                if isinstance(msg, EngineReady):
                    return msg
            elif self.lost_processes():
                raise self._lost_in_startup()
        self.shutdown()
        raise EngineDeadError("the engine did not start in time")

    def _lost_in_startup(self) -> EngineDeadError:
        """A process exited before EngineReady. The core knows why only for a worker that
        had connected (it says so at once); one that died before connecting it would wait
        for until its handshake timeout: give it a moment, then stop everything."""
        grace = time.monotonic() + STARTUP_REPORT_S
        while self.awaiting_core_report(grace):
            if self.from_core.poll(STARTUP_POLL_MS):
                self._take()  # raises with the core's reason
        return self.stopped("start-up failed")

    def _take(self) -> CoreMessage:
        """The message waiting on the output socket (EngineDeadError for EngineDead)."""
        msg = self.decode(self.from_core.recv())
        if isinstance(msg, EngineDead):
            if msg.outputs:
                # The failed requests first, as outputs; the next call raises.
                self._last_word = msg.reason
                return EngineOutputs(msg.outputs)
            raise self.stopped(msg.reason)
        return msg

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
        self._send(self.from_client.encode(msg), copy=False)

    def abort(self, request_ids: list[str]) -> None:
        self._send(self.from_client.encode(AbortRequests(request_ids)))

    def reset_prefix_cache(self) -> None:
        """Ask the core to forget every cached block (refused, and logged, while any
        request holds blocks); subscribers to KV events see AllBlocksCleared."""
        self._send(self.from_client.encode(ResetPrefixCache()))

    @property
    def closed(self) -> bool:
        """Shut down (by shutdown(), or after the engine died)."""
        return self.ctx.closed

    def _check_open(self) -> None:
        if self.ctx.closed:
            raise EngineDeadError("the engine was shut down; start a new one")

    def _send(self, data: bytes, copy: bool = True) -> None:
        self._check_open()
        try:
            self.to_core.send(data, zmq.NOBLOCK, copy=copy)
        except zmq.Again:
            # Without a high-water mark a PUSH send only waits when no core is connected:
            # the core has exited. Waiting would freeze the caller's event loop until the
            # watcher noticed, which it then could not.
            raise EngineDeadError(f"the engine core is gone{self._exit_codes()}") from None

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
        if self._last_word is not None:
            raise self.stopped(self._last_word)
        if self.from_core.poll(timeout_ms):
            return self._take()
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
        failed, with its exit status (those that failed first, not those shutdown ended)."""
        failed = self._exit_codes()
        self.shutdown()
        return EngineDeadError(self.failure(reason, failed or self._exit_codes()))

    def failure(self, reason: str = "", exit_codes: str | None = None) -> str:
        """The engine's death in words: the reason and the processes that failed so far."""
        codes = self._exit_codes() if exit_codes is None else exit_codes
        name = f"engine {self.label}" if self.label else "engine"
        return f"{name} stopped:{' ' if reason else ''}{reason}{codes}"

    def _exit_codes(self) -> str:
        parts = []
        for name, p in self.procs.items():
            code = p.poll()
            if code is not None and code != 0:
                status = p.exit_status() if isinstance(p, RayRank) else exit_status(code)
                parts.append(f"{name} (pid {p.pid}) {status}")
        return (" [" + "; ".join(parts) + "]") if parts else ""

    # -- shutdown ---------------------------------------------------------------------
    def shutdown(self) -> None:
        """Ask the core to stop, then make sure every child is gone and the socket folder
        with them, within SHUTDOWN_GRACE_S + SHUTDOWN_KILL_S. A stop signal meanwhile
        (in the main thread) does not interrupt this: it only ends the grace period."""
        with stop_signals_deferred():
            self._stop_children()
            if self.ray is not None:
                self.ray.shutdown()
            if not self.ctx.closed:
                self.ctx.destroy(linger=0)
            shutil.rmtree(self._dir, ignore_errors=True)

    def _stop_children(self) -> None:
        core = self.procs.get("engine core")
        # Before EngineReady the core reads no client message: only a signal stops it.
        graceful = hasattr(self, "ready") and core is not None and core.poll() is None
        if graceful:
            try:
                self.to_core.send(self.from_client.encode(ShutdownCore()), zmq.NOBLOCK)
            except zmq.ZMQError:
                graceful = False
        if graceful:
            _wait_all(self.procs.values(), time.monotonic() + SHUTDOWN_GRACE_S)
        for p in self.procs.values():
            if p.poll() is None:
                p.terminate()
        if not _wait_all(self.procs.values(), time.monotonic() + SHUTDOWN_KILL_S, hurry=False):
            for p in self.procs.values():
                if p.poll() is None:
                    p.kill()
        for p in self.procs.values():
            p.wait()

    def __enter__(self) -> EngineProcesses:
        return self

    def __exit__(self, *exc: object) -> None:
        self.shutdown()


def _wait_all(
    procs: Iterable[subprocess.Popen | RayRank], deadline: float, hurry: bool = True
) -> bool:
    """Wait until every process has exited (True) or the deadline passed (False); with
    hurry, a stop signal received meanwhile ends the wait early too."""
    procs = list(procs)
    while any(p.poll() is None for p in procs):
        if time.monotonic() >= deadline or (hurry and hurried()):
            return False
        time.sleep(EXIT_POLL_S)
    return True


def exit_status(code: int) -> str:
    """A child's return code in words."""
    return f"killed by signal {-code}" if code < 0 else f"exit status {code}"
