"""Client <-> EngineCore messages: requests in, streamed outputs back."""

from __future__ import annotations

import msgspec


class SamplingParams(msgspec.Struct, frozen=True, omit_defaults=True):
    """How to pick each next token. temperature 0 is greedy; top_k 0 and top_p 1 are off."""

    max_tokens: int = 16
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None
    stop_token_ids: list[int] = []
    ignore_eos: bool = False

    def validate(self, vocab_size: int | None = None) -> None:
        """Raise ValueError naming the first bad field."""
        if not 1 <= self.max_tokens < 2**63:
            raise ValueError(f"max_tokens must be in [1, 2**63), got {self.max_tokens}")
        if not (self.temperature >= 0.0):  # also rejects NaN
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        if not (0.0 < self.top_p <= 1.0):
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if not 0 <= self.top_k < 2**63:
            raise ValueError(f"top_k must be >= 0 (0 disables it), got {self.top_k}")
        if self.seed is not None and not (0 <= self.seed < 2**63):
            raise ValueError(f"seed must be in [0, 2**63), got {self.seed}")
        # Unbounded ints would not even encode (msgpack stops at 2**64).
        limit = 2**63 if vocab_size is None else vocab_size
        for t in self.stop_token_ids:
            if not 0 <= t < limit:
                raise ValueError(f"stop token id {t} is outside the vocabulary [0, {limit})")


class AddRequest(msgspec.Struct, frozen=True, tag="add"):
    request_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    cache_salt: str | None = None


class AbortRequests(msgspec.Struct, frozen=True, tag="abort"):
    request_ids: list[str]


class ResetPrefixCache(msgspec.Struct, frozen=True, tag="reset_prefix_cache"):
    pass


class ShutdownCore(msgspec.Struct, frozen=True, tag="shutdown"):
    pass


ClientMessage = AddRequest | AbortRequests | ResetPrefixCache | ShutdownCore


class RequestOutput(msgspec.Struct, frozen=True, array_like=True):
    """New tokens of one request since its last output; finish_reason once, at the end.

    finish_reason: "length", "stop" (EOS or a stop token), "abort" or "error" (then
    error says why; the request failed alone).
    """

    request_id: str
    new_token_ids: list[int]
    finish_reason: str | None = None
    num_cached_tokens: int = 0
    error: str | None = None


class SchedulerStats(msgspec.Struct, frozen=True):
    num_running: int
    num_waiting: int
    kv_cache_usage: float
    prefix_cache_queries: int
    prefix_cache_hits: int
    num_preemptions: int
    step: int


class EngineOutputs(msgspec.Struct, frozen=True, tag="outputs"):
    outputs: list[RequestOutput]
    stats: SchedulerStats | None = None


class EngineReady(msgspec.Struct, frozen=True, tag="ready"):
    """The core finished start-up: workers joined, KV cache sized."""

    num_gpu_blocks: int
    block_size: int
    max_model_len: int
    vocab_size: int
    eos_token_id: int | None


class EngineDead(msgspec.Struct, frozen=True, tag="dead"):
    """The core is exiting on an error; open requests were failed with it."""

    reason: str


CoreMessage = EngineOutputs | EngineReady | EngineDead
