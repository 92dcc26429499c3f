"""Benchmark-only instruments of the worker, installed on it through WorkerConfig.step_hooks
(HOOKS; worker/step_hooks.py) and off unless their variables are set.

PAGEDSERVE_BENCH_STEP_DELAY_MS: every step that runs tokens keeps a modelled device busy
  this much longer, as a GPU would: the device starts on a step when its launch begins
  (or when it finishes the previous step, if later) and finishes no earlier than the
  launch's end; collecting the step's tokens waits for it (a sleep: the CPU stays free).
  So a benchmark can give the model step a known length on any machine, and the worker
  can do host work meanwhile (benchmarks/overlap.py).
PAGEDSERVE_BENCH_SKIP=attention|layers: on the CPU the worker's thread runs the model
  itself, work a GPU's host thread only queues; with the delay above standing in for the
  device, this shrinks that forward toward a launch's cost (benchmarks/overlap.py --skip).
  "attention": every attention layer returns zeros instead of attending (the cache is
  still written). "layers": every decoder layer passes its input through, so a step is
  the embedding, the final norm, the LM head and sampling; each token still depends on
  the one fed in (so placeholder tokens are still checked) but no cache is written.
  Outputs are meaningless, but the same in every scheduling mode.
PAGEDSERVE_BENCH_WORKER_TIMING: a file the worker writes at exit, as JSON: the steps it
  ran, and how many of them it planned while their predecessor ran; the seconds its
  host thread spent on them (from planning a step to answering it, overlaps counted
  once), waiting between them, and launching them; and the modelled device's busy
  seconds and its span from its first step's start to its last step's end.
"""

from __future__ import annotations

import json
import time
from collections.abc import Iterable
from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING, Any, get_args

import torch

from protocol import envs
from worker.step_hooks import StepHooks

if TYPE_CHECKING:
    from worker.model_runner import ModelRunner

DELAY_ENV = envs.BENCH_STEP_DELAY_MS
TIMING_ENV = envs.BENCH_WORKER_TIMING
SKIP_ENV = envs.BENCH_SKIP
# What a benchmark puts in PAGEDSERVE_WORKER_HOOKS (WorkerConfig.step_hooks).
HOOKS = f"{Path(__file__).resolve()}:install"
SPIN_S = 2e-4  # the modelled device's end is waited for spinning this long
SKIPS: tuple[str, ...] = get_args(envs.BenchSkip)


def install(runner: ModelRunner) -> DeviceClock | None:
    """The worker's hook: skip what PAGEDSERVE_BENCH_SKIP names, and model the device
    when a delay or a timing file is asked for."""
    skipped = skip_requested()
    if skipped is not None:
        skip(skipped, runner.model.model.layers)
    return DeviceClock.from_env()


def skip_requested() -> str | None:
    """What of the forward the worker skips: None, "attention" or "layers"."""
    return envs.bench_skip()


def _no_attention(query: torch.Tensor, *_args: object, **_kwargs: object) -> torch.Tensor:
    return torch.zeros_like(query)


def _pass_through(x: torch.Tensor, *_args: object, **_kwargs: object) -> torch.Tensor:
    return x


def skip(what: str, decoder_layers: Iterable[Any]) -> None:
    """Skip `what` (one of SKIPS) in every decoder layer; the attention kernels' name says
    so (the worker logs it)."""
    if what not in SKIPS:
        raise ValueError(f"cannot skip {what!r}: one of {', '.join(SKIPS)}")
    for layer in decoder_layers:
        attention = layer.self_attn
        k = attention.kernels
        if what == "attention":
            attention.kernels = replace(
                k, name=f"{k.name}, attention skipped", paged_attention=_no_attention
            )
        else:
            attention.kernels = replace(k, name=f"{k.name}, layers skipped")
            # An instance attribute: nn.Module.__call__ looks forward up on the instance.
            layer.forward = _pass_through


class DeviceClock(StepHooks):
    def __init__(self, delay_s: float, path: str | None) -> None:
        self.delay_s = delay_s
        self.path = path
        self.steps = 0
        self.planned_ahead = 0  # steps planned while their predecessor ran
        self.busy_s = 0.0  # host thread, between plan and answer
        self.idle_s = 0.0
        self.device_busy_s = 0.0
        self.launch_s = 0.0  # host time queueing steps (on the CPU: running the model)
        self._busy_since: float | None = None
        self._idle_since: float | None = None  # no idle time counts before the first step
        self._launch_begin = 0.0
        self._device_first: float | None = None
        self._device_end = 0.0

    @classmethod
    def from_env(cls) -> DeviceClock | None:
        delay_ms, path = envs.bench_step_delay_ms(), envs.bench_worker_timing()
        if delay_ms is None and path is None:
            return None
        return cls((delay_ms or 0) / 1000, path)

    def planning(self) -> None:
        """The host starts on a step (planning it), unless already busy with one."""
        if self._busy_since is None:
            now = time.perf_counter()
            if self._idle_since is not None:
                self.idle_s += now - self._idle_since
            self._busy_since = now

    def launch_begin(self) -> None:
        self.planning()  # a step run through execute() alone starts here
        self._launch_begin = time.perf_counter()

    def launch_end(self) -> None:
        now = time.perf_counter()
        self.launch_s += now - self._launch_begin
        start = max(self._launch_begin, self._device_end)
        if self._device_first is None:
            self._device_first = start
        end = max(start + self.delay_s, now)
        self.device_busy_s += end - start
        self._device_end = end

    def time_left(self) -> float | None:
        """Seconds the host may block before the device's step ends (less the spin); None
        without a delay (the real device answers)."""
        if not self.delay_s:
            return None
        return self._device_end - SPIN_S - time.perf_counter()

    def sync(self) -> None:
        """Wait for the device to finish the launched step: asleep, then spinning for its
        last SPIN_S, as a GPU's synchronize spins, so the tokens are taken when the
        device finishes: a sleep alone overshoots, and the modelled device would idle for
        the overshoot every step."""
        end = self._device_end
        wait = end - SPIN_S - time.perf_counter()
        if wait > 0:
            time.sleep(wait)
        while time.perf_counter() < end:
            pass

    def collected(self) -> None:
        self.steps += 1

    def answered(self, more_planned: bool) -> None:
        """The host sent a step's answer; it idles now unless it planned the next one."""
        if more_planned:
            self.planned_ahead += 1
            return
        if self._busy_since is None:
            return
        now = time.perf_counter()
        self.busy_s += now - self._busy_since
        self._busy_since = None
        self._idle_since = now

    def close(self) -> None:
        self.write()

    def write(self) -> None:
        if self.path is None:
            return
        span = self._device_end - self._device_first if self._device_first is not None else 0.0
        with open(self.path, "w") as f:
            json.dump(
                {
                    "steps": self.steps,
                    "planned_ahead": self.planned_ahead,
                    "busy_s": self.busy_s,
                    "idle_s": self.idle_s,
                    "device_busy_s": self.device_busy_s,
                    "launch_s": self.launch_s,
                    "device_span_s": span,
                },
                f,
            )
