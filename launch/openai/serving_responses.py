"""POST /v1/responses (OpenAI's Responses API), and the stored responses: GET / DELETE
/v1/responses/{id}, GET /v1/responses/{id}/input_items, POST /v1/responses/{id}/cancel (a
background one: responses_background.py)."""

from __future__ import annotations

from starlette.requests import Request
from starlette.responses import Response

from launch.openai.generation import Generation
from launch.openai.protocol import APIError
from launch.openai.responses_background import BackgroundResponses
from launch.openai.responses_items import input_messages, without_oldest_turn
from launch.openai.responses_output import ResponseRun
from launch.openai.responses_protocol import ResponsesRequest
from launch.openai.responses_store import ResponseStore, list_page, not_found
from launch.openai.serving_base import ServingContext, error_response, json_response
from launch.openai.serving_chat import ChatServing
from launch.openai.serving_generation import GenerationServing

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
        body: ResponsesRequest = self.decode(await request.body(), ResponsesRequest)
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
        messages = []
        if body.previous_response_id is not None:
            prior = self.store.get(body.previous_response_id)
            if prior is None:
                raise not_found(body.previous_response_id, "previous_response_id")
            messages = prior.messages
        messages = [*messages, *input_messages(body.input)]
        system = [{"role": "system", "content": body.instructions}] if body.instructions else []
        limit = self.engine.max_model_len
        while True:
            chat = body.chat_request(system + messages)
            ids, tools = self._chat.prompt(chat, "input")
            if body.truncation != "auto" or len(ids) + (body.max_output_tokens or 1) <= limit:
                break
            shorter = without_oldest_turn(messages)
            if shorter is None:
                break  # what is left is one turn: the context error says so
            messages = shorter
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
