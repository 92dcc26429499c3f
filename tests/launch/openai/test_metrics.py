"""The server's periodic stats line (launch/metrics.StatsLog), on a clock the test moves:
rates over the interval, the queues and KV usage of the last step, the interval's prefix
hit rate, and silence while nothing happens."""

from __future__ import annotations

from launch.openai.metrics import ServerMetrics, StatsLog
from protocol.engine import SchedulerStats


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def stats(running: int, waiting: int, usage: float, queries: int, hits: int, pre: int):
    return SchedulerStats(running, waiting, usage, queries, hits, pre, step=0)


def test_a_line_reports_the_interval_and_idle_intervals_are_quiet() -> None:
    metrics = ServerMetrics("m", 1024, lambda: 0)
    clock = Clock()
    log = StatsLog(metrics, clock)
    clock.now += 10
    assert log.line() is None  # idle from the start: nothing to say
    timer = metrics.request(300)  # two requests of 300 and 100 prompt tokens
    metrics.request(100)
    timer.tokens(1)
    timer.tokens(49)
    metrics.on_stats(stats(2, 1, 0.25, 400, 100, 0))
    clock.now += 5
    assert log.line() == (
        "Avg prompt throughput: 80.0 tokens/s, Avg generation throughput: 10.0 tokens/s, "
        "Running: 2 reqs, Waiting: 1 reqs, KV cache usage: 25.0%, "
        "Prefix cache hit rate: 25.0%, Preemptions: 0"
    )
    # The next interval counts only its own tokens and lookups.
    timer.tokens(20)
    metrics.on_stats(stats(0, 0, 0.0, 500, 190, 2))
    clock.now += 2
    assert log.line() == (
        "Avg prompt throughput: 0.0 tokens/s, Avg generation throughput: 10.0 tokens/s, "
        "Running: 0 reqs, Waiting: 0 reqs, KV cache usage: 0.0%, "
        "Prefix cache hit rate: 90.0%, Preemptions: 2"
    )
    clock.now += 10
    assert log.line() is not None  # the first idle interval after work says so
    clock.now += 10
    assert log.line() is None
