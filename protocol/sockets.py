"""Sending without hanging on a peer that is gone.

A PUSH socket blocks in send() once it has no peer (bind side) or its queue to a vanished
peer is full (connect side, after HWM messages): a process whose launcher, core or worker
died would wait there forever, past every liveness check of its loop. send_or_drop waits
in slices instead and gives up as soon as the caller says the peer will not come back.
"""

from __future__ import annotations

import ctypes
import os
import select
import sys
import time
from collections.abc import Callable

import zmq

# How long one wait for room lasts before the caller's liveness check runs again.
SEND_RETRY_MS = 200

# Waking a blocked process is slow (a halted virtual CPU waits for the host) and it then
# runs on cold caches, so a process polls first for a message due soon, only while short
# waits last and only with a CPU of its own (its ZeroMQ I/O thread needs one too).
# benchmarks/step_overhead.py measures the effect; PAGEDSERVE_SPIN_US overrides (0: off).
DEFAULT_SPIN_S = 0.001
# A napping due wait sleeps until this long before the message is expected (the previous
# wait's length), then spins: a loaded VM's wake-up latency, with margin.
SPIN_BEFORE_S = 2e-4
# A due wait longer than this blocks from the start: its wake-up costs under 10% of it,
# and a spin at its end would take a CPU from the worker's second thread (worker/
# cpu_threads.py runs steps under 5 ms on one) or from a server and its clients.
NAP_MAX_S = 0.005
# Timed waits of the core and the workers (DueWait, a worker's wait for its device) are
# sub-millisecond; Linux's default timer slack would end them late by more than that.
TIMER_SLACK_NS = 1000
PR_SET_TIMERSLACK = 29  # <linux/prctl.h>


def spin_budget(world_size: int, override_us: float | None = None) -> float:
    """Seconds the core and each of world_size workers may poll for a due message before
    blocking: override_us when set (0: never), else DEFAULT_SPIN_S when every process of
    the group has a CPU of its own, else 0."""
    if override_us is not None:
        return max(0.0, override_us / 1e6)
    cpus = len(os.sched_getaffinity(0))
    return DEFAULT_SPIN_S if cpus >= world_size + 1 else 0.0


class DueWait:
    """The wait for a message that is due (a step's answer, the next step): polls without
    blocking for up to the budget while the previous such wait fit in it; the caller
    blocks as usual when ready() says no, then reports the arrival.

    A wait longer than the budget (but under longest_s) sleeps on the socket until one
    budget before it is due, then spins for up to two: its wake-up costs no latency and
    its spin stays bounded. ready(sock, nap=True) sleeps first on a shorter wait too,
    until SPIN_BEFORE_S before the time the previous wait took: for a wait that a step
    queued behind it makes long and regular, the core's wait for an answer under async
    scheduling: spinning through it takes a CPU from the worker and the I/O threads,
    blocking through it wakes the core late (benchmarks/overlap.py). A serial step's
    short waits are less regular: napping there slows the round trip."""

    __slots__ = ("_start", "budget", "last", "longest")

    def __init__(self, budget_s: float, longest_s: float = NAP_MAX_S) -> None:
        self.budget = budget_s
        self.longest = longest_s  # a longer last wait: block from the start
        self.last = 0.0  # seconds the previous due message took to come
        self._start = 0.0

    def ready(self, sock: zmq.Socket, nap: bool = False) -> bool:
        """True as soon as a message waits on sock; False once waiting here does not pay."""
        start = self._start = time.perf_counter()
        last = self.last
        if self.budget <= 0 or last > self.longest:
            return False
        if last > self.budget:
            # Longer than a spin may last: sleep through it, then spin from one budget
            # before it is due for up to two, a margin wide enough for wake-up jitter.
            asleep, spin = last - self.budget, 2.0 * self.budget
        elif nap:
            asleep = last - SPIN_BEFORE_S
            spin = self.budget - max(asleep, 0.0)
        else:
            asleep, spin = 0.0, self.budget
        if not ((asleep > 0 and wait_for_message(sock, asleep)) or spin_for_message(sock, spin)):
            return False
        self.last = time.perf_counter() - start
        return True

    def arrived(self) -> None:
        """A blocking wait that followed ready() ended with the message."""
        self.last = time.perf_counter() - self._start


def send_or_drop(
    sock: zmq.Socket, frame: bytes | memoryview, peer_alive: Callable[[], bool]
) -> bool:
    """Send frame; False (frame dropped) once peer_alive() says the peer is gone. The
    common case is one non-blocking send."""
    while True:
        try:
            sock.send(frame, zmq.NOBLOCK, copy=False)
            return True
        except zmq.Again:
            if not peer_alive():
                return False
            sock.poll(SEND_RETRY_MS, zmq.POLLOUT)


def wait_for_message(sock: zmq.Socket, timeout_s: float) -> bool:
    """Block until a message waits on sock (True) or timeout_s pass (False), to the
    microsecond: ZeroMQ's own poll takes whole milliseconds."""
    fd = sock.FD
    end = time.perf_counter() + timeout_s
    while True:
        # The descriptor only signals a change: EVENTS says whether a message waits, and
        # reading it rearms the descriptor.
        if sock.getsockopt(zmq.EVENTS) & zmq.POLLIN:
            return True
        left = end - time.perf_counter()
        if left <= 0:
            return False
        select.select((fd,), (), (), left)


def lower_timer_slack() -> None:
    """Ask Linux to end this process's timed waits within ~1 us of their timeout instead
    of the default 50 us. Elsewhere, or without prctl, a no-op (the slack costs latency,
    not correctness)."""
    if not sys.platform.startswith("linux"):
        return
    try:
        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_TIMERSLACK, TIMER_SLACK_NS, 0, 0, 0)
    except (OSError, AttributeError):
        pass


def spin_for_message(sock: zmq.Socket, spin_s: float) -> bool:
    """Poll sock without blocking for up to spin_s seconds: True as soon as a message
    waits, False when the time is up (the caller then blocks as usual)."""
    if spin_s <= 0:
        return False
    events = zmq.EVENTS
    end = time.perf_counter() + spin_s
    while True:
        # EVENTS reads the socket's state without a system call.
        if sock.getsockopt(events) & zmq.POLLIN:
            return True
        if time.perf_counter() >= end:
            return False
