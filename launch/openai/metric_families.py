"""What vLLM's /metrics promises a dashboard, beyond names: the histogram buckets, the
label values it creates up front, and the labels of its cache-config info series.

A Grafana panel's histogram_quantile is only as good as the buckets it reads, and a
panel that filters on finished_reason="length" shows "No data" rather than 0 unless
that series exists from the start: so both are vLLM's, not ours.
"""

from __future__ import annotations

from collections.abc import Mapping

# Every vllm: series carries model_name and engine (vLLM's data-parallel index: each
# replica's under --data-parallel-size, else "0").
LABELS = ("model_name", "engine")
ENGINE = "0"

# Request phases (e2e, queue, prefill, decode, inference): sub-second to two hours.
REQUEST_LATENCY_BUCKETS = (
    0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0,
    120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0,
)  # fmt: skip
TIME_TO_FIRST_TOKEN_BUCKETS = (
    0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5,
    10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0,
)  # fmt: skip
# Inter-token latency and each request's mean time per output token.
INTER_TOKEN_LATENCY_BUCKETS = (
    0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5,
    10.0, 20.0, 40.0, 80.0,
)  # fmt: skip
ITERATION_TOKENS_BUCKETS = (1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384)
REQUEST_PARAMS_N_BUCKETS = (1, 2, 5, 10, 20)
REQUEST_NUM_PREEMPTIONS_BUCKETS = (1, 2, 3, 4, 5, 10, 20)

# Pre-created label values, in vLLM's order.
FINISH_REASONS = ("stop", "length", "abort", "error", "repetition")
WAITING_REASONS = ("capacity", "deferred")  # nothing here defers a request: always 0
SLEEP_STATES = ("awake", "weights_offloaded", "discard_all")  # never asleep: awake is 1
PROMPT_SOURCES = ("local_compute", "local_cache_hit", "external_kv_transfer")
CACHED_SOURCES = ("device", "host", "p2p", "disk", "external_unspecified")
ADMISSION_REASONS = ("max_num_queued_reqs", "max_num_queued_tokens")

# vllm:cache_config_info's label names (vLLM's cache-config fields, plus engine). A
# dashboard joins on any of them, so all exist; those with no counterpart here say "None".
CACHE_CONFIG_LABELS = (
    "_block_size_resolved", "block_size", "cache_dtype", "cache_hit_alignment_tokens",
    "effective_attention_block_size", "enable_mamba_shared_prefix_checkpoint",
    "enable_prefix_caching", "engine", "gpu_memory_utilization", "hash_block_size",
    "is_attention_free", "kv_cache_dtype_skip_layers", "kv_cache_layout",
    "kv_cache_max_concurrency", "kv_cache_memory_bytes", "kv_cache_size_tokens",
    "kv_offloading_backend", "kv_offloading_size", "kv_sharing_fast_prefill",
    "mamba_block_size", "mamba_cache_dtype", "mamba_cache_mode", "mamba_page_size_padded",
    "mamba_ssm_cache_dtype", "num_cpu_blocks", "num_gpu_blocks", "num_gpu_blocks_override",
    "prefix_cache_retention_interval", "prefix_caching_hash_algo", "prefix_match_unit",
    "replayssm_buffer_len", "skip_page_size_padded", "sliding_window", "swa_bounded_replay",
    "use_kda_recoverssm", "use_replayssm", "user_specified_block_size",
)  # fmt: skip


def token_buckets(max_model_len: int) -> list[float]:
    """1, 2, 5, 10, 20, 50... up to max_model_len (the per-request token histograms)."""
    buckets: list[float] = []
    scale = 1
    while True:
        for m in (1, 2, 5):
            if m * scale > max_model_len:
                return buckets
            buckets.append(m * scale)
        scale *= 10


def cache_config_labels(
    block_size: int,
    num_gpu_blocks: int,
    max_model_len: int,
    enable_prefix_caching: bool = True,
    hash_algo: str = "xxh3_128",
    gpu_memory_utilization: float = 0.9,
    kv_cache_memory: int | None = None,
    num_gpu_blocks_override: int | None = None,
) -> dict[str, str]:
    """The info series' labels for this engine's KV cache, as vLLM spells values
    (str() of Python values: "True", "None")."""
    tokens = block_size * num_gpu_blocks
    known: Mapping[str, object] = {
        "block_size": block_size,
        "cache_dtype": "auto",  # the KV cache is in the model's dtype
        "enable_prefix_caching": enable_prefix_caching,
        "engine": ENGINE,
        "gpu_memory_utilization": gpu_memory_utilization,
        "hash_block_size": block_size,
        "is_attention_free": False,
        "kv_cache_max_concurrency": tokens / max_model_len if max_model_len else None,
        "kv_cache_memory_bytes": kv_cache_memory,
        "kv_cache_size_tokens": tokens,
        "num_cpu_blocks": None,
        "num_gpu_blocks": num_gpu_blocks,
        "num_gpu_blocks_override": num_gpu_blocks_override,
        "prefix_caching_hash_algo": hash_algo,
    }
    return {name: str(known.get(name)) for name in CACHE_CONFIG_LABELS}
