"""The CPU worker's torch thread count, chosen by timing steps while the engine runs.

Neither one thread less than the cores nor all of them is right on every machine at
every moment: OpenMP threads spin at their barriers, so a thread descheduled beside a busy
process stalls the others, while on an idle machine every core helps. So the worker tries
both: at start-up it times a matrix product of a decode step's size on each (a prompt's
first step can take seconds, and must not wait for evidence from steps), and while it runs
it now and then times a few steps on the other count against as many before, and switches
when that is clearly faster. A probe that loses makes the wait before the next one
longer, so a busy machine pays little for the check.

Prefills are tuned apart from decode steps (LARGE_STEP_TOKENS): they are products big
enough for a second thread to pay where a decode step's are not.

Counts are compared by their steps' mean time, which is what throughput sees, not by the
fastest step: contention that follows the count scatters two-thread steps, a few fast
among many slow, and the fastest step would pick the slower count.
"""

from __future__ import annotations

import logging
import math
import os
import time

import torch

from protocol.cpu_placement import usable_cpus

log = logging.getLogger("pagedserve.worker")

FIRST_PROBE_AFTER = 4  # steps: the start-up guess is checked early
# Steps on the chosen count between probes, doubled after each loss. Every probe step on
# the slower count is a late token to each stream: fewer than 1 step in 100 may be one
# (a server's inter-token latency p99), even in the first thousand steps.
PROBE_PERIOD = 128
MAX_PROBE_PERIOD = 4096
BACKOFF = 4  # the period's growth after a probe that lost
# A probe times steps on the other count until they add up to PROBE_S (at least
# MIN_PROBE_STEPS, at most MAX_PROBE_STEPS) and compares their mean with as many steps
# before: enough short steps to see through a busy server's jitter, few long ones, since
# each long step on the slower count is expensive.
PROBE_S = 0.04
MIN_PROBE_STEPS = 2
MAX_PROBE_STEPS = 8
# Steps shorter than this also get one untimed step first: the first step on the other
# count pays for the switch (the weights cached by the cores that ran the last steps),
# a large share of a short step and noise in a long one.
WARMUP_BELOW_S = 0.05
# Shorter steps gain little from a second thread and lose much when another process
# wants the core: they run on the low count, unprobed, until a step takes twice this again.
MIN_STEP_S = 0.005
MARGIN = 0.9  # the other count must take at most this share of the time to win
# Steps of at least this many tokens that hold a prefill (or a chunk of one) are tuned
# apart from the decode steps, compared by their time per token (their sizes vary too
# much to ever be equal): big products gain from a second thread even where a decode
# step loses (docs/benchmarks.md, figures behind the defaults).
LARGE_STEP_TOKENS = 256


def usable_cores() -> int:
    """How many cores this process may run on (its affinity mask where the OS has one)."""
    return len(usable_cpus()) or os.cpu_count() or 1


def pick_cpu_threads(world_size: int) -> int:
    """Intra-op threads for a CPU worker to start with: a share of the cores, leaving one
    to the core process. Oversubscribed OpenMP threads spin and can make small matmuls
    10x slower; a worker alone on the cores then tries every core (CpuThreadTuner)."""
    return max(1, (usable_cores() - 1) // world_size)


class _Tuning:
    """The choice between two counts for one kind of step, and its probes. Compares the
    time per token of the steps before a probe and in it. `exact` kinds (decode steps)
    compare only steps of one token count (a steady batch: a new count starts over), and
    their short steps run on `low` unprobed."""

    def __init__(self, low: int, high: int, exact: bool) -> None:
        self.low, self.high = low, high
        self.threads = low  # until calibrate() or a probe says otherwise
        self.exact = exact
        self.switches = 0
        self._period = FIRST_PROBE_AFTER
        self._since_probe = 0
        self._tokens = -1  # the current step's token count
        self._recent: list[tuple[float, int]] = []  # (seconds, tokens), chosen count
        self._probe: list[tuple[float, int]] | None = None  # on the other count
        self._probe_steps = MIN_PROBE_STEPS  # this probe's timed steps
        self._probe_warmup = 0  # and untimed ones before them
        # Steps too short for threads to pay: they run on `low` and are never probed.
        self._short = False

    @property
    def other(self) -> int:
        return self.high if self.threads == self.low else self.low

    def choose(self, num_tokens: int) -> int:
        """The count to run a step of num_tokens on."""
        if self.exact and num_tokens != self._tokens:
            self._tokens = num_tokens
            self._recent.clear()
            self._probe = None  # the batch changed mid-probe: no comparison
        if self._probe is not None:
            return self.other  # the probe's steps run on the other count
        if self._short:
            return self.low
        if self._since_probe >= self._period and len(self._recent) >= MIN_PROBE_STEPS:
            step_s = sum(s for s, _ in self._recent) / len(self._recent)
            wanted = math.ceil(PROBE_S / step_s) if step_s > 0 else MAX_PROBE_STEPS
            self._probe_steps = min(max(wanted, MIN_PROBE_STEPS), MAX_PROBE_STEPS)
            self._probe_warmup = 1 if step_s < WARMUP_BELOW_S else 0
            self._probe = []
            return self.other
        return self.threads

    def record(self, seconds: float, num_tokens: int) -> None:
        probe = self._probe
        if probe is None:
            if self._short:
                # Hysteresis: a step that was short on every core may not be on one.
                if seconds >= 2 * MIN_STEP_S:
                    self._short = False
                return
            if seconds < MIN_STEP_S and self.exact:  # a prefill's count is measured
                self._short = True
                self._recent.clear()
                return
            self._since_probe += 1
            self._recent.append((seconds, num_tokens))
            del self._recent[:-MAX_PROBE_STEPS]
            return
        probe.append((seconds, num_tokens))
        if len(probe) < self._probe_warmup + self._probe_steps:
            return
        self._probe = None
        self._since_probe = 0
        del probe[: self._probe_warmup]
        mine = _per_token(self._recent[-len(probe) :])
        theirs = _per_token(probe)
        if theirs < MARGIN * mine:
            log.info(
                "CPU threads%s: %d -> %d (%.2f us -> %.2f us a token)",
                "" if self.exact else f" for steps of {LARGE_STEP_TOKENS}+ tokens",
                self.threads,
                self.other,
                mine * 1e6,
                theirs * 1e6,
            )
            self.threads = self.other
            self.switches += 1
            self._period = PROBE_PERIOD
            self._recent = probe
        else:
            # From the start-up check straight to PROBE_PERIOD: doubling from there put too
            # many of a server's first thousand steps on the slower count.
            self._period = min(max(self._period * BACKOFF, PROBE_PERIOD), MAX_PROBE_PERIOD)


def _per_token(steps: list[tuple[float, int]]) -> float:
    return sum(s for s, _ in steps) / max(1, sum(n for _, n in steps))


class CpuThreadTuner:
    """Picks torch's intra-op thread count between `low` and `high`, step by step.

    Call before_step(num_tokens, num_reqs) before a step's compute and after_step(seconds)
    after. Decode steps are compared only at equal token counts (a steady batch); steps
    with a prefill and LARGE_STEP_TOKENS or more tokens have their own choice; short
    decode steps run on `low`."""

    def __init__(self, low: int, high: int) -> None:
        if not 1 <= low < high:
            raise ValueError(f"thread counts must satisfy 1 <= low < high, got {low}, {high}")
        self.low, self.high = low, high
        self._decode = _Tuning(low, high, exact=True)
        self._large = _Tuning(low, high, exact=False)
        self._step = self._decode  # the kind of the step running
        self._step_tokens = 0
        self._applied = low
        torch.set_num_threads(low)

    @property
    def threads(self) -> int:
        """The count chosen for decode-sized steps."""
        return self._decode.threads

    @threads.setter
    def threads(self, n: int) -> None:
        self._decode.threads = n

    @property
    def large_threads(self) -> int:
        """The count chosen for steps of LARGE_STEP_TOKENS or more."""
        return self._large.threads

    @property
    def switches(self) -> int:
        return self._decode.switches + self._large.switches

    @classmethod
    def for_worker(
        cls, device: torch.device, world_size: int, pinned: bool = False
    ) -> CpuThreadTuner | None:
        """A tuner for a CPU worker alone on its machine's cores (tensor-parallel ranks,
        a worker pinned to cores of its own and a user's OMP_NUM_THREADS keep their fixed
        counts)."""
        if device.type != "cpu" or world_size != 1 or pinned or "OMP_NUM_THREADS" in os.environ:
            return None
        cores = usable_cores()
        if cores < 2:
            return None
        return cls(cores - 1, cores)

    def calibrate(self, reps: int = 3) -> None:
        """Start on whichever count multiplies a [512 x 576] by a [576 x 1536] matrix
        (a SmolLM2 MLP projection of a mid-sized step, ~5 ms on one core) clearly faster,
        the counts interleaved; the step probes correct a wrong start."""
        a, b = torch.randn(512, 576), torch.randn(576, 1536)
        best = {self.low: float("inf"), self.high: float("inf")}
        for rep in range(reps + 1):
            for n in best:
                torch.set_num_threads(n)
                start = time.perf_counter()
                torch.mm(a, b)
                if rep:  # the first round starts the threads
                    best[n] = min(best[n], time.perf_counter() - start)
        if best[self.high] < MARGIN * best[self.low]:
            # Still probed after FIRST_PROBE_AFTER steps: the product runs alone, while
            # behind a server decode steps share the cores (one run here started the
            # server's decode on two threads and lost ~10% of its throughput to it).
            for kind in (self._decode, self._large):
                kind.threads = self.high
        torch.set_num_threads(self.threads)
        self._applied = self.threads
        log.info(
            "CPU threads: %d (a product took %.2f ms on %d, %.2f ms on %d)",
            self.threads,
            best[self.low] * 1e3,
            self.low,
            best[self.high] * 1e3,
            self.high,
        )

    def _apply(self, threads: int) -> None:
        if threads != self._applied:
            torch.set_num_threads(threads)
            self._applied = threads

    def before_step(self, num_tokens: int, num_reqs: int | None = None) -> None:
        """num_reqs: the requests the step schedules (None: as many as tokens). A step
        with more tokens than requests holds a prefill or extend chunk; one of at least
        LARGE_STEP_TOKENS is tuned apart. A decode step is never: a batch of 256 decoding
        requests is 256 tokens, and behind the overlap benchmark's 0.4 ms steps probing it
        on two threads cost async scheduling a quarter of its steps/s."""
        prefill = num_reqs is not None and num_tokens > num_reqs
        kind = self._large if prefill and num_tokens >= LARGE_STEP_TOKENS else self._decode
        self._step = kind
        self._step_tokens = num_tokens
        self._apply(kind.choose(num_tokens))

    def after_step(self, seconds: float) -> None:
        self._step.record(seconds, self._step_tokens)
