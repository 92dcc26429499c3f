#!/usr/bin/env python3
"""Where a decode step of the real model goes in the worker, component by component.

    python benchmarks/decode_profile.py [--workloads 32x264,64x200] [--steps 20]
        [--warmup 3] [--threads 1] [--modes plain,profiled]

SmolLM2-135M-Instruct (float32, tests/helpers/real_model.py) in a real ModelRunner on the CPU,
fed by the real Scheduler through the wire codecs, in this process. A workload RxL is R
greedy requests whose decode steps see about L tokens each (prompts of L - warmup -
steps / 2 tokens, +- --spread). Prefill is not what is measured and would cost a minute of compute,
so the prompts' forward is replaced by zeros (the scheduler, the batch, the block tables
and the sampler still run) and the KV cache is then filled with normal noise: decode
reads realistic values at realistic addresses.

Decode-only steps alternate between the modes, and between the --threads counts inside
each (interleaved, so a load change on the shared machine weighs on all alike):

- plain: execute() timed whole, the forward timed alone (one timer, nothing else).
- profiled: every component wrapped in a timer that counts exclusive time (a
  component's time excludes the components it calls): the codec's decode of the
  SchedulerOutput, batch.apply, prepare_inputs, block-table commit, the rest of
  prepare_step, the forward split into matmuls (every Linear but the LM head),
  attention (paged attention kernel), KV write, norms, rope (cos/sin and rotation),
  MLP activation (GatedMLP minus its linears), attention glue (LlamaAttention minus what
  it calls), residual adds (decoder layer minus what it calls), the rest of the forward
  (embedding, final norm's caller); LM head, sample, reserving the sampled tokens' slots,
  the rest of launch (row gather), the rest of collect (tolist, output assembly),
  filling the slots, the rest of plan and of execute, the encode of the
  output. A timer costs about a microsecond per call, so profiled totals run a little
  above plain ones.

Per workload and thread count: the median ms per step of every component and of the
plain totals, and every plain step's execute ms. Progress goes to stderr; the last line
of stdout is one JSON object.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import time
from collections import defaultdict
from collections.abc import Callable
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))


import torch  # noqa: E402

import worker.model_runner as model_runner_module  # noqa: E402
import worker.models.llama as llama_module  # noqa: E402
from enginecore.core import scheduler_config  # noqa: E402
from enginecore.kv_cache_config import make_kv_cache_config, with_num_blocks  # noqa: E402
from enginecore.request import Request  # noqa: E402
from enginecore.scheduler import Scheduler  # noqa: E402
from launch.client.engine_args import EngineArgs, runner_config  # noqa: E402
from pagedkernels.selection import AttentionKernels  # noqa: E402
from protocol.codec import Codec  # noqa: E402
from protocol.engine import SamplingParams  # noqa: E402
from protocol.kv_cache import NULL_BLOCK_ID  # noqa: E402
from protocol.worker import CoreToWorker, WorkerConfigure, WorkerToCore  # noqa: E402
from tests.helpers.real_model import fetch_real_model  # noqa: E402
from worker.host_memory import keep_freed_memory  # noqa: E402
from worker.layers import GatedMLP, Linear, ParallelLMHead, RMSNorm, RotaryEmbedding  # noqa: E402
from worker.model_runner import ModelRunner  # noqa: E402

BLOCK_SIZE = 16
FORWARD_PARTS = (
    "matmul",
    "attention",
    "kv_write",
    "norm",
    "rope",
    "mlp_act",
    "attention_glue",
    "residual",
    "forward_other",
)


def log(msg: str) -> None:
    print(f"[decode_profile] {msg}", file=sys.stderr, flush=True)


class Timers:
    """Exclusive time per component: a nested timed call's time is taken out of its caller's."""

    def __init__(self) -> None:
        self.ms: dict[str, float] = defaultdict(float)
        self._inner: list[float] = []
        self._undo: list[Callable[[], None]] = []

    def wrap(self, name: str, fn: Callable[..., Any]) -> Callable[..., Any]:
        inner, ms = self._inner, self.ms

        def timed(*args: Any, **kwargs: Any) -> Any:
            inner.append(0.0)
            t0 = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                elapsed = (time.perf_counter() - t0) * 1e3
                ms[name] += elapsed - inner.pop()
                if inner:
                    inner[-1] += elapsed

        return timed

    def patch(self, owner: Any, attr: str, name: str) -> None:
        """Time owner.attr (an instance's method or a module's function) until unpatch()."""
        self.replace(owner, attr, self.wrap(name, getattr(owner, attr)))

    def replace(self, owner: Any, attr: str, value: Any) -> None:
        had = attr in vars(owner)
        old = getattr(owner, attr)
        setattr(owner, attr, value)
        if had:
            self._undo.append(lambda: setattr(owner, attr, old))
        else:
            self._undo.append(lambda: delattr(owner, attr))

    def unpatch(self) -> None:
        while self._undo:
            self._undo.pop()()

    def take(self) -> dict[str, float]:
        out = dict(self.ms)
        self.ms.clear()
        return out


def instrument(timers: Timers, runner: ModelRunner, codecs: tuple[Codec, Codec]) -> None:
    batch = runner.batch
    assert batch is not None
    timers.patch(codecs[0], "decode", "decode_so")
    timers.patch(codecs[1], "encode", "encode_output")
    timers.patch(runner, "execute", "execute_other")
    timers.patch(runner, "plan", "plan_other")
    timers.patch(batch, "apply", "apply")
    timers.patch(runner, "prepare_step", "prepare_step_other")
    timers.patch(model_runner_module, "prepare_inputs", "prepare_inputs")
    timers.patch(batch.block_table, "commit", "commit")
    timers.patch(runner, "launch", "launch_other")
    timers.patch(runner, "collect", "collect_other")
    timers.patch(model_runner_module, "sample", "sample")
    timers.patch(batch, "reserve", "reserve")
    timers.patch(batch, "fill_reserved", "fill_reserved")
    timers.patch(runner.model, "forward", "forward_other")
    timers.patch(llama_module, "apply_rotary", "rope")
    for module in runner.model.modules():
        if isinstance(module, ParallelLMHead):
            timers.patch(module, "forward", "lm_head")
        elif isinstance(module, Linear):
            timers.patch(module, "forward", "matmul")
        elif isinstance(module, RMSNorm):
            timers.patch(module, "forward", "norm")
        elif isinstance(module, RotaryEmbedding):
            timers.patch(module, "forward", "rope")
        elif isinstance(module, GatedMLP):
            timers.patch(module, "forward", "mlp_act")
        elif isinstance(module, llama_module.LlamaAttention):
            timers.patch(module, "forward", "attention_glue")
            k = module.kernels
            timers.replace(
                module,
                "kernels",
                AttentionKernels(
                    k.name,
                    timers.wrap("kv_write", k.write_kv_cache),
                    timers.wrap("attention", k.paged_attention),
                ),
            )
        elif isinstance(module, llama_module.LlamaDecoderLayer):
            timers.patch(module, "forward", "residual")


def make_runner(model_dir: Path) -> ModelRunner:
    args = EngineArgs(model=str(model_dir), block_size=BLOCK_SIZE, device="cpu", dtype="float32")
    return ModelRunner(runner_config(args))


class DecodeLoop:
    """The real Scheduler driving the runner through the wire codecs, in this process, on
    num_reqs greedy requests whose decode steps see about `context` tokens."""

    def __init__(
        self, runner: ModelRunner, num_reqs: int, context: int, a: argparse.Namespace
    ) -> None:
        self.runner = runner
        self.prompt_len = prompt_len = context - a.warmup - a.steps // 2
        max_model_len = prompt_len + a.spread + a.warmup + a.steps + 2
        specs = runner.kv_cache_specs()
        groups = make_kv_cache_config(specs, 1 << 40).kv_cache_groups
        num_blocks = 1 + num_reqs * -(-max_model_len // BLOCK_SIZE)
        kv_config = with_num_blocks(groups, num_blocks)
        max_tokens = num_reqs * (prompt_len + a.spread)
        settings = EngineArgs(
            model="unused", max_num_batched_tokens=max_tokens, max_num_seqs=num_reqs
        )
        self.scheduler = Scheduler(
            scheduler_config(settings, max_model_len=max_model_len),
            kv_config,
            runner.model_config.vocab_size,
        )
        runner.initialize(WorkerConfigure(kv_config, num_reqs, max_model_len, max_tokens))
        self.to_worker = Codec(CoreToWorker, "core->worker")
        self.to_core = Codec(WorkerToCore, "worker->core")
        self._add_requests(num_reqs, a)

    def _add_requests(self, num_reqs: int, a: argparse.Namespace) -> None:
        rng = random.Random(a.seed)
        vocab = self.runner.model_config.vocab_size
        # The prefill loop ends on the first decode-only step: one more token than its count.
        params = SamplingParams(max_tokens=a.warmup + a.steps + 2, temperature=0, ignore_eos=True)
        hasher = self.scheduler.kv_cache_manager.block_hasher
        for i in range(num_reqs):
            # Lengths spread around the mean: attention then pads and masks as it does live.
            n = self.prompt_len + rng.randint(-a.spread, a.spread)
            prompt = [rng.randrange(3, vocab) for _ in range(n)]
            req = Request(f"r{i}", prompt, hasher, sampling_params=params)
            if self.scheduler.add_request(req) is not None:
                raise SystemExit(f"request r{i} was refused")

    def step(self) -> tuple[float, bool]:
        """One engine step; the ms its execute took, and whether it was decode-only."""
        scheduler, runner = self.scheduler, self.runner
        to_worker, to_core = self.to_worker, self.to_core
        so = scheduler.schedule()
        decode_only = so.total_num_scheduled_tokens == len(so.num_scheduled_tokens)
        t0 = time.perf_counter()
        out = runner.execute(to_worker.decode(to_worker.encode(so)))
        frame = None if out is None else to_core.encode(out)
        ms = (time.perf_counter() - t0) * 1e3
        if frame is not None:
            scheduler.update_from_output(so, to_core.decode(frame))
        return ms, decode_only

    def prefill_then_noise(self, a: argparse.Namespace) -> None:
        """Prefill without its compute (module docstring), noise in every KV slot, then
        the warm-up decode steps."""
        runner = self.runner
        hidden = runner.model_config.hidden_size
        real_forward = runner.model.forward
        runner.model.forward = lambda ids, *_: torch.zeros(ids.shape[0], hidden)  # type: ignore[method-assign]
        while not self.step()[1]:
            pass
        del runner.model.forward
        assert runner.model.forward == real_forward
        gen = torch.Generator().manual_seed(a.seed)
        for k_cache, v_cache in runner.kv_caches:
            for cache in (k_cache, v_cache):
                cache.normal_(generator=gen)
                cache[NULL_BLOCK_ID].fill_(float("nan"))
        for _ in range(a.warmup):
            self.step()

    def finish(self) -> None:
        while self.scheduler.has_unfinished_requests():
            self.step()
        self.step()  # the finishing step frees the worker's rows


class StepTimes:
    """Per thread count: plain steps' execute and forward ms, profiled steps' components."""

    def __init__(self, threads: list[int]) -> None:
        self.plain_ms: dict[int, list[float]] = {t: [] for t in threads}
        self.forward_ms: dict[int, list[float]] = {t: [] for t in threads}
        self.profiled: dict[int, list[dict[str, float]]] = {t: [] for t in threads}

    def by_threads(self, t: int) -> dict[str, Any]:
        def med(xs: list[float]) -> float | None:
            return round(statistics.median(xs), 3) if xs else None

        profiled = self.profiled[t]
        names = sorted({k for p in profiled for k in p})
        components = {n: med([p.get(n, 0.0) for p in profiled]) for n in names}
        if profiled:
            components["forward_sum"] = med(
                [sum(p.get(n, 0.0) for n in FORWARD_PARTS) for p in profiled]
            )
        return {
            "execute_ms": med(self.plain_ms[t]),
            "forward_ms": med(self.forward_ms[t]),
            "execute_ms_all": [round(x, 2) for x in self.plain_ms[t]],
            "forward_ms_all": [round(x, 2) for x in self.forward_ms[t]],
            "profiled_ms": components,
        }


def time_steps(loop: DecodeLoop, a: argparse.Namespace, threads: list[int]) -> StepTimes:
    """The timed decode steps, modes and thread counts interleaved step by step."""
    runner = loop.runner
    timers = Timers()
    fwd = Timers()
    modes = [(m, t) for m in a.modes for t in threads]
    times = StepTimes(threads)
    for i in range(a.steps):
        mode, t = modes[i % len(modes)]
        torch.set_num_threads(t)
        if mode == "plain":
            fwd.patch(runner.model, "forward", "forward")
            ms, decode_only = loop.step()
            fwd.unpatch()
            times.plain_ms[t].append(ms)
            times.forward_ms[t].append(fwd.take()["forward"])
        else:
            instrument(timers, runner, (loop.to_worker, loop.to_core))
            ms, decode_only = loop.step()
            timers.unpatch()
            parts = timers.take()
            parts["total"] = ms
            times.profiled[t].append(parts)
        if not decode_only:
            raise AssertionError(f"step {i} was not decode-only")
    return times


def run_workload(
    runner: ModelRunner, num_reqs: int, context: int, a: argparse.Namespace, threads: list[int]
) -> dict[str, Any]:
    loop = DecodeLoop(runner, num_reqs, context, a)
    loop.prefill_then_noise(a)
    times = time_steps(loop, a, threads)
    loop.finish()
    by_threads = {str(t): times.by_threads(t) for t in threads}
    return {"prompt_len": loop.prompt_len, "by_threads": by_threads}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--workloads", default="32x264,64x200", help="REQUESTSxCONTEXT, comma-separated")
    p.add_argument("--steps", type=int, default=20, help="timed decode steps per workload")
    p.add_argument("--warmup", type=int, default=3, help="decode steps before timing")
    p.add_argument("--threads", default="1", help="torch thread counts to interleave, e.g. 1,2")
    p.add_argument("--modes", default="plain,profiled", help="plain and/or profiled")
    p.add_argument("--spread", type=int, default=32, help="prompt lengths vary by +- this")
    p.add_argument("--seed", type=int, default=0)
    a = p.parse_args(argv)
    keep_freed_memory()  # as the worker process does on a CPU
    a.modes = a.modes.split(",")
    if not set(a.modes) <= {"plain", "profiled"} or a.steps < 1:
        raise SystemExit("--modes takes plain and/or profiled; --steps must be >= 1")
    threads = [int(t) for t in a.threads.split(",")]
    runner = make_runner(fetch_real_model())
    results: dict[str, Any] = {}
    for w in a.workloads.split(","):
        num_reqs, context = (int(x) for x in w.split("x"))
        log(f"{num_reqs} requests x ~{context} tokens, {a.steps} steps, threads {threads}")
        results[w] = run_workload(runner, num_reqs, context, a, threads)
        for t, r in results[w]["by_threads"].items():
            log(f"  {t} thread(s): execute {r['execute_ms']} ms, forward {r['forward_ms']} ms")
            log(f"    {r['profiled_ms']}")
    print(json.dumps({"workloads": results, "steps": a.steps, "threads": threads}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
