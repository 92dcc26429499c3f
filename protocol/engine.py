"""Client <-> EngineCore messages: requests in, streamed outputs back."""

from __future__ import annotations

import math

import msgspec

from protocol.speculative import SpecDecodeStats

# Temperatures below this sample greedily: dividing logits by a tinier one overflows
# float32 (1e-39 turns every logit into inf or NaN, and sampling then picks token 0).
GREEDY_TEMPERATURE = 1e-5


class SamplingDefaults(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """What a request's unset sampling fields become: the model's generation_config.json
    where it sets them, else these built-ins (temperature 1, top-p and top-k off)."""

    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0


BUILTIN_SAMPLING_DEFAULTS = SamplingDefaults()

# Limits checked at every boundary (SamplingParams.validate). OpenAI's API allows 4 stop
# sequences and 20 top logprobs; n is capped so one request cannot fill the batch alone.
MAX_N = 16
MAX_STOP_STRINGS = 4
MAX_LOGPROBS = 20
MAX_PENALTY = 2.0  # presence and frequency penalties lie in [-MAX_PENALTY, MAX_PENALTY]
MAX_LOGIT_BIAS = 100.0  # OpenAI's range for a logit_bias value: [-100, 100]
MAX_LOGIT_BIAS_TOKENS = 1024  # entries per request: bounds a step's sampling work
MAX_EMBEDDING_DIMENSIONS = 1 << 20  # only a bound for the wire; the model's width is checked
MAX_BAD_WORDS = 128  # token sequences per request (each word with and without a space)
MAX_BAD_WORD_TOKENS = 32  # tokens in one of them
# A structured-output spec's text (schema, regex, grammar, choices together): bounds the
# worker's compile of it, which runs on the step's thread.
MAX_STRUCTURED_OUTPUT_BYTES = 64 * 1024
# Token ids of the marker after which a language starts (StructuredOutputs.start_after).
MAX_START_AFTER = 16
MAX_CHOICES = 256


class StructuredOutputs(
    msgspec.Struct, frozen=True, omit_defaults=True, forbid_unknown_fields=True
):
    """Constrain a request's output to a language (vLLM's StructuredOutputsParams): exactly
    one of a JSON Schema (`json`, as JSON text), any JSON object (`json_object`), a
    regular expression (`regex`, Rust regex syntax, matching the whole output), one of
    several strings (`choice`) or a grammar (`grammar`: Lark, or llama.cpp's GBNF).
    Each worker masks every token the language cannot continue with, and allows only
    EOS once it is complete. JSON may hold up to 32 whitespace characters between two of
    its tokens (pretty-printing), or none with disable_any_whitespace.
    """

    json: str | None = None
    json_object: bool = False
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    disable_any_whitespace: bool = False
    # The language starts after the output ends with these token ids (a reasoning model's
    # end of thinking, `</think>`: the server sets them under --reasoning-parser); until
    # then any token may be sampled. None: from the first token.
    start_after: list[int] | None = None

    def kind(self) -> str:
        """The one constraint set: "json", "json_object", "regex", "choice" or "grammar"
        (ValueError when none or several are)."""
        given = [
            name
            for name, value in (
                ("json", self.json is not None),
                ("json_object", self.json_object),
                ("regex", self.regex is not None),
                ("choice", self.choice is not None),
                ("grammar", self.grammar is not None),
            )
            if value
        ]
        if len(given) != 1:
            found = ", ".join(given) if given else "none"
            raise ValueError(
                "structured_outputs takes exactly one of json, json_object, regex, choice "
                f"and grammar (got {found})"
            )
        return given[0]

    def validate(self) -> None:
        """Shape and size only; whether the language parses is the worker module's check
        (worker/structured_output.py), run at the boundary too."""
        kind = self.kind()
        size = sum(len(x) for x in (self.json or "", self.regex or "", self.grammar or ""))
        if self.choice is not None:
            if not self.choice or len(self.choice) > MAX_CHOICES:
                raise ValueError(
                    f"structured_outputs choice takes 1 to {MAX_CHOICES} strings, "
                    f"got {len(self.choice)}"
                )
            if not all(self.choice):
                raise ValueError("structured_outputs choice strings must not be empty")
            size += sum(len(c) for c in self.choice)
        if size > MAX_STRUCTURED_OUTPUT_BYTES:
            raise ValueError(
                f"structured_outputs {kind} is {size} characters; at most "
                f"{MAX_STRUCTURED_OUTPUT_BYTES}"
            )
        if self.start_after is not None and not 1 <= len(self.start_after) <= MAX_START_AFTER:
            raise ValueError(
                f"structured_outputs start_after holds 1 to {MAX_START_AFTER} token ids, "
                f"got {len(self.start_after)}"
            )


class EmbeddingParams(msgspec.Struct, frozen=True, omit_defaults=True, forbid_unknown_fields=True):
    """Return the prompt's embedding: the model's final hidden state at the prompt's last
    token (last-token pooling, as decoder embedding models such as Qwen3-Embedding,
    gte-Qwen2 and e5-mistral are trained), its first `dimensions` values when set
    (Matryoshka models), L2-normalized unless normalize is false."""

    normalize: bool = True
    dimensions: int | None = None


class SamplingParams(msgspec.Struct, frozen=True, omit_defaults=True):
    """How to pick each next token. temperature 0 (or below GREEDY_TEMPERATURE) is
    greedy; top_k 0, top_p 1 and min_p 0 are off (min_p: tokens less likely than min_p
    times the likeliest one are not sampled). temperature, top_p, top_k and min_p left
    unset (None) take the model's defaults (SamplingDefaults) when the core admits the
    request.

    n and stop are the client's (launch/): it fans a request out into n core requests
    (copy i seeded with seed + i) and matches stop strings on the detokenized text; the
    core and workers ignore both. Penalties count generated tokens (presence, frequency:
    OpenAI's) or prompt and generated tokens (repetition: divides positive logits,
    multiplies negative ones). min_tokens: EOS and stop_token_ids cannot end the request
    (nor stop strings match) before that many tokens. logprobs: how many top
    alternatives to return with each token's log-probability (0: only the chosen one's).
    logit_bias: added to these tokens' logits before penalties and sampling (OpenAI's;
    -100 all but bans a token, +100 all but forces it); logprobs stay the model's own.
    """

    max_tokens: int = 16
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    seed: int | None = None
    stop_token_ids: list[int] = []
    ignore_eos: bool = False
    n: int = 1
    stop: list[str] = []
    min_tokens: int = 0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logprobs: int | None = None
    logit_bias: dict[int, float] | None = None
    # Logprobs of the prompt's tokens (each given the ones before it) with that many top
    # alternatives; the request then skips the prefix cache (a cached token has no
    # logits), as vLLM's do.
    prompt_logprobs: int | None = None
    # The output must be in this language (JSON Schema, regex, choice, grammar).
    structured_outputs: StructuredOutputs | None = None
    min_p: float | None = None
    # The client's, like n and stop (the core ignores them): a stop string's text ends
    # the output instead of being cut; special tokens (BOS, EOS, chat markers) decoded
    # into the text, which by default leaves them out.
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    # Only these tokens may be sampled (vLLM's allowed_token_ids).
    allowed_token_ids: list[int] | None = None
    # vLLM's bad_words, as texts (the client's: it tokenizes them into
    # bad_words_token_ids, which the workers apply: a sequence's last token is banned
    # wherever the output ends with the rest of it).
    bad_words: list[str] = []
    bad_words_token_ids: list[list[int]] = []
    # The client's: only the prompt's last k tokens are sent (-1: as many as the model's
    # context holds), vLLM's truncate_prompt_tokens.
    truncate_prompt_tokens: int | None = None
    # The prompt's embedding comes back with the first token (RequestOutput.embedding).
    embedding: EmbeddingParams | None = None

    @property
    def has_penalties(self) -> bool:
        return (
            self.presence_penalty != 0.0
            or self.frequency_penalty != 0.0
            or self.repetition_penalty != 1.0
        )

    def validate(self, vocab_size: int | None = None) -> None:
        """Raise ValueError naming the first bad field."""
        self._check_sampling()
        # Unbounded ints would not even encode (msgpack stops at 2**64).
        limit = 2**63 if vocab_size is None else vocab_size
        self._check_stopping(limit)
        self._check_penalties()
        self._check_logprobs()
        self._check_logit_bias(limit)
        self._check_pooling()
        self._check_token_lists(limit)
        self._check_structured_outputs(limit)

    def _check_sampling(self) -> None:
        """Length, temperature, the top-p/top-k/min-p filters, seed."""
        if not 1 <= self.max_tokens < 2**63:
            raise ValueError(f"max_tokens must be in [1, 2**63), got {self.max_tokens}")
        if self.temperature is not None and not (self.temperature >= 0.0):  # NaN too
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        if self.top_p is not None and not (0.0 < self.top_p <= 1.0):
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k is not None and not 0 <= self.top_k < 2**63:
            raise ValueError(f"top_k must be >= 0 (0 disables it), got {self.top_k}")
        if self.min_p is not None and not 0.0 <= self.min_p <= 1.0:  # NaN too
            raise ValueError(f"min_p must be in [0, 1] (0 disables it), got {self.min_p}")
        if self.seed is not None and not (0 <= self.seed < 2**63):
            raise ValueError(f"seed must be in [0, 2**63), got {self.seed}")

    def _check_stopping(self, limit: int) -> None:
        """Stop token ids (below limit), the number of outputs, stop strings, min_tokens."""
        for t in self.stop_token_ids:
            if not 0 <= t < limit:
                raise ValueError(f"stop token id {t} is outside the vocabulary [0, {limit})")
        if not 1 <= self.n <= MAX_N:
            raise ValueError(f"n must be in [1, {MAX_N}], got {self.n}")
        if len(self.stop) > MAX_STOP_STRINGS:
            raise ValueError(f"stop takes at most {MAX_STOP_STRINGS} strings, got {len(self.stop)}")
        if not all(self.stop):  # "" would match before any text
            raise ValueError("stop strings must not be empty")
        if not 0 <= self.min_tokens <= self.max_tokens:
            raise ValueError(
                f"min_tokens must be in [0, max_tokens={self.max_tokens}], got {self.min_tokens}"
            )

    def _check_penalties(self) -> None:
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            if not -MAX_PENALTY <= value <= MAX_PENALTY:  # NaN too
                raise ValueError(f"{name} must be in [-2, 2], got {value}")
        r = self.repetition_penalty
        if not (r > 0.0 and math.isfinite(r)):
            raise ValueError(f"repetition_penalty must be > 0 (1 disables it), got {r}")

    def _check_logprobs(self) -> None:
        if self.logprobs is not None and not 0 <= self.logprobs <= MAX_LOGPROBS:
            raise ValueError(f"logprobs must be in [0, {MAX_LOGPROBS}], got {self.logprobs}")
        if self.prompt_logprobs is not None and not 0 <= self.prompt_logprobs <= MAX_LOGPROBS:
            raise ValueError(
                f"prompt_logprobs must be in [0, {MAX_LOGPROBS}], got {self.prompt_logprobs}"
            )

    def _check_logit_bias(self, limit: int) -> None:
        if self.logit_bias is None:
            return
        if len(self.logit_bias) > MAX_LOGIT_BIAS_TOKENS:
            raise ValueError(
                f"logit_bias takes at most {MAX_LOGIT_BIAS_TOKENS} tokens, "
                f"got {len(self.logit_bias)}"
            )
        for t, bias in self.logit_bias.items():
            if not 0 <= t < limit:
                raise ValueError(f"logit_bias token id {t} is outside the vocabulary [0, {limit})")
            if not -MAX_LOGIT_BIAS <= bias <= MAX_LOGIT_BIAS:  # NaN too
                raise ValueError(f"logit_bias for token {t} must be in [-100, 100], got {bias}")

    def _check_pooling(self) -> None:
        """Embedding dimensions and prompt truncation."""
        if self.embedding is not None:
            d = self.embedding.dimensions
            if d is not None and not 1 <= d <= MAX_EMBEDDING_DIMENSIONS:
                raise ValueError(f"dimensions must be >= 1, got {d}")
        error = truncation_error(self.truncate_prompt_tokens)
        if error is not None:
            raise ValueError(error)

    def _check_token_lists(self, limit: int) -> None:
        """allowed_token_ids and bad words: bounded, non-empty, ids below limit."""
        if self.allowed_token_ids is not None:
            if not self.allowed_token_ids:
                raise ValueError("allowed_token_ids must not be empty (null allows every token)")
            for t in self.allowed_token_ids:
                if not 0 <= t < limit:
                    raise ValueError(
                        f"allowed_token_ids holds {t}, outside the vocabulary [0, {limit})"
                    )
        if len(self.bad_words) > MAX_BAD_WORDS or len(self.bad_words_token_ids) > MAX_BAD_WORDS:
            raise ValueError(f"bad_words takes at most {MAX_BAD_WORDS} entries")
        if not all(w.strip() for w in self.bad_words):
            raise ValueError("bad_words must not be empty or blank")
        for seq in self.bad_words_token_ids:
            if not 1 <= len(seq) <= MAX_BAD_WORD_TOKENS:
                raise ValueError(
                    f"bad_words_token_ids: each sequence holds 1 to {MAX_BAD_WORD_TOKENS} tokens"
                )
            for t in seq:
                if not 0 <= t < limit:
                    raise ValueError(
                        f"bad_words_token_ids holds {t}, outside the vocabulary [0, {limit})"
                    )

    def _check_structured_outputs(self, limit: int) -> None:
        if self.structured_outputs is None:
            return
        self.structured_outputs.validate()
        for t in self.structured_outputs.start_after or ():
            if not 0 <= t < limit:
                raise ValueError(
                    f"structured_outputs start_after holds {t}, outside the vocabulary [0, {limit})"
                )
        # The language decides where the output ends (EOS, once it is complete).
        if self.min_tokens:
            raise ValueError(
                "min_tokens cannot be combined with structured_outputs: the output "
                "ends when its language is complete"
            )
        if self.ignore_eos:
            raise ValueError(
                "ignore_eos cannot be combined with structured_outputs: the output "
                "ends with EOS when its language is complete"
            )

    def resolve(self, defaults: SamplingDefaults = BUILTIN_SAMPLING_DEFAULTS) -> SamplingParams:
        """Every field set: unset ones from defaults, a temperature below
        GREEDY_TEMPERATURE as 0. Returns self when nothing changes."""
        t, p, k, m = self.temperature, self.top_p, self.top_k, self.min_p
        if t is None:
            t = defaults.temperature
        if t < GREEDY_TEMPERATURE:
            t = 0.0
        if p is None:
            p = defaults.top_p
        if k is None:
            k = defaults.top_k
        if m is None:
            m = defaults.min_p
        if t == self.temperature and p == self.top_p and k == self.top_k and m == self.min_p:
            return self
        return msgspec.structs.replace(self, temperature=t, top_p=p, top_k=k, min_p=m)


def truncation_error(k: object) -> str | None:
    """Why k cannot be a truncate_prompt_tokens (>= 1, or -1: the model's context)."""
    if k is None or (type(k) is int and (k >= 1 or k == -1)):
        return None
    return f"truncate_prompt_tokens must be >= 1, or -1 for the context, got {k!r}"


class AddRequest(msgspec.Struct, frozen=True, tag="add"):
    request_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    cache_salt: str | None = None
    # Under the priority scheduling policy, lower runs first (vLLM's convention); any
    # other value than 0 fails the request under "fcfs".
    priority: int = 0


def priority_error(priority: object, policy: str) -> str | None:
    """Why a request's priority cannot be served under the scheduling policy, or None."""
    if type(priority) is not int:
        return f"priority must be an integer, not {priority!r}"
    if priority and policy != "priority":
        return (
            f"priority {priority} needs the priority scheduling policy "
            "(--scheduling-policy priority); this engine serves requests in arrival order"
        )
    return None


class AbortRequests(msgspec.Struct, frozen=True, tag="abort"):
    request_ids: list[str]


class ResetPrefixCache(msgspec.Struct, frozen=True, tag="reset_prefix_cache"):
    pass


class ShutdownCore(msgspec.Struct, frozen=True, tag="shutdown"):
    pass


ClientMessage = AddRequest | AbortRequests | ResetPrefixCache | ShutdownCore


class Logprobs(msgspec.Struct, frozen=True, array_like=True):
    """One sampled token's log-probabilities under the model's raw distribution (a
    log-softmax of the logits before penalties, temperature, top-k/top-p and masks)."""

    logprob: float  # of the sampled token
    top_token_ids: list[int]  # the most likely tokens, most likely first
    top_logprobs: list[float]  # their logprobs


class RequestOutput(msgspec.Struct, frozen=True, array_like=True, omit_defaults=True):
    """New tokens of one request since its last output; finish_reason once, at the end.

    finish_reason: "length", "stop" (EOS or a stop token), "abort" or "error" (then
    error says why; the request failed alone). logprobs: one per new token when the
    request asked for them, else None.
    """

    request_id: str
    new_token_ids: list[int]
    finish_reason: str | None = None
    num_cached_tokens: int = 0
    error: str | None = None
    logprobs: list[Logprobs] | None = None
    # With the request's first token, when it asked for prompt_logprobs: one per prompt
    # token after the first (the first has nothing before it).
    prompt_logprobs: list[Logprobs] | None = None
    # With the request's first token, when it asked for its embedding (SamplingParams.
    # embedding): float32 values, little-endian.
    embedding: bytes | None = None
    # With the request's first token: seconds it waited in the core before it was first
    # scheduled (its queue time; a preemption's wait is not counted).
    queued_s: float | None = None
    # With the request's last token: how many times it was preempted (0 is not sent).
    num_preemptions: int = 0


class KVTierStats(msgspec.Struct, frozen=True):
    """The second KV tier since start (docs/kv_tier.md): prompt tokens looked up in it
    after a device miss and found; blocks stored into it and loaded from it, and their
    bytes per worker."""

    queries: int = 0
    hits: int = 0
    stored_blocks: int = 0
    loaded_blocks: int = 0
    block_bytes: int = 0
    disk_loaded_blocks: int = 0  # of loaded_blocks: read from the disk level
    failed_blocks: int = 0  # disk reads that failed verification: recomputed
    load_seconds: float = 0.0  # time rank 0 spent loading blocks
    promoted_blocks: int = 0  # blocks loaded from disk and copied into host memory


class SchedulerStats(msgspec.Struct, frozen=True, omit_defaults=True):
    num_running: int
    num_waiting: int
    kv_cache_usage: float
    prefix_cache_queries: int
    prefix_cache_hits: int
    num_preemptions: int
    step: int
    # Cumulative since start: prompt tokens computed here and those served from the
    # prefix cache (counted once, when a request is first scheduled); tokens sampled.
    num_prompt_computed_tokens: int = 0
    num_prompt_cached_tokens: int = 0
    num_sampled_tokens: int = 0
    spec_decode: SpecDecodeStats | None = None  # with --speculative-config only
    kv_tier: KVTierStats | None = None  # None: no tier


class Rejection(msgspec.Struct, frozen=True, array_like=True):
    """A request the core refused without touching it: its id is already open. Not a
    RequestOutput, which would read as the open request failing."""

    request_id: str
    reason: str


class EngineOutputs(msgspec.Struct, frozen=True, tag="outputs"):
    outputs: list[RequestOutput]
    stats: SchedulerStats | None = None
    rejected: list[Rejection] = []


class EngineReady(msgspec.Struct, frozen=True, tag="ready"):
    """The core finished start-up: workers joined, KV cache sized."""

    num_gpu_blocks: int
    block_size: int
    max_model_len: int
    vocab_size: int
    # Every id that ends a request (unless ignore_eos): config.json's and
    # generation_config.json's.
    eos_token_ids: list[int]
    sampling_defaults: SamplingDefaults
    # Where KV events are published and replayed (ports resolved), when they are on.
    kv_events_endpoint: str | None = None
    kv_events_replay_endpoint: str | None = None
    device: str = "cpu"  # the workers' ("cpu", "cuda:0", ...)


class EngineDead(msgspec.Struct, frozen=True, tag="dead"):
    """The core is exiting on an error. Its open requests fail with reason in outputs,
    in this one message: a client that saw them fail already knows the engine is gone,
    so it cannot send a new request into the dying engine in between."""

    reason: str
    outputs: list[RequestOutput] = []


CoreMessage = EngineOutputs | EngineReady | EngineDead
