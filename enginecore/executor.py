"""Fans each step out to every worker rank and collects rank 0's answer.

One PUSH socket per rank (the core binds, so each socket has exactly one peer and a
disconnect names the rank), one PULL socket for all answers. Every rank receives the
same encoded bytes. With record_dir set, those bytes and rank 0's answers are also
written to a recording (protocol/recording.py); launch/replay.py drives an Executor
of its own to play a recording back.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import time

import zmq

from enginecore.errors import ConfigError
from enginecore.kv_cache_config import (
    make_kv_cache_config,
    unify_kv_cache_configs,
    with_num_blocks,
)
from protocol.codec import Codec, ProtocolError
from protocol.config import EngineCoreConfig, any_port, parent_alive, worker_sockets
from protocol.kv_cache import KVCacheConfig
from protocol.kv_memory import core_memory_error
from protocol.recording import CONFIGURE, HELLO, OUTPUT, STEP, Recorder, RecordingError
from protocol.sockets import DueWait, send_or_drop, spin_budget
from protocol.worker import (
    PROTOCOL_VERSION,
    BlockTables,
    CoreToWorker,
    DumpBlockTables,
    ModelRunnerOutput,
    SchedulerOutput,
    ShutdownWorker,
    WorkerAccepted,
    WorkerConfigure,
    WorkerConnected,
    WorkerFailed,
    WorkerHello,
    WorkerReady,
    WorkerRejected,
    WorkerToCore,
)
from protocol.zmq_security import PeerWatch, ServerKeys, secure_server

log = logging.getLogger("pagedserve.core")

# The most blocks the engine sizes itself to without --num-gpu-blocks. Real models on
# today's GPUs stay far below (an 8B Llama on 141 GB: ~60k blocks of 16); a toy model on a
# big GPU would otherwise ask the core for tens of millions of block objects (seconds of
# start-up and gigabytes of host memory) that no workload fills.
MAX_AUTO_NUM_BLOCKS = 1 << 20
# tcp://HOST:0: how many random base ports to try for a free run of world_size + 1.
MAX_BIND_TRIES = 100


class WorkerDied(RuntimeError):
    """A worker failed or vanished; the message names the rank and why."""


class Executor:
    def __init__(
        self, ctx: zmq.Context, config: EngineCoreConfig, keys: ServerKeys | None = None
    ) -> None:
        self.config = config
        self.world_size = config.world_size
        self.to_core: Codec[WorkerToCore] = Codec(WorkerToCore, "worker->core")
        self.to_worker: Codec[CoreToWorker] = Codec(CoreToWorker, "core->worker")
        self.push = [ctx.socket(zmq.PUSH) for _ in range(config.world_size)]
        self.results = ctx.socket(zmq.PULL)
        for sock in (*self.push, self.results):
            sock.setsockopt(zmq.LINGER, 0)
            secure_server(sock, keys, config.worker_address)
        self.address = self._bind(config.worker_address)
        # A rank is lost when its step socket's worker disconnects; strangers refused at
        # the handshake are not ranks.
        self.peers = [PeerWatch(sock) for sock in self.push]
        self.monitors = [peer.monitor for peer in self.peers]
        # Liveness checks for send_or_drop, built once (broadcast runs every step).
        self._rank_alive = [
            functools.partial(self._is_rank_alive, r) for r in range(self.world_size)
        ]
        self._due = DueWait(spin_budget(config.world_size, config.spin_us))
        self.poller = zmq.Poller()
        self.poller.register(self.results, zmq.POLLIN)
        for monitor in self.monitors:
            self.poller.register(monitor, zmq.POLLIN)
        self.hellos: list[WorkerHello] = []
        # Each admitted rank's process and host (or launcher-given node), named if it is lost.
        self.where: dict[int, str] = {}
        # The frame behind _recv's last message: recordings keep bytes, not re-encodings.
        self.last_frame: zmq.Frame | None = None
        self.recorder: Recorder | None = None
        if config.record_dir is not None:
            if config.record_worker is None:
                raise RecordingError("record_dir needs record_worker (the workers' settings)")
            self.recorder = Recorder(config.record_dir, config.record_worker)

    # -- start-up ---------------------------------------------------------------------
    def _bind(self, address: str) -> str:
        """Bind the results and step sockets at address; return the address workers
        must be given. For tcp://HOST:0 the core takes a free run of ports itself and
        logs it, so nobody picks a port that is taken before it is bound."""
        host = any_port(address)
        if host is None:
            try:
                result_address, step_addresses = worker_sockets(address, self.world_size)
            except ValueError as e:
                raise ConfigError(str(e)) from None
            for sock, where in zip((self.results, *self.push), (result_address, *step_addresses)):
                try:
                    sock.bind(where)
                except zmq.ZMQError as e:
                    raise ConfigError(
                        f"cannot listen for workers at {where}: {e.strerror} (choose another "
                        "--worker-address, or port 0 to let the core pick free ports)"
                    ) from None
            return address
        for _ in range(MAX_BIND_TRIES):
            base = self.results.bind_to_random_port(f"tcp://{host}", max_port=65535 - 64)
            resolved = f"tcp://{host}:{base}"
            bound = []
            step_addresses = worker_sockets(resolved, self.world_size)[1]
            try:
                for sock, step_address in zip(self.push, step_addresses):
                    sock.bind(step_address)
                    bound.append((sock, step_address))
            except zmq.ZMQError as e:
                if e.errno != zmq.EADDRINUSE:
                    raise
                for sock, step_address in bound:
                    sock.unbind(step_address)
                self.results.unbind(self.results.last_endpoint.decode())
                continue
            log.warning("engine core: workers connect to --core %s", resolved)
            return resolved
        raise RuntimeError(f"no run of {self.world_size + 1} free ports found on {host}")

    def handshake(self) -> list[WorkerHello]:
        """Wait for every rank's hello within the timeout; check protocol and ranks."""
        deadline = time.monotonic() + self.config.handshake_timeout_s
        hellos: dict[int, WorkerHello] = {}
        frames: dict[int, bytes] = {}
        connected: dict[int, WorkerConnected] = {}
        while len(hellos) < self.world_size:
            msg = self._recv(deadline, "hello")
            if msg is None:
                raise WorkerDied(self._missing(connected, hellos))
            if isinstance(msg, WorkerConnected):
                self._admit(msg)
                connected[msg.rank] = msg
                continue
            if not isinstance(msg, WorkerHello):
                raise WorkerDied(f"expected a worker hello, got {type(msg).__name__}")
            if msg.protocol_version != PROTOCOL_VERSION:
                raise WorkerDied(
                    f"worker rank {msg.rank} speaks protocol {msg.protocol_version}, "
                    f"the core speaks {PROTOCOL_VERSION}: versions differ"
                )
            self._check_rank(msg.rank, msg.world_size)
            if msg.rank in hellos:
                raise WorkerDied(f"two workers claim rank {msg.rank}")
            hellos[msg.rank] = msg
            if self.recorder is not None and self.last_frame is not None:
                frames[msg.rank] = self.last_frame.bytes
        self.hellos = [hellos[r] for r in range(self.world_size)]
        if self.recorder is not None:
            for r in range(self.world_size):
                self.recorder.write(HELLO, frames[r])
        return self.hellos

    def _admit(self, msg: WorkerConnected) -> None:
        """Accept a connecting rank, or tell it (and the user) which setting differs, before
        it spends minutes loading a model or waits for a group that never forms."""
        config = self.config
        problems = []
        if msg.protocol_version != PROTOCOL_VERSION:
            problems.append(f"protocol {msg.protocol_version} (the core: {PROTOCOL_VERSION})")
        if msg.world_size != self.world_size:
            problems.append(f"--tp {msg.world_size} (the core: --tp {self.world_size})")
        if config.block_size is not None and msg.block_size != config.block_size:
            problems.append(
                f"--block-size {msg.block_size} (the core: --block-size {config.block_size})"
            )
        if not 0 <= msg.rank < self.world_size:
            problems.append(f"--rank {msg.rank} (the core's ranks: 0..{self.world_size - 1})")
        if not problems:
            self.where[msg.rank] = f"pid {msg.pid} on {msg.host}"
            self.push[msg.rank].send(self.to_worker.encode(WorkerAccepted()))
            return
        reason = (
            f"worker rank {msg.rank} (pid {msg.pid} on {msg.host}) was started with "
            f"{', '.join(problems)}: start the core and every worker with the same settings"
        )
        if 0 <= msg.rank < self.world_size:
            self.push[msg.rank].send(self.to_worker.encode(WorkerRejected(reason)))
        raise WorkerDied(reason)

    def _check_rank(self, rank: int, world_size: int) -> None:
        if not 0 <= rank < self.world_size or world_size != self.world_size:
            raise WorkerDied(
                f"worker rank {rank} of {world_size} does not fit a group of {self.world_size}"
            )

    def _missing(self, connected: dict[int, WorkerConnected], hellos: dict) -> str:
        waited = f"{self.config.handshake_timeout_s:g} s"
        never = [r for r in range(self.world_size) if r not in connected and r not in hellos]
        stuck = [r for r in connected if r not in hellos]
        parts = []
        if never:
            parts.append(
                f"worker rank(s) {never} never connected to {self.config.worker_address} "
                f"within {waited}"
            )
        if stuck:
            where = ", ".join(
                f"rank {r} (pid {connected[r].pid} on {connected[r].host})" for r in stuck
            )
            parts.append(
                f"{where} connected but did not finish loading (or waited for "
                f"the missing ranks to join the group)"
            )
        return "; ".join(parts)

    def build_kv_cache_config(self, num_gpu_blocks: int | None) -> KVCacheConfig:
        configs = []
        for hello in self.hellos:
            if not hello.kv_cache_specs:
                raise WorkerDied(f"worker rank {hello.rank} reported no KV cache layers")
            try:
                configs.append(
                    make_kv_cache_config(hello.kv_cache_specs, hello.available_kv_memory)
                )
            except ValueError as e:
                raise WorkerDied(f"worker rank {hello.rank}: {e}") from None
        try:
            common = unify_kv_cache_configs(configs)
        except ValueError as e:
            raise WorkerDied(f"the ranks' KV caches cannot be unified: {e}") from None
        return size_kv_cache(common, num_gpu_blocks)

    def configure(self, message: WorkerConfigure) -> list[WorkerReady]:
        return self.configure_frame(self.to_worker.encode(message))

    def configure_frame(self, frame: bytes) -> list[WorkerReady]:
        """Broadcast an encoded WorkerConfigure; wait until every rank allocated; their
        answers."""
        if self.recorder is not None:
            self.recorder.write(CONFIGURE, frame)
        self.broadcast(frame)
        deadline = time.monotonic() + self.config.handshake_timeout_s
        ready: set[int] = set()
        readies: list[WorkerReady] = []
        while len(ready) < self.world_size:
            msg = self._recv(deadline, "ready")
            if msg is None:
                missing = sorted(set(range(self.world_size)) - ready)
                raise WorkerDied(f"worker rank(s) {missing} did not allocate their KV cache")
            if not isinstance(msg, WorkerReady):
                raise WorkerDied(f"expected worker ready, got {type(msg).__name__}")
            ready.add(msg.rank)
            readies.append(msg)
        return readies

    # -- steps ------------------------------------------------------------------------
    def send(self, so: SchedulerOutput) -> None:
        """Send a step to every rank. Rank 0 answers it (wait_output) when it schedules
        tokens; steps are answered in the order they were sent."""
        frame = self.to_worker.encode(so)
        if self.recorder is not None:
            # Before sending: the step that brings a worker down is the one to keep.
            self.recorder.write(STEP, frame)
        self.broadcast(frame)

    def execute(self, so: SchedulerOutput) -> ModelRunnerOutput:
        """Run a step on every rank; rank 0's answer."""
        self.send(so)
        return self.wait_output()

    def broadcast(self, frame: bytes) -> None:
        for rank, sock in enumerate(self.push):
            if not send_or_drop(sock, frame, self._rank_alive[rank]):
                raise WorkerDied(self.describe_loss(rank, "its next step"))

    def _is_rank_alive(self, rank: int) -> bool:
        """False once rank's step socket reported a disconnect (or the launcher is gone)."""
        return not self.peers[rank].check() and parent_alive(self.config.parent_pid)

    def watch(self, poller: zmq.Poller) -> None:
        """Register the ranks' disconnect monitors, for check_workers."""
        for monitor in self.monitors:
            poller.register(monitor, zmq.POLLIN)

    def check_workers(self, events: dict) -> None:
        """WorkerDied naming the rank if poller events show one disconnected."""
        for rank, monitor in enumerate(self.monitors):
            if monitor in events and self.peers[rank].check():
                raise WorkerDied(self.describe_loss(rank, "next step"))

    def wait_output(self, nap: bool = False) -> ModelRunnerOutput:
        """The oldest step's answer. nap: sleep through most of the wait (DueWait), for a
        step with another queued behind it."""
        timeout = self.config.step_timeout_s
        msg: WorkerToCore | None
        if self._due.ready(self.results, nap):  # a short step's answer: no wake-up
            msg = self._take_result()
        else:
            msg = self._recv(time.monotonic() + timeout, "model output")
            self._due.arrived()
        if msg is None:
            raise WorkerDied(
                f"worker rank 0 did not answer a step within {timeout:g} s (--step-timeout): "
                "a rank is stopped, hung or stuck in a collective"
            )
        if not isinstance(msg, ModelRunnerOutput):
            raise WorkerDied(f"expected a model output, got {type(msg).__name__}")
        if self.recorder is not None:
            assert self.last_frame is not None
            self.recorder.write(OUTPUT, self.last_frame.buffer)
        return msg

    def dump_block_tables(self) -> list[BlockTables]:
        """Debugging (replay only): every rank's block-table rows after the steps sent so
        far, in rank order."""
        self.broadcast(self.to_worker.encode(DumpBlockTables()))
        deadline = time.monotonic() + self.config.step_timeout_s
        dumps: dict[int, BlockTables] = {}
        while len(dumps) < self.world_size:
            msg = self._recv(deadline, "block tables")
            if msg is None:
                missing = sorted(set(range(self.world_size)) - set(dumps))
                raise WorkerDied(f"worker rank(s) {missing} did not dump their block tables")
            if not isinstance(msg, BlockTables):
                raise WorkerDied(f"expected block tables, got {type(msg).__name__}")
            dumps[msg.rank] = msg
        return [dumps[r] for r in range(self.world_size)]

    def shutdown(self) -> None:
        frame = self.to_worker.encode(ShutdownWorker())
        for sock in self.push:
            with contextlib.suppress(zmq.ZMQError):
                sock.send(frame, zmq.NOBLOCK)
        if self.recorder is not None:
            self.recorder.close()

    def _recv(self, deadline: float | None, waiting_for: str) -> WorkerToCore | None:
        """Next worker message; None at the deadline; WorkerDied if a rank is lost."""
        while True:
            timeout = 500
            if deadline is not None:
                left = deadline - time.monotonic()
                if left <= 0:
                    return None
                timeout = min(timeout, int(left * 1000) + 1)
            events = dict(self.poller.poll(timeout))
            for rank, monitor in enumerate(self.monitors):
                if monitor in events and self.peers[rank].check():
                    raise WorkerDied(self.describe_loss(rank, waiting_for))
            if self.results in events:
                return self._take_result()
            if not parent_alive(self.config.parent_pid):
                raise WorkerDied("the launching process is gone")

    def _take_result(self) -> WorkerToCore:
        """The worker message that waits on the results socket."""
        frame = self.results.recv(copy=False)
        self.last_frame = frame
        try:
            msg = self.to_core.decode(frame.buffer)
        except ProtocolError as e:
            raise WorkerDied(str(e)) from None
        if isinstance(msg, WorkerFailed):
            raise WorkerDied(self._describe_failure(msg))
        return msg

    def _describe_failure(self, msg: WorkerFailed) -> str:
        return self._diagnose([msg], "next step")

    def describe_loss(self, rank: int, waiting_for: str) -> str:
        return self._diagnose([], waiting_for, lost=rank)

    def _diagnose(
        self, failures: list[WorkerFailed], waiting_for: str, lost: int | None = None
    ) -> str:
        """Which rank went first. A rank that vanished without a word is the cause; ranks
        that then failed (a collective lost its peer) are named after it."""
        deadline = time.monotonic() + 0.5
        while time.monotonic() < deadline:
            if self.results.poll(20):
                try:
                    msg = self.to_core.decode(self.results.recv())
                except ProtocolError:
                    continue
                if isinstance(msg, WorkerFailed):
                    failures.append(msg)
        failed = {f.rank for f in failures}
        silent = [
            r for r, p in enumerate(self.peers) if (r == lost or p.check()) and r not in failed
        ]
        parts = [
            f"worker rank {r} disconnected while the core waited for its {waiting_for} "
            f"(killed or crashed without a word{self._ran_as(r)})"
            for r in silent[:1]
        ]
        lead = "then " if parts else ""
        parts += [f"worker rank {f.rank} {lead}failed: {f.error}" for f in failures]
        return "; ".join(parts) or "a worker disconnected"

    def _ran_as(self, rank: int) -> str:
        where = self.where.get(rank)
        return f"; it ran as {where}" if where else ""


def size_kv_cache(config: KVCacheConfig, num_gpu_blocks: int | None) -> KVCacheConfig:
    """The workers' common config with the block count the engine will use: the user's
    --num-gpu-blocks, else what memory allows up to MAX_AUTO_NUM_BLOCKS."""
    if num_gpu_blocks is not None:
        if num_gpu_blocks < 2:
            raise ConfigError(f"num_gpu_blocks must be >= 2, got {num_gpu_blocks}")
        error = core_memory_error(num_gpu_blocks)
        if error is not None:
            raise ConfigError(error)
        return with_num_blocks(config.kv_cache_groups, num_gpu_blocks)
    if config.num_blocks > MAX_AUTO_NUM_BLOCKS:
        log.warning(
            "KV cache capped at %d blocks (the workers' memory allows %d); "
            "--num-gpu-blocks sets it",
            MAX_AUTO_NUM_BLOCKS,
            config.num_blocks,
        )
        return with_num_blocks(config.kv_cache_groups, MAX_AUTO_NUM_BLOCKS)
    return config
