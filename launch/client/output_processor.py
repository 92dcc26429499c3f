"""One core request as a client sees it: token ids, text deltas, stop strings, logprobs.

Shared by `LLM` and `AsyncLLM`, so a stop string ends a request the same way through
every door: the text stops before it, finish_reason is "stop", stop_reason names it, and
the caller aborts the core request at once (its blocks free; later tokens are dropped).
"""

from __future__ import annotations

from dataclasses import dataclass

import msgspec
import numpy as np

from launch.client.detokenizer import IncrementalDetokenizer
from launch.client.stop_strings import StopStringMatcher
from launch.client.tokenizer import Tokenizer
from protocol.engine import Logprobs, RequestOutput, SamplingParams


@dataclass(slots=True)
class SequenceOutput:
    new_token_ids: list[int]
    text: str  # "" when not detokenizing
    num_output_tokens: int  # so far, these included
    finish_reason: str | None
    logprobs: list[Logprobs] | None  # one per new token, when asked for
    stop_reason: str | int | None  # the stop string or stop token id that ended it
    # With the first output, when asked for: one per prompt token, None for the first.
    prompt_logprobs: list[Logprobs | None] | None = None
    # With the first output, when asked for (SamplingParams.embedding).
    embedding: list[float] | None = None


class SequenceState:
    """Turns a core request's outputs into SequenceOutputs. `stopped` turns True when a
    stop string ended it here: the core does not know yet, so the caller aborts it."""

    def __init__(self, tokenizer: Tokenizer | None, params: SamplingParams, text: bool) -> None:
        if params.stop and tokenizer is None:
            raise ValueError("stop strings need the model's tokenizer (this model has none)")
        self.params = params
        self._detok = (
            IncrementalDetokenizer(tokenizer, params.skip_special_tokens)
            if tokenizer and (text or params.stop)
            else None
        )
        self._text = text
        self._stop = (
            StopStringMatcher(params.stop, params.min_tokens, params.include_stop_str_in_output)
            if params.stop
            else None
        )
        self.num_output_tokens = 0
        self.stopped = False
        self.finished = False

    def process(self, o: RequestOutput) -> SequenceOutput:
        self.num_output_tokens += len(o.new_token_ids)
        finish = o.finish_reason
        text = ""
        if self._detok is not None:
            keep = self.params.include_stop_str_in_output
            text = self._detok.step(text_token_ids(o.new_token_ids, finish, keep))
            if finish is not None:
                text += self._detok.flush()
        stop_reason: str | int | None = None
        if self._stop is not None:
            text = self._stop.step(text, self.num_output_tokens)
            if self._stop.matched is not None:
                finish, stop_reason = "stop", self._stop.matched
                self.stopped = o.finish_reason is None  # the core still runs it
            elif finish is not None:
                text += self._stop.flush()
        if finish == "stop" and stop_reason is None and o.new_token_ids:
            last = o.new_token_ids[-1]
            if last in self.params.stop_token_ids:
                stop_reason = last  # as vLLM reports it (EOS gives None)
        self.finished = finish is not None
        return SequenceOutput(
            o.new_token_ids,
            text if self._text else "",
            self.num_output_tokens,
            finish,
            o.logprobs,
            stop_reason,
            None if o.prompt_logprobs is None else [None, *o.prompt_logprobs],
            None if o.embedding is None else embedding_values(o.embedding),
        )


def text_token_ids(token_ids: list[int], finish_reason: str | None, keep_stop: bool) -> list[int]:
    """The tokens whose text is output: all but the EOS or stop token that ended the request
    ("stop" from the core), unless include_stop_str_in_output (vLLM's rule; skipping
    special tokens hides EOS, not a stop token id's text)."""
    if finish_reason == "stop" and token_ids and not keep_stop:
        return token_ids[:-1]
    return token_ids


def embedding_values(vector: bytes) -> list[float]:
    """RequestOutput.embedding (float32, little-endian) as Python floats."""
    return np.frombuffer(vector, dtype="<f4").tolist()


def fan_out(request_id: str, params: SamplingParams) -> list[tuple[str, SamplingParams]]:
    """The core requests of one prompt's client request, as (core request id, params): n
    copies (n 1 each, stop strings left to the client) named request_id when n is 1, else
    "{request_id}-{i}"; with a seed, copy i gets seed + i so that the copies differ.
    Sent back to back, the copies share the prompt's full blocks through the prefix cache."""
    one = msgspec.structs.replace(params, n=1, stop=[], bad_words=[])
    if params.n == 1:
        return [(request_id, one)]
    if params.seed is None:
        return [(f"{request_id}-{i}", one) for i in range(params.n)]
    replace = msgspec.structs.replace
    return [
        (f"{request_id}-{i}", replace(one, seed=(params.seed + i) % 2**63)) for i in range(params.n)
    ]


def merge(first: SequenceOutput, later: SequenceOutput) -> None:
    """Fold later (the same sequence's next output) into first: what both added at once."""
    first.new_token_ids = first.new_token_ids + later.new_token_ids
    first.text += later.text
    first.num_output_tokens = later.num_output_tokens
    first.finish_reason = later.finish_reason
    first.stop_reason = later.stop_reason
    if later.logprobs:
        first.logprobs = (first.logprobs or []) + later.logprobs
    if first.prompt_logprobs is None:
        first.prompt_logprobs = later.prompt_logprobs
    if first.embedding is None:
        first.embedding = later.embedding
