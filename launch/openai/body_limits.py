"""How large a request body may be: at most --max-request-body-bytes, else 413, told by its
Content-Length before a byte of it is read, or counted as a chunked body streams in. (How
deep its JSON may nest: launch/openai/json_shape.py.)"""

from __future__ import annotations

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from launch.openai.protocol import APIError
from launch.openai.serving_base import error_response

DEFAULT_MAX_BODY_BYTES = 32 * 2**20


def body_too_large(limit: int) -> APIError:
    return APIError(
        f"the request body is larger than {limit} bytes (--max-request-body-bytes)",
        413,
        code="request_too_large",
        type="invalid_request_error",
    )


class BodyLimit:
    """ASGI middleware: a body over max_bytes is answered 413 and its connection closed.
    A declared Content-Length is judged before the app runs; a chunked body raises the
    413 from receive() once it passes the limit, which the routes answer as any APIError."""

    def __init__(self, app: ASGIApp, max_bytes: int) -> None:
        self.app = app
        self.max_bytes = max_bytes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        limit = self.max_bytes
        declared = next((v for k, v in scope["headers"] if k == b"content-length"), None)
        # (The HTTP parser let only digits through; more of them than any limit has are
        # too large, whatever int() would make of them.)
        if declared and declared.isdigit() and (len(declared) > 18 or int(declared) > limit):
            await _refuse(body_too_large(limit), scope, receive, send)
            return
        seen = 0

        async def counted() -> Message:
            nonlocal seen
            message = await receive()
            if message["type"] == "http.request":
                seen += len(message.get("body", b""))
                if seen > limit:
                    raise body_too_large(limit)
            return message

        await self.app(scope, counted, send)


async def _refuse(error: APIError, scope: Scope, receive: Receive, send: Send) -> None:
    # Closing the connection spares reading the rest of a body nobody wants.
    response = error_response(error)
    response.headers["connection"] = "close"
    await response(scope, receive, send)
