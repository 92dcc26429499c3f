"""protocol/sockets.py: polling before blocking, and when it is allowed; waiting on a
socket to the microsecond, and napping before the spin."""

from __future__ import annotations

import functools
import os
import threading
from collections.abc import Iterator

import pytest
import zmq

from launch.client.engine_args import EngineArgs
from protocol.envs import SPIN_US as SPIN_ENV
from protocol.sockets import (
    DEFAULT_SPIN_S,
    DueWait,
    spin_budget,
    spin_for_message,
    wait_for_message,
)


def test_spin_budget_only_when_every_process_has_a_cpu() -> None:
    cpus = len(os.sched_getaffinity(0))
    for world_size in (1, 2, 4):
        want = DEFAULT_SPIN_S if cpus >= world_size + 1 else 0.0
        assert spin_budget(world_size) == want
    assert spin_budget(cpus) == 0.0  # more processes (core + workers) than CPUs: never
    assert spin_budget(cpus, 50.0) == pytest.approx(50e-6)  # the launcher's override
    assert spin_budget(1, 0.0) == 0.0


def test_the_spin_override_is_read_by_the_launcher_and_checked(monkeypatch) -> None:
    monkeypatch.setenv(SPIN_ENV, "50")
    assert EngineArgs(model="m").spin_us == 50.0
    monkeypatch.setenv(SPIN_ENV, "fast")
    with pytest.raises(ValueError, match="PAGEDSERVE_SPIN_US must be a number"):
        EngineArgs(model="m")
    monkeypatch.delenv(SPIN_ENV)
    assert EngineArgs(model="m").spin_us is None
    with pytest.raises(ValueError, match="spin_us must be in"):
        EngineArgs(model="m", spin_us=-1.0).validate()


@pytest.fixture
def pair() -> Iterator[tuple[zmq.Socket, zmq.Socket]]:
    """A connected inproc PAIR: (sender, receiver)."""
    ctx = zmq.Context()
    a, b = ctx.socket(zmq.PAIR), ctx.socket(zmq.PAIR)
    a.bind("inproc://spin")
    b.connect("inproc://spin")
    yield a, b
    a.close(linger=0)
    b.close(linger=0)
    ctx.term()


def test_spin_for_message_sees_a_waiting_frame_and_gives_up_without_one(pair) -> None:
    a, b = pair
    assert not spin_for_message(b, 0.0)  # off: no look at all
    assert not spin_for_message(b, 0.001)  # nothing sent: the budget runs out
    a.send(b"step")
    assert spin_for_message(b, 5.0)  # returns as soon as it is there
    assert b.recv() == b"step"


def test_due_wait_spins_only_while_the_last_wait_was_short(pair) -> None:
    a, b = pair
    due = DueWait(5.0)
    a.send(b"step")
    assert due.ready(b)  # due and waiting: taken without blocking
    assert b.recv() == b"step"
    assert 0.0 <= due.last < 5.0
    due.last = 6.0  # the last step's message took longer than the budget
    a.send(b"step")
    assert not due.ready(b)  # so it does not even look: the caller blocks
    assert b.poll(1000) and b.recv() == b"step"
    due.arrived()  # that blocking wait was short: spinning pays again
    assert due.last < 5.0
    a.send(b"step")
    assert due.ready(b) and b.recv() == b"step"
    off = DueWait(0.0)
    a.send(b"step")
    assert not off.ready(b)  # no budget: always the blocking wait


def test_wait_for_message_wakes_on_arrival_and_times_out_without_one(pair) -> None:
    a, b = pair
    assert not wait_for_message(b, 0.0)
    assert not wait_for_message(b, 0.002)  # nothing sent: the timeout ends it
    sender = threading.Timer(0.01, a.send, args=(b"step",))
    sender.start()
    assert wait_for_message(b, 60.0)  # woken by the arrival, long before the timeout
    sender.join()
    assert b.recv(zmq.NOBLOCK) == b"step"


def test_a_napping_due_wait_sleeps_then_takes_the_message(pair) -> None:
    a, b = pair
    due = DueWait(60.0, longest_s=120.0)
    due.last = 30.0  # the previous answer took 30 s: nap until shortly before that
    sender = threading.Timer(0.01, a.send, args=(b"step",))
    sender.start()
    assert due.ready(b, nap=True)  # it came during the nap, which it ends
    sender.join()
    assert b.recv(zmq.NOBLOCK) == b"step"
    assert due.last < 30.0  # the next nap is sized by this wait
    due.last = 121.0  # longer than the longest wait worth napping: the caller blocks
    a.send(b"step")
    assert not due.ready(b, nap=True)  # without a look, though a message waits
    assert b.recv(zmq.NOBLOCK) == b"step"


def test_a_due_wait_longer_than_its_budget_sleeps_through_it(pair) -> None:
    a, b = pair
    due = DueWait(1.0, longest_s=120.0)
    due.last = 30.0  # longer than the budget: sleep until one budget before it is due
    sender = threading.Timer(0.01, a.send, args=(b"step",))
    sender.start()
    assert due.ready(b)  # woken by the arrival, not by the end of the nap
    sender.join()
    assert b.recv(zmq.NOBLOCK) == b"step"
    assert due.last < 30.0
    short = DueWait(0.001)
    short.last = 0.002  # due in 2 ms: sleeps 1, spins at most 2, then gives up
    assert not short.ready(b)
    assert short.last == 0.002  # a wait that ended without the message tells nothing
    short.last = 1.0  # past the default longest nap (NAP_MAX_S)
    a.send(b"step")
    assert not short.ready(b)
    assert b.recv(zmq.NOBLOCK) == b"step"


def _returns(call, timeout_s: float = 60.0) -> object:
    """call()'s result, run on a thread: a wait that never gives up fails the test (after
    a timeout far beyond any wait under test) instead of hanging the suite."""
    result: list[object] = []
    worker = threading.Thread(target=lambda: result.append(call()), daemon=True)
    worker.start()
    worker.join(timeout_s)
    assert result, "the wait never gave up"
    return result[0]


def test_a_due_wait_gives_up_when_nothing_comes(pair) -> None:
    """Spin, nap or sleep-then-spin: each is bounded by the last wait, never open-ended
    (an idle engine must not spin)."""
    _a, b = pair
    for last, nap in ((0.001, False), (0.001, True), (0.01, False)):
        due = DueWait(0.005, longest_s=1.0)
        due.last = last
        assert _returns(functools.partial(due.ready, b, nap=nap)) is False, (last, nap)


def test_a_nap_sleeps_on_the_socket_instead_of_spinning(pair) -> None:
    """A napping wait for a message 0.5 s away costs next to no CPU; a spin through it
    would cost about half a second of it (twice the bound asserted, even if a loaded
    machine gave the spinning thread only half a CPU)."""
    import time

    a, b = pair
    due = DueWait(60.0, longest_s=120.0)
    due.last = 30.0
    sender = threading.Timer(0.5, a.send, args=(b"step",))
    cpu = time.thread_time()
    sender.start()
    assert due.ready(b, nap=True)
    used = time.thread_time() - cpu
    sender.join()
    assert b.recv(zmq.NOBLOCK) == b"step"
    assert used < 0.1, f"the nap used {used:.3f} s of CPU"
