"""Whether a request can be admitted at all: the checks that fail it alone, at once,
before it holds any block."""

from __future__ import annotations

from typing import TYPE_CHECKING

from protocol.engine import priority_error

if TYPE_CHECKING:
    from enginecore.kv_cache_manager import KVCacheManager
    from enginecore.request import Request
    from enginecore.scheduler import SchedulerConfig


def request_error(
    request: Request, config: SchedulerConfig, vocab_size: int, kv: KVCacheManager
) -> str | None:
    """Why request can never run here (its error for the client), or None."""
    error = priority_error(request.priority, config.scheduling_policy)
    if error is not None:
        return error
    n = request.num_prompt_tokens
    if n > config.max_model_len:
        return f"prompt has {n} tokens, longer than max_model_len {config.max_model_len}"
    vocab = vocab_size
    ids = request.all_token_ids
    if min(ids) < 0 or max(ids) >= vocab:  # C loops; find the culprit only on failure
        bad = next(t for t in ids if not 0 <= t < vocab)
        return f"token id {bad} is outside the vocabulary [0, {vocab})"
    try:
        request.sampling_params.validate(vocab)
    except ValueError as e:
        return str(e)
    # Its whole life must fit the pool, or it would be admitted, preempt everyone and
    # itself, and never finish: fail it now, alone.
    longest = min(n + request.sampling_params.max_tokens, config.max_model_len)
    need = kv.max_blocks_held(longest, config.max_num_batched_tokens)
    if need > kv.num_usable_blocks:
        return (
            f"needs more KV cache than exists: {longest} tokens (prompt + max_tokens) "
            f"need {need} blocks, the cache has {kv.num_usable_blocks}"
        )
    return None
