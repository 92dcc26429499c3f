"""The worker process: handshake with the core, then run every step it sends.

    python -m worker.main - < config.json    (a WorkerConfig as JSON)

Any failure is reported to the core (WorkerFailed, with the traceback) before exiting,
so the core can name the rank and the reason.
"""

from __future__ import annotations

import functools
import logging
import os
import signal
import socket
import sys
import time
import traceback
from collections.abc import Callable
from typing import TYPE_CHECKING

import zmq

from protocol.codec import Codec
from protocol.config import WorkerConfig, any_port, parent_alive, read_config, worker_sockets
from protocol.gc_heap import freeze_startup_heap
from protocol.sockets import (
    DueWait,
    lower_timer_slack,
    send_or_drop,
    spin_budget,
    wait_for_message,
)
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
    is_answered,
)
from protocol.zmq_security import ClientKeys, load_client_keys, secure_client
from worker.generation_config import load_generation_config

if TYPE_CHECKING:
    from worker.model_runner import ModelRunner
    from worker.step_state import InFlight

log = logging.getLogger("pagedserve.worker")


def serve(config: WorkerConfig, pull: zmq.Socket, push: zmq.Socket) -> None:
    to_core: Codec[WorkerToCore] = Codec(WorkerToCore, "worker->core")
    from_core: Codec[CoreToWorker] = Codec(CoreToWorker, "core->worker")
    runner = _start_runner(config, push, to_core)
    # A worker started on its own (no parent to watch) leaves when the core goes away.
    monitor = pull.get_monitor_socket(zmq.EVENT_DISCONNECTED)
    try:
        _serve_messages(config, runner, pull, push, monitor, to_core, from_core)
    finally:
        if runner.hooks is not None:
            runner.hooks.close()
        # An open monitor socket would keep the context from terminating.
        pull.disable_monitor()
        monitor.close(linger=0)


def _start_runner(
    config: WorkerConfig, push: zmq.Socket, to_core: Codec[WorkerToCore]
) -> ModelRunner:
    """Load the model, install the config's step hooks, tell the core what this rank
    holds (WorkerHello) and settle the CPU threads; the ModelRunner."""
    # torch imports: after the sockets exist
    from worker.cpu_threads import CpuThreadTuner
    from worker.host_memory import keep_freed_memory
    from worker.model_runner import ModelRunner
    from worker.step_hooks import load_step_hooks

    log.info("worker rank %d: loading %s", config.rank, config.model)
    # Before the weights: a malformed file fails in a moment, not after the load.
    extra_eos, sampling_defaults = load_generation_config(config.model, config.generation_config)
    runner = ModelRunner(config)
    if config.step_hooks is not None:
        runner.hooks = load_step_hooks(config.step_hooks, runner)
    mc = runner.model_config
    push.send(
        to_core.encode(
            WorkerHello(
                protocol_version=PROTOCOL_VERSION,
                rank=config.rank,
                world_size=config.world_size,
                device=str(runner.device),
                kv_cache_specs=runner.kv_cache_specs(),
                available_kv_memory=runner.available_kv_memory(),
                vocab_size=mc.vocab_size,
                max_model_len=mc.max_position_embeddings,
                eos_token_ids=list(dict.fromkeys(mc.eos_token_ids + extra_eos)),
                sampling_defaults=sampling_defaults,
            )
        )
    )
    # Unpinned and alone on the cores: one core less or all of them, whichever runs faster.
    runner.cpu_threads = CpuThreadTuner.for_worker(
        runner.device, config.world_size, pinned=bool(config.cpus)
    )
    if runner.cpu_threads is not None:
        runner.cpu_threads.calibrate()
    if runner.device.type == "cpu":
        keep_freed_memory()  # before the KV cache and the first step allocate
    return runner


def _serve_messages(
    config: WorkerConfig,
    runner: ModelRunner,
    pull: zmq.Socket,
    push: zmq.Socket,
    monitor: zmq.Socket,
    to_core: Codec[WorkerToCore],
    from_core: Codec[CoreToWorker],
) -> None:
    """Handle the core's messages until it says stop or goes away."""
    core_is_alive = functools.partial(core_alive, config, monitor)  # once, not per step
    poller = zmq.Poller()
    poller.register(pull, zmq.POLLIN)
    poller.register(monitor, zmq.POLLIN)
    due = DueWait(spin_budget(config.world_size, config.spin_us))
    answered = False  # the last step was answered: the next one is due soon
    waited = False  # blocked for a due step: its arrival time tells DueWait
    ready = {pull: zmq.POLLIN}
    held: CoreToWorker | None = None  # arrived while a step ran; handled after its answer
    while True:
        if held is None:
            # Right after a step, its successor is due: catch it without a wake-up.
            if answered and due.ready(pull):
                events = ready
            else:
                waited = waited or answered
                events = dict(poller.poll(500))
            answered = False
            if monitor in events and pull not in events and not pull.poll(100):
                # The core closed its end (its shutdown message, if any, came first).
                log.warning("worker rank %d: the engine core went away; exiting", config.rank)
                return
            # Busy or idle (one getppid per step): a vanished launcher ends the group.
            if not parent_alive(config.parent_pid):
                return
            if pull not in events:
                continue
            if waited:
                due.arrived()
                waited = False
            msg = from_core.decode(pull.recv(copy=False).buffer)
        else:
            msg, held = held, None
        if isinstance(msg, SchedulerOutput):
            ran = _run_steps(msg, config, runner, pull, push, to_core, from_core, core_is_alive)
            if ran is None:
                return
            answered, held = ran
        elif isinstance(msg, WorkerConfigure):
            runner.initialize(msg)
            freeze_startup_heap()  # the model and the KV cache are in place: serving starts
            allocated = WorkerReady(
                config.rank, msg.kv_cache_config.num_blocks, runner.kv_tier_restored
            )
            push.send(to_core.encode(allocated))
        elif isinstance(msg, ShutdownWorker):
            if runner.kv_tier is not None:
                runner.kv_tier.close()  # the disk tier's queued writes land first
            return
        elif isinstance(msg, DumpBlockTables):  # replay's check; every rank answers
            push.send(to_core.encode(BlockTables(config.rank, runner.block_tables())))


def _run_steps(
    so: SchedulerOutput,
    config: WorkerConfig,
    runner: ModelRunner,
    pull: zmq.Socket,
    push: zmq.Socket,
    to_core: Codec[WorkerToCore],
    from_core: Codec[CoreToWorker],
    core_is_alive: Callable[[], bool],
) -> tuple[bool, CoreToWorker | None] | None:
    """Run so's step, and each step planned while its predecessor ran; (whether a step
    was answered, a message that arrived meanwhile), or None: the worker must stop."""
    step = runner.plan(so)
    answered = step is not None
    held: CoreToWorker | None = None
    if step is None and is_answered(so):
        # Loads only (a two-phase tier load): the core waits for their report.
        if config.rank == 0 and not send_or_drop(
            push, to_core.encode(_loads_answer(runner, so)), core_is_alive
        ):
            return None
        return True, None
    while step is not None:
        flight = runner.launch(step)
        step = None
        loads_only = None  # the next step, planned ahead: it runs loads only
        if wait_for_next(pull, runner, flight):
            # Async scheduling sent the next step already: plan it while this one runs
            # on the device.
            held = from_core.decode(pull.recv(copy=False).buffer)
            if isinstance(held, SchedulerOutput) and runner.can_plan_ahead(held):
                step = runner.plan(held)
                if step is None and is_answered(held):
                    loads_only = held
                held = None
        out = runner.collect(flight)
        if config.rank == 0 and not send_or_drop(push, to_core.encode(out), core_is_alive):
            log.warning("worker rank %d: the engine core went away", config.rank)
            return None
        if loads_only is not None:
            late = _loads_answer(runner, loads_only)
            if config.rank == 0 and not send_or_drop(push, to_core.encode(late), core_is_alive):
                return None
        if runner.hooks is not None:
            runner.hooks.answered(step is not None)
        # Steps planned back to back skip the wait for messages: check here too.
        if step is not None and not parent_alive(config.parent_pid):
            return None
    return answered, held


def _loads_answer(runner: ModelRunner, so: SchedulerOutput) -> ModelRunnerOutput:
    """The answer to a step that ran tier loads and no tokens: the loads' report."""
    out = ModelRunnerOutput(so.step_id, [], [])
    return out if runner.kv_tier is None else runner.kv_tier.answer(out)


def wait_for_next(pull: zmq.Socket, runner: ModelRunner, flight: InFlight) -> bool:
    """Whether the core's next message arrived before the launched step finished. Waits
    no longer than the step (a serial core sends nothing until it has the answer).

    Under async scheduling the next step's arrival is on the critical path (the core sent
    it right after taking the previous answer): the 0.1 ms sleeps between non-blocking
    polls used before noticed it 0.1-0.2 ms late (benchmarks/overlap.py)."""
    while True:
        left = runner.time_left(flight)
        if left <= 0:
            return bool(pull.getsockopt(zmq.EVENTS) & zmq.POLLIN)
        if wait_for_message(pull, left):
            return True


def core_alive(config: WorkerConfig, monitor: zmq.Socket) -> bool:
    """False once the core's step socket disconnected or the launcher is gone."""
    return not monitor.poll(0) and parent_alive(config.parent_pid)


def _wait_for_acceptance(config: WorkerConfig, pull: zmq.Socket) -> str | None:
    """None once the core accepts this rank; else why not (refused, no core, no parent)."""
    from_core: Codec[CoreToWorker] = Codec(CoreToWorker, "core->worker")
    deadline = time.monotonic() + config.core_timeout_s
    while time.monotonic() < deadline:
        if pull.poll(500):
            msg = from_core.decode(pull.recv())
            if isinstance(msg, WorkerAccepted):
                return None
            if isinstance(msg, WorkerRejected):
                return f"refused by the core: {msg.reason}"
            return f"expected the core's answer to connecting, got {type(msg).__name__}"
        if not parent_alive(config.parent_pid):
            return "the launcher went away"
    return (
        f"no engine core answered at {config.core_address} within "
        f"{config.core_timeout_s:g} s (--core-timeout): is it running, at that address"
        f"{', with the same --zmq-curve-keys' if config.core_address.startswith('tcp://') else ''}?"
    )


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    config = read_config("worker.main", WorkerConfig, argv)
    if isinstance(config, str):
        print(f"worker: {config}", file=sys.stderr)
        return 2
    return run(config)


def run(config: WorkerConfig) -> int:
    """Serve the core at config.core_address until it says stop; the exit status."""
    logging.basicConfig(level=config.log_level, format="%(asctime)s %(name)s: %(message)s")
    if config.parent_pid is not None:
        signal.signal(signal.SIGINT, signal.SIG_IGN)  # the launcher owns Ctrl-C
    try:
        if any_port(config.core_address) is not None:
            raise ValueError(
                f"core address {config.core_address!r} has port 0: give the port the core "
                "logged ('workers connect to --core ...')"
            )
        result_address, step_addresses = worker_sockets(config.core_address, config.world_size)
        if not 0 <= config.rank < config.world_size:
            raise ValueError(f"rank {config.rank} is outside a group of {config.world_size}")
        keys: ClientKeys | None = None
        if config.zmq_curve_keys is not None and config.core_address.startswith("tcp://"):
            keys = load_client_keys(config.zmq_curve_keys)  # KeysError is a ValueError
    except ValueError as e:
        print(f"worker: {e}", file=sys.stderr)
        return 2
    lower_timer_slack()
    ctx = zmq.Context()
    pull = ctx.socket(zmq.PULL)
    secure_client(pull, keys, config.core_address)
    pull.connect(step_addresses[config.rank])
    push = ctx.socket(zmq.PUSH)
    push.setsockopt(zmq.LINGER, 3000)
    secure_client(push, keys, config.core_address)
    push.connect(result_address)
    push.send(
        Codec(WorkerToCore, "worker->core").encode(
            WorkerConnected(
                config.rank,
                os.getpid(),
                config.node or socket.gethostname(),
                PROTOCOL_VERSION,
                config.world_size,
                config.block_size,
            )
        )
    )
    refusal = _wait_for_acceptance(config, pull)
    if refusal is not None:
        print(f"worker rank {config.rank}: {refusal}", file=sys.stderr)
        pull.close(linger=0)
        push.close(linger=0)
        ctx.term()
        return 1
    code = 0
    try:
        serve(config, pull, push)
    except Exception as e:
        if isinstance(e, ValueError):  # bad input (model files, flags): the message says it
            log.error("worker rank %d failed: %s", config.rank, e)
        else:
            log.error("worker rank %d failed:\n%s", config.rank, traceback.format_exc())
        short = f"{type(e).__name__}: {e}"
        push.send(Codec(WorkerToCore, "worker->core").encode(WorkerFailed(config.rank, short)))
        code = 1
    finally:
        pull.close(linger=0)
        push.close()  # linger: let a failure report reach the core
        ctx.term()
    return code


if __name__ == "__main__":
    raise SystemExit(main())
