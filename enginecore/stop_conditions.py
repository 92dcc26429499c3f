"""When a sampled token ends its request: EOS or a stop token id (not below min_tokens),
or the request's length limit."""

from __future__ import annotations

from enginecore.request import Request
from protocol.engine import SamplingParams


def stop_reason(
    request: Request, token: int, num_tokens: int, eos_token_ids: frozenset[int]
) -> str | None:
    """ "stop", "length" or None for a request whose last token (its num_tokens-th) is
    token. Runs once per sampled token: comparisons only, nothing allocated."""
    params = request.sampling_params
    if (
        (token in eos_token_ids and not params.ignore_eos)
        or (params.stop_token_ids and token in params.stop_token_ids)
    ) and num_tokens - request.num_prompt_tokens > params.min_tokens:
        # Not below min_tokens (where the worker does not sample them either).
        return "stop"
    if num_tokens >= request.max_num_tokens:
        return "length"
    return None


def stop_token_set(params: SamplingParams, eos_token_ids: frozenset[int]) -> frozenset[int]:
    """The token ids that may end a request with these parameters (EOS unless ignored,
    its stop token ids), min_tokens aside: most sampled tokens are checked against this
    set alone, and only a hit or the length limit asks stop_reason."""
    eos = frozenset() if params.ignore_eos else eos_token_ids
    if not params.stop_token_ids:
        return eos
    return eos | frozenset(params.stop_token_ids)
