"""Token-in/token-out generation, vLLM's POST /inference/v1/generate: a prompt's token ids
and sampling parameters in, the generated token ids out (no text either way), whole or
as server-sent events. Reinforcement-learning trainers use it: what they train on is the
exact ids sampled, never a round trip through text.

The request runs as the legacy completion of a token-id prompt (the same checks, the same
engine request); only its body and answer differ. POST /v1/chat/completions/render
(serving_render.py) answers with a body this route takes as is.
"""

from __future__ import annotations

import uuid
from collections.abc import AsyncIterator
from typing import Annotated, Any

import msgspec
from starlette.requests import Request
from starlette.responses import Response

from launch.openai.generation import Generation, Started
from launch.openai.protocol import (
    SAMPLING_FIELDS,
    APIError,
    CompletionRequest,
    GenerationRequest,
    StreamOptions,
    StructuredOutputsBody,
    sampling_fields,
)
from launch.openai.response_shapes import chat_logprobs, sse_event, usage
from launch.openai.serving_base import ServingContext, error_response, json_response
from launch.openai.serving_generation import GenerationServing

# A client's request_id is echoed, not kept: bounded so an answer cannot be made to grow.
MAX_REQUEST_ID = 512

# The body's sampling_params takes the SamplingParams fields every completion body takes
# (vLLM's SamplingParams names).
TOKEN_SAMPLING_FIELDS = SAMPLING_FIELDS

TokenSamplingParams = msgspec.defstruct(
    "TokenSamplingParams",
    [
        *sampling_fields(TOKEN_SAMPLING_FIELDS),
        # Each sampled token's logprob with this many alternatives; None: none.
        ("logprobs", int | None, None),
        # vLLM's: whether outputs are turned into text; answers here carry ids only.
        ("detokenize", bool, True),
    ],
    module=__name__,
    kw_only=True,
    forbid_unknown_fields=True,
)
TokenSamplingParams.__doc__ = "sampling_params of a token-in/token-out request (vLLM's names)."


class TokensRequest(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    """POST /inference/v1/generate (vLLM's GenerateRequest)."""

    token_ids: list[int]
    sampling_params: TokenSamplingParams = msgspec.field(default_factory=TokenSamplingParams)
    model: str | None = None
    # Echoed in the answer; a fresh one when not given.
    request_id: Annotated[str, msgspec.Meta(max_length=MAX_REQUEST_ID)] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    cache_salt: str | None = None
    priority: int = 0
    # vLLM's disaggregated serving: only null is served here.
    features: None = None
    kv_transfer_params: None = None

    def completion(self) -> CompletionRequest:
        """The same request as a legacy completion of a token-id prompt."""
        sp = self.sampling_params
        fields = {name: getattr(sp, name) for name in TOKEN_SAMPLING_FIELDS}
        return CompletionRequest(
            prompt=self.token_ids,
            model=self.model,
            stream=self.stream,
            stream_options=self.stream_options,
            cache_salt=self.cache_salt,
            priority=self.priority,
            logprobs=sp.logprobs,
            **fields,
        )


def sampling_params_of(body: GenerationRequest, max_tokens: int | None) -> dict[str, Any]:
    """A generation body's sampling options as a TokensRequest's sampling_params (what
    rendering a request answers with)."""
    structured, _ = body.structured()
    fields = {name: getattr(body, name) for name in TOKEN_SAMPLING_FIELDS}
    fields["max_tokens"] = max_tokens
    if structured is not None:
        fields["structured_outputs"] = StructuredOutputsBody(
            json=structured.json,
            json_object=structured.json_object,
            regex=structured.regex,
            choice=structured.choice,
            grammar=structured.grammar,
            disable_any_whitespace=structured.disable_any_whitespace,
        )
    return msgspec.to_builtins(TokenSamplingParams(logprobs=body.num_logprobs(), **fields))


class TokensServing(GenerationServing):
    async def generate(self, request: Request) -> Response:
        body: TokensRequest = await self.read(request, TokensRequest)
        self.check_model(body.model)
        if not body.token_ids:
            raise APIError("token_ids must not be empty", param="token_ids", code="invalid_value")
        try:
            ids = self.engine.prompt_token_ids(body.token_ids)
        except (TypeError, ValueError) as e:
            raise APIError(str(e), param="token_ids", code="invalid_value") from None
        max_tokens = body.sampling_params.max_tokens
        if max_tokens is None and len(ids) < self.engine.max_model_len:
            max_tokens = self.engine.max_model_len - len(ids)  # vLLM's: the context left
        completion = body.completion()
        try:
            started = await self.start(completion, [ids], max_tokens, "generate-tokens")
        except APIError as e:
            e.param = _param(e.param)
            raise
        answer = TokensAnswer(self.ctx, completion, started, body.request_id)
        return await self.answer(request, body.stream, answer.events, answer.complete)


def _param(param: str | None) -> str | None:
    """A completion's field as the token request names it."""
    if param == "prompt":
        return "token_ids"
    if param in TOKEN_SAMPLING_FIELDS or param == "logprobs":
        return f"sampling_params.{param}"
    return param


def _token_name(token_id: int) -> str:
    return f"token_id:{token_id}"


class TokensAnswer(Generation):
    """A token-in/token-out answer: each choice's token ids (and logprobs, named by id)."""

    def __init__(
        self,
        ctx: ServingContext,
        body: CompletionRequest,
        started: Started,
        request_id: str | None,
    ) -> None:
        super().__init__(ctx, body, started)
        self.request_id = request_id or uuid.uuid4().hex

    def _choice_logprobs(self, index: int, start: int) -> dict[str, Any] | None:
        c = self.choices[index]
        if c.logprobs is None:
            return None
        return chat_logprobs(c.ids[start:], c.logprobs[start:], _token_name)

    def _usage(self) -> dict[str, Any]:
        return usage(self.num_prompt_tokens, self.timer.num_tokens, self.cached_tokens())

    async def complete(self) -> Response:
        try:
            async for _ in self.outputs():
                pass
        except APIError as e:
            return error_response(e)
        choices = [
            {
                "index": i,
                "logprobs": self._choice_logprobs(i, 0),
                "finish_reason": c.finish,
                "token_ids": c.ids,
            }
            for i, c in enumerate(self.choices)
        ]
        c0 = self.choices[0]
        answer = {
            "request_id": self.request_id,
            "id": self.id,
            "object": "generate",
            "created": self.created,
            "model": self.ctx.model_name,
            "choices": choices,
            "usage": self._usage(),
            "prompt_logprobs": self.prompt_logprobs(c0),
            "kv_transfer_params": None,
        }
        return json_response(answer)

    async def events(self) -> AsyncIterator[bytes]:
        options = self.body.stream_options
        continuous = options is not None and options.continuous_usage_stats
        try:
            async for out in self.outputs():
                c = self.choices[out.index]
                if not out.new_token_ids and out.finish_reason is None:
                    continue
                choice = {
                    "index": out.index,
                    "logprobs": self._choice_logprobs(out.index, c.sent),
                    "finish_reason": out.finish_reason,
                    "token_ids": c.ids[c.sent :],
                }
                c.sent = len(c.ids)
                chunk: dict[str, Any] = {"request_id": self.request_id, "choices": [choice]}
                if continuous:
                    chunk["usage"] = self._usage()
                yield sse_event(chunk)
            if self.body.include_usage:
                last = {"request_id": self.request_id, "choices": [], "usage": self._usage()}
                yield sse_event(last)
        except APIError as e:
            yield sse_event(e.body())
        yield b"data: [DONE]\n\n"
