"""POST /v1/messages and POST /v1/messages/count_tokens (Anthropic's Messages API): a
Messages request runs as the chat completion of its conversation (its chat template,
tools, tool-call and reasoning parsers); errors come back in Anthropic's shape."""

from __future__ import annotations

from collections.abc import Awaitable, Callable

from starlette.requests import Request
from starlette.responses import Response

from launch.client.engine_processes import EngineDeadError
from launch.openai.anthropic_protocol import (
    CountTokensRequest,
    MessagesRequest,
    decode,
    error_body,
)
from launch.openai.generation import Generation
from launch.openai.messages_output import MessageRun
from launch.openai.protocol import APIError
from launch.openai.serving_base import ServingContext, json_response, off_loop, unknown_model
from launch.openai.serving_chat import ChatServing
from launch.openai.serving_generation import GenerationServing

Handler = Callable[[Request], Awaitable[Response]]


def anthropic_error(e: APIError) -> Response:
    return json_response(error_body(e), e.status)


def anthropic_guard(handler: Handler) -> Handler:
    """Bad input and a dead engine become Anthropic-shaped errors; the server keeps on."""

    async def run(request: Request) -> Response:
        try:
            return await handler(request)
        except APIError as e:
            return anthropic_error(e)
        except EngineDeadError as e:
            return anthropic_error(APIError(str(e), 503))

    return run


class MessagesServing(GenerationServing):
    def __init__(self, ctx: ServingContext, chat: ChatServing) -> None:
        super().__init__(ctx)
        self._chat = chat

    def _check_model(self, model: str) -> None:
        """An unknown model is Anthropic's (and OpenAI's) 404 not_found_error."""
        if model not in self.ctx.model_names:
            raise unknown_model(self.ctx.model_names, model, 404)

    async def create(self, request: Request) -> Response:
        body: MessagesRequest = await off_loop(decode, await request.body(), MessagesRequest)
        body.check()
        self._check_model(body.model)
        chat = body.chat()
        ids, tools = self._chat.prompt(chat, "messages")
        started = await self.start(chat, [ids], body.max_tokens, "msg", thinking=True, tools=tools)
        reasoning = self.ctx.reasoning_parser
        generation = Generation(self.ctx, chat, started, reasoning)
        show = reasoning is not None and (body.thinking is None or body.thinking.type != "disabled")
        run = MessageRun(body, generation, tools, self.ctx.model_name, show)

        async def whole() -> Response:
            try:
                return json_response(await run.complete())
            except APIError as e:
                return anthropic_error(e)

        return await self.answer(request, body.stream, run.events, whole)

    async def count_tokens(self, request: Request) -> Response:
        """{"input_tokens": N}: the prompt the same Messages request would render (its
        system prompt and tools included)."""
        body: CountTokensRequest = await off_loop(decode, await request.body(), CountTokensRequest)
        self._check_model(body.model)
        chat = body.chat_request()
        if chat.tools:
            # The template gets the tools whatever the choice; "auto" alone would ask
            # for a tool-call parser that counting does not need.
            chat.tool_choice = "none"
        ids, _ = self._chat.prompt(chat, "messages")
        return json_response({"input_tokens": len(ids)})
