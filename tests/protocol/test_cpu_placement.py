"""The CPU plan (front cores kept back, the rest split among the workers) and pinning every
thread of a running process."""

from __future__ import annotations

import os
import subprocess
import sys

from protocol.cpu_placement import (
    CpuPlan,
    describe,
    pin_process,
    plan_cpus,
    thread_ids,
    usable_cpus,
)


def test_the_last_cores_go_to_the_front_and_the_rest_split_evenly() -> None:
    assert plan_cpus([0, 1], 1, 1) == CpuPlan(front=[1], workers=[[0]])
    assert plan_cpus([3, 1, 2, 0], 1, 2) == CpuPlan(front=[2, 3], workers=[[0, 1]])
    # 7 compute cores among 3 ranks: 2 each, the odd one to the front.
    plan = plan_cpus(range(8), 3, 1)
    assert plan == CpuPlan(front=[6, 7], workers=[[0, 1], [2, 3], [4, 5]])
    assert describe(plan) == (
        "CPU placement: API server and engine core on CPUs 6,7, rank 0 on CPUs 0,1; "
        "rank 1 on CPUs 2,3; rank 2 on CPUs 4,5"
    )
    # Every core of the plan is used once.
    for n, world, reserved in [(2, 1, 1), (16, 4, 1), (9, 2, 3), (5, 4, 1)]:
        p = plan_cpus(range(n), world, reserved)
        assert p is not None
        used = p.front + [c for w in p.workers for c in w]
        assert sorted(used) == list(range(n)) and len(p.front) >= reserved
        assert len({len(w) for w in p.workers}) == 1


def test_too_few_cores_means_no_plan() -> None:
    assert plan_cpus([0], 1, 1) is None  # the front would take the worker's only core
    assert plan_cpus([0, 1, 2], 3, 1) is None
    assert plan_cpus([0, 1, 2, 3], 2, 3) is None
    assert plan_cpus([0, 1], 1, 0) is None


def _masks(pid: int) -> set[frozenset[int]]:
    return {frozenset(os.sched_getaffinity(tid)) for tid in thread_ids(pid)}


def test_pin_process_moves_threads_started_before_it() -> None:
    # A child with four threads already running when it is pinned: each thread moves.
    code = (
        "import threading, sys\n"
        "e = threading.Event()\n"
        "ts = [threading.Thread(target=e.wait) for _ in range(3)]\n"
        "[t.start() for t in ts]\n"
        "print('up', flush=True)\n"
        "sys.stdin.read()\n"
        "e.set()\n"
    )
    child = subprocess.Popen(
        [sys.executable, "-c", code], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
    )
    try:
        assert child.stdout is not None and child.stdout.readline() == "up\n"
        first = usable_cpus()[:1]
        assert len(thread_ids(child.pid)) == 4
        pin_process(child.pid, first)
        assert _masks(child.pid) == {frozenset(first)}
        pin_process(child.pid, usable_cpus())
        assert _masks(child.pid) == {frozenset(usable_cpus())}
    finally:
        assert child.stdin is not None
        child.stdin.close()
        child.wait(timeout=60)
