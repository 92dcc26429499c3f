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
# machine (1.18 ms for a 2.8 KB ping-pong here, 0.15 ms when both sides poll instead).
# The core waiting for a step's answer and a worker waiting for its next step therefore
# poll without blocking for up to this long first, then block. Bounded so that on a
# 2-core machine a spinning process takes little from the one doing the work; only used
# where an answer is due soon (never by an idle engine). PAGEDSERVE_SPIN_US=0 turns it off.
SPIN_S = float(os.environ.get("PAGEDSERVE_SPIN_US", "200")) / 1e6


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


def spin_for_message(sock: zmq.Socket, spin_s: float = SPIN_S) -> bool:
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
