"""Starting a generation (completions, chat, responses): every prompt's parameters checked,
then the request admitted and sent to the engine as one stream."""

from __future__ import annotations

import uuid

import msgspec

from launch.client.beam_search import BeamSearchParams
from launch.client.inputs import check_priority, check_stream_interval, truncated
from launch.client.request_stream import RequestStream
from launch.openai.beam_search_stream import BeamSearchStream
from launch.openai.generation import Started
from launch.openai.protocol import APIError, GenerationRequest
from launch.openai.reasoning import language_start
from launch.openai.sampling_params import beam_search_params, precompile, sampling_params
from launch.openai.serving_base import OpenAIServing, checked_truncation
from launch.openai.tools import ToolPlan
from protocol.engine import SamplingParams


class GenerationServing(OpenAIServing):
    """The base of the serving families that generate."""

    async def start(
        self,
        body: GenerationRequest,
        prompts: list[list[int]],
        max_tokens: int | None,
        prefix: str,
        thinking: bool = False,
        prompt_only: bool = False,
        tools: ToolPlan | None = None,
    ) -> Started:
        """Check every prompt's parameters, then send them all as one stream. thinking:
        the answer may reason first (a chat under --reasoning-parser); prompt_only:
        completions' echo alone (max_tokens 0); tools: what the chat's tools make of its
        answer."""
        k = checked_truncation(body.truncate_prompt_tokens)
        if k is not None:
            prompts = [truncated(ids, k, self.engine.max_model_len) for ids in prompts]
        params, beam = await self._params(body, prompts, max_tokens, prompt_only, tools)
        if thinking and self.ctx.reasoning_parser is not None and params[0].structured_outputs:
            params = [self._after_thinking(p, ids) for p, ids in zip(params, prompts)]
        admission = self.ctx.admission
        admission.check_open()
        try:
            check_priority(body.priority, self.engine.limits.scheduling_policy)
        except ValueError as e:
            raise APIError(str(e), 400, param="priority", code="invalid_value") from None
        admission.check_room()
        request_id = f"{prefix}-{body.request_id or uuid.uuid4().hex}"
        try:
            stream = self._stream(body, request_id, prompts, params, beam)
        except ValueError as e:  # e.g. vLLM's request_id naming a request still open
            param = "request_id" if body.request_id is not None else None
            raise APIError(str(e), param=param, code="invalid_value") from None
        return Started(stream, request_id, params[0], admission.admit())

    def _stream(
        self,
        body: GenerationRequest,
        request_id: str,
        prompts: list[list[int]],
        params: list[SamplingParams],
        beam: BeamSearchParams | None,
    ) -> RequestStream | BeamSearchStream:
        """The request sent to the engine: a beam search, or one stream of its prompts."""
        if beam is not None:
            return BeamSearchStream(
                self.engine,
                request_id,
                prompts,
                beam,
                params[0].logprobs,
                body.cache_salt,
                body.priority,
            )
        return self.engine.generate_many(
            prompts,
            params,
            request_id,
            cache_salt=body.cache_salt,
            priority=body.priority,
            stream_interval=body.stream_interval,
        )

    async def _params(
        self,
        body: GenerationRequest,
        prompts: list[list[int]],
        max_tokens: int | None,
        prompt_only: bool,
        tools: ToolPlan | None,
    ) -> tuple[list[SamplingParams], BeamSearchParams | None]:
        """Each prompt's SamplingParams, and use_beam_search's parameters when asked."""
        engine = self.engine
        constraint = tools.constraint if tools is not None else None
        await precompile(body, constraint)
        params = [
            sampling_params(
                body,
                max_tokens,
                len(ids),
                engine.max_model_len,
                engine.vocab_size,
                f"prompt {i}" if len(prompts) > 1 else "the prompt",
                engine.inputs.tokenizer is not None,
                constraint,
            )
            for i, ids in enumerate(prompts)
        ]
        if body.stream_interval is not None:
            try:
                check_stream_interval(body.stream_interval, "stream_interval")
            except ValueError as e:
                raise APIError(str(e), param="stream_interval", code="invalid_value") from None
        beam = None
        if body.use_beam_search:
            beam = beam_search_params(body, params, tools is not None and tools.choice != "none")
            if prompt_only:
                raise APIError(
                    "max_tokens 0 (echo only) cannot be used with use_beam_search",
                    param="max_tokens",
                    code="invalid_value",
                )
        return params, beam

    def _after_thinking(self, params: SamplingParams, prompt: list[int]) -> SamplingParams:
        """Under a reasoning parser, a structured output's language holds the answer, not
        the thinking before it (launch/openai/reasoning.language_start)."""
        spec = params.structured_outputs
        assert spec is not None
        start = language_start(lambda text: self.engine.inputs.encode(text, False), prompt)
        if start is None:
            return params
        spec = msgspec.structs.replace(spec, start_after=start)
        return msgspec.structs.replace(params, structured_outputs=spec)
