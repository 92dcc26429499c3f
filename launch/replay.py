"""`pagedserve replay DIR`: play a recording into fresh workers, with no core, and check
that they answer bit for bit as the recorded ones did.

This process takes the core's side of the worker protocol through an Executor of its own
(same sockets, handshake and failure reports as the core), starts the recorded number of
workers with the recorded settings, sends the recorded WorkerConfigure, then every
recorded SchedulerOutput frame. After each step it compares rank 0's ModelRunnerOutput
bytes with the recording, and every rank's block-table rows with the block ids the
recording's SchedulerOutputs assigned (launch/replay_tables.py). The first difference
stops the replay, naming the step and the request.
"""

from __future__ import annotations

import logging
import os
import shutil
import subprocess
from collections import deque
from dataclasses import dataclass
from pathlib import Path

import msgspec
import zmq

from enginecore.executor import Executor, WorkerDied
from enginecore.kv_cache_config import describe_spec_difference
from launch.client.engine_args import DEFAULT_LOG_LEVEL, EngineArgs, core_config, log_level_name
from launch.client.engine_processes import spawn
from launch.replay_tables import CoreBlockTables, ReplayMismatch
from protocol.codec import Codec
from protocol.config import ipc_address, ipc_dir
from protocol.recording import (
    CONFIGURE,
    HELLO,
    KIND_NAMES,
    OUTPUT,
    STEP,
    Recording,
    RecordingError,
)
from protocol.worker import (
    CoreToWorker,
    ModelRunnerOutput,
    SchedulerOutput,
    TierOutput,
    WorkerConfigure,
    WorkerHello,
    WorkerToCore,
    is_answered,
)

log = logging.getLogger("pagedserve.replay")


@dataclass
class ReplaySummary:
    steps: int = 0
    requests: int = 0
    scheduled_tokens: int = 0
    sampled_tokens: int = 0
    world_size: int = 1
    truncated: bool = False  # the recording's run crashed: replayed up to its last record

    def line(self) -> str:
        cut = " (the recorded run ended without closing it)" if self.truncated else ""
        return (
            f"replay ok: {self.steps} steps, {self.requests} requests, "
            f"{self.scheduled_tokens} tokens scheduled, {self.sampled_tokens} sampled, "
            f"TP {self.world_size}: outputs and block tables equal the recording{cut}"
        )


@dataclass
class _Parts:
    hellos: list[WorkerHello]
    configure: bytes
    steps: list[tuple[bytes, bytes | None]]  # (SchedulerOutput frame, its output or None)


def replay(
    directory: str | Path,
    model: str | None = None,
    timeout_s: float = 300.0,
    log_level: str = DEFAULT_LOG_LEVEL,
) -> ReplaySummary:
    """Replay a recording; ReplayMismatch at the first difference, RecordingError when it
    cannot be replayed at all (version, damage, other model)."""
    level = log_level_name(log_level)
    recording = Recording(directory)
    manifest = recording.manifest
    parts = _split(recording)
    private = ipc_dir()
    ctx = zmq.Context()
    procs: list[subprocess.Popen] = []
    executor = None
    try:
        # Replay has no client and no scheduler: the core's client addresses and its
        # scheduler settings stay unused; the spin is the machine's own, as the recorded
        # workers' settings are theirs.
        args = EngineArgs(
            model=manifest.model,
            tensor_parallel_size=manifest.world_size,
            block_size=manifest.block_size,
            startup_timeout_s=timeout_s,
            step_timeout_s=timeout_s,
            spin_us=None,
        )
        executor = Executor(
            ctx,
            core_config(
                args,
                input_address="",
                output_address="",
                worker_address=ipc_address(private, "workers"),
                log_level=level,
            ),
        )
        dist_init = f"file://{os.path.join(private, 'dist-store')}"
        for rank in range(manifest.world_size):
            config = msgspec.structs.replace(
                manifest.worker,
                model=model or manifest.model,
                rank=rank,
                core_address=executor.address,
                dist_init=dist_init if manifest.world_size > 1 else None,
                parent_pid=os.getpid(),
                log_level=level,
            )
            procs.append(spawn("worker.main", config))
        try:
            hellos = executor.handshake()
        except WorkerDied as e:
            raise RecordingError(f"the replay's workers did not start: {e}") from None
        _check_hellos(parts.hellos, hellos)
        summary = _play(executor, parts)
        summary.truncated = recording.truncated
        return summary
    finally:
        if executor is not None:
            executor.shutdown()
        for p in procs:
            try:
                p.wait(10)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()
        ctx.destroy(linger=0)
        shutil.rmtree(private, ignore_errors=True)


def _split(recording: Recording) -> _Parts:
    """The recording's records, checked to come in the order the core writes them."""
    world_size = recording.manifest.world_size
    to_core: Codec[WorkerToCore] = Codec(WorkerToCore, "recorded worker->core")
    from_core: Codec[CoreToWorker] = Codec(CoreToWorker, "recorded core->worker")
    hellos: list[WorkerHello] = []
    configure: bytes | None = None
    steps: list[tuple[bytes, bytes | None]] = []
    # Steps that schedule tokens and await their answer, oldest first: with async
    # scheduling the core sends a step before the previous one's answer is recorded.
    unanswered: deque[int] = deque()
    for kind, payload in recording.records():
        if kind == HELLO and configure is None and len(hellos) < world_size:
            hello = to_core.decode(payload)
            if not isinstance(hello, WorkerHello):
                raise RecordingError(f"a hello record holds a {type(hello).__name__}")
            hellos.append(hello)
        elif kind == CONFIGURE and configure is None and len(hellos) == world_size:
            configure = payload
        elif kind == STEP and configure is not None:
            so = from_core.decode(payload)
            if isinstance(so, SchedulerOutput) and is_answered(so):
                unanswered.append(len(steps))
            steps.append((payload, None))
        elif kind == OUTPUT and unanswered:
            i = unanswered.popleft()
            steps[i] = (steps[i][0], payload)
        else:
            raise RecordingError(
                f"{recording.dir}: a {KIND_NAMES[kind]} record out of order (after "
                f"{len(hellos)} hellos and {len(steps)} steps)"
            )
    if configure is None:
        raise RecordingError(f"{recording.dir}: the recorded run never configured its workers")
    return _Parts(hellos, configure, steps)


def _check_hellos(recorded: list[WorkerHello], now: list[WorkerHello]) -> None:
    """Workers of another model (or dtype) cannot reproduce the recording: say so first."""
    for old, new in zip(recorded, now):
        diff = describe_spec_difference(old.kv_cache_specs, new.kv_cache_specs)
        if diff is not None:
            raise RecordingError(
                f"worker rank {new.rank} reports other KV cache layers than the recorded one "
                f"({diff}): replay with the recorded model and settings"
            )


def _play(executor: Executor, parts: _Parts) -> ReplaySummary:
    from_core: Codec[CoreToWorker] = Codec(CoreToWorker, "recorded core->worker")
    to_core: Codec[WorkerToCore] = Codec(WorkerToCore, "recorded worker->core")
    configure = from_core.decode(parts.configure)
    if not isinstance(configure, WorkerConfigure):
        raise RecordingError(f"the configure record holds a {type(configure).__name__}")
    groups = configure.kv_cache_config.kv_cache_groups
    tables = CoreBlockTables([g.kv_cache_spec.block_size for g in groups])
    summary = ReplaySummary(world_size=executor.world_size)
    executor.configure_frame(parts.configure)
    requests: set[str] = set()
    # The recorded run may have ended while waiting for its last steps' answers (two with
    # async scheduling): those, and only those, may lack them.
    answered_until = max((i + 1 for i, (_, out) in enumerate(parts.steps) if out), default=0)
    for i, (frame, recorded) in enumerate(parts.steps):
        so = from_core.decode(frame)
        if not isinstance(so, SchedulerOutput):
            raise RecordingError(f"a step record holds a {type(so).__name__}")
        # Workers answer exactly the steps that schedule tokens or load tier blocks.
        answered = is_answered(so)
        if answered != (recorded is not None) and (recorded is not None or i < answered_until):
            raise RecordingError(
                f"step {so.step_id} schedules {so.total_num_scheduled_tokens} tokens but has "
                f"{'an' if recorded is not None else 'no'} output record"
            )
        tables.apply(so)  # before sending: a corrupt step is named, not run
        try:
            executor.broadcast(frame)
            if answered:
                executor.wait_output()
                assert executor.last_frame is not None
                answer = executor.last_frame.bytes
                if recorded is not None and not _same_answer(to_core, answer, recorded):
                    raise ReplayMismatch(_describe_output(so.step_id, to_core, answer, recorded))
            dumps = executor.dump_block_tables()
        except WorkerDied as e:
            raise ReplayMismatch(f"step {so.step_id}: {e}") from None
        for dump in dumps:
            tables.compare(so.step_id, dump.rank, dump.tables)
        summary.steps += 1
        requests.update(r.req_id for r in so.new_reqs)
        summary.scheduled_tokens += so.total_num_scheduled_tokens
        if recorded is not None:
            out = to_core.decode(recorded)
            assert isinstance(out, ModelRunnerOutput)
            summary.sampled_tokens += len(out.sampled_token_ids)
    summary.requests = len(requests)
    return summary


def _same_answer(codec: Codec[WorkerToCore], got: bytes, want: bytes) -> bool:
    """Equal bytes, or equal but for a KV tier report (its load time is the clock's)."""
    if got == want:
        return True
    new, old = codec.decode(got), codec.decode(want)
    if not isinstance(new, TierOutput) and not isinstance(old, TierOutput):
        return False
    n = len(ModelRunnerOutput.__struct_fields__)
    return msgspec.structs.astuple(new)[:n] == msgspec.structs.astuple(old)[:n]


def _describe_output(step: int, codec: Codec[WorkerToCore], got: bytes, want: bytes) -> str:
    """The first request whose sampled token differs, with both values."""
    new, old = codec.decode(got), codec.decode(want)
    assert isinstance(new, ModelRunnerOutput) and isinstance(old, ModelRunnerOutput)
    if new.step_id != old.step_id:
        return f"step {step}: the worker answered step {new.step_id}, the recording {old.step_id}"
    for i, (a, b) in enumerate(zip(new.req_ids, old.req_ids)):
        if a != b:
            return (
                f"step {step}: the worker's sample {i} is for request {a!r}, the recording's "
                f"for {b!r}"
            )
        if new.sampled_token_ids[i] != old.sampled_token_ids[i]:
            return (
                f"step {step}, request {a!r}: the worker sampled token "
                f"{new.sampled_token_ids[i]}, the recording has {old.sampled_token_ids[i]}"
            )
    return (
        f"step {step}: the worker sampled for requests {new.req_ids}, the recording for "
        f"{old.req_ids}"
    )
