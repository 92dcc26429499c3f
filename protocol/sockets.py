"""Sending without hanging on a peer that is gone.

A PUSH socket blocks in send() once it has no peer (bind side) or its queue to a vanished
peer is full (connect side, after HWM messages): a process whose launcher, core or worker
died would wait there forever, past every liveness check of its loop. send_or_drop waits
in slices instead and gives up as soon as the caller says the peer will not come back.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable

import zmq

# How long one wait for room lasts before the caller's liveness check runs again.
SEND_RETRY_MS = 200

# Waking a process blocked in poll() costs from ~20 us to over 1 ms depending on the
# machine. The core waiting for a step's answer and a worker waiting for its next step
# can therefore poll without blocking for a while first (never when idle: only where an
# answer is due). But every frame also crosses each process's ZeroMQ I/O thread, which
# needs a CPU to move it: a spinning main thread starves its own and the peer's I/O
# threads unless each process has two CPUs. On this 2-core machine (256-request serial
# steps, benchmarks/step_overhead.py, alternating runs) the IPC round trip was 467-541 us
# without polling, 612-617 us polling 200 us and 1330-1390 us polling 1 ms. So it is on
# only when every process of the group (core and workers) has two CPUs of its own.
# PAGEDSERVE_SPIN_US overrides it (0: off).
DEFAULT_SPIN_S = 0.0002


def spin_budget(world_size: int) -> float:
    """Seconds the core and each of world_size workers poll before blocking."""
    env = os.environ.get("PAGEDSERVE_SPIN_US")
    if env is not None:
        try:
            return max(0.0, float(env) / 1e6)
        except ValueError:
            raise ValueError(f"PAGEDSERVE_SPIN_US must be a number, got {env!r}") from None
    cpus = len(os.sched_getaffinity(0))
    return DEFAULT_SPIN_S if cpus >= 2 * (world_size + 1) else 0.0


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
