"""What every endpoint family's serving shares: the narrow context it is given (engine,
model names, metrics, admission, parsers), the model-name check, the admission of new
requests (--max-waiting-requests, stopping), and answering a started request whole or
streamed, aborting it when the client goes away."""

from __future__ import annotations

import asyncio
import functools
from collections.abc import AsyncIterator, Awaitable, Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import ParamSpec, TypeVar

import msgspec
from starlette.requests import Request
from starlette.responses import Response, StreamingResponse

from launch.client.async_llm import AsyncLLM
from launch.openai.metrics import ServerMetrics
from launch.openai.protocol import APIError, decode_body
from launch.openai.reasoning import ReasoningParser
from launch.openai.tool_parsers import ToolCallParser
from protocol.engine import truncation_error

_json = msgspec.json.Encoder()
P = ParamSpec("P")
T = TypeVar("T")

# Preparing a request (decoding its body, rendering its chat, tokenizing) takes seconds for
# the largest: it runs on these threads so that the event loop answers everyone else
# meanwhile. A few: Jinja holds the GIL while it renders (tokenizers let go of it).
PREPARE_THREADS = 4
_prepare = ThreadPoolExecutor(PREPARE_THREADS, thread_name_prefix="pagedserve-prepare")


async def off_loop(fn: Callable[P, T], *args: P.args, **kwargs: P.kwargs) -> T:
    """fn(*args, **kwargs) on the preparing threads."""
    call = functools.partial(fn, *args, **kwargs)
    return await asyncio.get_running_loop().run_in_executor(_prepare, call)


T = TypeVar("T")


def json_response(body: object, status: int = 200) -> Response:
    return Response(_json.encode(body), status, media_type="application/json")


def error_response(e: APIError) -> Response:
    return json_response(e.body(), e.status)


def stopping() -> APIError:
    return APIError(
        "the server is stopping: it takes no new requests", 503, code="server_shutting_down"
    )


class Admission:
    """Which new requests are taken: none while stopping (serve's --shutdown-timeout), and
    none while max_waiting admitted ones have not had their first token (exact here; the
    core's queue is a step old)."""

    def __init__(self, max_waiting: int | None = None) -> None:
        self.max_waiting = max_waiting
        self.draining = False
        self.num_waiting = 0
        self.on_reject: Callable[[], None] | None = None  # the metrics' count of refusals

    def check_open(self) -> None:
        if self.draining:
            raise stopping()

    def check_room(self) -> None:
        if self.max_waiting is not None and self.num_waiting >= self.max_waiting:
            if self.on_reject is not None:
                self.on_reject()
            raise APIError(
                f"{self.num_waiting} requests are already waiting (--max-waiting-requests "
                f"{self.max_waiting}); retry later",
                503,
                code="too_many_waiting_requests",
            )

    def admit(self) -> Waiting:
        """One more request waiting for its first token, until its ticket says started."""
        self.num_waiting += 1
        return Waiting(self)

    def _started(self) -> None:
        self.num_waiting -= 1


class Waiting:
    """An admitted request's place among the waiting ones; started() frees it, once."""

    __slots__ = ("_admission",)

    def __init__(self, admission: Admission) -> None:
        self._admission: Admission | None = admission

    def started(self) -> None:
        if self._admission is not None:
            self._admission._started()
            self._admission = None


@dataclass(frozen=True)
class ServingContext:
    """What a serving family may use: never the server or the app."""

    engine: AsyncLLM
    # Every name a request may use; answers (and metrics) carry the first.
    model_names: tuple[str, ...]
    metrics: ServerMetrics
    admission: Admission
    reasoning_parser: ReasoningParser | None = None
    tool_call_parser: ToolCallParser | None = None
    # --strict-request-fields: a body field no route declares is a 400, not a warning.
    strict_fields: bool = False

    @property
    def model_name(self) -> str:
        return self.model_names[0]

    def token_text(self, token_id: int) -> str:
        """One token's text in logprobs (its id when the model has no tokenizer)."""
        tok = self.engine.tokenizer
        return tok.decode([token_id]) if tok is not None else token_id_text(token_id)


def token_id_text(token_id: int) -> str:
    """A token as vLLM's return_tokens_as_token_ids writes it in logprobs."""
    return f"token_id:{token_id}"


class OpenAIServing:
    """The base of each endpoint family's serving: checks and answers they all need."""

    def __init__(self, ctx: ServingContext) -> None:
        self.ctx = ctx
        self.engine = ctx.engine

    def check_model(self, model: str | None) -> None:
        """A model this server does not serve is a 404, as OpenAI and vLLM answer it."""
        if model is not None and model not in self.ctx.model_names:
            raise unknown_model(self.ctx.model_names, model, 404)

    async def read(self, request: Request, kind: type[T]) -> T:
        """A route's body, checked (launch/openai/protocol.decode_body) off the event loop,
        under this server's rule for fields it does not know."""
        body: T = await off_loop(decode_body, await request.body(), kind, self.ctx.strict_fields)
        return body

    @staticmethod
    async def answer(
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
        return await until_disconnect(request, whole())


def unknown_model(model_names: tuple[str, ...], model: str, status: int) -> APIError:
    served = " or ".join(repr(n) for n in model_names)
    return APIError(
        f"the model {model!r} does not exist; this server serves {served}",
        status,
        param="model",
        code="model_not_found",
    )


def checked_truncation(k: int | None) -> int | None:
    """A body's truncate_prompt_tokens, checked before any prompt is cut."""
    error = truncation_error(k)
    if error is not None:
        raise APIError(error, param="truncate_prompt_tokens", code="invalid_value")
    return k


async def until_disconnect(request: Request, work: Awaitable[Response]) -> Response:
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
