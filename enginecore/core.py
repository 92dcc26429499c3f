"""The EngineCore process: client requests in, schedule, fan out, outputs back.

Runs without torch. It blocks on its sockets when idle (no spinning), and when a worker
is lost it fails every open request with the reason, tells the client, and exits.

    python -m enginecore.core - < config.json    (an EngineCoreConfig as JSON)
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import logging
import os
import shutil
import signal
import sys
import traceback
from collections import deque
from collections.abc import Callable
from typing import Any

import msgspec
import zmq
from zmq.auth.thread import ThreadAuthenticator

from enginecore.errors import ConfigError, InvariantViolation
from enginecore.executor import Executor, WorkerDied
from enginecore.kv_cache_config import describe_spec_difference
from enginecore.kv_event_publisher import KVEventPublisher
from enginecore.kv_step_log import describe_kv_step
from enginecore.kv_tier import tier_settings
from enginecore.scheduler import DuplicateRequestId, Scheduler, SchedulerConfig
from protocol.codec import Codec, ProtocolError
from protocol.config import (
    EngineCoreConfig,
    max_num_batched_tokens_for,
    parent_alive,
    prefill_tokens_per_request_for,
    read_config,
)
from protocol.engine import (
    AbortRequests,
    AddRequest,
    ClientMessage,
    CoreMessage,
    EngineDead,
    EngineOutputs,
    EngineReady,
    Rejection,
    RequestOutput,
    ResetPrefixCache,
    ShutdownCore,
)
from protocol.gc_heap import freeze_startup_heap
from protocol.kv_cache import KVCacheConfig
from protocol.kv_events import MEDIUM_CPU, MEDIUM_GPU, KVCacheEvent
from protocol.sockets import lower_timer_slack, send_or_drop
from protocol.worker import (
    CachedRequestData,
    SchedulerOutput,
    WorkerConfigure,
    WorkerHello,
    is_answered,
    with_kv_tier,
)
from protocol.zmq_security import (
    KeysError,
    ServerKeys,
    load_server_keys,
    secure_server,
    start_authenticator,
)

log = logging.getLogger("pagedserve.core")
# Pools up to this many blocks are checked every step (PAGEDSERVE_CHECK_INVARIANTS).
_CHECKED_BLOCKS = 16384


# The scheduler's settings that EngineCoreConfig and EngineArgs both carry, by name.
SCHEDULER_SETTINGS = (
    "speculative_config",
    "max_num_batched_tokens",
    "prefill_tokens_per_request",
    "max_num_seqs",
    "enable_prefix_caching",
    "hash_algo",
    "scheduling_policy",
)


def scheduler_config(settings: object, *, device: str = "cpu", **fields: Any) -> SchedulerConfig:
    """A scheduler's config: SCHEDULER_SETTINGS read from settings (the core's
    EngineCoreConfig, or EngineArgs where a test or tool runs a Scheduler in-process),
    plus the fields known only once the workers answered (max_model_len, ...); an unset
    token budget takes the default of the workers' device."""
    values = {name: getattr(settings, name) for name in SCHEDULER_SETTINGS}
    values["max_num_batched_tokens"] = max_num_batched_tokens_for(
        device, values["max_num_batched_tokens"]
    )
    values["prefill_tokens_per_request"] = prefill_tokens_per_request_for(
        device, values["prefill_tokens_per_request"]
    )
    return SchedulerConfig(**values, **fields)


class ClientGone(RuntimeError):
    """The launcher vanished: nobody will read another output."""


class EngineCore:
    # Built by start() once the workers have said what KV cache they hold; the loop
    # runs only after it.
    scheduler: Scheduler

    def __init__(self, config: EngineCoreConfig) -> None:
        self.config = config
        self.ctx = zmq.Context()
        self.keys: ServerKeys | None = None
        self.auth: ThreadAuthenticator | None = None
        if config.zmq_curve_keys is not None:
            try:
                self.keys = load_server_keys(config.zmq_curve_keys)
            except KeysError as e:
                raise ConfigError(f"--zmq-curve-keys: {e}") from None
            # Before any socket listens: no handshake may pass unchecked.
            self.auth = start_authenticator(self.ctx, self.keys)
        self.inp = self.ctx.socket(zmq.PULL)
        secure_server(self.inp, self.keys, config.input_address)
        self.inp.connect(config.input_address)
        self.out = self.ctx.socket(zmq.PUSH)
        self.out.setsockopt(zmq.LINGER, 2000)
        secure_server(self.out, self.keys, config.output_address)
        self.out.connect(config.output_address)
        self.from_client: Codec[ClientMessage] = Codec(ClientMessage, "client->core")
        self.to_client: Codec[CoreMessage] = Codec(CoreMessage, "core->client")
        self.executor = Executor(self.ctx, config, self.keys)
        # Built once: _send runs every step and must not make a bound method each time.
        self._client_alive = functools.partial(parent_alive, config.parent_pid)
        self.kv_events: KVEventPublisher | None = None
        self._take_kv_events: Callable[[], list[KVCacheEvent]] = list  # bound at start
        self._stop = False
        # Steps sent and not yet answered, oldest first. With async scheduling the next
        # step is sent while one runs (at most two: the workers never idle between steps,
        # and the core never plans further ahead than one step it has not seen).
        self._in_flight: deque[SchedulerOutput] = deque()
        self._pending: EngineOutputs | None = None  # the last answer's, until _flush
        self._max_in_flight = 2 if config.async_scheduling else 1
        self._check = config.check_invariants
        self._check_every = 1
        if config.log_kv:
            kv_log.setLevel(logging.INFO)

    # -- start-up ---------------------------------------------------------------------
    def start(self) -> None:
        log.info(
            "engine core: waiting for %d worker(s) at %s",
            self.config.world_size,
            self.executor.address,
        )
        hellos = self.executor.handshake()
        first = hellos[0]
        max_model_len = self._check_hellos(hellos)
        kv_config = self.executor.build_kv_cache_config(self.config.num_gpu_blocks)
        tier = tier_settings(self.config, kv_config)
        sched_config = scheduler_config(
            self.config,
            device=first.device,
            max_model_len=max_model_len,
            hash_seed=hash_seed(self.config),
            enable_kv_events=self.config.kv_events_endpoint is not None,
            kv_events_medium=MEDIUM_CPU if first.device == "cpu" else MEDIUM_GPU,
            kv_tier_slots=tier.kv_tier_slots,
            kv_tier_disk_slots=tier.kv_tier_dir_slots,
            kv_tier_load_bytes=self.config.kv_tier_load_bytes or 0,
        )
        self.scheduler = self._fitted_scheduler(sched_config, kv_config, first)
        # The invariant walk is linear in the pool: a large one is walked every few steps,
        # so that checking costs each step about what a pool of _CHECKED_BLOCKS does.
        self._check_every = -(-kv_config.num_blocks // _CHECKED_BLOCKS)
        max_model_len = self.scheduler.config.max_model_len
        if self.config.kv_events_endpoint is not None:
            self._start_kv_events(self.config.kv_events_endpoint)
        readies = self.executor.configure(
            WorkerConfigure(
                kv_cache_config=kv_config,
                max_num_reqs=sched_config.max_num_seqs,
                max_model_len=max_model_len,
                max_num_batched_tokens=sched_config.max_num_batched_tokens,
                **dataclasses.asdict(tier),
            )
        )
        kv_tier = self.scheduler.kv_cache_manager.tier
        if kv_tier is not None and tier.kv_tier_dir is not None:
            restored = kv_tier.restore([r.kv_tier_restored for r in readies])
            log.info("KV tier: %d block(s) restored from %s", restored, tier.kv_tier_dir)
        block_size = kv_config.kv_cache_groups[0].kv_cache_spec.block_size
        kv = self.scheduler.kv_cache_manager
        per_request = kv.max_blocks_held(max_model_len, sched_config.max_num_batched_tokens)
        log.info(
            "KV cache: %d blocks of %d tokens in %d group(s), %.2f GiB per worker; "
            "max_model_len %d, %d request(s) of that length at once",
            kv_config.num_blocks,
            block_size,
            len(kv_config.kv_cache_groups),
            sum(t.size for t in kv_config.kv_cache_tensors) / (1 << 30),
            max_model_len,
            kv.num_usable_blocks // max(per_request, 1),
        )
        self._warn_concurrency(kv.num_usable_blocks // max(per_request, 1), max_model_len)
        if self._check:
            # The checks slow every step: the log says why a run is slower than it should be.
            log.info("engine core: checking the KV invariants after every step")
        self._send(
            EngineReady(
                num_gpu_blocks=kv_config.num_blocks,
                block_size=block_size,
                max_model_len=max_model_len,
                vocab_size=first.vocab_size,
                eos_token_ids=first.eos_token_ids,
                sampling_defaults=first.sampling_defaults,
                kv_events_endpoint=self.kv_events and self.kv_events.endpoint,
                kv_events_replay_endpoint=self.kv_events and self.kv_events.replay_endpoint,
                device=first.device,
            )
        )

    def _warn_concurrency(self, fits: int, max_model_len: int) -> None:
        """Say so when max_num_seqs requests of max_model_len tokens cannot all hold their
        KV at once: running that many that long preempts and recomputes some of them."""
        seqs = self.scheduler.config.max_num_seqs
        if fits < seqs:
            log.warning(
                "the KV cache holds %d request(s) of max_model_len %d at once, fewer than "
                "max_num_seqs %d: requests that long, that many at once, are preempted and "
                "recomputed; --kv-cache-memory (or --num-gpu-blocks) makes room, a lower "
                "--max-num-seqs or --max-model-len asks for less",
                fits,
                max_model_len,
                seqs,
            )

    def _fitted_scheduler(
        self, config: SchedulerConfig, kv_config: KVCacheConfig, first: WorkerHello
    ) -> Scheduler:
        """The scheduler over this pool. Without --max-model-len, a pool too small for one
        request of the model's whole context serves the longest request it holds instead
        (a first run should start, not stop on a number the engine can work out); an
        explicit length that does not fit is still refused."""

        def build(c: SchedulerConfig) -> Scheduler:
            return Scheduler(
                c, kv_config, first.vocab_size, first.eos_token_ids, first.sampling_defaults
            )

        scheduler = build(config)
        if self.config.max_model_len is not None:
            scheduler.check_capacity()
            return scheduler
        kv = scheduler.kv_cache_manager
        fits = kv.longest_request(config.max_model_len, config.max_num_batched_tokens)
        if fits == config.max_model_len or fits == 0:
            scheduler.check_capacity()  # fits whole, or refused: not even one token fits
            return scheduler
        log.warning(
            "max_model_len %d: the KV cache (%d blocks) holds one request of at most %d "
            "tokens, not the model's %d; --kv-cache-memory or --num-gpu-blocks makes room",
            fits,
            kv.num_usable_blocks,
            fits,
            config.max_model_len,
        )
        return build(dataclasses.replace(config, max_model_len=fits))

    def _check_hellos(self, hellos: list[WorkerHello]) -> int:
        """Every rank runs the same model: the max_model_len to serve, within its limit."""
        first = hellos[0]
        for hello in hellos[1:]:
            diff = describe_spec_difference(first.kv_cache_specs, hello.kv_cache_specs)
            if diff is not None:
                raise WorkerDied(
                    f"worker rank {hello.rank} reports KV cache specs that differ from "
                    f"rank 0 ({diff}): start every rank with the same model and flags"
                )
        model_len = first.max_model_len
        max_model_len = self.config.max_model_len or model_len
        if max_model_len > model_len:
            raise ConfigError(
                f"max_model_len {max_model_len} exceeds the model's limit of {model_len} "
                f"positions (max_position_embeddings)"
            )
        return max_model_len

    def _start_kv_events(self, endpoint: str) -> None:
        try:
            self.kv_events = KVEventPublisher(
                self.ctx,
                endpoint,
                self.config.kv_events_replay_endpoint,
                self.config.kv_events_buffer_steps,
                self.config.kv_events_topic,
                keys=self.keys,
            )
        except zmq.ZMQError as e:
            raise ConfigError(f"KV events endpoint: {e}") from None
        self._take_kv_events = self.scheduler.take_kv_events

    # -- loop -------------------------------------------------------------------------
    def run(self) -> None:
        scheduler = self.scheduler
        poller = zmq.Poller()
        poller.register(self.inp, zmq.POLLIN)
        self.executor.watch(poller)
        kv_events = self.kv_events
        if kv_events is not None and kv_events.replay is not None:
            poller.register(kv_events.replay, zmq.POLLIN)
        in_flight = self._in_flight
        while not self._stop:
            busy = bool(in_flight) or scheduler.has_unfinished_requests()
            # Idle: block (waking twice a second to notice a vanished parent).
            events = dict(poller.poll(0 if busy else 500))
            self.executor.check_workers(events)
            if self.inp in events:
                self._drain_input()
            # Busy or idle: a launcher killed without a word must not leave us computing
            # for nobody (one getppid per step).
            if not parent_alive(self.config.parent_pid):
                log.warning("engine core: the launcher went away; exiting")
                return
            if in_flight or scheduler.has_unfinished_requests():
                self._step()
            if self._pending is not None and not (in_flight or scheduler.has_unfinished_requests()):
                self._flush()  # no step to send first
            if kv_events is not None:
                kv_events.publish(scheduler.take_kv_events())  # a prefix-cache reset
                kv_events.serve_replays()
        self._flush()

    def _drain_input(self) -> None:
        scheduler = self.scheduler
        errors: list[RequestOutput] = []
        rejected: list[Rejection] = []
        while True:
            try:
                frame = self.inp.recv(zmq.NOBLOCK, copy=False)
            except zmq.Again:
                break
            try:
                msg = self.from_client.decode(frame.buffer)
            except ProtocolError as e:
                log.error("%s", e)  # a bad frame from a client fails alone
                errors.extend(_answer_malformed(frame.buffer, e))
                continue
            if isinstance(msg, AddRequest):
                try:
                    errors.extend(self._add(msg))
                except DuplicateRequestId as e:
                    rejected.append(Rejection(msg.request_id, str(e)))
            elif isinstance(msg, AbortRequests):
                errors.extend(scheduler.abort_requests(msg.request_ids))
            elif isinstance(msg, ResetPrefixCache):
                ok = scheduler.reset_prefix_cache()
                log.info("reset prefix cache: %s", "done" if ok else "refused, blocks in use")
            elif isinstance(msg, ShutdownCore):
                self._stop = True
        if errors or rejected:
            # With the stats: an abort frees blocks now, and a client watching KV usage
            # (the server's /metrics) must not wait for the next step to see it.
            self._send(EngineOutputs(errors, scheduler.stats(), rejected))

    def _add(self, msg: AddRequest) -> list[RequestOutput]:
        scheduler = self.scheduler
        try:
            request = scheduler.new_request(
                msg.request_id,
                msg.prompt_token_ids,
                msg.sampling_params,
                msg.cache_salt,
                msg.priority,
            )
        except ValueError as e:
            return [RequestOutput(msg.request_id, [], "error", 0, str(e))]
        error = scheduler.add_request(request)
        return [error] if error is not None else []

    def _step(self) -> None:
        """Send the next step if there is room in flight, then take the oldest step's
        answer when the queue is full or nothing new could be sent. Serial scheduling is
        the same with room for one step."""
        scheduler = self.scheduler
        in_flight = self._in_flight
        sent = False
        limit = self._max_in_flight
        spec = scheduler.spec
        if (
            spec is not None
            and in_flight
            and spec.serial(in_flight[-1], scheduler.running, scheduler.step_id + 1)
        ):
            limit = 1  # drafts need the last answer first (Speculator.serial)
        if len(in_flight) < limit and scheduler.has_unfinished_requests():
            so = scheduler.schedule()
            # An empty schedule while a step runs is a wait for its answer, not a step.
            if self.config.log_kv and (so.total_num_scheduled_tokens or not in_flight):
                kv_log.info("%s", describe_kv_step(scheduler.kv_cache_manager, so))
            if is_answered(so):  # tokens, or two-phase tier loads to report on
                self.executor.send(so)
                in_flight.append(so)
                sent = True
            else:
                if so.finished_req_ids or so.preempted_req_ids:
                    self.executor.send(so)  # no rank answers it
                # With a step in flight, its answer may free what the head request needs.
                outputs = [] if in_flight else scheduler.fail_unschedulable()
                if outputs:
                    self._send(EngineOutputs(outputs, scheduler.stats()))
        self._flush()
        if in_flight and (len(in_flight) >= limit or not sent):
            so = in_flight.popleft()
            # With a further step queued the answer comes at the device's pace: nap.
            result = self.executor.wait_output(nap=bool(in_flight))
            try:
                outputs = scheduler.update_from_output(so, result)
            except InvariantViolation:
                raise  # the core's own bug: not the worker's answer
            except ValueError as e:
                raise WorkerDied(f"worker rank 0 answered step {so.step_id} wrongly: {e}") from None
            if self._check and so.step_id % self._check_every == 0:
                scheduler.check_invariants()
            # Published once the next step is on its way (_flush): the workers start on
            # it while the client's outputs are encoded and sent, instead of after.
            self._pending = EngineOutputs(outputs, scheduler.stats())

    def _flush(self) -> None:
        """Send the outputs of the last answer, if not sent yet."""
        pending = self._pending
        if pending is not None:
            self._pending = None
            self._send(pending)

    def _send(self, msg: object) -> None:
        self._flush()  # a request's outputs must reach the client in order
        if self.kv_events is not None:
            # A step's events go out before its outputs: a router that sees a request
            # finish already knows the blocks it left cached.
            self.kv_events.publish(self._take_kv_events())
        if not send_or_drop(self.out, self.to_client.encode(msg), self._client_alive):
            raise ClientGone("the launcher went away")

    def _persist_kv_tier(self) -> None:
        """A last step of no tokens: a disk tier stores the blocks still on the device."""
        ops = self.scheduler.kv_cache_manager.flush_to_tier()
        if ops is not None:
            self.scheduler.step_id += 1
            empty = CachedRequestData([], [], [], [], [])
            step = SchedulerOutput(self.scheduler.step_id, [], empty, [], 0, [], [])
            self.executor.send(with_kv_tier(step, ops))

    def fail(self, reason: str) -> None:
        """Fail every open request with reason, tell the client (if it is still there),
        stop the workers."""
        started = hasattr(self, "scheduler")  # start() may have failed before it
        outputs = self.scheduler.fail_all(reason) if started else []
        with contextlib.suppress(ClientGone):
            self._send(EngineDead(reason, outputs))

    def close(self) -> None:
        if self.kv_events is not None:
            self.kv_events.close()
        if hasattr(self, "scheduler"):
            with contextlib.suppress(WorkerDied):  # a lost worker keeps what it wrote
                self._persist_kv_tier()
        self.executor.shutdown()
        if self.auth is not None:
            self.auth.stop()
        self.ctx.destroy(linger=1000)


# Its own logger, at INFO even when the engine logs only warnings: --log-kv asks for it.
kv_log = logging.getLogger("pagedserve.kv")


def hash_seed(config: EngineCoreConfig) -> bytes:
    """The block-hash root's secret: the deployment's seed (--prefix-cache-hash-seed-file
    or its variable), else random per start."""
    if config.prefix_cache_hash_seed is not None:
        return config.prefix_cache_hash_seed.encode()
    return os.urandom(16)


def _answer_malformed(frame: memoryview, error: ProtocolError) -> list[RequestOutput]:
    """An AddRequest whose fields do not decode still names its request id: fail that
    request with the reason, so its client is not left waiting for an answer."""
    try:
        raw = msgspec.msgpack.decode(frame)
    except msgspec.DecodeError:
        return []
    if isinstance(raw, dict) and raw.get("type") == "add":
        rid = raw.get("request_id")
        if isinstance(rid, str):
            return [RequestOutput(rid, [], "error", 0, f"request {rid}: {error}")]
    return []


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    # The launcher owns Ctrl-C: it shuts us down in order. Its SIGTERM (a shutdown in a
    # hurry) still runs our clean-up below.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, _exit_on_sigterm)
    config = read_config("enginecore.core", EngineCoreConfig, argv)
    if isinstance(config, str):
        print(f"enginecore: {config}", file=sys.stderr)
        return 2
    logging.basicConfig(level=config.log_level, format="%(asctime)s %(name)s: %(message)s")
    lower_timer_slack()  # the executor's due waits are sub-millisecond
    try:
        core = EngineCore(config)
    except ConfigError as e:  # e.g. the worker address is taken
        log.error("%s", e)
        return 1
    code = 0
    try:
        core.start()
        freeze_startup_heap()
        core.run()
    except ClientGone as e:
        log.warning("engine core: %s; exiting", e)
        code = 1
    except (WorkerDied, ConfigError) as e:
        log.error("%s", e)
        core.fail(str(e))
        code = 1
    except Exception as e:  # a bug in the core: say what, then go down cleanly
        log.error("engine core crashed:\n%s", traceback.format_exc())
        core.fail(f"engine core crashed: {type(e).__name__}: {e}")
        code = 1
    finally:
        core.close()
        if config.private_dir:
            # Last one out: the launcher removes the folder too, but it may be killed
            # without a word at any moment, even after we are gone. The sockets in it are
            # connected already; the workers that are left are stopping.
            shutil.rmtree(config.private_dir, ignore_errors=True)
    return code


def _exit_on_sigterm(signum: int, _frame: object) -> None:
    # Once: a second SIGTERM must not interrupt the clean-up the first one started.
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    raise SystemExit(128 + signum)


if __name__ == "__main__":
    exit_code = main()
    # Clean-up is done: a late SIGTERM would only interrupt the interpreter's exit
    # (logging's flush at exit printed a traceback).
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    raise SystemExit(exit_code)
