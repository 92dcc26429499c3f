"""vLLM's prompt rendering without generation: POST /v1/chat/completions/render (one
conversation) and POST /v1/completions/render (each prompt). The answer is what POST
/inference/v1/generate takes: the prompt's token ids, exactly as the chat or completions
route would send them, and the request's sampling options, so a client may render, look
or edit, then generate token-in/token-out."""

from __future__ import annotations

import uuid
from typing import Any

from starlette.requests import Request
from starlette.responses import Response

from launch.openai.protocol import (
    APIError,
    ChatCompletionRequest,
    CompletionRequest,
    GenerationRequest,
)
from launch.openai.serving_base import OpenAIServing, ServingContext, json_response
from launch.openai.serving_chat import ChatServing
from launch.openai.serving_tokens import sampling_params_of


class RenderServing(OpenAIServing):
    def __init__(self, ctx: ServingContext, chat: ChatServing) -> None:
        super().__init__(ctx)
        self._chat = chat

    async def chat(self, request: Request) -> Response:
        body: ChatCompletionRequest = await self.read(request, ChatCompletionRequest)
        self.check_model(body.model)
        ids, _tools = self._chat.prompt(body, "messages")
        max_tokens = body.max_completion_tokens
        if max_tokens is None:
            max_tokens = body.max_tokens
        return json_response(self._rendered(body, ids, max_tokens))

    async def completion(self, request: Request) -> Response:
        body: CompletionRequest = await self.read(request, CompletionRequest)
        self.check_model(body.model)
        prompts = body.prompt_inputs()
        rendered = []
        for i, prompt in enumerate(prompts):
            try:
                ids = self.engine.prompt_token_ids(prompt)
            except (TypeError, ValueError) as e:
                message = f"prompt {i}: {e}" if len(prompts) > 1 else str(e)
                raise APIError(message, param="prompt", code="invalid_value") from None
            rendered.append(self._rendered(body, ids, body.max_tokens))
        return json_response(rendered)

    def _rendered(
        self, body: GenerationRequest, ids: list[int], max_tokens: int | None
    ) -> dict[str, Any]:
        """A generate request (serving_tokens.TokensRequest's fields) for this prompt."""
        options = body.stream_options
        return {
            "request_id": uuid.uuid4().hex,
            "token_ids": ids,
            "features": None,
            "sampling_params": sampling_params_of(body, max_tokens),
            "model": self.ctx.model_name,
            "stream": body.stream,
            "stream_options": None
            if options is None
            else {
                "include_usage": options.include_usage,
                "continuous_usage_stats": options.continuous_usage_stats,
            },
            "cache_salt": body.cache_salt,
            "priority": body.priority,
            "kv_transfer_params": None,
        }
