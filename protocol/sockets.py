"""Sending without hanging on a peer that is gone.

A PUSH socket blocks in send() once it has no peer (bind side) or its queue to a vanished
peer is full (connect side, after HWM messages): a process whose launcher, core or worker
died would wait there forever, past every liveness check of its loop. send_or_drop waits
in slices instead and gives up as soon as the caller says the peer will not come back.
"""

from __future__ import annotations

from collections.abc import Callable

import zmq

# How long one wait for room lasts before the caller's liveness check runs again.
SEND_RETRY_MS = 200


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
