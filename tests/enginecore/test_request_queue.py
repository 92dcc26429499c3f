"""enginecore/request_queue.py: the waiting queue gives requests in arrival order (fcfs,
a preempted one back at the head) or by (priority, arrival) (priority), checked against
a sort of the same requests."""

from __future__ import annotations

import random

import pytest

from enginecore.request import Request
from enginecore.request_queue import FCFSQueue, PriorityQueue, make_request_queue


def _request(name: str, arrival: int, priority: int = 0) -> Request:
    r = Request(name, [1, 2, 3], priority=priority)
    r.arrival = arrival
    return r


def _drain(queue: FCFSQueue | PriorityQueue) -> list[str]:
    names = []
    while queue:
        assert queue.peek() is not None
        names.append(queue.pop_head().request_id)
    return names


def test_fcfs_serves_in_arrival_order_with_a_preempted_request_first() -> None:
    q = make_request_queue("fcfs")
    assert isinstance(q, FCFSQueue)
    for i, name in enumerate("abc"):
        q.add(_request(name, i))
    q.add_preempted(_request("p", 99))
    assert [r.request_id for r in q] == ["p", "a", "b", "c"]
    q.remove_ids({"a", "c"})
    assert _drain(q) == ["p", "b"]


def test_priority_serves_lowest_priority_first_ties_by_arrival() -> None:
    rng = random.Random(7)
    requests = [_request(f"r{i}", i, rng.randint(-2, 2)) for i in range(30)]
    q = make_request_queue("priority")
    assert isinstance(q, PriorityQueue)
    for r in rng.sample(requests, len(requests)):
        q.add(r)
    want = [r.request_id for r in sorted(requests, key=lambda r: (r.priority, r.arrival))]
    assert len(q) == 30
    assert [r.request_id for r in q] == want  # iteration is admission order
    assert _drain(q) == want


def test_a_preempted_priority_request_goes_back_where_its_key_puts_it() -> None:
    q = PriorityQueue()
    q.add(_request("late", 5, priority=1))
    q.add(_request("urgent", 9, priority=0))
    q.add_preempted(_request("old", 1, priority=1))
    assert _drain(q) == ["urgent", "old", "late"]


def test_priority_removal_by_object_and_by_id_keeps_the_rest_in_order() -> None:
    q = PriorityQueue()
    rs = [_request(n, i, p) for i, (n, p) in enumerate([("a", 3), ("b", 1), ("c", 2), ("d", 0)])]
    for r in rs:
        q.add(r)
    q.remove(rs[2])
    q.remove_ids({"d"})
    assert [r.request_id for r in q] == ["b", "a"]
    q.clear()
    assert not q and len(q) == 0


def test_an_unknown_policy_is_refused_by_name() -> None:
    with pytest.raises(ValueError, match="must be fcfs or priority, not 'lifo'"):
        make_request_queue("lifo")  # type: ignore[arg-type]
