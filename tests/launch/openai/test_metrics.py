"""The server's metrics: the periodic stats line (StatsLog) on a clock the test moves;
then a real server's /metrics against vLLM's own (the same families, types, labels and
buckets), and the values after real requests: tokens per step, prefill compute without
prefix-cache hits, preemptions per request, HTTP traffic by route."""

from __future__ import annotations

import urllib.error
import urllib.request
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import pytest
from prometheus_client.parser import text_string_to_metric_families

from launch.openai.metric_families import token_buckets
from launch.openai.metrics import ServerMetrics, StatsLog
from launch.openai.protocol import APIError
from launch.openai.serving_base import Admission
from protocol.engine import KVTierStats, SchedulerStats
from tests.helpers.server import MODEL_NAME, Server, metrics, post, start_server


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


# --- against vLLM's own /metrics (tests/launch/openai/data/vllm_metrics.txt) -------------

VLLM_METRICS = Path(__file__).parent / "data" / "vllm_metrics.txt"
# vLLM's families with nothing to count here, and why.
NOT_HERE = {
    "vllm:estimated_flops_per_gpu": "vLLM's analytic FLOPs model of each layer: none here",
    "vllm:estimated_read_bytes_per_gpu": "the same model's memory-traffic estimate",
    "vllm:estimated_write_bytes_per_gpu": "the same model's memory-traffic estimate",
    "vllm:external_prefix_cache_queries": "a KV connector's cross-instance cache: none here",
    "vllm:external_prefix_cache_hits": "a KV connector's cross-instance cache: none here",
    "vllm:mm_cache_queries": "the multimodal input cache: text-only models here",
    "vllm:mm_cache_hits": "the multimodal input cache: text-only models here",
}
MAX_MODEL_LEN = 128
BLOCK_SIZE = 16
NUM_GPU_BLOCKS = 12  # 11 usable: three 90-token requests cannot all hold their blocks


@dataclass(frozen=True)
class Family:
    type: str
    labels: frozenset[str]
    buckets: tuple[float, ...] | None
    values: dict[str, tuple[str, ...]]  # label -> values that exist before any request


def vllm_families() -> dict[str, Family]:
    families = {}
    for line in VLLM_METRICS.read_text().splitlines():
        if line.startswith("#"):
            continue
        name, kind, labels, *rest = line.split(" ")
        buckets, values = None, {}
        for item in rest:
            key, _, value = item.partition("=")
            if key == "buckets":
                bounds = token_buckets(MAX_MODEL_LEN) if value == "1-2-5" else value.split(",")
                buckets = tuple(float(b) for b in bounds)
            else:
                values[key] = tuple(value.split("|"))
        names = frozenset() if labels == "-" else frozenset(labels.split(","))
        families[name] = Family(kind, names, buckets, values)
    return families


def served_families(url: str) -> dict[str, Family]:
    with urllib.request.urlopen(f"{url}/metrics", timeout=60) as r:
        text = r.read().decode()
    families = {}
    for f in text_string_to_metric_families(text):
        labels: set[str] = set()
        values: dict[str, list[str]] = {}
        bounds: list[float] = []
        for s in f.samples:
            labels |= s.labels.keys() - {"le", "quantile"}
            for k, v in s.labels.items():
                if v not in values.setdefault(k, []):
                    values[k].append(v)
            le = s.labels.get("le")
            if s.name.endswith("_bucket") and le != "+Inf" and float(le) not in bounds:
                bounds.append(float(le))
        buckets = tuple(bounds) if f.type == "histogram" else None
        families[f.name] = Family(
            f.type, frozenset(labels), buckets, {k: tuple(v) for k, v in values.items()}
        )
    return families


@pytest.fixture(scope="module")
def small_kv_server(chat_model: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    s = start_server(
        chat_model,
        tmp_path_factory.mktemp("metrics"),
        *("--max-model-len", str(MAX_MODEL_LEN), "--block-size", str(BLOCK_SIZE)),
        *("--num-gpu-blocks", str(NUM_GPU_BLOCKS)),
    )
    yield s
    s.stop()


def complete(server: Server, prompt: list[int], max_tokens: int) -> dict:
    body = {"model": MODEL_NAME, "prompt": prompt, "max_tokens": max_tokens, "ignore_eos": True}
    status, answer = post(f"{server.url}/v1/completions", body)
    assert status == 200, answer
    return answer


def delta(before: dict[str, float], after: dict[str, float], name: str) -> float:
    return after.get(name, 0.0) - before.get(name, 0.0)


def test_every_vllm_family_that_applies_is_served_alike(small_kv_server: Server) -> None:
    """Same name, type, label names, buckets and pre-created label values as vLLM's, so a
    dashboard's queries find every series before the first request; nothing invented
    under vLLM's prefix."""
    complete(small_kv_server, [5, 6, 7], 2)  # the http_* families have a series
    ours, theirs = served_families(small_kv_server.url), vllm_families()
    for name, want in theirs.items():
        if name in NOT_HERE:
            assert name not in ours, f"{name} is served: drop it from NOT_HERE"
            continue
        assert name in ours, f"{name} is missing"
        got = ours[name]
        assert (got.type, got.labels) == (want.type, want.labels), name
        assert got.buckets == want.buckets, name
        for label, values in want.values.items():
            assert got.values[label][: len(values)] == values, (name, label)
    assert not {n for n in ours if n.startswith("vllm:")} - theirs.keys()
    assert all(v == ("0",) for f in ours.values() for k, v in f.values.items() if k == "engine")
    info = ours["vllm:cache_config_info"].values
    assert info["block_size"] == (str(BLOCK_SIZE),)
    assert info["num_gpu_blocks"] == (str(NUM_GPU_BLOCKS),)
    assert info["enable_prefix_caching"] == ("True",)


def test_iteration_and_prefill_tokens_count_what_the_engine_computed(
    small_kv_server: Server,
) -> None:
    """Per step: the prompt tokens computed (when a request is first scheduled) plus the tokens
    sampled; a prefix-cache hit is neither computed nor counted as prefill compute."""
    url = small_kv_server.url
    prompt = list(range(100, 140))  # 40 tokens: two full blocks cached after the first
    before = metrics(url)
    complete(small_kv_server, prompt, 3)
    complete(small_kv_server, prompt, 3)  # the second computes 40 - 32 prompt tokens
    after = metrics(url)
    computed, cached, generated = 40 + 8, 32, 6
    assert delta(before, after, "vllm:iteration_tokens_total_sum") == computed + generated
    assert delta(before, after, "vllm:request_prefill_kv_computed_tokens_sum") == computed
    assert delta(before, after, "vllm:request_prefill_kv_computed_tokens_count") == 2
    by_source = "vllm:prompt_tokens_by_source_total{source=%s}"
    assert delta(before, after, by_source % "local_compute") == computed
    assert delta(before, after, by_source % "local_cache_hit") == cached
    assert delta(before, after, by_source % "external_kv_transfer") == 0
    assert delta(before, after, "vllm:prompt_tokens_cached_total") == cached
    hits = delta(before, after, "vllm:prefix_cache_hits_total")
    assert delta(before, after, "vllm:prompt_tokens_cached_by_source_total{source=device}") == hits
    assert delta(before, after, "vllm:request_num_preemptions_count") == 2


def test_preemptions_are_counted_per_request(small_kv_server: Server) -> None:
    """Three requests that cannot all keep their blocks: the core preempts, and every
    preemption shows in the counter and in its request's histogram entry."""
    url = small_kv_server.url
    before = metrics(url)

    def run(k: int) -> dict:
        return complete(small_kv_server, [k] * 30, 60)  # 90 tokens: 6 of the 11 blocks

    with ThreadPoolExecutor(3) as pool:
        answers = list(pool.map(run, (40, 50, 60)))
    assert [a["usage"]["completion_tokens"] for a in answers] == [60] * 3
    after = metrics(url)
    preempted = delta(before, after, "vllm:num_preemptions_total")
    assert preempted > 0
    assert delta(before, after, "vllm:request_num_preemptions_sum") == preempted
    assert delta(before, after, "vllm:request_num_preemptions_count") == 3
    assert delta(before, after, "vllm:request_success_total{finished_reason=length}") == 3


def test_http_requests_are_counted_by_route_template(small_kv_server: Server) -> None:
    """By route template and status class; a path no route knows is "none"; probes and
    scrapes are not counted."""
    url = small_kv_server.url
    before = metrics(url)
    complete(small_kv_server, [1, 2], 1)
    for path in ("/no/such/path", "/v1/models/absent", "/health"):
        try:
            urllib.request.urlopen(f"{url}{path}", timeout=60).close()
        except urllib.error.HTTPError:
            pass
    after = metrics(url)
    total = "http_requests_total{handler=%s,method=%s,status=%s}"
    assert delta(before, after, total % ("/v1/completions", "POST", "2xx")) == 1
    assert delta(before, after, total % ("none", "GET", "4xx")) == 1
    assert delta(before, after, total % ("/v1/models/{model:path}", "GET", "4xx")) == 1
    assert not any("/health" in k or "/metrics" in k for k in after)
    assert delta(before, after, "http_request_duration_highr_seconds_count") == 3
    size = "http_request_size_bytes_count{handler=/v1/completions}"
    assert delta(before, after, size) == 1


def test_a_refusal_by_the_waiting_bound_is_counted_as_vllm_names_it() -> None:
    metrics = ServerMetrics("m", 1024, lambda: 0)
    admission = Admission(max_waiting=1)
    admission.on_reject = metrics.rejected
    admission.admit()
    with pytest.raises(APIError):
        admission.check_room()
    text = metrics.exposition().decode()
    assert (
        'vllm:admission_rejections_total{model_name="m",reason="max_num_queued_reqs"} 1.0' in text
    )
    assert (
        'vllm:admission_rejections_total{model_name="m",reason="max_num_queued_tokens"} 0.0' in text
    )


def test_kv_tier_loads_their_time_and_failed_disk_reads_are_counted() -> None:
    metrics = ServerMetrics("m", 1024, lambda: 0)
    for loaded, disk, failed, seconds in ((4, 1, 0, 0.25), (10, 6, 2, 0.75)):
        tier = KVTierStats(40, 4 * loaded, 20, loaded, 2048, disk, failed, seconds, disk - 1)
        metrics.on_stats(SchedulerStats(0, 0, 0.0, 0, 0, 0, 0, kv_tier=tier))
    families = {
        s.name: s.value
        for f in text_string_to_metric_families(metrics.exposition().decode())
        for s in f.samples
    }
    assert families["pagedserve:kv_tier_loaded_blocks_total"] == 10
    assert families["pagedserve:kv_tier_disk_loaded_blocks_total"] == 6
    assert families["pagedserve:kv_tier_failed_blocks_total"] == 2
    assert families["pagedserve:kv_tier_load_seconds_total"] == 0.75
    assert families["pagedserve:kv_tier_promoted_blocks_total"] == 5
