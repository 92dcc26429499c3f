"""The OpenAI-compatible HTTP API over one AsyncLLM (Starlette; run_server.py runs it).

Routes: POST /v1/completions, POST /v1/chat/completions, POST /v1/embeddings, POST
/v1/responses (GET / DELETE /v1/responses/{id}, GET .../input_items), GET
/v1/models (and /v1/models/{id}), Anthropic's POST /v1/messages and
/v1/messages/count_tokens (serving_messages.py; `x-api-key: KEY` is accepted too), GET /health,
GET /metrics (Prometheus, launch/openai/metrics.py), POST /reset_prefix_cache, and vLLM's POST
/tokenize, POST /detokenize, GET /version, GET /load, POST /inference/v1/generate
(token-in/token-out), POST /v1/chat/completions/render and /v1/completions/render, POST
/v1/responses/{id}/cancel, and GET/POST /ping (SageMaker's probe); GET /openapi.json
describes them all (GET /docs, as a page). With
an API key (--api-key), every route but /health, /ping, /metrics, /version, /load,
/openapi.json and /docs wants
`Authorization: Bearer KEY`; with CORS origins (--allowed-origins), browsers' cross-origin
requests from them are answered, preflights without the key. Streaming answers
are server-sent events ending in `data: [DONE]`; a request that fails mid-stream gets an
`{"error": ...}` event first (OpenAI's clients raise it). A client that goes away, while
streaming or not, aborts its request (every prompt and copy of it) in the engine at once.
Each request is one RequestStream, so a stream that falls behind writes one chunk per
choice for all the tokens that arrived meanwhile. A body over --max-request-body-bytes is
413 (body_limits.py), JSON nested too deep or holding
too many values 400 (json_shape.py); requests are prepared off
the event loop (serving_base.off_loop); connections are limited in connections.py.

This module holds the app: its routes, middleware and the state they share; each
endpoint family's work is its serving_*.py, given a ServingContext, never this server.
"""

from __future__ import annotations

import functools
import secrets
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from typing import Any

from starlette.applications import Starlette
from starlette.middleware.cors import CORSMiddleware
from starlette.requests import ClientDisconnect, Request
from starlette.responses import HTMLResponse, Response
from starlette.routing import Route
from starlette.types import ASGIApp, Receive, Scope, Send

from launch.client.async_llm import AsyncLLM
from launch.client.data_parallel import DataParallelLLM
from launch.client.engine_processes import EngineDeadError
from launch.client.version import package_version
from launch.openai.body_limits import DEFAULT_MAX_BODY_BYTES, BodyLimit
from launch.openai.http_metrics import HTTPMetricsMiddleware
from launch.openai.metric_families import cache_config_labels
from launch.openai.metrics import CONTENT_TYPE, ServerMetrics
from launch.openai.openapi import docs_page, openapi_document
from launch.openai.protocol import APIError
from launch.openai.reasoning import ReasoningParser
from launch.openai.responses_store import (
    DEFAULT_MAX_STORED_RESPONSES,
    DEFAULT_RESPONSES_STORE_BYTES,
    ResponseStore,
)
from launch.openai.serving_base import (
    Admission,
    ServingContext,
    error_response,
    json_response,
    stopping,
    unknown_model,
)
from launch.openai.serving_chat import ChatServing
from launch.openai.serving_completions import CompletionServing
from launch.openai.serving_embeddings import EmbeddingServing
from launch.openai.serving_messages import MessagesServing, anthropic_error, anthropic_guard
from launch.openai.serving_render import RenderServing
from launch.openai.serving_responses import ResponsesServing
from launch.openai.serving_tokenize import TokenizeServing
from launch.openai.serving_tokens import TokensServing
from launch.openai.tool_parsers import ToolCallParser

# Probes a load balancer or a scraper calls without credentials.
OPEN_PATHS = frozenset(
    ("/health", "/ping", "/metrics", "/version", "/load", "/openapi.json", "/docs")
)


class RequireAPIKey:
    """ASGI middleware: HTTP requests outside OPEN_PATHS need `Authorization: Bearer KEY`
    or `x-api-key: KEY` (what Anthropic's clients send); 401 otherwise, in the shape of
    the route's API. Pure ASGI, so a stream's chunks pass untouched."""

    def __init__(self, app: ASGIApp, api_key: str) -> None:
        self.app = app
        self._expected = f"Bearer {api_key}".encode()
        self._key = api_key.encode()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        path = _route_path(scope) if scope["type"] == "http" else ""
        if scope["type"] == "http" and path not in OPEN_PATHS:
            headers = dict(scope["headers"])
            bearer = secrets.compare_digest(headers.get(b"authorization", b""), self._expected)
            if not (bearer or secrets.compare_digest(headers.get(b"x-api-key", b""), self._key)):
                error = APIError(
                    "invalid or missing API key: send Authorization: Bearer <key> "
                    "(or x-api-key: <key>)",
                    401,
                    code="invalid_api_key",
                )
                shape = anthropic_error if path.startswith("/v1/messages") else error_response
                await shape(error)(scope, receive, send)
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
    """The routes' state: the engine, the served model's names, metrics, admission, and
    one serving object per endpoint family."""

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
        responses_store_bytes: int = DEFAULT_RESPONSES_STORE_BYTES,
        strict_fields: bool = False,
        max_body_bytes: int = DEFAULT_MAX_BODY_BYTES,
    ) -> None:
        self.engine = engine
        self.max_body_bytes = max_body_bytes
        self.cors = cors
        self.api_key = api_key
        self.admission = Admission(max_waiting)
        args, ready = engine.engine.args, engine.engine.ready
        cache_info = cache_config_labels(
            ready.block_size, ready.num_gpu_blocks, ready.max_model_len,
            args.enable_prefix_caching, args.hash_algo, args.gpu_memory_utilization,
            args.kv_cache_memory, args.num_gpu_blocks,
        )  # fmt: skip
        dp = engine if isinstance(engine, DataParallelLLM) else None
        self.metrics = ServerMetrics(
            model_name, engine.max_model_len, lambda: engine.num_open_requests, cache_info,
            engines=1 if dp is None else dp.size, router=None if dp is None else dp.router,
        )  # fmt: skip
        self.admission.on_reject = self.metrics.rejected
        engine.on_stats = self.metrics.on_stats
        ctx = ServingContext(
            engine,
            (model_name, *(a for a in aliases if a != model_name)),
            self.metrics,
            self.admission,
            reasoning_parser,
            tool_call_parser,
            strict_fields,
        )
        self.ctx = ctx
        self.response_store = ResponseStore(max_stored_responses, responses_store_bytes)
        self.completions = CompletionServing(ctx)
        self.chat = ChatServing(ctx)
        self.responses = ResponsesServing(ctx, self.chat, self.response_store)
        self.embeddings = EmbeddingServing(ctx)
        self.tokenizing = TokenizeServing(ctx)
        self.tokens = TokensServing(ctx)
        self.render = RenderServing(ctx, self.chat)
        # /v1/models' `created`: when this server started serving the model.
        self.started_at = int(time.time())
        self._openapi: dict[str, Any] | None = None
        self.messages = MessagesServing(ctx, self.chat)

    @property
    def draining(self) -> bool:
        """Stopping (serve's --shutdown-timeout): open requests finish, new ones get 503."""
        return self.admission.draining

    @draining.setter
    def draining(self, value: bool) -> None:
        self.admission.draining = value

    def app(self, lifespan: Any = None) -> ASGIApp:
        guard = _guard
        app = Starlette(
            lifespan=lifespan,
            routes=[
                Route("/v1/completions", guard(self.completions.create), methods=["POST"]),
                Route("/v1/chat/completions", guard(self.chat.create), methods=["POST"]),
                Route("/v1/chat/completions/render", guard(self.render.chat), methods=["POST"]),
                Route("/v1/completions/render", guard(self.render.completion), methods=["POST"]),
                Route("/inference/v1/generate", guard(self.tokens.generate), methods=["POST"]),
                Route("/v1/embeddings", guard(self.embeddings.create), methods=["POST"]),
                Route("/v1/responses", guard(self.responses.create), methods=["POST"]),
                Route(
                    "/v1/responses/{response_id}",
                    guard(self.responses.stored),
                    methods=["GET", "DELETE"],
                ),
                Route(
                    "/v1/responses/{response_id}/cancel",
                    guard(self.responses.cancel),
                    methods=["POST"],
                ),
                Route(
                    "/v1/responses/{response_id}/input_items",
                    guard(self.responses.input_items),
                    methods=["GET"],
                ),
                Route("/v1/messages", anthropic_guard(self.messages.create), methods=["POST"]),
                Route(
                    "/v1/messages/count_tokens",
                    anthropic_guard(self.messages.count_tokens),
                    methods=["POST"],
                ),
                Route("/v1/models", self.models, methods=["GET"]),
                Route("/v1/models/{model:path}", self.model, methods=["GET"]),
                Route("/health", self.health, methods=["GET"]),
                Route("/ping", self.health, methods=["GET", "POST"]),  # SageMaker's probe
                Route("/metrics", self.metrics_endpoint, methods=["GET"]),
                Route("/reset_prefix_cache", guard(self.reset_prefix_cache), methods=["POST"]),
                Route("/tokenize", guard(self.tokenizing.tokenize), methods=["POST"]),
                Route("/detokenize", guard(self.tokenizing.detokenize), methods=["POST"]),
                Route("/version", self.version, methods=["GET"]),
                Route("/load", self.load, methods=["GET"]),
                Route("/openapi.json", self.openapi, methods=["GET"]),
                Route("/docs", self.docs, methods=["GET"]),
            ],
        )
        # Counted outside the body limit: its 413s show in http_requests_total.
        limited = BodyLimit(app, self.max_body_bytes)
        guarded: ASGIApp = HTTPMetricsMiddleware(limited, self.metrics.http, app.routes)
        if self.api_key is not None:
            guarded = RequireAPIKey(guarded, self.api_key)
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
        """vLLM's model card: root is the checkpoint served, parent the base model of an
        adapter (none here), permission one entry allowing what the server does."""
        created = self.started_at
        return {
            "id": name,
            "object": "model",
            "created": created,
            "owned_by": "pagedserve",
            "root": self.engine.model,
            "parent": None,
            "max_model_len": self.engine.max_model_len,
            "permission": [
                {
                    "id": f"modelperm-{name}",
                    "object": "model_permission",
                    "created": created,
                    "allow_create_engine": False,
                    "allow_sampling": True,
                    "allow_logprobs": True,
                    "allow_search_indices": False,
                    "allow_view": True,
                    "allow_fine_tuning": False,
                    "organization": "*",
                    "group": None,
                    "is_blocking": False,
                }
            ],
        }

    async def models(self, _request: Request) -> Response:
        return json_response(
            {"object": "list", "data": [self._card(n) for n in self.ctx.model_names]}
        )

    async def model(self, request: Request) -> Response:
        """GET /v1/models/{id} (the openai client's models.retrieve)."""
        name = request.path_params["model"]
        if name not in self.ctx.model_names:
            return error_response(unknown_model(self.ctx.model_names, name, 404))
        return json_response(self._card(name))

    async def health(self, _request: Request) -> Response:
        if self.engine.dead_reason is not None:
            return error_response(APIError(self.engine.dead_reason, 503))
        if self.draining or not self.engine.can_send():  # as requests are refused
            return error_response(stopping())
        return Response(status_code=200)

    async def metrics_endpoint(self, _request: Request) -> Response:
        return Response(self.metrics.exposition(), media_type=CONTENT_TYPE)

    async def reset_prefix_cache(self, _request: Request) -> Response:
        self.engine.reset_prefix_cache()  # the core refuses (and logs) while blocks are held
        return Response(status_code=200)

    async def version(self, _request: Request) -> Response:
        """The server's version (vLLM's GET /version)."""
        return json_response({"version": package_version()})

    async def load(self, _request: Request) -> Response:
        """The requests in flight in the engine (vLLM's GET /load)."""
        return json_response({"server_load": self.engine.num_open_requests})

    async def openapi(self, request: Request) -> Response:
        """This OpenAPI document: every route, each request body's JSON Schema."""
        if self._openapi is None:
            root = request.scope.get("root_path", "")
            self._openapi = openapi_document(
                request.app.routes, "pagedserve", package_version(), root_path=root
            )
        return json_response(self._openapi)

    async def docs(self, request: Request) -> Response:
        """A readable page of the OpenAPI document."""
        await self.openapi(request)
        assert self._openapi is not None
        return HTMLResponse(docs_page(self._openapi))


def _guard(
    handler: Callable[[Request], Awaitable[Response]],
) -> Callable[[Request], Awaitable[Response]]:
    """Bad input and a dead engine become OpenAI-style errors; the server keeps on."""

    @functools.wraps(handler)
    async def run(request: Request) -> Response:
        try:
            return await handler(request)
        except APIError as e:
            response = error_response(e)
            if e.status == 413:  # the rest of the body would be read for nothing
                response.headers["connection"] = "close"
            return response
        except EngineDeadError as e:
            return error_response(APIError(str(e), 503))
        except ClientDisconnect:  # gone, or closed for sending its body too slowly
            return Response(status_code=499)

    return run
