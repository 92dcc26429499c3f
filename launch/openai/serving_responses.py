"""POST /v1/responses (OpenAI's Responses API), and the stored responses: GET / DELETE
/v1/responses/{id}, GET /v1/responses/{id}/input_items, POST /v1/responses/{id}/cancel (a
background one: responses_background.py)."""

from __future__ import annotations

from typing import Any

from starlette.requests import Request
from starlette.responses import Response

from launch.openai.generation import Generation
from launch.openai.protocol import APIError, ChatCompletionRequest
from launch.openai.responses_background import BackgroundResponses
from launch.openai.responses_items import input_messages, turn_starts, without_oldest_turns
from launch.openai.responses_output import ResponseRun
from launch.openai.responses_protocol import ResponsesRequest
from launch.openai.responses_store import ResponseStore, list_page, not_found
from launch.openai.serving_base import (
    ServingContext,
    error_response,
    json_response,
    off_loop,
)
from launch.openai.serving_chat import ChatServing
from launch.openai.serving_generation import GenerationServing
from launch.openai.tools import ToolPlan

# Chat completions' names for what a Responses body calls otherwise.
_RESPONSES_PARAMS = {
    "messages": "input",
    "max_tokens": "max_output_tokens",
    "response_format": "text.format",
}


class ResponsesServing(GenerationServing):
    """A Responses request runs as the chat completion of its conversation (its input
    items, after a stored response's when it continues one)."""

    def __init__(self, ctx: ServingContext, chat: ChatServing, store: ResponseStore) -> None:
        super().__init__(ctx)
        self._chat = chat
        self.store = store
        self.background = BackgroundResponses(store)

    async def create(self, request: Request) -> Response:
        body: ResponsesRequest = await self.read(request, ResponsesRequest)
        body.check()
        self.check_model(body.model)
        if body.background:
            if not self.store.capacity:
                raise APIError(
                    "background responses are fetched from the response store, which this "
                    "server keeps off (--max-stored-responses 0)",
                    param="background",
                    code="invalid_value",
                )
            self.background.check_room()
        prior: list[dict[str, Any]] = []
        if body.previous_response_id is not None:
            stored = self.store.get(body.previous_response_id)
            if stored is None:
                raise not_found(body.previous_response_id, "previous_response_id")
            prior = stored.messages
        chat, ids, tools, messages = await off_loop(self._conversation, body, prior)
        try:
            started = await self.start(
                chat, [ids], body.max_output_tokens, "resp", thinking=True, tools=tools
            )
        except APIError as e:
            e.param = _RESPONSES_PARAMS.get(e.param, e.param)  # type: ignore[arg-type]
            raise
        generation = Generation(self.ctx, chat, started, self.ctx.reasoning_parser)
        run = ResponseRun(body, generation, tools, self.ctx.model_name, messages, self.store)
        if body.background:
            return json_response(self.background.start(run))

        async def whole() -> Response:
            try:
                return json_response(await run.complete())
            except APIError as e:
                return error_response(e)

        return await self.answer(request, body.stream, run.events, whole)

    def _conversation(
        self, body: ResponsesRequest, prior: list[dict[str, Any]]
    ) -> tuple[ChatCompletionRequest, list[int], ToolPlan | None, list[dict[str, Any]]]:
        """The conversation as sent (a prior response's messages, then the input's), its
        chat request, token ids and tools. Under truncation "auto" it is cut by as few of
        its oldest turns as leave room for the answer: a binary search over how many, so
        log n renders of it, not one per turn dropped."""
        messages = [*prior, *input_messages(body.input)]
        system = [{"role": "system", "content": body.instructions}] if body.instructions else []
        room = self.engine.max_model_len - (body.max_output_tokens or 1)
        starts: list[int] = []  # turn_starts(messages), once it is needed

        def render(k: int) -> tuple[ChatCompletionRequest, list[int], ToolPlan | None, Any]:
            kept = messages if k == 0 else without_oldest_turns(messages, starts[k])
            chat = body.chat_request(system + kept)
            ids, tools = self._chat.prompt(chat, "input")
            return chat, ids, tools, kept

        whole = render(0)
        if body.truncation != "auto" or len(whole[1]) <= room:
            return whole
        starts = turn_starts(messages)
        if len(starts) == 1:
            return whole  # one turn: the context error says so
        # The fewest turns to drop is in [low, high]; high (all but one) if none fits.
        low, high = 1, len(starts) - 1
        tried = {}
        while low < high:
            mid = (low + high) // 2
            tried[mid] = render(mid)
            if len(tried[mid][1]) <= room:
                high = mid
            else:
                low = mid + 1
        return tried[low] if low in tried else render(low)

    async def stored(self, request: Request) -> Response:
        """GET (the openai client's responses.retrieve) or DELETE a stored response."""
        response_id = request.path_params["response_id"]
        if request.method == "DELETE":
            if not self.store.delete(response_id):
                raise not_found(response_id)
            return json_response({"id": response_id, "object": "response.deleted", "deleted": True})
        stored = self.store.get(response_id)
        if stored is None:
            raise not_found(response_id)
        return json_response(stored.response)

    async def cancel(self, request: Request) -> Response:
        """POST /v1/responses/{id}/cancel (the openai client's responses.cancel)."""
        return json_response(await self.background.cancel(request.path_params["response_id"]))

    async def input_items(self, request: Request) -> Response:
        """GET a stored response's input items (the openai client's
        responses.input_items.list): limit 1-100 (20), order desc (default) or asc, after."""
        response_id = request.path_params["response_id"]
        stored = self.store.get(response_id)
        if stored is None:
            raise not_found(response_id)
        query = request.query_params
        try:
            limit = int(query.get("limit", 20))
        except ValueError:
            limit = 0
        if not 1 <= limit <= 100:
            raise APIError(
                "limit must be an integer in [1, 100]", param="limit", code="invalid_value"
            )
        order = query.get("order", "desc")
        if order not in ("asc", "desc"):
            raise APIError('order must be "asc" or "desc"', param="order", code="invalid_value")
        return json_response(list_page(stored.input_items, limit, order, query.get("after")))
