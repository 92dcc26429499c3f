"""The waiting queue, in the order the scheduling policy admits requests.

"fcfs": arrival order; a preempted request goes back to the head (it arrived before
everyone still waiting). "priority": the lowest `priority` value first, ties in arrival
order; a preempted request goes back where its (priority, arrival) puts it. Either way
the scheduler admits from the head only: nobody overtakes a head that does not fit.
"""

from __future__ import annotations

import heapq
from collections import deque
from collections.abc import Iterator

from enginecore.request import Request
from protocol.config import SchedulingPolicy


class FCFSQueue(deque):
    """Arrival order: a deque, so the common policy's length and truth tests stay in C."""

    add = deque.append
    add_preempted = deque.appendleft
    pop_head = deque.popleft

    def peek(self) -> Request:
        return self[0]

    def remove_ids(self, request_ids: set[str]) -> None:
        kept = [r for r in self if r.request_id not in request_ids]
        self.clear()
        self.extend(kept)


class PriorityQueue:
    """A heap on (priority, arrival): Request.arrival is unique per scheduler, so no two
    keys tie and requests are never compared."""

    __slots__ = ("_heap",)

    def __init__(self) -> None:
        self._heap: list[tuple[int, int, Request]] = []

    def add(self, request: Request) -> None:
        heapq.heappush(self._heap, (request.priority, request.arrival, request))

    add_preempted = add  # its key is its own: back where it belongs

    def peek(self) -> Request:
        return self._heap[0][2]

    def pop_head(self) -> Request:
        return heapq.heappop(self._heap)[2]

    def remove(self, request: Request) -> None:
        self._heap = [e for e in self._heap if e[2] is not request]
        heapq.heapify(self._heap)

    def remove_ids(self, request_ids: set[str]) -> None:
        self._heap = [e for e in self._heap if e[2].request_id not in request_ids]
        heapq.heapify(self._heap)

    def clear(self) -> None:
        self._heap.clear()

    def __len__(self) -> int:
        return len(self._heap)

    def __bool__(self) -> bool:
        return bool(self._heap)

    def __iter__(self) -> Iterator[Request]:
        """In admission order."""
        return (e[2] for e in sorted(self._heap, key=lambda e: e[:2]))


def make_request_queue(policy: SchedulingPolicy) -> FCFSQueue | PriorityQueue:
    if policy == "fcfs":
        return FCFSQueue()
    if policy == "priority":
        return PriorityQueue()
    raise ValueError(f"scheduling policy must be fcfs or priority, not {policy!r}")
