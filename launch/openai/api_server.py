"""The OpenAI-compatible HTTP API over one AsyncLLM (Starlette; run_server.py runs it).

Routes: POST /v1/completions, POST /v1/chat/completions, POST /v1/embeddings, POST
/v1/responses (GET / DELETE /v1/responses/{id}, GET .../input_items: responses.py), GET
/v1/models (and /v1/models/{id}), GET /health,
GET /metrics (Prometheus, launch/openai/metrics.py), POST /reset_prefix_cache, and vLLM's POST
/tokenize, POST /detokenize and GET /version, and GET/POST /ping (SageMaker's probe). With
an API key (--api-key), every route but /health, /ping, /metrics and /version wants
`Authorization: Bearer KEY`; with CORS origins (--allowed-origins), browsers' cross-origin
requests from them are answered, preflights without the key. Streaming answers
are server-sent events ending in `data: [DONE]`; a request that fails mid-stream gets an
`{"error": ...}` event first (OpenAI's clients raise it). A client that goes away, while
streaming or not, aborts its request (every prompt and copy of it) in the engine at once.
Each request is one RequestStream, so a stream that falls behind writes one chunk per
choice for all the tokens that arrived meanwhile.
"""

from __future__ import annotations

import asyncio
import base64
import secrets
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from dataclasses import dataclass
from typing import Any

import msgspec
import numpy as np
from starlette.applications import Starlette
from starlette.middleware.cors import CORSMiddleware
from starlette.requests import Request
from starlette.responses import Response, StreamingResponse
from starlette.routing import Route
from starlette.types import ASGIApp, Receive, Scope, Send

from launch.client.async_llm import AsyncLLM
from launch.client.chat import ChatTemplateError
from launch.client.engine_processes import EngineDeadError
from launch.client.inputs import Prompt, check_priority, check_stream_interval, truncated
from launch.client.request_stream import RequestStream
from launch.client.version import package_version
from launch.openai.metrics import CONTENT_TYPE, ServerMetrics
from launch.openai.protocol import (
    APIError,
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    EmbeddingRequest,
    TokenizeRequest,
    beam_search_params,
    decode_body,
    precompile,
    sampling_params,
)
from launch.openai.reasoning import ReasoningParser, language_start
from launch.openai.responses import (
    DEFAULT_MAX_STORED_RESPONSES,
    ResponsesRequest,
    ResponseStore,
    input_messages,
    list_page,
    not_found,
    without_oldest_turn,
)
from launch.openai.responses_run import ResponseRun
from launch.openai.serving import BeamSearchStream, Call, error_response, json_response
from launch.openai.tool_parsers import ToolCallParser
from launch.openai.tools import ToolError, ToolPlan, plan_tools, template_messages
from protocol.engine import EmbeddingParams, SamplingParams, truncation_error

# Probes a load balancer or a scraper calls without credentials.
OPEN_PATHS = frozenset(("/health", "/ping", "/metrics", "/version"))


class RequireAPIKey:
    """ASGI middleware: HTTP requests outside OPEN_PATHS need `Authorization: Bearer KEY`
    (401 as OpenAI answers it otherwise). Pure ASGI, so a stream's chunks pass untouched."""

    def __init__(self, app: ASGIApp, api_key: str) -> None:
        self.app = app
        self._expected = f"Bearer {api_key}".encode()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and _route_path(scope) not in OPEN_PATHS:
            given = next((v for k, v in scope["headers"] if k == b"authorization"), b"")
            if not secrets.compare_digest(given, self._expected):
                error = APIError(
                    "invalid or missing API key: send Authorization: Bearer <key>",
                    401,
                    code="invalid_api_key",
                )
                await error_response(error)(scope, receive, send)
                return
        await self.app(scope, receive, send)


@dataclass(frozen=True)
class CORS:
    """Which browsers' cross-origin requests are answered (Starlette's CORSMiddleware)."""

    origins: list[str]
    methods: list[str]
    headers: list[str]
    credentials: bool = False


def _route_path(scope: Scope) -> str:
    """The request's path without --root-path (uvicorn puts it in front)."""
    path, root = scope["path"], scope.get("root_path", "")
    return path[len(root) :] if root and path.startswith(root) else path


class OpenAIServer:
    """The routes' state: the engine, the served model's name, metrics, admission."""

    def __init__(
        self,
        engine: AsyncLLM,
        model_name: str,
        max_waiting: int | None = None,
        api_key: str | None = None,
        tool_call_parser: ToolCallParser | None = None,
        max_stored_responses: int = DEFAULT_MAX_STORED_RESPONSES,
        reasoning_parser: ReasoningParser | None = None,
        cors: CORS | None = None,
        aliases: Sequence[str] = (),
    ) -> None:
        self.engine = engine
        # Stopping (serve's --shutdown-timeout): open requests finish, new ones get 503.
        self.draining = False
        # Every name a request may use; answers (and metrics) carry the first.
        self.model_names = (model_name, *(a for a in aliases if a != model_name))
        self.cors = cors
        self.reasoning_parser = reasoning_parser
        self.response_store = ResponseStore(max_stored_responses)
        self.model_name = model_name
        self.tool_call_parser = tool_call_parser
        self.max_waiting = max_waiting
        self.api_key = api_key
        # Requests admitted that have not had their first token: what
        # --max-waiting-requests bounds (exact here; the core's queue is a step old).
        self.num_waiting = 0
        self.metrics = ServerMetrics(
            model_name, engine.max_model_len, lambda: engine.num_open_requests
        )
        engine.on_stats = self.metrics.on_stats

    def app(self, lifespan: Any = None) -> ASGIApp:
        app = Starlette(
            lifespan=lifespan,
            routes=[
                Route("/v1/completions", self._guard(self.completions), methods=["POST"]),
                Route("/v1/chat/completions", self._guard(self.chat), methods=["POST"]),
                Route("/v1/embeddings", self._guard(self.embeddings), methods=["POST"]),
                Route("/v1/responses", self._guard(self.responses), methods=["POST"]),
                Route(
                    "/v1/responses/{response_id}",
                    self._guard(self.stored_response),
                    methods=["GET", "DELETE"],
                ),
                Route(
                    "/v1/responses/{response_id}/input_items",
                    self._guard(self.stored_input_items),
                    methods=["GET"],
                ),
                Route("/v1/models", self.models, methods=["GET"]),
                Route("/v1/models/{model:path}", self.model, methods=["GET"]),
                Route("/health", self.health, methods=["GET"]),
                Route("/ping", self.health, methods=["GET", "POST"]),  # SageMaker's probe
                Route("/metrics", self.metrics_endpoint, methods=["GET"]),
                Route(
                    "/reset_prefix_cache", self._guard(self.reset_prefix_cache), methods=["POST"]
                ),
                Route("/tokenize", self._guard(self.tokenize), methods=["POST"]),
                Route("/detokenize", self._guard(self.detokenize), methods=["POST"]),
                Route("/version", self.version, methods=["GET"]),
            ],
        )
        guarded: ASGIApp = app if self.api_key is None else RequireAPIKey(app, self.api_key)
        cors = self.cors
        if cors is None:
            return guarded
        # Outside the key check: a browser's preflight carries no credentials.
        return CORSMiddleware(
            guarded,
            allow_origins=cors.origins,
            allow_methods=cors.methods,
            allow_headers=cors.headers,
            allow_credentials=cors.credentials,
        )

    # -- small routes -------------------------------------------------------------------
    def _card(self, name: str) -> dict[str, Any]:
        return {
            "id": name,
            "object": "model",
            "created": 0,
            "owned_by": "pagedserve",
            "max_model_len": self.engine.max_model_len,
        }

    async def models(self, _request: Request) -> Response:
        return json_response({"object": "list", "data": [self._card(n) for n in self.model_names]})

    async def model(self, request: Request) -> Response:
        """GET /v1/models/{id} (the openai client's models.retrieve)."""
        name = request.path_params["model"]
        if name not in self.model_names:
            return error_response(self._unknown_model(name, 404))
        return json_response(self._card(name))

    async def health(self, _request: Request) -> Response:
        if self.engine.dead_reason is not None:
            return error_response(APIError(self.engine.dead_reason, 503))
        if self.draining:
            return error_response(_stopping())
        return Response(status_code=200)

    async def metrics_endpoint(self, _request: Request) -> Response:
        return Response(self.metrics.exposition(), media_type=CONTENT_TYPE)

    async def reset_prefix_cache(self, _request: Request) -> Response:
        self.engine.reset_prefix_cache()  # the core refuses (and logs) while blocks are held
        return Response(status_code=200)

    async def version(self, _request: Request) -> Response:
        return json_response({"version": package_version()})

    async def tokenize(self, request: Request) -> Response:
        """The ids a completion (prompt) or a chat completion (messages) would send."""
        body: TokenizeRequest = decode_body(await request.body(), TokenizeRequest)
        self._check_model(body.model)
        inputs = self.engine.inputs
        if (body.prompt is None) == (body.messages is None):
            raise APIError("give exactly one of prompt and messages", code="invalid_value")
        try:
            if body.prompt is not None:
                special = True if body.add_special_tokens is None else body.add_special_tokens
                ids = inputs.encode(body.prompt, special)
            else:
                chat = Prompt(
                    messages=template_messages(body.messages),
                    add_generation_prompt=body.add_generation_prompt,
                    chat_template_kwargs=body.chat_template_kwargs,
                    tools=[msgspec.to_builtins(t) for t in body.tools] if body.tools else None,
                    continue_final_message=body.continue_final_message,
                )
                ids = inputs.encode(inputs.chat_text(chat), bool(body.add_special_tokens))
        except (TypeError, ValueError) as e:
            param = "prompt" if body.prompt is not None else "messages"
            raise APIError(str(e), param=param, code="invalid_value") from None
        return json_response(
            {"count": len(ids), "max_model_len": self.engine.max_model_len, "tokens": ids}
        )

    async def detokenize(self, request: Request) -> Response:
        body: DetokenizeRequest = decode_body(await request.body(), DetokenizeRequest)
        self._check_model(body.model)
        try:  # the range check every token-id prompt gets
            text = self.engine.inputs.decode(self.engine.prompt_token_ids(body.tokens))
        except (TypeError, ValueError) as e:
            raise APIError(str(e), param="tokens", code="invalid_value") from None
        return json_response({"prompt": text})

    # -- generation ---------------------------------------------------------------------
    def _guard(
        self, handler: Callable[[Request], Awaitable[Response]]
    ) -> Callable[[Request], Awaitable[Response]]:
        """Bad input and a dead engine become OpenAI-style errors; the server keeps on."""

        async def run(request: Request) -> Response:
            try:
                return await handler(request)
            except APIError as e:
                return error_response(e)
            except EngineDeadError as e:
                return error_response(APIError(str(e), 503))

        return run

    async def completions(self, request: Request) -> Response:
        body: CompletionRequest = decode_body(await request.body(), CompletionRequest)
        self._check_model(body.model)
        prompts = body.prompt_inputs()
        several = len(prompts) > 1
        ids = []
        for i, prompt in enumerate(prompts):
            try:
                ids.append(self.engine.prompt_token_ids(prompt))
            except (TypeError, ValueError) as e:
                message = f"prompt {i}: {e}" if several else str(e)
                raise APIError(message, param="prompt", code="invalid_value") from None
        echo = None
        if body.echo:  # each prompt as given; token ids as the tokenizer reads them
            try:
                echo = [p if isinstance(p, str) else self.engine.inputs.decode(p) for p in prompts]
            except ValueError as e:
                raise APIError(str(e), param="echo", code="invalid_value") from None
        max_tokens = body.max_tokens
        prompt_only = max_tokens == 0 and body.echo
        if prompt_only:
            # Scoring a text (its echo and, with logprobs, its tokens' logprobs): the engine
            # generates at least one token, which the answer leaves out.
            if body.stream:
                raise APIError(
                    "max_tokens 0 (echo only) is not streamed: send stream false",
                    param="max_tokens",
                    code="invalid_value",
                )
            max_tokens = 1
        call = await self._start(
            body, ids, max_tokens, "cmpl", chat=False, echo=echo, prompt_only=prompt_only
        )
        return await self._answer(request, body.stream, call.events, call.complete)

    async def chat(self, request: Request) -> Response:
        body: ChatCompletionRequest = decode_body(await request.body(), ChatCompletionRequest)
        self._check_model(body.model)
        ids, tools = self._chat_prompt(body, "messages")
        max_tokens = body.max_completion_tokens
        if max_tokens is None:
            max_tokens = body.max_tokens
        call = await self._start(body, [ids], max_tokens, "chatcmpl", chat=True, tools=tools)
        return await self._answer(request, body.stream, call.events, call.complete)

    def _chat_prompt(
        self, body: ChatCompletionRequest, param: str
    ) -> tuple[list[int], ToolPlan | None]:
        """The conversation's token ids, rendered by the chat template with its tools, and
        what the tools make of the answer; param names the conversation in errors. A tool
        format whose markers are special tokens keeps them in the answer's text."""
        try:
            tools = plan_tools(
                body.tools, body.tool_choice, body.parallel_tool_calls, self.tool_call_parser
            )
        except ToolError as e:
            raise APIError(str(e), param=e.param, code="invalid_value") from None
        if tools is not None and tools.keeps_special_tokens:
            body.skip_special_tokens = False
        prompt = Prompt(
            messages=template_messages(body.messages),
            add_generation_prompt=body.add_generation_prompt,
            chat_template_kwargs=body.chat_template_kwargs,
            tools=tools.template_tools() if tools is not None else None,
            continue_final_message=body.continue_final_message,
        )
        try:
            return self.engine.prompt_token_ids(prompt), tools
        except (ChatTemplateError, TypeError, ValueError) as e:
            raise APIError(str(e), param=param, code="invalid_value") from None

    async def responses(self, request: Request) -> Response:
        """OpenAI's Responses API (launch/openai/responses.py): the conversation of its input
        items, after a stored response's when it continues one, as a chat completion."""
        body: ResponsesRequest = decode_body(await request.body(), ResponsesRequest)
        body.check()
        self._check_model(body.model)
        messages = []
        if body.previous_response_id is not None:
            prior = self.response_store.get(body.previous_response_id)
            if prior is None:
                raise not_found(body.previous_response_id, "previous_response_id")
            messages = prior.messages
        messages = [*messages, *input_messages(body.input)]
        system = [{"role": "system", "content": body.instructions}] if body.instructions else []
        limit = self.engine.max_model_len
        while True:
            chat = body.chat_request(system + messages)
            ids, tools = self._chat_prompt(chat, "input")
            if body.truncation != "auto" or len(ids) + (body.max_output_tokens or 1) <= limit:
                break
            shorter = without_oldest_turn(messages)
            if shorter is None:
                break  # what is left is one turn: the context error says so
            messages = shorter
        try:
            call = await self._start(
                chat, [ids], body.max_output_tokens, "resp", chat=True, tools=tools
            )
        except APIError as e:
            e.param = _RESPONSES_PARAMS.get(e.param, e.param)  # type: ignore[arg-type]
            raise
        run = ResponseRun(body, call, tools, self.model_name, messages, self.response_store)

        async def whole() -> Response:
            try:
                return json_response(await run.complete())
            except APIError as e:
                return error_response(e)

        return await self._answer(request, body.stream, run.events, whole)

    async def stored_response(self, request: Request) -> Response:
        """GET (the openai client's responses.retrieve) or DELETE a stored response."""
        response_id = request.path_params["response_id"]
        if request.method == "DELETE":
            if not self.response_store.delete(response_id):
                raise not_found(response_id)
            return json_response({"id": response_id, "object": "response.deleted", "deleted": True})
        stored = self.response_store.get(response_id)
        if stored is None:
            raise not_found(response_id)
        return json_response(stored.response)

    async def stored_input_items(self, request: Request) -> Response:
        """GET a stored response's input items (the openai client's
        responses.input_items.list): limit 1-100 (20), order desc (default) or asc, after."""
        response_id = request.path_params["response_id"]
        stored = self.response_store.get(response_id)
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

    async def embeddings(self, request: Request) -> Response:
        """Each input's embedding (EmbeddingParams: last-token pooling): one prefill step
        per input, as one engine request of several prompts."""
        body: EmbeddingRequest = decode_body(await request.body(), EmbeddingRequest)
        self._check_model(body.model)
        engine = self.engine
        if body.dimensions is not None and not 1 <= body.dimensions <= engine.inputs.hidden_size:
            raise APIError(
                f"dimensions must be in [1, {engine.inputs.hidden_size}] (the model's "
                f"embedding width), got {body.dimensions}",
                param="dimensions",
                code="invalid_value",
            )
        k = _truncation(body.truncate_prompt_tokens)
        prompts = []
        for i, item in enumerate(body.inputs()):
            try:
                ids = truncated(engine.prompt_token_ids(item), k, engine.max_model_len)
            except (TypeError, ValueError) as e:
                raise APIError(f"input {i}: {e}", param="input", code="invalid_value") from None
            if len(ids) >= engine.max_model_len:
                raise APIError(
                    f"input {i} has {len(ids)} tokens; this model's context is "
                    f"{engine.max_model_len} (truncate_prompt_tokens cuts it)",
                    param="input",
                    code="context_length_exceeded",
                )
            prompts.append(ids)
        if self.draining:
            raise _stopping()
        params = SamplingParams(
            max_tokens=1,
            temperature=0.0,
            embedding=EmbeddingParams(body.normalize, body.dimensions),
        )
        stream = engine.generate_many(prompts, params, f"embd-{uuid.uuid4().hex}", text=False)

        async def answer() -> Response:
            vectors: list[list[float] | None] = [None] * len(prompts)
            try:
                async for out in stream:
                    if out.finish_reason == "error":
                        raise APIError(out.error or "the request failed", 500)
                    if out.embedding is not None:
                        vectors[out.index] = out.embedding
            except EngineDeadError as e:
                raise APIError(str(e), 500) from None
            finally:
                stream.close()
            data = []
            for i, v in enumerate(vectors):
                if v is None:
                    raise APIError(f"input {i} got no embedding", 500)
                value: Any = v
                if body.encoding_format == "base64":
                    value = base64.b64encode(np.asarray(v, dtype="<f4").tobytes()).decode()
                data.append({"object": "embedding", "index": i, "embedding": value})
            n = sum(len(p) for p in prompts)
            return json_response(
                {
                    "id": stream.request_id,
                    "object": "list",
                    "created": int(time.time()),
                    "model": self.model_name,
                    "data": data,
                    "usage": {"prompt_tokens": n, "total_tokens": n},
                }
            )

        return await _until_disconnect(request, answer())

    def _check_model(self, model: str | None) -> None:
        if model is not None and model not in self.model_names:
            raise self._unknown_model(model, 400)

    def _unknown_model(self, model: str, status: int) -> APIError:
        served = " or ".join(repr(n) for n in self.model_names)
        return APIError(
            f"the model {model!r} does not exist; this server serves {served}",
            status,
            param="model",
            code="model_not_found",
        )

    async def _start(
        self,
        body: CompletionRequest | ChatCompletionRequest,
        prompts: list[list[int]],
        max_tokens: int | None,
        prefix: str,
        chat: bool,
        echo: list[str] | None = None,
        prompt_only: bool = False,
        tools: ToolPlan | None = None,
    ) -> Call:
        """Check every prompt's parameters, then send them all as one stream. echo: each
        prompt's text, to answer before its completions (completions' echo); prompt_only:
        answer the echo alone (max_tokens 0), not the token generated; tools: what the
        chat's tools make of its answer."""
        engine = self.engine
        k = _truncation(body.truncate_prompt_tokens)
        if k is not None:
            prompts = [truncated(ids, k, engine.max_model_len) for ids in prompts]
        await precompile(body, tools.constraint if tools is not None else None)
        params = [
            sampling_params(
                body,
                max_tokens,
                len(ids),
                engine.max_model_len,
                engine.vocab_size,
                f"prompt {i}" if len(prompts) > 1 else "the prompt",
                engine.inputs.tokenizer is not None,
                tools.constraint if tools is not None else None,
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
        if self.reasoning_parser is not None and chat and params[0].structured_outputs:
            params = [self._after_thinking(p, ids) for p, ids in zip(params, prompts)]
        if self.draining:
            raise _stopping()
        try:
            check_priority(body.priority, engine.limits.scheduling_policy)
        except ValueError as e:
            raise APIError(str(e), 400, param="priority", code="invalid_value") from None
        if self.max_waiting is not None and self.num_waiting >= self.max_waiting:
            raise APIError(
                f"{self.num_waiting} requests are already waiting (--max-waiting-requests "
                f"{self.max_waiting}); retry later",
                503,
                code="too_many_waiting_requests",
            )
        request_id = f"{prefix}-{uuid.uuid4().hex}"
        stream: RequestStream | BeamSearchStream
        if beam is not None:
            stream = BeamSearchStream(
                engine,
                request_id,
                prompts,
                beam,
                params[0].logprobs,
                body.cache_salt,
                body.priority,
            )
        else:
            stream = engine.generate_many(
                prompts,
                params,
                request_id,
                cache_salt=body.cache_salt,
                priority=body.priority,
                stream_interval=body.stream_interval,
            )
        return Call(self, body, stream, request_id, chat, params[0], echo, prompt_only, tools)

    def _after_thinking(self, params: SamplingParams, prompt: list[int]) -> SamplingParams:
        """Under a reasoning parser, a structured output's language holds the answer, not
        the thinking before it (launch/reasoning.language_start)."""
        spec = params.structured_outputs
        assert spec is not None
        start = language_start(lambda text: self.engine.inputs.encode(text, False), prompt)
        if start is None:
            return params
        spec = msgspec.structs.replace(spec, start_after=start)
        return msgspec.structs.replace(params, structured_outputs=spec)

    @staticmethod
    async def _answer(
        request: Request,
        stream: bool,
        events: Callable[[], AsyncIterator[bytes]],
        whole: Callable[[], Awaitable[Response]],
    ) -> Response:
        """A started request, answered: streamed as events, or whole."""
        if stream:
            # Starlette cancels the body's iteration when the client disconnects; the
            # stream's close() then aborts the request.
            return StreamingResponse(events(), media_type="text/event-stream")
        return await _until_disconnect(request, whole())


# Chat completions' names for what a Responses body calls otherwise.
_RESPONSES_PARAMS = {
    "messages": "input",
    "max_tokens": "max_output_tokens",
    "response_format": "text.format",
}


def _stopping() -> APIError:
    return APIError(
        "the server is stopping: it takes no new requests", 503, code="server_shutting_down"
    )


def _truncation(k: int | None) -> int | None:
    """A body's truncate_prompt_tokens, checked before any prompt is cut."""
    error = truncation_error(k)
    if error is not None:
        raise APIError(error, param="truncate_prompt_tokens", code="invalid_value")
    return k


async def _until_disconnect(request: Request, work: Awaitable[Response]) -> Response:
    """work's response, or, if the client goes away first, work cancelled (which aborts
    its request) and an empty response nobody reads."""
    task = asyncio.ensure_future(work)
    watch = asyncio.ensure_future(_disconnected(request))
    try:
        await asyncio.wait((task, watch), return_when=asyncio.FIRST_COMPLETED)
    finally:
        watch.cancel()
    if not task.done():
        task.cancel()
        try:
            await task
        except asyncio.CancelledError:
            pass
        return Response(status_code=499)
    return task.result()


async def _disconnected(request: Request) -> None:
    """Returns when the client disconnects (the body was read, so nothing else comes)."""
    while (await request.receive())["type"] != "http.disconnect":
        pass
