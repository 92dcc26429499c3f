"""Run 1 of the step-overhead benchmark: every piece of a decode step in one process, each
timed on its own (benchmarks/step_overhead.py)."""

from __future__ import annotations

import cProfile
import dataclasses
import gc
import statistics
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

from step_overhead_common import NOT_PROFILED, Setup, all_decoding, clock, summarize, top_functions

from enginecore.scheduler import Scheduler
from launch.client.engine_args import runner_config
from protocol.codec import Codec
from protocol.engine import CoreMessage, EngineOutputs
from protocol.worker import CoreToWorker, ModelRunnerOutput, SchedulerOutput, WorkerToCore

if TYPE_CHECKING:
    from worker.model_runner import ModelRunner

# Consecutive pieces of one in-process step, in order ("fake_model" is not host work).
INPROC_KEYS = (
    "schedule",
    "encode_so",
    "decode_so",
    "apply",
    # Three pieces of prepare_step timed again on their own, for the breakdown only.
    "prepare_inputs",
    "slot_mapping",
    "commit",
    "prepare_step",
    "fake_model",
    "append_sampled",
    "encode_mro",
    "decode_mro",
    "update",
    "client_encode",
)
CORE_KEYS = ("schedule", "encode_so", "decode_mro", "update", "client_encode")
WORKER_KEYS = (
    "decode_so",
    "apply",
    "prepare_step",
    "append_sampled",
    "encode_mro",
)


def run_inprocess(s: Setup, model_dir: Path, profile_steps: int) -> dict[str, Any]:
    """Per-step nanoseconds of every piece (and the frame sizes), and the profiles."""
    a = s.a
    n = a.requests
    runner, sched = _inprocess_engine(s, model_dir)
    batch = runner.batch
    core_prof = cProfile.Profile()
    worker_prof = cProfile.Profile()
    step = _inprocess_step(runner, sched, a.vocab, core_prof, worker_prof)
    gc.collect()
    gc.freeze()
    prefill_steps = 0
    while not all_decoding(step(None), n):
        prefill_steps += 1
        if prefill_steps > 200:
            raise SystemExit("requests did not all reach decode within 200 steps")
    for _ in range(a.warmup):
        step(None)
    rec: dict[str, list[int]] = {k: [] for k in (*INPROC_KEYS, "so_bytes", "mro_bytes")}
    for _ in range(a.steps):
        if not all_decoding(step(rec), n):
            raise SystemExit("a timed step was not a pure decode step of every request")
    for _ in range(profile_steps):
        step(None, profile=True)
    gc.unfreeze()
    if sched.num_preemptions:
        raise SystemExit(f"{sched.num_preemptions} preemptions: the KV cache is too small")
    run: dict[str, Any] = {"rec": rec, "prefill_steps": prefill_steps + 1}
    # Token ids of a 32000-word vocabulary take 3 bytes each in msgpack; ours are small.
    ids = batch.req_ids
    tokens = [1000 + 31 * int(r) % 30000 for r in ids]
    big = Codec(WorkerToCore, "worker->core").encode(ModelRunnerOutput(sched.step_id, ids, tokens))
    run["mro_bytes_vocab_32000"] = len(big)
    if profile_steps:
        run["profile"] = {
            "steps": profile_steps,
            "core_schedule_update_top": top_functions(core_prof, a.profile_top),
            "worker_bookkeeping_top": top_functions(worker_prof, a.profile_top),
        }
    return run


def _inprocess_engine(s: Setup, model_dir: Path) -> tuple[ModelRunner, Scheduler]:
    """A real ModelRunner configured as the core would, and the scheduler holding every
    request."""
    from enginecore.kv_cache_config import make_kv_cache_config, with_num_blocks
    from worker.model_runner import ModelRunner

    runner = ModelRunner(runner_config(dataclasses.replace(s.args, model=str(model_dir))))
    # As Executor.build_kv_cache_config does with a num_gpu_blocks override.
    sized = make_kv_cache_config(runner.kv_cache_specs(), runner.available_kv_memory())
    kv_config = with_num_blocks(sized.kv_cache_groups, s.num_blocks)
    runner.initialize(s.configure(kv_config))
    assert runner.batch is not None
    return runner, s.scheduler(kv_config)


def _inprocess_step(
    runner: ModelRunner,
    sched: Scheduler,
    vocab: int,
    core_prof: cProfile.Profile,
    worker_prof: cProfile.Profile,
) -> Callable[..., SchedulerOutput]:
    """One step of every piece in turn, timed into rec (or profiled, or neither)."""
    import numpy as np

    from worker.model_inputs import prepare_inputs

    batch = runner.batch
    core_to_worker: Codec[CoreToWorker] = Codec(CoreToWorker, "core->worker")
    worker_from_core: Codec[CoreToWorker] = Codec(CoreToWorker, "core->worker")
    worker_to_core: Codec[WorkerToCore] = Codec(WorkerToCore, "worker->core")
    core_from_worker: Codec[WorkerToCore] = Codec(WorkerToCore, "worker->core")
    to_client: Codec[CoreMessage] = Codec(CoreMessage, "core->client")

    def step(rec: dict[str, list[int]] | None, profile: bool = False) -> SchedulerOutput:
        # cProfile.Profile is a context manager; a step is either profiled or timed.
        core = core_prof if profile else NOT_PROFILED
        worker = worker_prof if profile else NOT_PROFILED
        t = [clock()]
        with core:
            so = sched.schedule()
        t.append(clock())
        frame = core_to_worker.encode(so)
        t.append(clock())
        with worker:
            wso = worker_from_core.decode(frame)
            assert isinstance(wso, SchedulerOutput)
            t.append(clock())
            batch.apply(wso)
            t.append(clock())
            inputs = prepare_inputs(batch, wso)
            t.append(clock())
            slots = [np.empty(len(inputs.positions), np.int64) for _ in batch.block_table.tables]
            batch.block_table.compute_slot_mapping(inputs.req_rows, inputs.positions, slots)
            t.append(clock())
            batch.block_table.commit(batch.num_reqs)
            t.append(clock())
            # The rest of ModelRunner's host path before the model: tensors, sampling.
            prepared = runner.prepare_step(wso)
            req_ids = prepared.sampling_req_ids
        t.append(clock())
        # The fake model: as the peer's, one token per sampler (its rows hold the outputs).
        done = (batch.num_tokens - batch.num_prompt_tokens)[prepared.sampling_rows].tolist()
        tokens = [(1000 + 31 * int(r) + k) % vocab for r, k in zip(req_ids, done)]
        t.append(clock())
        with worker:
            batch.append_sampled(req_ids, tokens, prepared.sampling_rows)
            t.append(clock())
            out_frame = worker_to_core.encode(ModelRunnerOutput(wso.step_id, req_ids, tokens))
        t.append(clock())
        mro = core_from_worker.decode(out_frame)
        assert isinstance(mro, ModelRunnerOutput)
        t.append(clock())
        with core:
            outputs = sched.update_from_output(so, mro)
            stats = sched.stats()
        t.append(clock())
        to_client.encode(EngineOutputs(outputs, stats))
        t.append(clock())
        if rec is not None:
            for key, t0, t1 in zip(INPROC_KEYS, t, t[1:]):
                rec[key].append(t1 - t0)
            rec["so_bytes"].append(len(frame))
            rec["mro_bytes"].append(len(out_frame))
        return so

    return step


def summarize_inprocess(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """Medians over the steps of every in-process run, pooled; each run's own too."""
    rec = {k: [x for r in runs for x in r["rec"][k]] for k in runs[0]["rec"]}
    steps = len(rec["schedule"])
    parts = (*CORE_KEYS, *WORKER_KEYS)
    su = [x + y for x, y in zip(rec["schedule"], rec["update"])]
    core = [sum(rec[k][i] for k in CORE_KEYS) for i in range(steps)]
    worker = [sum(rec[k][i] for k in WORKER_KEYS) for i in range(steps)]
    total = [sum(rec[k][i] for k in parts) for i in range(steps)]
    so_bytes = sorted(rec["so_bytes"])
    result: dict[str, Any] = {
        "runs": len(runs),
        "prefill_steps": runs[0]["prefill_steps"],
        "schedule_update": summarize(su),
        "schedule_update_median_us_per_run": [
            summarize([x + y for x, y in zip(r["rec"]["schedule"], r["rec"]["update"])])[
                "median_us"
            ]
            for r in runs
        ],
        "core": summarize(core),
        "worker_bookkeeping": summarize(worker),
        "total_without_ipc": summarize(total),
        "pieces": {k: summarize(rec[k]) for k in INPROC_KEYS if k != "fake_model"},
        "scheduler_output_bytes": {
            "median": statistics.median(so_bytes),
            "min": so_bytes[0],
            "max": so_bytes[-1],
        },
        "model_runner_output_bytes": statistics.median(rec["mro_bytes"]),
        "model_runner_output_bytes_vocab_32000": runs[0]["mro_bytes_vocab_32000"],
    }
    if "profile" in runs[0]:
        result["profile"] = runs[0]["profile"]
    return result
