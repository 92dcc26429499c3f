"""One schedule() call's plan, and the small helpers the scheduler's loops share."""

from __future__ import annotations

from enginecore.request import Request
from protocol.worker import NewRequestData


class StepPlan:
    """What one schedule() call decided, in wire order, built up while deciding (running
    requests, then admissions) and encoded once by _build_output."""

    __slots__ = (
        "budget",
        "cached_blocks",
        "cached_computed",
        "cached_counts",
        "cached_ids",
        "cached_resumed",
        "new_counts",
        "new_reqs",
        "num_due",
        "num_running",
        "preempted",
        "total",
    )

    def __init__(self, budget: int) -> None:
        self.budget = budget  # tokens left this step
        self.total = 0  # tokens scheduled
        self.num_running = 0  # leading cached_* entries that are running requests
        self.num_due = 0  # requests whose tokens this step completes: each samples one
        self.preempted: list[str] = []
        self.cached_ids: list[str] = []
        self.cached_blocks: list[list[list[int]] | None] = []
        self.cached_computed: list[int] = []
        # After the running ones: True per resumed admission (the rest are all False).
        self.cached_resumed: list[bool] = []
        self.cached_counts: list[int] = []
        self.new_reqs: list[NewRequestData] = []
        self.new_counts: list[int] = []


def rank(request: Request) -> tuple[int, int]:
    """Its place under the priority policy: lower priority values first, then arrival."""
    return request.priority, request.arrival


def block_ids(blocks: tuple) -> list[list[int]] | None:
    """Block ids per group, or None when no group got a block (the common decode step)."""
    if not any(blocks):
        return None
    return [[b.block_id for b in group] for group in blocks]
