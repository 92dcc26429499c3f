"""The OpenAI-compatible HTTP API over one AsyncLLM (Starlette; `launch/serve.py` runs it).

Routes: POST /v1/completions, POST /v1/chat/completions, POST /v1/embeddings, POST
/v1/responses (GET / DELETE /v1/responses/{id}, GET .../input_items: launch/responses_api.py), GET
/v1/models (and /v1/models/{id}), GET /health,
GET /metrics (Prometheus, launch/metrics.py), POST /reset_prefix_cache, and vLLM's POST
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
from collections.abc import AsyncIterator, Awaitable, Callable
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

from launch.async_llm import AsyncLLM, RequestStream, StreamOutput
from launch.chat import ChatTemplateError
from launch.cli import package_version
from launch.engine import EngineDeadError
from launch.inputs import Prompt, truncated
from launch.metrics import CONTENT_TYPE, RequestTimer, ServerMetrics
from launch.openai_api import (
    APIError,
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    EmbeddingRequest,
    TokenizeRequest,
    chat_logprobs,
    completion_logprobs,
    decode_body,
    precompile,
    sampling_params,
    sse_event,
    usage,
    vllm_prompt_logprobs,
)
from launch.reasoning import ReasoningParser, ReasoningSplit, language_start
from launch.responses_api import (
    DEFAULT_MAX_STORED_RESPONSES,
    ResponseRun,
    ResponsesRequest,
    ResponseStore,
    input_messages,
    list_page,
    not_found,
    without_oldest_turn,
)
from launch.tool_parsers import ToolCallParser, new_call_id
from launch.tools import ToolError, ToolPlan, plan_tools, template_messages
from protocol.engine import EmbeddingParams, Logprobs, SamplingParams, truncation_error

_json = msgspec.json.Encoder()


def json_response(body: object, status: int = 200) -> Response:
    return Response(_json.encode(body), status, media_type="application/json")


def error_response(e: APIError) -> Response:
    return json_response(e.body(), e.status)


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
    ) -> None:
        self.engine = engine
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
    def _card(self) -> dict[str, Any]:
        return {
            "id": self.model_name,
            "object": "model",
            "created": 0,
            "owned_by": "pagedserve",
            "max_model_len": self.engine.max_model_len,
        }

    async def models(self, _request: Request) -> Response:
        return json_response({"object": "list", "data": [self._card()]})

    async def model(self, request: Request) -> Response:
        """GET /v1/models/{id} (the openai client's models.retrieve)."""
        if request.path_params["model"] != self.model_name:
            return error_response(
                APIError(
                    f"the model {request.path_params['model']!r} does not exist; this server "
                    f"serves {self.model_name!r}",
                    404,
                    param="model",
                    code="model_not_found",
                )
            )
        return json_response(self._card())

    async def health(self, _request: Request) -> Response:
        if self.engine.dead_reason is not None:
            return error_response(APIError(self.engine.dead_reason, 503))
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
        return await self._answer(request, call)

    async def chat(self, request: Request) -> Response:
        body: ChatCompletionRequest = decode_body(await request.body(), ChatCompletionRequest)
        self._check_model(body.model)
        ids, tools = self._chat_prompt(body, "messages")
        if tools is not None and tools.keeps_special_tokens:
            body.skip_special_tokens = False
        max_tokens = body.max_completion_tokens
        if max_tokens is None:
            max_tokens = body.max_tokens
        call = await self._start(body, [ids], max_tokens, "chatcmpl", chat=True, tools=tools)
        return await self._answer(request, call)

    def _chat_prompt(
        self, body: ChatCompletionRequest, param: str
    ) -> tuple[list[int], ToolPlan | None]:
        """The conversation's token ids, rendered by the chat template with its tools, and
        what the tools make of the answer; param names the conversation in errors."""
        try:
            tools = plan_tools(
                body.tools, body.tool_choice, body.parallel_tool_calls, self.tool_call_parser
            )
        except ToolError as e:
            raise APIError(str(e), param=e.param, code="invalid_value") from None
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
        """OpenAI's Responses API (launch/responses_api.py): the conversation of its input
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
        if tools is not None and tools.keeps_special_tokens:
            chat.skip_special_tokens = False
        try:
            call = await self._start(
                chat, [ids], body.max_output_tokens, "resp", chat=True, tools=tools
            )
        except APIError as e:
            e.param = _RESPONSES_PARAMS.get(e.param, e.param)  # type: ignore[arg-type]
            raise
        run = ResponseRun(body, call, tools, self.model_name, messages, self.response_store)
        if body.stream:
            return StreamingResponse(run.events(), media_type="text/event-stream")

        async def whole() -> Response:
            try:
                return json_response(await run.complete())
            except APIError as e:
                return error_response(e)

        return await _until_disconnect(request, whole())

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
        if model is not None and model != self.model_name:
            raise APIError(
                f"the model {model!r} does not exist; this server serves {self.model_name!r}",
                400,
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
    ) -> _Call:
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
        if self.reasoning_parser is not None and chat and params[0].structured_outputs:
            params = [self._after_thinking(p, ids) for p, ids in zip(params, prompts)]
        try:
            engine.engine.check_priority(body.priority)
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
        stream = engine.generate_many(
            prompts, params, request_id, cache_salt=body.cache_salt, priority=body.priority
        )
        return _Call(self, body, stream, request_id, chat, params[0], echo, prompt_only, tools)

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
    async def _answer(request: Request, call: _Call) -> Response:
        """A started call, answered: streamed as events, or whole."""
        if call.body.stream:
            # Starlette cancels the body's iteration when the client disconnects; the
            # stream's close() then aborts the request.
            return StreamingResponse(call.events(), media_type="text/event-stream")
        return await _until_disconnect(request, call.complete())


class _Choice:
    """One sequence of a request (choice index = prompt_i * n + copy_j), as it grows."""

    __slots__ = (
        "finish",
        "ids",
        "logprobs",
        "num_cached",
        "offset",
        "prompt",
        "prompt_logprobs",
        "sent",
        "split",
        "stop_reason",
        "texts",
        "thoughts",
        "tool_call",
    )

    def __init__(
        self, prompt: int, logprobs: bool, reasoning: ReasoningParser | None = None
    ) -> None:
        self.prompt = prompt  # which prompt it answers
        self.num_cached = 0  # its prompt tokens served from the prefix cache (at finish)
        self.ids: list[int] = []
        # Each output's text; with a reasoning parser, its answer part, and its reasoning
        # part in thoughts (both "" while a tag is held back).
        self.texts: list[str] = []
        self.thoughts: list[str] = []
        self.split = ReasoningSplit(reasoning) if reasoning is not None else None
        self.logprobs: list[Logprobs] | None = [] if logprobs else None
        self.finish: str | None = None
        self.stop_reason: str | int | None = None
        self.sent = 0  # tokens already streamed
        self.offset = 0  # text streamed so far, in characters (completions' text_offset)
        # With the first output, when asked for (None first); streamed once, then None.
        self.prompt_logprobs: list[Logprobs | None] | None = None
        # A streamed named tool call: its id once its first delta is out.
        self.tool_call: str | None = None

    def add(self, out: StreamOutput) -> None:
        self.ids += out.new_token_ids
        text = out.text
        if self.split is not None:
            thought, text = self.split.feed(text, len(out.new_token_ids))
            if out.finish_reason is not None:
                more_thought, more_text = self.split.finish()
                thought, text = thought + more_thought, text + more_text
            self.thoughts.append(thought)
        self.texts.append(text)
        if self.logprobs is not None and out.logprobs:
            self.logprobs += out.logprobs
        if out.prompt_logprobs is not None:
            self.prompt_logprobs = out.prompt_logprobs
        if out.finish_reason is not None:
            self.finish, self.stop_reason = out.finish_reason, out.stop_reason
            self.num_cached = out.num_cached_tokens


class _Call:
    """One generation request: its stream, timings, and the shapes of its answers."""

    def __init__(
        self,
        server: OpenAIServer,
        body: CompletionRequest | ChatCompletionRequest,
        stream: RequestStream,
        request_id: str,
        chat: bool,
        params: SamplingParams,
        echo: list[str] | None = None,
        prompt_only: bool = False,
        tools: ToolPlan | None = None,
    ) -> None:
        self.server = server
        self.echo = echo
        self.prompt_only = prompt_only
        # A chat's tools, unless "none": its answers may be tool calls.
        self.tools = tools if tools is not None and tools.choice != "none" else None
        self.body = body
        self.stream = stream
        self.id = request_id
        self.chat = chat
        self.created = int(time.time())
        self.object = "chat.completion" if chat else "text_completion"
        self.num_prompt_tokens = sum(len(ids) for ids in stream.prompts)
        self.timer: RequestTimer = server.metrics.request(
            self.num_prompt_tokens, params.n, params.max_tokens
        )
        # Every prompt has the same n (one body): choice i answers prompt i // n.
        self.n = params.n
        lp = params.logprobs is not None
        reasoning = server.reasoning_parser if chat else None
        # The answer's reasoning field (the reasoning is told apart either way).
        self.show_reasoning = reasoning is not None and getattr(body, "include_reasoning", True)
        self.choices = [
            _Choice(i // params.n, lp, reasoning) for i in range(len(stream.prompts) * params.n)
        ]
        self._waiting = True
        server.num_waiting += 1

    def _started(self) -> None:
        if self._waiting:
            self._waiting = False
            self.server.num_waiting -= 1

    async def outputs(self) -> AsyncIterator[StreamOutput]:
        """Each sequence's outputs, added to its choice; APIError for a failure."""
        try:
            async for out in self.stream:
                self._started()
                if out.queued_s is not None:
                    self.timer.queued(out.queued_s)
                self.timer.tokens(len(out.new_token_ids))
                if out.finish_reason == "error":
                    raise APIError(out.error or "the request failed", 500)
                if out.finish_reason == "abort":
                    raise APIError("the request was aborted: the server is stopping", 503)
                self.choices[out.index].add(out)
                if out.finish_reason is not None and self.stream.finished:
                    longest = max(len(c.ids) for c in self.choices)
                    self.timer.finish(out.finish_reason, longest, self._cached_tokens())
                yield out
        except EngineDeadError as e:
            raise APIError(str(e), 500) from None
        finally:
            self._started()
            self.stream.close()

    def _usage(self) -> dict[str, Any]:
        """Each prompt counted once (its first copy's cache hits: later copies hit what
        the first brought in), completion tokens of every choice."""
        generated = 0 if self.prompt_only else self.timer.num_tokens
        return usage(self.num_prompt_tokens, generated, self._cached_tokens())

    def _cached_tokens(self) -> int:
        return sum(c.num_cached for c in self.choices[:: self.n])

    def token_text(self, token_id: int) -> str:
        tok = self.server.engine.tokenizer
        return tok.decode([token_id]) if tok is not None else f"token_id:{token_id}"

    def _logprobs(self, c: _Choice, start: int, offset: int) -> dict[str, Any] | None:
        """The logprobs of c's tokens from start on, in the endpoint's shape."""
        if c.logprobs is None:
            return None
        ids, lps = c.ids[start:], c.logprobs[start:]
        if self.chat:
            return chat_logprobs(ids, lps, self.token_text)
        return completion_logprobs(ids, lps, self.token_text, offset)

    def _prompt_logprobs(self, c: _Choice) -> list[Any] | None:
        if c.prompt_logprobs is None:
            return None
        ids = self.stream.prompts[c.prompt]
        return vllm_prompt_logprobs(ids, c.prompt_logprobs, self.token_text)

    def _echo_head(self, c: _Choice) -> dict[str, Any]:
        """The legacy logprobs of c's prompt, echoed: its tokens, the first without a
        logprob (nothing comes before it)."""
        ids = self.stream.prompts[c.prompt]
        first = self.token_text(ids[0])
        found = [lp for lp in (c.prompt_logprobs or [])[1:] if lp is not None]
        head = completion_logprobs(ids[1:], found, self.token_text, len(first))
        return {
            "tokens": [first, *head["tokens"]],
            "token_logprobs": [None, *head["token_logprobs"]],
            "top_logprobs": [None, *head["top_logprobs"]],
            "text_offset": [0, *head["text_offset"]],
        }

    def _echo_logprobs(self, c: _Choice, completion: dict[str, Any]) -> dict[str, Any]:
        """OpenAI's echo with logprobs: the prompt's tokens first, then the completion's."""
        head = self._echo_head(c)
        return {k: head[k] + completion[k] for k in head}

    async def complete(self) -> Response:
        try:
            async for _ in self.outputs():
                pass
        except APIError as e:
            return error_response(e)
        choices = []
        for i, c in enumerate(self.choices):
            if self.prompt_only:  # the one token generated is not part of the answer
                c.ids, c.texts = [], []
                c.logprobs = None if c.logprobs is None else []
            text = "".join(c.texts)
            echo = "" if self.echo is None else self.echo[c.prompt]
            choice: dict[str, Any] = {"index": i}
            finish = c.finish
            if self.chat:
                message: dict[str, Any] = {"role": "assistant", "content": text}
                if self.show_reasoning:
                    message["reasoning"] = "".join(c.thoughts) or None
                if self.tools is not None:
                    content, calls = self.tools.calls(text, c.finish == "stop")
                    message["content"] = content
                    if calls:
                        message["tool_calls"] = [call.body() for call in calls]
                        finish = "tool_calls" if c.finish == "stop" else c.finish
                choice["message"] = message
            else:
                choice["text"] = echo + text
            logprobs = self._logprobs(c, 0, len(echo))
            if logprobs is not None and self.echo is not None:
                logprobs = self._echo_logprobs(c, logprobs)
            choice.update(logprobs=logprobs, finish_reason=finish, stop_reason=c.stop_reason)
            if self.body.prompt_logprobs is not None and not self.chat:
                choice["prompt_logprobs"] = self._prompt_logprobs(c)
            if self.body.return_token_ids:
                choice["token_ids"] = c.ids
                choice["prompt_token_ids"] = self.stream.prompts[c.prompt]
            choices.append(choice)
        answer = self._envelope(choices, self._usage())
        if self.body.prompt_logprobs is not None and self.chat:
            answer["prompt_logprobs"] = self._prompt_logprobs(self.choices[0])
        if self.body.return_token_ids and len(self.stream.prompts) == 1:
            answer["prompt_token_ids"] = self.stream.prompt_token_ids
        return json_response(answer)

    def _envelope(self, choices: list[dict[str, Any]], usage: object) -> dict[str, Any]:
        obj = self.object + (".chunk" if self.chat and self.body.stream else "")
        answer = {"id": self.id, "object": obj, "created": self.created}
        answer.update(model=self.server.model_name, choices=choices)
        if usage is not None or self.body.include_usage:
            answer["usage"] = usage  # OpenAI: null on every chunk but the last
        return answer

    async def events(self) -> AsyncIterator[bytes]:
        ids_too = self.body.return_token_ids
        echo_logprobs = isinstance(self.body, CompletionRequest) and self.body.echo_logprobs
        options = self.body.stream_options
        continuous = options is not None and options.continuous_usage_stats
        try:
            if self.chat:
                for i in range(len(self.choices)):
                    first = {"role": "assistant", "content": ""}
                    yield sse_event(self._envelope([self._chunk(i, first, None, None)], None))
            elif self.echo is not None and not echo_logprobs:
                for i, c in enumerate(self.choices):
                    chunk = self._chunk(i, self.echo[c.prompt], None, None)
                    yield sse_event(self._envelope([chunk], None))
            echoed: set[int] = set()
            async for out in self.outputs():
                c = self.choices[out.index]
                if echo_logprobs and out.index not in echoed:
                    # The prompt's logprobs came with this first output: its echo goes
                    # first, with them.
                    assert self.echo is not None
                    echoed.add(out.index)
                    echo = self.echo[c.prompt]
                    chunk = self._chunk(out.index, echo, None, None)
                    chunk["logprobs"] = self._echo_head(c)
                    c.offset = len(echo)
                    yield sse_event(self._envelope([chunk], None))
                text, finish = c.texts[-1], out.finish_reason
                thought = c.thoughts[-1] if self.show_reasoning else ""
                delta: Any
                if self.tools is not None:
                    delta, finish, text = self._tool_delta(c, text, finish)
                    if thought:
                        delta = {"reasoning": thought, **(delta or {})}
                    if delta is None:
                        continue  # held until the calls can be read
                elif not (text or thought or finish or (ids_too and out.new_token_ids)):
                    # A character unfinished or text held back for a stop string (or a
                    # reasoning tag): its tokens (and logprobs) go with the next chunk.
                    continue
                elif self.chat:
                    delta = {"reasoning": thought} if thought else {}
                    if text or not (finish or thought):
                        delta["content"] = text
                else:
                    delta = text
                choice = self._chunk(out.index, delta, finish, c.ids[c.sent :] if ids_too else None)
                choice["logprobs"] = self._logprobs(c, c.sent, c.offset)
                if finish is not None:
                    choice["stop_reason"] = c.stop_reason
                c.sent = len(c.ids)
                c.offset += len(text)
                envelope = self._envelope([choice], self._usage() if continuous else None)
                if c.prompt_logprobs is not None:  # the choice's first chunk: once
                    if self.body.prompt_logprobs is not None:
                        prompt = self._prompt_logprobs(c)
                        (envelope if self.chat else choice)["prompt_logprobs"] = prompt
                    c.prompt_logprobs = None
                yield sse_event(envelope)
            if self.body.include_usage:
                yield sse_event(self._envelope([], self._usage()))
        except APIError as e:
            yield sse_event(e.body())
        yield b"data: [DONE]\n\n"

    def _tool_delta(
        self, c: _Choice, text: str, finish: str | None
    ) -> tuple[dict[str, Any] | None, str | None, str]:
        """A streamed chat answer under tools: (its next delta, or None to hold it; the
        finish reason; the text the delta released). A named function's arguments stream
        as they come; an "auto" answer streams its text up to where a tool call may
        begin; calls that must be read whole ("required", a parsed call) go out at the
        end, complete."""
        plan = self.tools
        assert plan is not None
        # A named call holds nothing back: what is new is this output's text.
        fresh = text if plan.choice == "named" else "".join(c.texts)[c.offset :]
        if plan.choice == "named":
            if finish == "stop":
                finish = "tool_calls"
            if not fresh:
                return ({} if finish else None), finish, ""
            call: dict[str, Any] = {"index": 0, "function": {"arguments": fresh}}
            if c.tool_call is None:
                c.tool_call = new_call_id(plan.parser)
                call.update(id=c.tool_call, type="function")
                call["function"] = {"name": plan.name, "arguments": fresh}
            return {"tool_calls": [call]}, finish, fresh
        if finish is None:
            if plan.choice != "auto":
                return None, None, ""
            ready = fresh[: max(0, plan.content_so_far("".join(c.texts)) - c.offset)]
            return ({"content": ready} if ready else None), None, ready
        content, calls = plan.calls(fresh, finish == "stop")
        delta: dict[str, Any] = {"content": content} if content else {}
        if calls:
            delta["tool_calls"] = [{"index": k, **call.body()} for k, call in enumerate(calls)]
            finish = "tool_calls" if finish == "stop" else finish
        return delta, finish, fresh

    def _chunk(
        self, index: int, delta: Any, finish: str | None, ids: list[int] | None
    ) -> dict[str, Any]:
        choice: dict[str, Any] = {"index": index}
        choice["delta" if self.chat else "text"] = delta
        choice.update(logprobs=None, finish_reason=finish)
        if ids is not None:
            choice["token_ids"] = ids
        return choice


# Chat completions' names for what a Responses body calls otherwise.
_RESPONSES_PARAMS = {
    "messages": "input",
    "max_tokens": "max_output_tokens",
    "response_format": "text.format",
}


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
