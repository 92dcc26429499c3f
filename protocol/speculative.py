"""--speculative-config: which draft-free method proposes tokens, and how many per step.

The keys are vLLM's, so a command line written for it reads the same here. The core
proposes the drafts (it holds every request's tokens); the workers only verify them.
"""

from __future__ import annotations

from typing import Literal

import msgspec

SpeculativeMethod = Literal["ngram", "suffix"]

# Upper bounds on what one request may draft per step and how long an n-gram may be:
# beyond them a step's verification costs more than any acceptance could repay.
MAX_SPECULATIVE_TOKENS = 32
MAX_PROMPT_LOOKUP = 64
# vLLM's default n-gram length when neither bound is given.
DEFAULT_PROMPT_LOOKUP = 5


class SpeculativeConfig(msgspec.Struct, frozen=True, forbid_unknown_fields=True, kw_only=True):
    method: SpeculativeMethod
    num_speculative_tokens: int  # K: drafts per request per step (at most)
    # ngram: the suffix of the request's tokens to look for earlier in them, in tokens.
    prompt_lookup_min: int | None = None
    prompt_lookup_max: int | None = None
    # suffix: the longest suffix matched, how many finished requests' outputs are
    # remembered, and drafts per matched token (a longer match drafts more, up to
    # num_speculative_tokens).
    suffix_decoding_max_tree_depth: int = 24
    suffix_decoding_max_cached_requests: int = 1000
    suffix_decoding_max_spec_factor: float = 1.0

    @property
    def lookup_min(self) -> int:
        return self.prompt_lookup_min or self.prompt_lookup_max or DEFAULT_PROMPT_LOOKUP

    @property
    def lookup_max(self) -> int:
        return self.prompt_lookup_max or self.prompt_lookup_min or DEFAULT_PROMPT_LOOKUP


def parse_speculative_config(text: str) -> SpeculativeConfig:
    """The flag's JSON, decoded and checked; ValueError naming the key and the fix."""
    try:
        config = msgspec.json.decode(text, type=SpeculativeConfig)
    except msgspec.ValidationError as e:  # a subclass of DecodeError: first
        raise ValueError(
            f"--speculative-config: {e} (keys: method 'ngram' or 'suffix', "
            "num_speculative_tokens, prompt_lookup_min, prompt_lookup_max, suffix_decoding_*)"
        ) from None
    except msgspec.DecodeError as e:
        raise ValueError(f"--speculative-config: not valid JSON: {e}") from None
    error = speculative_config_error(config)
    if error is not None:
        raise ValueError(f"--speculative-config: {error}")
    return config


def speculative_config_error(config: SpeculativeConfig) -> str | None:
    """What is wrong with a decoded config (the core checks its copy again), or None."""
    k = config.num_speculative_tokens
    if not 1 <= k <= MAX_SPECULATIVE_TOKENS:
        return f"num_speculative_tokens must be in [1, {MAX_SPECULATIVE_TOKENS}], got {k}"
    for name in ("prompt_lookup_min", "prompt_lookup_max"):
        value = getattr(config, name)
        if value is not None and not 1 <= value <= MAX_PROMPT_LOOKUP:
            return f"{name} must be in [1, {MAX_PROMPT_LOOKUP}], got {value}"
    if config.lookup_min > config.lookup_max:
        return (
            f"prompt_lookup_min ({config.lookup_min}) must not exceed "
            f"prompt_lookup_max ({config.lookup_max})"
        )
    if config.method == "ngram":
        return None
    if not 1 <= config.suffix_decoding_max_tree_depth <= 1024:
        return "suffix_decoding_max_tree_depth must be in [1, 1024]"
    if not 0 <= config.suffix_decoding_max_cached_requests <= 100_000:
        return "suffix_decoding_max_cached_requests must be in [0, 100000]"
    if not config.suffix_decoding_max_spec_factor > 0:
        return "suffix_decoding_max_spec_factor must be > 0"
    return None


class SpecDecodeStats(msgspec.Struct, frozen=True, array_like=True):
    """Cumulative since the core started (vLLM's spec-decode counters): verifications
    that had drafts, drafted tokens, accepted drafts, accepted drafts by position."""

    num_drafts: int
    num_draft_tokens: int
    num_accepted_tokens: int
    accepted_per_pos: list[int]

    @property
    def acceptance_rate(self) -> float:
        """Accepted drafts per drafted token."""
        return self.num_accepted_tokens / self.num_draft_tokens if self.num_draft_tokens else 0.0

    @property
    def mean_accepted_length(self) -> float:
        """Tokens a verification emits on average: its accepted drafts plus the one the
        target sampled after them (vLLM's mean acceptance length)."""
        return 1 + self.num_accepted_tokens / self.num_drafts if self.num_drafts else 0.0

    def summary(self) -> str:
        return (
            f"spec decode: {self.num_drafts} verifications, acceptance rate "
            f"{self.acceptance_rate:.1%}, mean accepted length {self.mean_accepted_length:.2f}"
        )
