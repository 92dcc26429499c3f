"""The server's Prometheus metrics, under vLLM's names so existing dashboards work.

Every metric is named `vllm:<name>` as vLLM (v1) names it, labelled model_name; the one
metric of our own is `pagedserve:open_requests`. Engine-side values (queue lengths, KV
usage, prefix-cache tokens, preemptions) come from the SchedulerStats the core sends
with each step's outputs; request latencies and token counts are measured in the server
as it streams each request.

| metric | type | what |
| --- | --- | --- |
| vllm:num_requests_running / _waiting | gauge | the core's queues, last step |
| vllm:kv_cache_usage_perc | gauge | fraction of KV blocks in use (0..1) |
| vllm:prefix_cache_queries_total / _hits_total | counter | prompt tokens looked up / hit |
| vllm:num_preemptions_total | counter | requests preempted |
| vllm:prompt_tokens_total / generation_tokens_total | counter | tokens in / out |
| vllm:request_success_total{finished_reason} | counter | requests that ended |
| vllm:time_to_first_token_seconds | histogram | arrival to first token |
| vllm:inter_token_latency_seconds | histogram | between tokens of a request |
| vllm:e2e_request_latency_seconds | histogram | arrival to last token |
| vllm:request_queue_time_seconds | histogram | waiting in the core before first scheduled |
| vllm:request_prefill_time_seconds | histogram | first scheduled to first token |
| vllm:request_decode_time_seconds | histogram | first token to last |
| vllm:request_inference_time_seconds | histogram | first scheduled to last token |
| vllm:request_time_per_output_token_seconds | histogram | decode time per later token |
| vllm:request_prompt_tokens / _generation_tokens | histogram | tokens per request |
| vllm:request_max_num_generation_tokens | histogram | the longest sequence's tokens |
| vllm:request_params_n / _max_tokens | histogram | what requests asked for |
| vllm:prompt_tokens_cached_total | counter | prompt tokens served from the prefix cache |
| pagedserve:open_requests | gauge | requests the server has open in the engine |
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

import prometheus_client as prom

from protocol.engine import SchedulerStats

# Latency buckets from 1 ms (a cached decode on a GPU) to 10 min (a long CPU request).
LATENCY_BUCKETS = (0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 600)
CONTENT_TYPE = prom.CONTENT_TYPE_LATEST


def token_buckets(max_model_len: int) -> list[float]:
    """1, 2, 5, 10, 20, 50... up to max_model_len."""
    buckets: list[float] = []
    scale = 1
    while True:
        for m in (1, 2, 5):
            if m * scale > max_model_len:
                return buckets
            buckets.append(m * scale)
        scale *= 10


class ServerMetrics:
    def __init__(
        self, model_name: str, max_model_len: int, open_requests: Callable[[], int]
    ) -> None:
        prom.disable_created_metrics()  # the *_created series only double the output
        self.registry = prom.CollectorRegistry()
        r, labels = self.registry, ["model_name"]

        def gauge(name: str, doc: str) -> prom.Gauge:
            return prom.Gauge(name, doc, labels, registry=r).labels(model_name)

        def counter(name: str, doc: str) -> prom.Counter:
            return prom.Counter(name, doc, labels, registry=r).labels(model_name)

        def histogram(name: str, doc: str, buckets: tuple | list) -> prom.Histogram:
            return prom.Histogram(name, doc, labels, buckets=buckets, registry=r).labels(model_name)

        def latency(name: str, doc: str) -> prom.Histogram:
            return histogram(f"vllm:{name}_seconds", doc, LATENCY_BUCKETS)

        self.running = gauge("vllm:num_requests_running", "Requests in the running batch.")
        self.waiting = gauge("vllm:num_requests_waiting", "Requests waiting to run.")
        self.kv_usage = gauge("vllm:kv_cache_usage_perc", "KV-cache usage (1 = full).")
        self.queries = counter("vllm:prefix_cache_queries", "Prompt tokens looked up.")
        self.hits = counter("vllm:prefix_cache_hits", "Prompt tokens found in the cache.")
        self.preemptions = counter("vllm:num_preemptions", "Preempted requests.")
        self.prompt_tokens = counter("vllm:prompt_tokens", "Prompt tokens of requests.")
        self.generation_tokens = counter("vllm:generation_tokens", "Generated tokens.")
        self.success = prom.Counter(
            "vllm:request_success",
            "Requests that ended, by finish reason.",
            ["model_name", "finished_reason"],
            registry=r,
        )
        self.model_name = model_name
        self.ttft = latency("time_to_first_token", "Arrival to first token.")
        self.itl = latency("inter_token_latency", "Time between tokens.")
        self.e2e = latency("e2e_request_latency", "Arrival to last token.")
        self.queue = latency(
            "request_queue_time", "Time in the core's queue before first scheduled."
        )
        self.prefill = latency("request_prefill_time", "First scheduled to first token.")
        self.decode = latency("request_decode_time", "First token to last.")
        self.inference = latency("request_inference_time", "First scheduled to last token.")
        self.tpot = latency(
            "request_time_per_output_token", "Decode time per token after the first."
        )
        tokens = token_buckets(max_model_len)
        self.request_prompt = histogram(
            "vllm:request_prompt_tokens", "Prompt tokens per request.", tokens
        )
        self.request_generation = histogram(
            "vllm:request_generation_tokens", "Generated tokens per request.", tokens
        )
        self.request_max_generation = histogram(
            "vllm:request_max_num_generation_tokens",
            "Generated tokens of a request's longest sequence.",
            tokens,
        )
        self.params_n = histogram("vllm:request_params_n", "Requests' n.", (1, 2, 5, 10, 20))
        self.params_max_tokens = histogram(
            "vllm:request_params_max_tokens", "Requests' max_tokens.", tokens
        )
        self.prompt_cached = counter(
            "vllm:prompt_tokens_cached", "Prompt tokens served from the prefix cache."
        )
        prom.Gauge(
            "pagedserve:open_requests",
            "Requests the server has open in the engine.",
            registry=r,
        ).set_function(open_requests)
        self._last: SchedulerStats | None = None
        # Plain totals for the periodic log line (StatsLog), beside the Prometheus series.
        self.total_prompt_tokens = 0
        self.total_generation_tokens = 0

    @property
    def last_stats(self) -> SchedulerStats | None:
        return self._last

    def on_stats(self, stats: SchedulerStats) -> None:
        self.running.set(stats.num_running)
        self.waiting.set(stats.num_waiting)
        self.kv_usage.set(stats.kv_cache_usage)
        # The core's counts are cumulative since it started: count what is new.
        last = self._last
        self.queries.inc(stats.prefix_cache_queries - (last.prefix_cache_queries if last else 0))
        self.hits.inc(stats.prefix_cache_hits - (last.prefix_cache_hits if last else 0))
        self.preemptions.inc(stats.num_preemptions - (last.num_preemptions if last else 0))
        self._last = stats

    def request(self, num_prompt_tokens: int, n: int = 1, max_tokens: int = 0) -> RequestTimer:
        self.prompt_tokens.inc(num_prompt_tokens)
        self.total_prompt_tokens += num_prompt_tokens
        self.request_prompt.observe(num_prompt_tokens)
        self.params_n.observe(n)
        if max_tokens:
            self.params_max_tokens.observe(max_tokens)
        return RequestTimer(self)

    def exposition(self) -> bytes:
        return prom.generate_latest(self.registry)


class RequestTimer:
    """One request's latencies, fed as its outputs arrive."""

    __slots__ = ("_first", "_last", "_metrics", "_queued", "_start", "num_tokens")

    def __init__(self, metrics: ServerMetrics) -> None:
        self._metrics = metrics
        self._start = self._last = time.monotonic()
        self._first: float | None = None
        self._queued: float | None = None
        self.num_tokens = 0

    def queued(self, seconds: float) -> None:
        """The core's queue time, with the first output (of the first sequence, with n)."""
        if self._queued is None:
            self._queued = seconds
            self._metrics.queue.observe(seconds)

    def tokens(self, n: int) -> None:
        """n new tokens arrived now (one step's worth: n is 1 but for the first)."""
        if n <= 0:
            return
        now = time.monotonic()
        m = self._metrics
        if self._first is None:
            self._first = now
            m.ttft.observe(now - self._start)
        else:
            gap = (now - self._last) / n
            for _ in range(n):
                m.itl.observe(gap)
        self._last = now
        self.num_tokens += n
        m.generation_tokens.inc(n)
        m.total_generation_tokens += n

    def finish(self, finish_reason: str, longest: int = 0, cached_tokens: int = 0) -> None:
        """longest: the tokens of the request's longest sequence; cached_tokens: its prompt
        tokens served from the prefix cache."""
        m = self._metrics
        m.e2e.observe(self._last - self._start)  # to its last token
        m.request_generation.observe(self.num_tokens)
        m.request_max_generation.observe(longest or self.num_tokens)
        m.success.labels(m.model_name, finish_reason).inc()
        m.prompt_cached.inc(cached_tokens)
        first = self._first
        if first is None:
            return
        # From the server's clock, less the core's queue time: what the engine spent.
        scheduled = self._start + (self._queued or 0.0)
        m.prefill.observe(max(first - scheduled, 0.0))
        m.decode.observe(self._last - first)
        m.inference.observe(max(self._last - scheduled, 0.0))
        if self.num_tokens > 1:
            m.tpot.observe((self._last - first) / (self.num_tokens - 1))


class StatsLog:
    """vLLM's periodic server log line: throughput since the last line, the queues, KV
    usage and the prefix-cache hit rate over the interval. An idle interval after an
    idle one says nothing, so a quiet server's log stays quiet."""

    def __init__(self, metrics: ServerMetrics, clock: Callable[[], float] = time.monotonic):
        self.metrics = metrics
        self.clock = clock
        self._at = clock()
        self._prompt = metrics.total_prompt_tokens
        self._generation = metrics.total_generation_tokens
        self._queries = self._hits = self._preemptions = 0
        self._idle = True

    def line(self) -> str | None:
        """The line for the interval since the last call, or None for a second idle one."""
        m = self.metrics
        now = self.clock()
        seconds = max(now - self._at, 1e-9)
        stats = m.last_stats
        queries = stats.prefix_cache_queries if stats else 0
        hits = stats.prefix_cache_hits if stats else 0
        preemptions = stats.num_preemptions if stats else 0
        prompt = m.total_prompt_tokens - self._prompt
        generation = m.total_generation_tokens - self._generation
        new_queries, new_hits = queries - self._queries, hits - self._hits
        new_preemptions = preemptions - self._preemptions
        running = stats.num_running if stats else 0
        waiting = stats.num_waiting if stats else 0
        self._at, self._prompt = now, m.total_prompt_tokens
        self._generation = m.total_generation_tokens
        self._queries, self._hits, self._preemptions = queries, hits, preemptions
        idle = not (prompt or generation or running or waiting)
        if idle and self._idle:
            return None
        self._idle = idle
        return (
            f"Avg prompt throughput: {prompt / seconds:.1f} tokens/s, "
            f"Avg generation throughput: {generation / seconds:.1f} tokens/s, "
            f"Running: {running} reqs, Waiting: {waiting} reqs, "
            f"KV cache usage: {100 * (stats.kv_cache_usage if stats else 0.0):.1f}%, "
            f"Prefix cache hit rate: {100 * new_hits / new_queries if new_queries else 0.0:.1f}%, "
            f"Preemptions: {new_preemptions}"
        )


STATS_LOGGER = logging.getLogger("pagedserve.stats")
