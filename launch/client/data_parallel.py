"""Data parallelism behind one client: N whole engines (a core plus its TP workers each)
and a KV-aware router that sends each prompt to the replica caching most of it.

`DataParallelLLM` has AsyncLLM's interface, so the OpenAI server and every serving module
run over it unchanged; each replica is an AsyncLLM of its own (its processes, its output
reader, its death), started with KV events on and the deployment's one prefix-cache hash
seed (given, or a fresh secret), so the router can hash prompts as every replica does.
A replica that dies fails only the requests it held; the others keep serving while it is
restarted (a bounded number of times) and it rejoins routing once ready. The server is
dead only when no replica is left to restart.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import itertools
import logging
import os
import secrets
import time
from concurrent.futures import ThreadPoolExecutor
from types import ModuleType
from typing import Any

import zmq.asyncio

from launch.client.async_llm import AsyncLLM
from launch.client.engine_args import DEFAULT_LOG_LEVEL, EngineArgs
from launch.client.engine_client import OutputSink
from launch.client.engine_processes import EngineDeadError, EngineProcesses
from launch.client.inputs import PreparedPrompt
from launch.client.prefix_router import PrefixRouter, ReplicaEvents
from launch.client.ray_executor import RayPlacementError, import_ray
from protocol.engine import SamplingParams, SchedulerStats
from protocol.zmq_security import ClientKeys, load_client_keys

log = logging.getLogger("pagedserve.router")

# A replica's own event sockets: free ports on this machine, reported when it is ready.
LOCAL_EVENTS = "tcp://127.0.0.1:0"
# Restarts a replica may have over the deployment's life, and the wait before each.
DEFAULT_MAX_RESTARTS = 5
RESTART_BACKOFF_S = (0.5, 2.0, 5.0)


@dataclasses.dataclass(eq=False)
class Replica:
    index: int
    llm: AsyncLLM
    events: ReplicaEvents | None = None  # once bound to the event loop
    serving: bool = False
    restarts: int = 0
    supervisor: asyncio.Task[None] | None = None


class DataParallelLLM(AsyncLLM):
    """data_parallel_size engines behind one router. Keyword arguments as AsyncLLM's
    (EngineArgs fields); max_restarts bounds each replica's restarts."""

    def __init__(
        self,
        model: str | None = None,
        *,
        log_level: str = DEFAULT_LOG_LEVEL,
        chat_template: str | None = None,
        stream_interval: int = 1,
        max_restarts: int = DEFAULT_MAX_RESTARTS,
        **kwargs: Any,
    ) -> None:
        # Not AsyncLLM.__init__: no engine of its own; _adopt sets what the request path
        # it inherits (generate, generate_many, beam_search) reads.
        args = EngineArgs(model=model or "", **kwargs)
        args.validate()
        self.size = args.data_parallel_size
        self.max_restarts = max_restarts
        self._replica_kwargs = _replica_kwargs(args, kwargs)
        self._client_kwargs = dict(
            log_level=log_level, chat_template=chat_template, stream_interval=stream_interval
        )
        self._model = model
        seed = self._replica_kwargs["prefix_cache_hash_seed"]
        self._keys: ClientKeys | None = (
            None if args.zmq_curve_keys is None else load_client_keys(args.zmq_curve_keys)
        )
        # Ray replicas share this process's connection to the cluster: joined here, so
        # that no replica's shutdown disconnects the others.
        self._ray = None
        if self._replica_kwargs.get("distributed_executor_backend") == "ray":
            self._ray = _join_ray(args.ray_address)
        self._gpus = _gpus_per_replica(args, self._replica_kwargs)
        started = time.monotonic()
        try:
            llms = _start_all(self._new_llm, self.size)
        except BaseException:
            self._leave_ray()
            raise
        self.startup_s = time.monotonic() - started
        self.replicas = [Replica(i, llm) for i, llm in enumerate(llms)]
        self._adopt(llms[0])
        ready = llms[0].engine.ready
        self.router = PrefixRouter(
            ready.block_size, args.hash_algo, seed.encode(), args.enable_prefix_caching
        )
        self._where: dict[str, Replica] = {}  # open core request -> its replica
        self._sticky: tuple[PreparedPrompt, Replica] | None = None
        self._ctx: zmq.asyncio.Context | None = None
        log.info("%d data-parallel replicas ready in %.1f s", self.size, self.startup_s)

    @classmethod
    def from_engine_args(cls, args: EngineArgs, **client_kwargs: Any) -> DataParallelLLM:
        """The replicas of args (a Ray Serve deployment builds one this way); an empty
        model is the built-in one."""
        fields = {f.name: getattr(args, f.name) for f in dataclasses.fields(args)}
        return cls(fields.pop("model") or None, **client_kwargs, **fields)

    def _new_llm(self, index: int) -> AsyncLLM:
        kwargs = self._replica_kwargs
        if self._gpus:
            kwargs = {**kwargs, "device": f"cuda:{index % self._gpus}"}
        llm = AsyncLLM(self._model, **self._client_kwargs, **kwargs)
        llm.engine.label = f"replica {index}"
        llm.on_stats = lambda stats: self._replica_stats(index, stats)
        return llm

    def _adopt(self, first: AsyncLLM) -> None:
        """What AsyncLLM's request path reads of its engine: every replica's is the same."""
        self.stream_interval = first.stream_interval
        self.inputs, self.model, self.tokenizer = first.inputs, first.model, first.tokenizer
        self.chat_template = first.chat_template
        self.vocab_size, self.max_model_len = first.vocab_size, first.max_model_len
        self.eos_token_ids, self.sampling_defaults = first.eos_token_ids, first.sampling_defaults
        self.limits = first.limits
        self.stats: SchedulerStats | None = None
        self.on_stats = None  # called (stats, replica index) after each replica's step
        self.dead_reason: str | None = None
        self._sinks: dict[str, OutputSink] = {}
        self._closing = False
        self._ids = itertools.count()
        self._reader = None
        self._socket = None
        self._dead = asyncio.Event()
        self._closed = False

    @property
    def engine(self) -> EngineProcesses:  # type: ignore[override]
        """A serving replica's processes (their args and ready report are everyone's)."""
        for r in self.replicas:
            if r.serving:
                return r.llm.engine
        return self.replicas[0].llm.engine

    def _replica_stats(self, index: int, stats: SchedulerStats) -> None:
        self.stats = stats
        if self.on_stats is not None:
            self.on_stats(stats, index)

    # -- routing ----------------------------------------------------------------------
    def send(
        self, core_id: str, one: PreparedPrompt, params: SamplingParams, sink: OutputSink
    ) -> None:
        """Open a core request on the replica the router picks for its prompt (a prompt's
        copies, sent one after another, all go where the first went)."""
        sticky = self._sticky
        if (
            sticky is not None
            and sticky[0] is one
            and sticky[1].serving
            and sticky[1].llm.can_send()
        ):
            replica = sticky[1]
        else:
            replica = self._route(one)
            self._sticky = (one, replica)
        self._sinks[core_id] = sink
        self._where[core_id] = replica
        replica.llm.send(core_id, one, params, sink)

    def _route(self, one: PreparedPrompt) -> Replica:
        hashes = self.router.block_hashes(one.ids, one.cache_salt)
        replicas = self.replicas
        # A replica whose client already knows it died is out even before its supervisor
        # wakes to mark it: a request sent there now would only fail.
        views = [
            r.events.view if r.serving and r.events and r.llm.can_send() else None for r in replicas
        ]
        loads = [r.llm.num_open_requests for r in replicas]
        try:
            index, reason, blocks = self.router.choose(hashes, views, loads)
        except ValueError:
            raise EngineDeadError("no data-parallel replica is serving; restarting") from None
        if log.isEnabledFor(logging.DEBUG):
            log.debug(
                "route: replica %d (%s; %d of %d blocks cached there; open requests %s)",
                index, reason, blocks, len(hashes), loads,
            )  # fmt: skip
        return replicas[index]

    # -- request bookkeeping ------------------------------------------------------------
    def abort_requests(self, request_ids: list[str]) -> None:
        by_replica: dict[Replica, list[str]] = {}
        for r in request_ids:
            if self._sinks.pop(r, None) is not None:
                by_replica.setdefault(self._where.pop(r), []).append(r)
        for replica, ids in by_replica.items():
            if replica.serving:
                replica.llm.abort_requests(ids)

    def abort_all(self) -> None:
        self.abort_requests(list(self._sinks))

    def forget(self, request_id: str) -> None:
        self._sinks.pop(request_id, None)
        replica = self._where.pop(request_id, None)
        if replica is not None:
            replica.llm.forget(request_id)

    def fail_open(self, error: EngineDeadError) -> None:
        for r in self.replicas:
            r.llm.fail_open(error)  # every open request is some replica's
        self._sinks.clear()
        self._where.clear()

    def can_send(self) -> bool:
        return not self._closing and self.dead_reason is None and self.num_serving > 0

    @property
    def num_serving(self) -> int:
        return sum(r.serving for r in self.replicas)

    def reset_prefix_cache(self) -> None:
        self._check_running()
        for r in self.replicas:
            if r.serving:
                r.llm.reset_prefix_cache()

    # -- the event loop: readers, event views, supervisors --------------------------------
    def _check_running(self) -> None:
        if self.dead_reason is not None:
            raise EngineDeadError(self.dead_reason)
        if self._closing:
            raise EngineDeadError("the engine was shut down; start a new one")
        if self._ctx is None:
            self._bind_loop()
        if not self.num_serving:
            raise EngineDeadError("no data-parallel replica is serving; restarting")

    def _bind_loop(self) -> None:
        self._ctx = zmq.asyncio.Context()
        loop = asyncio.get_running_loop()
        for r in self.replicas:
            self._join(r)
            r.supervisor = loop.create_task(self._supervise(r), name=f"replica-{r.index}")

    def _join(self, r: Replica) -> None:
        """Start following a ready replica's outputs and events; route to it from now."""
        assert self._ctx is not None
        r.llm._check_running()  # its output reader, on this loop
        ready = r.llm.engine.ready
        assert ready.kv_events_endpoint and ready.kv_events_replay_endpoint
        r.events = ReplicaEvents(
            self._ctx, ready.kv_events_endpoint, ready.kv_events_replay_endpoint, self._keys
        )
        r.events.start()
        r.serving = True

    async def _supervise(self, r: Replica) -> None:
        """Wait for the replica to die; fail what it held (its client did), restart it."""
        while True:
            reason = await r.llm.wait_dead()
            r.serving = False
            if self._closing:
                return
            log.error("data-parallel replica %d stopped: %s", r.index, reason)
            self._drop_routed(r)
            if r.events is not None:
                await r.events.aclose()
                r.events = None
            await r.llm.aclose()
            if not await self._restart(r):
                if not self.num_serving and not self._restarting():
                    self._die(f"every data-parallel replica stopped; the last: {reason}")
                return

    def _restarting(self) -> bool:
        return any(
            not r.serving and r.supervisor is not None and not r.supervisor.done()
            for r in self.replicas
            if r.restarts < self.max_restarts
        )

    def _drop_routed(self, r: Replica) -> None:
        """Its client ended these requests (EngineDeadError): forget where they went."""
        for rid in [rid for rid, where in self._where.items() if where is r]:
            del self._where[rid]
            self._sinks.pop(rid, None)

    async def _restart(self, r: Replica) -> bool:
        """Start the replica again (a few tries); True once it serves."""
        attempt = 0
        while r.restarts < self.max_restarts and not self._closing:
            await asyncio.sleep(RESTART_BACKOFF_S[min(attempt, len(RESTART_BACKOFF_S) - 1)])
            r.restarts += 1
            attempt += 1
            log.warning("data-parallel replica %d: restart %d", r.index, r.restarts)
            try:
                llm = await asyncio.to_thread(self._new_llm, r.index)
            except (ValueError, EngineDeadError, OSError) as e:
                log.error("data-parallel replica %d did not start: %s", r.index, e)
                continue
            if self._closing:
                await llm.aclose()
                return False
            r.llm = llm
            self._join(r)
            log.warning("data-parallel replica %d serves again", r.index)
            return True
        log.error("data-parallel replica %d: no restarts left", r.index)
        return False

    def _die(self, reason: str) -> None:
        self.dead_reason = reason
        self.fail_open(EngineDeadError(reason))
        self._dead.set()

    async def wait_dead(self) -> str:
        if self._ctx is None:
            self._check_running()
        await self._dead.wait()
        return self.dead_reason or "the engine stopped"

    # -- shutdown -----------------------------------------------------------------------
    async def aclose(self) -> None:
        """End every open stream, stop the supervisors and every replica. Idempotent."""
        if self._closed:
            return
        self._closed = True
        self.abort_all()
        self._closing = True
        for r in self.replicas:
            if r.supervisor is not None:
                r.supervisor.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await r.supervisor
        await asyncio.gather(*(self._close_replica(r) for r in self.replicas))
        if self._ctx is not None:
            self._ctx.destroy(linger=0)
        self._leave_ray()

    async def _close_replica(self, r: Replica) -> None:
        r.serving = False
        if r.events is not None:
            await r.events.aclose()
            r.events = None
        await r.llm.aclose()

    def shutdown(self) -> None:
        """Stop every replica's processes from outside a running loop."""
        self._closing = True
        for r in self.replicas:
            r.serving = False
            r.llm.shutdown()
        self._leave_ray()

    def _leave_ray(self) -> None:
        if self._ray is not None:
            self._ray.shutdown()
            self._ray = None


def _replica_kwargs(args: EngineArgs, kwargs: dict[str, Any]) -> dict[str, Any]:
    """Each replica's EngineArgs fields: one replica each, KV events on (on free local
    ports unless given as port 0), the shared seed, and the workers where the data-
    parallel backend puts them."""
    out = dict(kwargs)
    out["data_parallel_size"] = 1
    out.pop("data_parallel_backend", None)
    out["prefix_cache_hash_seed"] = args.prefix_cache_hash_seed or secrets.token_hex(32)
    out["kv_events_endpoint"] = args.kv_events_endpoint or LOCAL_EVENTS
    out["kv_events_replay_endpoint"] = args.kv_events_replay_endpoint or LOCAL_EVENTS
    if args.data_parallel_backend is not None:
        out["distributed_executor_backend"] = args.data_parallel_backend
    return out


def _gpus_per_replica(args: EngineArgs, replica: dict[str, Any]) -> int:
    """With local workers on GPUs, how many GPUs the replicas take in turn (replica i on
    GPU i mod that); 0 where nothing needs placing (CPU, Ray, an explicit cuda:N)."""
    if replica.get("distributed_executor_backend") == "ray" or args.device not in ("auto", "cuda"):
        return 0
    gpus = _visible_gpus()
    if not gpus:
        return 0
    if args.tensor_parallel_size > 1:
        raise ValueError(
            "data-parallel replicas of several ranks each on local GPUs would share their "
            "first GPUs: use --data-parallel-backend ray (Ray gives every rank its own GPU)"
        )
    if gpus < args.data_parallel_size:
        log.warning(
            "%d replicas on %d GPU(s): they share them; lower --gpu-memory-utilization so "
            "that they fit side by side",
            args.data_parallel_size,
            gpus,
        )
    return gpus


def _visible_gpus() -> int:
    """NVIDIA GPUs this process may use, without loading CUDA here: CUDA_VISIBLE_DEVICES
    when set, else the driver's list."""
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    if visible is not None:
        return len([d for d in visible.split(",") if d.strip() and d.strip() != "-1"])
    try:
        return len(os.listdir("/proc/driver/nvidia/gpus"))
    except OSError:
        return 0


def _join_ray(address: str | None) -> ModuleType | None:
    """Ray, joined by this process (None if the program had joined it already: it stays
    joined after us)."""
    ray = import_ray()
    if ray.is_initialized():
        return None
    try:
        ray.init(address=address, include_dashboard=False, log_to_driver=True)
    except ConnectionError as e:
        raise RayPlacementError(f"cannot join a Ray cluster at {address!r}: {e}") from None
    return ray


def _start_all(start: Any, n: int) -> list[AsyncLLM]:
    """start(i) for every replica at once (each blocks until its engine is ready). If one
    fails, or a signal interrupts, the others are stopped once started."""
    with ThreadPoolExecutor(n, thread_name_prefix="replica-start") as pool:
        futures = [pool.submit(start, i) for i in range(n)]
        try:
            return [f.result() for f in futures]
        except BaseException:
            for f in futures:
                with contextlib.suppress(BaseException):
                    f.result().shutdown()
            raise
