"""Run 2 of the step-overhead benchmark: this process is the core (a real Scheduler and
Executor) and drives a real worker process; the worker's pieces are timed from outside,
through this module's entry (benchmarks/step_overhead.py --as-worker)."""

from __future__ import annotations

import cProfile
import dataclasses
import gc
import json
import os
import shutil
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

from step_overhead_common import (
    ROOT,
    Setup,
    all_decoding,
    clock,
    log,
    summarize,
    top_functions,
)

from launch.client.engine_args import DEFAULT_LOG_LEVEL, core_config, worker_config
from protocol.codec import Codec
from protocol.config import EngineCoreConfig, WorkerConfig
from protocol.engine import CoreMessage, EngineOutputs
from protocol.worker import SchedulerOutput

if TYPE_CHECKING:
    from enginecore.executor import Executor

# The script whose --as-worker entry runs the timed worker.
ENTRY = Path(__file__).resolve().with_name("step_overhead.py")
CORE_PIECES = ("schedule", "encode_so", "send", "wait", "decode_mro", "update", "client_encode")


WORKER_PIECES = ("decode", "execute", "apply", "prepare_inputs", "commit", "model", "encode")


def worker_entry(config_json: str, out_path: str, options_json: str) -> int:
    """Run worker.main unchanged, with timers around its pieces; write them at exit.

    With attention "skip" the layer's paged attention returns zeros, so the model is
    embedding, MLP and LM head (what a model without layers would cost). Pure decode
    steps after the first `profile_after` are cProfiled, the model's calls excluded."""
    import msgspec
    from bench_clock import HOOKS, SKIP_ENV

    import worker.main as worker_main
    from protocol.config import WorkerConfig

    options = json.loads(options_json)
    steps: list[dict[str, int]] = []
    prof = cProfile.Profile()
    state = {"decode_steps": 0, "profiling": False}

    _install_timers(options, steps, prof, state)
    # The benchmarks' forward skip (benchmarks/bench_clock.py), installed on the runner the
    # worker builds: it replaces whatever kernels the layers were given (replacing only the
    # reference kernel once left the batched CPU one running, whose cost evicted the host
    # path's data and put the core's CPU to sleep).
    os.environ[SKIP_ENV] = "attention" if options["attention"] == "skip" else ""
    config = msgspec.json.decode(config_json, type=WorkerConfig)
    config = msgspec.structs.replace(config, step_hooks=HOOKS)
    code = worker_main.main([msgspec.json.encode(config).decode()])
    top = top_functions(prof, options["profile_top"]) if state["profiling"] else []
    with open(out_path, "w") as f:
        json.dump({"steps": [r for r in steps if "step_id" in r], "profile_top": top}, f)
    return code


def _install_timers(
    options: dict[str, Any],
    steps: list[dict[str, int]],
    prof: cProfile.Profile,
    state: dict[str, Any],
) -> None:
    """Wrap the worker's pieces with timers that add into steps[-1] (a step opens at its
    SchedulerOutput's decode)."""
    import worker.model_runner as mr
    import worker.models.llama as llama
    from worker.block_table import MultiGroupBlockTable
    from worker.input_batch import InputBatch

    def timed(name: str, fn: Callable[..., Any], opens_step: bool = False) -> Callable[..., Any]:
        model = name == "model"

        def wrapper(*args: Any, **kwargs: Any) -> Any:
            if model and state["profiling"]:
                prof.disable()
            t0 = clock()
            result = fn(*args, **kwargs)
            dt = clock() - t0
            if model and state["profiling"]:
                prof.enable()
            if opens_step:
                steps.append({})
            if steps:
                rec = steps[-1]
                rec[name] = rec.get(name, 0) + dt
            return result

        return wrapper

    model_cls = llama.LlamaForCausalLM
    Codec.decode = timed("decode", Codec.decode, opens_step=True)  # type: ignore[method-assign]
    Codec.encode = timed("encode", Codec.encode)  # type: ignore[method-assign]
    InputBatch.apply = timed("apply", InputBatch.apply)  # type: ignore[method-assign]
    MultiGroupBlockTable.commit = timed("commit", MultiGroupBlockTable.commit)  # type: ignore[method-assign]
    mr.prepare_inputs = timed("prepare_inputs", mr.prepare_inputs)
    mr.sample = timed("model", mr.sample)
    model_cls.forward = timed("model", model_cls.forward)  # type: ignore[method-assign]
    model_cls.compute_logits = timed("model", model_cls.compute_logits)  # type: ignore[method-assign]
    plan, collect = mr.ModelRunner.plan, mr.ModelRunner.collect
    n = options["requests"]
    # This benchmark's core is serial, so the worker plans, launches and collects each
    # step in turn: "execute" is a step's time from plan to collect.

    def timed_plan(self: Any, so: SchedulerOutput) -> Any:
        if all_decoding(so, n):
            state["decode_steps"] += 1
        state["profiling"] = state["decode_steps"] > options["profile_after"]
        if state["profiling"]:
            prof.enable()
        rec = steps[-1]
        rec["step_id"] = so.step_id
        rec["plan_start"] = clock()
        step = plan(self, so)
        if step is None:  # no tokens: nothing to launch or collect
            timed_collect_end(rec)
        return step

    def timed_collect_end(rec: dict[str, int]) -> None:
        if state["profiling"]:
            prof.disable()
        rec["execute"] = clock() - rec.pop("plan_start")

    def timed_collect(self: Any, flight: Any) -> Any:
        out = collect(self, flight)
        timed_collect_end(steps[-1])
        return out

    mr.ModelRunner.plan = timed_plan  # type: ignore[method-assign]
    mr.ModelRunner.collect = timed_collect  # type: ignore[method-assign]


def run_multiprocess(s: Setup, model_dir: Path) -> dict[str, Any]:
    import zmq

    from enginecore.executor import Executor
    from protocol.config import ipc_dir

    a = s.a
    directory = ipc_dir()
    core, worker = _configs(s, model_dir, directory)
    timings_path = Path(directory) / "worker_timings.json"
    cmd = _worker_command(s, worker, timings_path)
    ctx = zmq.Context()
    executor = Executor(ctx, core)
    proc = subprocess.Popen(cmd, cwd=ROOT, stdin=subprocess.DEVNULL)
    try:
        executor.handshake()
        kv_config = executor.build_kv_cache_config(s.num_blocks)
        executor.configure(s.configure(kv_config))
        log(f"worker ready (pid {proc.pid}); {kv_config.num_blocks} KV blocks")
        prefill_steps, rec = _drive(s, executor, kv_config)
        executor.shutdown()
        if proc.wait(timeout=60) != 0:
            raise SystemExit(f"the worker exited with {proc.returncode}")
        timings = json.loads(timings_path.read_text()) if a.worker_hooks else None
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        ctx.destroy(linger=0)
        shutil.rmtree(directory, ignore_errors=True)
    return _multiprocess_result(a.worker_hooks, prefill_steps, rec, timings)


def _configs(s: Setup, model_dir: Path, directory: str) -> tuple[EngineCoreConfig, WorkerConfig]:
    """The core's and the worker's configs, made as the launcher makes them."""
    from protocol.config import ipc_address

    worker_address = ipc_address(directory, "workers")
    # spin_us: PAGEDSERVE_SPIN_US, read by EngineArgs as the launcher reads it.
    args = dataclasses.replace(s.args, model=str(model_dir), startup_timeout_s=120.0)
    core = core_config(
        args,
        input_address=ipc_address(directory, "input"),
        output_address=ipc_address(directory, "output"),
        worker_address=worker_address,
        log_level=DEFAULT_LOG_LEVEL,
    )
    worker = worker_config(
        args,
        model=args.model,
        rank=0,
        world_size=1,
        core_address=worker_address,
        parent_pid=os.getpid(),
        log_level=DEFAULT_LOG_LEVEL,
        spin_us=args.spin_us,
    )
    return core, worker


def _worker_command(s: Setup, worker: WorkerConfig, timings_path: Path) -> list[str]:
    """The timed worker (--as-worker), or plain worker.main with --no-worker-hooks."""
    import msgspec

    a = s.a
    config_json = msgspec.json.encode(worker).decode()
    if not a.worker_hooks:
        return [sys.executable, "-m", "worker.main", config_json]
    options = {
        "attention": a.attention,
        "requests": a.requests,
        "profile_after": 1 + a.warmup + a.ipc_steps,
        "profile_top": a.profile_top,
    }
    return [
        sys.executable,
        str(ENTRY),
        "--as-worker",
        config_json,
        str(timings_path),
        json.dumps(options),
    ]


def _drive(s: Setup, executor: Executor, kv_config: Any) -> tuple[int, dict[str, list[int]]]:
    """Prefill, warm up, time --ipc-steps steps and run the worker's profiled ones: the
    prefill's step count and the timed steps' pieces."""
    a = s.a
    n = a.requests
    sched = s.scheduler(kv_config)
    to_client: Codec[CoreMessage] = Codec(CoreMessage, "core->client")
    decode_ns = [0]
    decode = executor.to_core.decode

    def timed_decode(frame: bytes | memoryview) -> Any:
        t0 = clock()
        msg = decode(frame)
        decode_ns[0] = clock() - t0
        return msg

    executor.to_core.decode = timed_decode  # type: ignore[method-assign]
    encode = executor.to_worker.encode
    keys = CORE_PIECES

    def step(rec: dict[str, list[int]] | None) -> SchedulerOutput:
        t0 = clock()
        so = sched.schedule()
        t1 = clock()
        if so.total_num_scheduled_tokens == 0:  # the worker would not answer
            raise SystemExit(f"step {so.step_id} scheduled nothing")
        frame = encode(so)
        t2 = clock()
        executor.broadcast(frame)
        t3 = clock()
        mro = executor.wait_output()
        t4 = clock()
        outputs = sched.update_from_output(so, mro)
        stats = sched.stats()
        t5 = clock()
        to_client.encode(EngineOutputs(outputs, stats))
        t6 = clock()
        if rec is not None:
            wait = t4 - t3
            for key, dt in zip(
                keys, (t1 - t0, t2 - t1, t3 - t2, wait, decode_ns[0], t5 - t4, t6 - t5)
            ):
                rec[key].append(dt)
            rec["step_id"].append(so.step_id)
            rec["step"].append(t6 - t0)
        return so

    gc.collect()
    gc.freeze()
    prefill_steps = 1
    t_start = time.perf_counter()
    while not all_decoding(step(None), n):
        prefill_steps += 1
        if prefill_steps > 200:
            raise SystemExit("requests did not all reach decode within 200 steps")
    log(f"prefill: {prefill_steps} steps in {time.perf_counter() - t_start:.1f} s")
    for _ in range(a.warmup):
        step(None)
    rec: dict[str, list[int]] = {k: [] for k in (*keys, "step_id", "step")}
    t_start = time.perf_counter()
    for _ in range(a.ipc_steps):
        if not all_decoding(step(rec), n):
            raise SystemExit("a timed step was not a pure decode step of every request")
    log(f"{a.ipc_steps} timed steps in {time.perf_counter() - t_start:.1f} s")
    for _ in range(a.profile_steps if a.worker_hooks else 0):
        step(None)  # the worker profiles these
    gc.unfreeze()
    return prefill_steps, rec


def _multiprocess_result(
    worker_hooks: bool,
    prefill_steps: int,
    rec: dict[str, list[int]],
    timings: dict[str, Any] | None,
) -> dict[str, Any]:
    result: dict[str, Any] = {
        "prefill_steps": prefill_steps,
        "worker_hooks": worker_hooks,
        "step_with_model": summarize(rec["step"]),
        "schedule_update": summarize([x + y for x, y in zip(rec["schedule"], rec["update"])]),
        "core_pieces": {k: summarize(rec[k]) for k in CORE_PIECES},
    }
    if timings is None:
        result["total"] = summarize(rec["step"])
        result["note"] = "no worker timers: total includes the model's compute"
        return result
    by_step = {r["step_id"]: r for r in timings["steps"]}
    worker = [by_step[i] for i in rec["step_id"]]
    model = [w.get("model", 0) for w in worker]
    # IPC both ways: the core's wait less what the worker did between receive and send
    # and less the core's own decode of the answer (socket and poll wake-ups remain).
    ipc = [
        wait - w["decode"] - w["execute"] - w["encode"] - dec
        for wait, w, dec in zip(rec["wait"], worker, rec["decode_mro"])
    ]
    bookkeeping = [w["execute"] - m for w, m in zip(worker, model)]
    result["total"] = summarize([st - m for st, m in zip(rec["step"], model)])
    result["ipc_round_trip"] = summarize(ipc)
    result["worker_bookkeeping"] = summarize(bookkeeping)
    result["worker_model"] = summarize(model)
    result["worker_pieces"] = {k: summarize([w.get(k, 0) for w in worker]) for k in WORKER_PIECES}
    if timings["profile_top"]:
        result["worker_profile_top"] = timings["profile_top"]
    return result
