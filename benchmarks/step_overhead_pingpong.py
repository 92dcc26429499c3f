"""The bare baseline of the step-overhead benchmark: frames of the engine's sizes
ping-ponged over a ZeroMQ PAIR ipc socket with nothing else done."""

from __future__ import annotations

import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

# The script whose --as-pingpong entry runs the echo side.
ENTRY = Path(__file__).resolve().with_name("step_overhead.py")


def pingpong_entry(address: str, mode: str, reply_bytes: str) -> int:
    """The echo side of the bare ping-pong: answer every frame with reply_bytes bytes."""
    import zmq

    ctx = zmq.Context()
    sock = ctx.socket(zmq.PAIR)
    sock.connect(address)
    reply = bytes(int(reply_bytes))
    while True:
        if mode == "poll":
            while not sock.getsockopt(zmq.EVENTS) & zmq.POLLIN:
                pass
        frame = sock.recv()
        if frame == b"stop":
            break
        sock.send(reply)
    sock.close(linger=0)
    ctx.term()
    return 0


def bare_pingpong(frame_bytes: int, reply_bytes: int, mode: str, rounds: int) -> list[int]:
    """Round trips of a SchedulerOutput-sized frame and a ModelRunnerOutput-sized answer
    between this process and a child over a ZeroMQ PAIR ipc socket, nothing else done:
    both sides spinning on the socket's state ("poll") or blocking in recv ("block").
    What IPC alone costs on this machine, for the engine's round trip to be judged by:
    the round trips in nanoseconds."""
    import zmq

    directory = tempfile.mkdtemp(prefix="pingpong-")
    address = f"ipc://{directory}/pp"
    ctx = zmq.Context()
    sock = ctx.socket(zmq.PAIR)
    sock.bind(address)
    child = subprocess.Popen(
        [sys.executable, str(ENTRY), "--as-pingpong", address, mode, str(reply_bytes)]
    )
    frame = bytes(frame_bytes)
    times: list[int] = []
    try:
        clock = time.perf_counter_ns
        for i in range(rounds + rounds // 10):  # the first tenth warms up
            t0 = clock()
            sock.send(frame)
            if mode == "poll":
                while not sock.getsockopt(zmq.EVENTS) & zmq.POLLIN:
                    pass
            sock.recv()
            if i >= rounds // 10:
                times.append(clock() - t0)
        sock.send(b"stop")
        child.wait(timeout=60)
    finally:
        if child.poll() is None:
            child.kill()
            child.wait()
        sock.close(linger=0)
        ctx.term()
        shutil.rmtree(directory, ignore_errors=True)
    return times
