"""Where a CPU engine's processes run: each worker's compute threads on cores of their own,
the front (the process that started the engine, with its API server, and the engine core)
on the cores kept back for it ("reserve", vLLM's CPU split), or every process anywhere
("shared", the default: the worker then picks its thread count by timing steps,
worker/cpu_threads.py).

Reserving keeps a worker's OpenMP threads from stalling at their barriers while the API
server takes their core, at the price of the reserved cores' idle time: this engine's
front is light, so on a machine of few cores sharing is faster (docs/generate.md).
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterable, Sequence
from typing import Literal, NamedTuple

CpuPlacement = Literal["reserve", "shared"]
DEFAULT_CPU_PLACEMENT: CpuPlacement = "shared"
DEFAULT_RESERVED_CORES = 1


class CpuPlan(NamedTuple):
    front: list[int]  # the launcher (API server) and the engine core
    workers: list[list[int]]  # per rank: the cores its threads run on, one thread each


def usable_cpus() -> list[int]:
    """The CPUs this process may run on, in order ([] where the OS does not say)."""
    if not hasattr(os, "sched_getaffinity"):
        return []
    return sorted(os.sched_getaffinity(0))


def plan_cpus(cpus: Sequence[int], world_size: int, reserved: int) -> CpuPlan | None:
    """The last `reserved` CPUs (and any left over by an uneven split) for the front, the
    rest split evenly among world_size workers; None when a worker would get no core."""
    cpus = sorted(cpus)
    compute = len(cpus) - reserved
    if reserved < 1 or compute < world_size:
        return None
    share = compute // world_size
    workers = [cpus[rank * share : (rank + 1) * share] for rank in range(world_size)]
    return CpuPlan(front=cpus[share * world_size :], workers=workers)


def pin_process(pid: int, cpus: Iterable[int]) -> None:
    """Every thread of pid onto cpus: an affinity mask is per thread, and threads already
    started (ZeroMQ's I/O thread, a thread pool) keep the one they were born with."""
    mask = set(cpus)
    for tid in thread_ids(pid):
        # A thread that ended meanwhile is not an error.
        with contextlib.suppress(ProcessLookupError):
            os.sched_setaffinity(tid, mask)


def thread_ids(pid: int) -> list[int]:
    """pid's threads (its main thread alone where there is no /proc)."""
    try:
        return [int(t) for t in os.listdir(f"/proc/{pid}/task")]
    except OSError:
        return [pid]


def describe(plan: CpuPlan) -> str:
    """One line for the start-up log."""
    workers = "; ".join(
        f"rank {rank} on {_cpu_list(cpus)}" for rank, cpus in enumerate(plan.workers)
    )
    return f"CPU placement: API server and engine core on {_cpu_list(plan.front)}, {workers}"


def _cpu_list(cpus: Sequence[int]) -> str:
    return ("CPU " if len(cpus) == 1 else "CPUs ") + ",".join(map(str, cpus))
