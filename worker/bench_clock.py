"""Benchmark-only instruments of the worker loop, off unless their variables are set.

PAGEDSERVE_BENCH_STEP_DELAY_MS: every step that runs tokens takes this much longer before
  it answers (a sleep: the CPU stays free, as while a GPU step runs), so a benchmark can
  give the model step a known length on any machine (benchmarks/overlap.py).
PAGEDSERVE_BENCH_WORKER_TIMING: a file the worker writes at exit, as JSON: the steps it
  ran, the seconds it spent in them (busy) and the seconds it waited between them (idle).
"""

from __future__ import annotations

import json
import os
import time

DELAY_ENV = "PAGEDSERVE_BENCH_STEP_DELAY_MS"
TIMING_ENV = "PAGEDSERVE_BENCH_WORKER_TIMING"


class StepClock:
    def __init__(self, delay_s: float, path: str | None) -> None:
        self.delay_s = delay_s
        self.path = path
        self.steps = 0
        self.busy_s = 0.0
        self.idle_s = 0.0
        self._begin = 0.0
        self._last_end: float | None = None  # no idle time counts before the first step

    @classmethod
    def from_env(cls) -> StepClock | None:
        delay, path = os.environ.get(DELAY_ENV), os.environ.get(TIMING_ENV)
        if delay is None and path is None:
            return None
        try:
            delay_ms = float(delay or 0)
        except ValueError:
            raise ValueError(
                f"{DELAY_ENV} must be a number of milliseconds, got {delay!r}"
            ) from None
        if not delay_ms >= 0:
            raise ValueError(f"{DELAY_ENV} must be >= 0, got {delay!r}")
        return cls(delay_ms / 1000, path)

    def begin(self) -> None:
        now = time.perf_counter()
        if self._last_end is not None:
            self.idle_s += now - self._last_end
        self._begin = now

    def end(self) -> None:
        if self.delay_s:
            time.sleep(self.delay_s)
        now = time.perf_counter()
        self.busy_s += now - self._begin
        self.steps += 1
        self._last_end = now

    def write(self) -> None:
        if self.path is not None:
            with open(self.path, "w") as f:
                json.dump({"steps": self.steps, "busy_s": self.busy_s, "idle_s": self.idle_s}, f)
