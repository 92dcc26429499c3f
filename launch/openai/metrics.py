"""The server's Prometheus metrics, under vLLM's names, types, labels and buckets, so a
dashboard made for vLLM works unchanged (docs/serving.md lists them).

Every vllm: series is labelled model_name and engine: the step-fed ones per engine (a
data-parallel replica's index; "0" with one engine), the request-fed ones, measured in
the server for all replicas together, under "0". Our own: pagedserve:open_requests and,
with data parallelism, the router's decisions (pagedserve:router_*). Engine-side values
(queues, KV usage, prefix-cache lookups, preemptions, prompt tokens computed or cached,
tokens sampled) come from the SchedulerStats the core sends with each step's outputs, as cumulative
counts: the server adds what is new. Request latencies and token counts are measured
in the server as it streams each request; HTTP traffic by http_metrics.py. The served
registry also holds prometheus_client's standard process_* and python_* collectors.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import prometheus_client as prom
from prometheus_client.core import CounterMetricFamily, Metric

from launch.client.prefix_router import REASONS, PrefixRouter
from launch.openai.http_metrics import HTTPMetrics
from launch.openai.metric_families import (
    ADMISSION_REASONS,
    CACHED_SOURCES,
    ENGINE,
    FINISH_REASONS,
    INTER_TOKEN_LATENCY_BUCKETS,
    ITERATION_TOKENS_BUCKETS,
    LABELS,
    PROMPT_SOURCES,
    REQUEST_LATENCY_BUCKETS,
    REQUEST_NUM_PREEMPTIONS_BUCKETS,
    REQUEST_PARAMS_N_BUCKETS,
    SLEEP_STATES,
    TIME_TO_FIRST_TOKEN_BUCKETS,
    WAITING_REASONS,
    token_buckets,
)
from launch.openai.spec_metrics import SpecDecodeMetrics
from protocol.engine import KVTierStats, SchedulerStats

CONTENT_TYPE = prom.CONTENT_TYPE_LATEST
_NO_STATS = SchedulerStats(0, 0, 0.0, 0, 0, 0, 0)  # before the core's first step
# The second KV tier's counters (pagedserve:kv_tier_*), from SchedulerStats.kv_tier.
TIER_COUNTERS = {
    "queries": "Prompt tokens looked up in the KV tier after a device miss.",
    "hits": "Prompt tokens loaded from the KV tier instead of computed.",
    "stored_blocks": "Blocks stored into the KV tier.",
    "loaded_blocks": "Blocks loaded from the KV tier.",
    "stored_bytes": "Bytes stored into the KV tier, per worker.",
    "loaded_bytes": "Bytes loaded from the KV tier, per worker.",
    "disk_loaded_blocks": "Blocks loaded from the KV tier's disk level.",
    "failed_blocks": "Blocks whose disk read failed verification (recomputed instead).",
    "load_seconds": "Seconds the first worker spent loading KV tier blocks.",
    "promoted_blocks": "Blocks loaded from the disk level and copied into host memory.",
}


class ServerMetrics:
    def __init__(
        self,
        model_name: str,
        max_model_len: int,
        open_requests: Callable[[], int],
        cache_info: Mapping[str, str] | None = None,
        engines: int = 1,
        router: PrefixRouter | None = None,
    ) -> None:
        prom.disable_created_metrics()  # the *_created series only double the output
        self.registry = r = prom.CollectorRegistry()
        # What prometheus_client's default registry holds (vLLM serves that one).
        prom.ProcessCollector(registry=r)
        prom.PlatformCollector(registry=r)
        prom.GCCollector(registry=r)
        self.http = HTTPMetrics(r)
        self.model_name = model_name
        self._define_engine(model_name, engines)
        self.spec_decode = SpecDecodeMetrics(self._metric, model_name, engines)
        self._define_requests(model_name, max_model_len)
        if cache_info is not None:
            info = prom.Gauge(
                "vllm:cache_config_info",
                "The engine's KV-cache configuration, as labels (always 1).",
                list(cache_info),
                registry=r,
            )
            for e in range(engines):
                info.labels(**{**cache_info, "engine": str(e)}).set(1)
        if router is not None:
            r.register(RouterCollector(router))
        prom.Gauge(
            "pagedserve:open_requests",
            "Requests the server has open in the engine.",
            registry=r,
        ).set_function(open_requests)
        # Plain totals for the periodic log line (StatsLog), beside the Prometheus series.
        self.total_prompt_tokens = 0
        self.total_generation_tokens = 0

    def _metric(self, kind: type, name: str, doc: str, extra: Sequence[str] = (), **kw: Any) -> Any:
        """A vllm: family labelled model_name and engine (plus extra), in this registry."""
        return kind(name, doc, [*LABELS, *extra], registry=self.registry, **kw)

    def _define_engine(self, model: str, engines: int) -> None:
        """The families fed by the cores' per-step stats: a series per engine (a
        data-parallel replica's index)."""
        gauge, counter = prom.Gauge, prom.Counter

        def one(kind: type, name: str, doc: str, **kw: Any) -> list[Any]:
            metric = self._metric(kind, name, doc, **kw)
            return [metric.labels(model, str(e)) for e in range(engines)]

        def by(kind: type, name: str, doc: str, label: str, values: Sequence[str]) -> list[dict]:
            metric = self._metric(kind, name, doc, [label])
            return [{v: metric.labels(model, str(e), v) for v in values} for e in range(engines)]

        running = one(gauge, "vllm:num_requests_running", "Requests in the running batch.")
        waiting = one(gauge, "vllm:num_requests_waiting", "Requests waiting to run.")
        waiting_by_reason = by(
            gauge,
            "vllm:num_requests_waiting_by_reason",
            "Waiting requests by reason: capacity (no room yet) or deferred (never here).",
            "reason",
            WAITING_REASONS,
        )
        sleep = by(gauge, "vllm:engine_sleep_state", "Always awake.", "sleep_state", SLEEP_STATES)
        for state in sleep:
            state["awake"].set(1)
        kv_usage = one(gauge, "vllm:kv_cache_usage_perc", "KV-cache usage (1 = full).")
        queries = one(counter, "vllm:prefix_cache_queries", "Prompt tokens looked up.")
        hits = one(counter, "vllm:prefix_cache_hits", "Prompt tokens found in the cache.")
        preemptions = one(counter, "vllm:num_preemptions", "Preempted requests.")
        tier = {
            name: one(counter, f"pagedserve:kv_tier_{name}", text)
            for name, text in TIER_COUNTERS.items()
        }
        tier_counts = [{name: each[e] for name, each in tier.items()} for e in range(engines)]
        prompt_by_source = by(
            counter,
            "vllm:prompt_tokens_by_source",
            "Prompt tokens by source: computed here or served from the prefix cache.",
            "source",
            PROMPT_SOURCES,
        )
        prompt_cached = one(
            counter, "vllm:prompt_tokens_cached", "Prompt tokens served from the prefix cache."
        )
        cached_by_source = by(
            counter,
            "vllm:prompt_tokens_cached_by_source",
            "Prefix-cache hit tokens by tier (device only here), counted at lookup.",
            "source",
            CACHED_SOURCES,
        )
        iteration_tokens = one(
            prom.Histogram,
            "vllm:iteration_tokens_total",
            "Tokens per engine step: prompt tokens computed (of requests first scheduled) "
            "plus tokens sampled.",
            buckets=ITERATION_TOKENS_BUCKETS,
        )
        series = dict(
            running=running, waiting=waiting, waiting_by_reason=waiting_by_reason,
            kv_usage=kv_usage, queries=queries, hits=hits, preemptions=preemptions,
            prompt_by_source=prompt_by_source, prompt_cached=prompt_cached,
            cached_by_source=cached_by_source, iteration_tokens=iteration_tokens,
            tier_counts=tier_counts,
        )  # fmt: skip
        self.engines = [
            EngineSeries(**{name: each[e] for name, each in series.items()}) for e in range(engines)
        ]

    def _define_requests(self, model: str, max_model_len: int) -> None:
        """The families the server measures per request."""

        def one(kind: type, name: str, doc: str, **kw: Any) -> Any:
            return self._metric(kind, name, doc, **kw).labels(model, ENGINE)

        def histogram(name: str, doc: str, buckets: Sequence[float]) -> prom.Histogram:
            return one(prom.Histogram, name, doc, buckets=buckets)

        counter = prom.Counter
        self.prompt_tokens = one(counter, "vllm:prompt_tokens", "Prompt tokens of requests.")
        self.generation_tokens = one(counter, "vllm:generation_tokens", "Generated tokens.")
        success = self._metric(
            counter, "vllm:request_success", "Requests that ended, by finish reason.",
            ["finished_reason"],
        )  # fmt: skip
        self.success = {r: success.labels(model, ENGINE, r) for r in FINISH_REASONS}
        self._success_metric = success
        rejections = prom.Counter(
            "vllm:admission_rejections",
            "Requests refused by a queue limit, by reason (--max-waiting-requests: "
            "max_num_queued_reqs).",
            ["model_name", "reason"],
            registry=self.registry,
        )
        self.rejections = {r: rejections.labels(model, r) for r in ADMISSION_REASONS}
        latency, ttft = REQUEST_LATENCY_BUCKETS, TIME_TO_FIRST_TOKEN_BUCKETS
        itl = INTER_TOKEN_LATENCY_BUCKETS
        self.ttft = histogram("vllm:time_to_first_token_seconds", "Arrival to first token.", ttft)
        self.itl = histogram("vllm:inter_token_latency_seconds", "Time between tokens.", itl)
        self.e2e = histogram("vllm:e2e_request_latency_seconds", "Arrival to last token.", latency)
        self.queue = histogram(
            "vllm:request_queue_time_seconds", "In the core's queue before first run.", latency
        )
        self.prefill = histogram(
            "vllm:request_prefill_time_seconds", "First scheduled to first token.", latency
        )
        self.decode = histogram("vllm:request_decode_time_seconds", "First token to last.", latency)
        self.inference = histogram(
            "vllm:request_inference_time_seconds", "First scheduled to last token.", latency
        )
        self.tpot = histogram(
            "vllm:request_time_per_output_token_seconds", "Decode time per later token.", itl
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
        self.params_n = histogram("vllm:request_params_n", "Requests' n.", REQUEST_PARAMS_N_BUCKETS)
        self.params_max_tokens = histogram(
            "vllm:request_params_max_tokens", "Requests' max_tokens.", tokens
        )
        self.request_preemptions = histogram(
            "vllm:request_num_preemptions",
            "Times each finished request was preempted.",
            REQUEST_NUM_PREEMPTIONS_BUCKETS,
        )
        self.prefill_kv_computed = histogram(
            "vllm:request_prefill_kv_computed_tokens",
            "Prompt tokens each request computed (prefix-cache hits excluded).",
            tokens,
        )

    @property
    def last_stats(self) -> SchedulerStats | None:
        """The latest stats, summed over the engines (KV usage: their mean)."""
        seen = [e.last for e in self.engines if e.has_stats]
        if not seen:
            return None
        if len(seen) == 1:
            return seen[0]
        fields = SchedulerStats.__struct_fields__[:-1]  # the counts; not spec_decode
        total = [sum(getattr(s, f) for s in seen) for f in fields]
        usage = SchedulerStats.__struct_fields__.index("kv_cache_usage")
        total[usage] /= len(seen)
        return SchedulerStats(*total)

    def on_stats(self, stats: SchedulerStats, engine: int = 0) -> None:
        """An engine's stats after a step (engine: its data-parallel index)."""
        if stats.spec_decode is not None:
            self.spec_decode.update(engine, stats.spec_decode)
        self.engines[engine].update(stats)

    def rejected(self, reason: str = "max_num_queued_reqs") -> None:
        """A request refused by a queue limit (vLLM's admission reasons)."""
        self.rejections[reason].inc()

    def request(self, num_prompt_tokens: int, n: int = 1, max_tokens: int = 0) -> RequestTimer:
        self.prompt_tokens.inc(num_prompt_tokens)
        self.total_prompt_tokens += num_prompt_tokens
        self.request_prompt.observe(num_prompt_tokens)
        self.params_n.observe(n)
        if max_tokens:
            self.params_max_tokens.observe(max_tokens)
        return RequestTimer(self, num_prompt_tokens)

    def finished(self, reason: str) -> None:
        counter = self.success.get(reason)
        if counter is None:  # a reason vLLM does not pre-create
            counter = self._success_metric.labels(self.model_name, ENGINE, reason)
        counter.inc()

    def exposition(self) -> bytes:
        return prom.generate_latest(self.registry)


@dataclass
class EngineSeries:
    """One engine's step-fed series, and its last stats (the core's counts are cumulative
    since it started: the series add what is new)."""

    running: Any
    waiting: Any
    waiting_by_reason: dict[str, Any]
    kv_usage: Any
    queries: Any
    hits: Any
    preemptions: Any
    prompt_by_source: dict[str, Any]
    prompt_cached: Any
    cached_by_source: dict[str, Any]
    iteration_tokens: Any
    tier_counts: dict[str, Any]
    last: SchedulerStats = _NO_STATS
    has_stats: bool = False

    def _tier(self, now: KVTierStats, last: KVTierStats) -> None:
        c = self.tier_counts
        hits = now.hits - last.hits
        c["queries"].inc(now.queries - last.queries)
        c["hits"].inc(hits)
        self.cached_by_source["host"].inc(hits)
        stored, loaded = (
            now.stored_blocks - last.stored_blocks,
            now.loaded_blocks - last.loaded_blocks,
        )
        c["stored_blocks"].inc(stored)
        c["loaded_blocks"].inc(loaded)
        c["stored_bytes"].inc(stored * now.block_bytes)
        c["loaded_bytes"].inc(loaded * now.block_bytes)
        c["disk_loaded_blocks"].inc(now.disk_loaded_blocks - last.disk_loaded_blocks)
        c["failed_blocks"].inc(now.failed_blocks - last.failed_blocks)
        c["load_seconds"].inc(max(now.load_seconds - last.load_seconds, 0.0))
        c["promoted_blocks"].inc(now.promoted_blocks - last.promoted_blocks)

    def update(self, stats: SchedulerStats) -> None:
        self.running.set(stats.num_running)
        self.waiting.set(stats.num_waiting)
        self.waiting_by_reason["capacity"].set(stats.num_waiting)
        self.kv_usage.set(stats.kv_cache_usage)
        last = self.last
        if stats.step < last.step:
            last = _NO_STATS  # a restarted engine counts from zero again
        self.queries.inc(stats.prefix_cache_queries - last.prefix_cache_queries)
        hits = stats.prefix_cache_hits - last.prefix_cache_hits
        self.hits.inc(hits)
        self.cached_by_source["device"].inc(hits)
        self.preemptions.inc(stats.num_preemptions - last.num_preemptions)
        if stats.kv_tier is not None:
            self._tier(stats.kv_tier, last.kv_tier or KVTierStats())
        computed = stats.num_prompt_computed_tokens - last.num_prompt_computed_tokens
        cached = stats.num_prompt_cached_tokens - last.num_prompt_cached_tokens
        self.prompt_by_source["local_compute"].inc(computed)
        self.prompt_by_source["local_cache_hit"].inc(cached)
        self.prompt_cached.inc(cached)
        step_tokens = computed + stats.num_sampled_tokens - last.num_sampled_tokens
        if step_tokens:  # outputs without a step (an abort's) ran nothing
            self.iteration_tokens.observe(step_tokens)
        self.last = stats
        self.has_stats = True


class RouterCollector:
    """The data-parallel router's decisions, read from its counts at each scrape."""

    def __init__(self, router: PrefixRouter) -> None:
        self.router = router

    def collect(self) -> Iterator[Metric]:
        decisions = CounterMetricFamily(
            "pagedserve:router_requests",
            "Requests routed to a data-parallel replica, by reason: prefix_hit (one held "
            "the longest cached prefix), tie (several did: the least loaded), load (none did).",
            labels=["reason"],
        )
        for reason in REASONS:
            decisions.add_metric([reason], self.router.decisions[reason])
        yield decisions
        yield CounterMetricFamily(
            "pagedserve:router_load_skips",
            "Requests not sent to the replica with their longest cached prefix because its "
            "open requests were far above the mean.",
            value=self.router.load_skips,
        )


class RequestTimer:
    """One request's latencies, fed as its outputs arrive."""

    __slots__ = (
        "_first", "_last", "_metrics", "_queued", "_start", "num_preemptions",
        "num_prompt_tokens", "num_tokens",
    )  # fmt: skip

    def __init__(self, metrics: ServerMetrics, num_prompt_tokens: int = 0) -> None:
        self._metrics = metrics
        self._start = self._last = time.monotonic()
        self._first: float | None = None
        self._queued: float | None = None
        self.num_tokens = 0
        self.num_prompt_tokens = num_prompt_tokens
        self.num_preemptions = 0  # of its sequences, summed

    def queued(self, seconds: float) -> None:
        """The core's queue time, with the first output (of the first sequence, with n)."""
        if self._queued is None:
            self._queued = seconds
            self._metrics.queue.observe(seconds)

    def tokens(self, n: int, preemptions: int = 0) -> None:
        """n new tokens arrived now (one step's worth: n is 1 but for the first);
        preemptions: a sequence's count, with its last output."""
        self.num_preemptions += preemptions
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
        m.finished(finish_reason)
        m.request_preemptions.observe(self.num_preemptions)
        m.prefill_kv_computed.observe(max(self.num_prompt_tokens - cached_tokens, 0))
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

    def __init__(self, metrics: ServerMetrics, clock: Callable[[], float] = time.monotonic) -> None:
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
