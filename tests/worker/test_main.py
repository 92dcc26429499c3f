"""worker.main.wait_for_next: the worker's wait, while a launched step runs, for the
core's next message (async scheduling) or the step's end, on the socket's descriptor
with a timeout finer than ZeroMQ's milliseconds. Nothing here depends on how fast the
machine is: the step lengths are seconds where a message must win, and an arrival that
never comes where the step must."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator

import pytest
import zmq

from benchmarks.bench_clock import SPIN_S, DeviceClock
from worker.main import wait_for_next


class Step:
    """The one thing wait_for_next asks a runner: how long the launched step has left,
    here from the benchmarks' modelled device (benchmarks/bench_clock.py)."""

    def __init__(self, seconds: float) -> None:
        self.clock = DeviceClock(seconds, None)
        self.clock.launch_begin()
        self.clock.launch_end()

    def time_left(self, _flight: object) -> float:
        left = self.clock.time_left()
        assert left is not None
        return left


@pytest.fixture
def pair() -> Iterator[tuple[zmq.Socket, zmq.Socket]]:
    ctx = zmq.Context()
    pull, push = ctx.socket(zmq.PULL), ctx.socket(zmq.PUSH)
    port = pull.bind_to_random_port("tcp://127.0.0.1")
    push.connect(f"tcp://127.0.0.1:{port}")
    yield pull, push
    pull.close(linger=0)
    push.close(linger=0)
    ctx.term()


def test_a_waiting_message_is_taken_at_once(pair: tuple[zmq.Socket, zmq.Socket]) -> None:
    pull, push = pair
    push.send(b"next step")
    assert pull.poll(10_000)  # delivered (tcp): now it waits on the socket
    assert wait_for_next(pull, Step(60.0), None)  # type: ignore[arg-type]
    assert pull.recv() == b"next step"


def test_a_message_arriving_mid_step_ends_the_wait(pair: tuple[zmq.Socket, zmq.Socket]) -> None:
    pull, push = pair
    # Sent from another thread once the wait has begun (whenever that is).
    sender = threading.Timer(0.05, push.send, args=(b"next step",))
    sender.start()
    start = time.perf_counter()
    arrived = wait_for_next(pull, Step(60.0), None)  # type: ignore[arg-type]
    sender.join()
    assert arrived
    assert time.perf_counter() - start < 60.0
    assert pull.recv(zmq.NOBLOCK) == b"next step"


def test_without_a_message_the_wait_ends_with_the_step(
    pair: tuple[zmq.Socket, zmq.Socket],
) -> None:
    pull, _ = pair
    step = Step(0.05)
    assert not wait_for_next(pull, step, None)  # type: ignore[arg-type]
    assert step.time_left(None) <= 0  # blocked until the spin before the device's end
    step.clock.sync()
    assert step.clock.time_left() <= -SPIN_S  # the device's end has passed
