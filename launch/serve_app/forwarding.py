"""One HTTP request carried from the ingress to an engine replica through a Serve handle,
and run there through the replica's own OpenAI app: the answer comes back as the app's ASGI
messages, streamed, so status, headers and every server-sent event pass unchanged.

The request travels whole (its body read by the ingress) because Serve's request router
sees a handle call's arguments, not an HTTP body still held by the proxy: the prompt's block
hashes ride along for the prefix-aware router (prefix_router.py)."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

from starlette.types import ASGIApp, Message, Scope

# The scope keys an HTTP request keeps on its way to the replica.
_SCOPE_KEYS = ("http_version", "method", "scheme", "path", "raw_path", "query_string", "headers")


@dataclass
class ForwardedRequest:
    """An HTTP request as the ingress read it."""

    scope: dict[str, Any]
    body: bytes
    # Chained block hashes of the prompt's full blocks (the replicas' seed and block
    # size); empty when the ingress could not tell the prompt (routed by load alone).
    block_hashes: list[bytes] = field(default_factory=list)


def forwarded(scope: Scope, body: bytes, block_hashes: list[bytes]) -> ForwardedRequest:
    """The request's scope without what only the ingress's connection means; the path as
    the app routes it (Serve's route prefix taken off)."""
    kept = {k: scope[k] for k in _SCOPE_KEYS if k in scope}
    root = scope.get("root_path", "")
    path = kept.get("path", "/")
    if root and path.startswith(root):
        kept["path"] = path[len(root) :] or "/"
        kept.pop("raw_path", None)
    kept["headers"] = [(bytes(k), bytes(v)) for k, v in scope.get("headers", [])]
    kept["client"] = scope.get("client")
    return ForwardedRequest(kept, body, block_hashes)


async def run_app(app: ASGIApp, request: ForwardedRequest) -> AsyncIterator[Message]:
    """Run `app` on the request; yield each message it sends. The consumer closing this
    generator (the client went away, Serve cancelled the call) is the app's disconnect."""
    scope: dict[str, Any] = {
        "type": "http",
        "asgi": {"version": "3.0", "spec_version": "2.3"},
        "root_path": "",
        "server": None,
        **request.scope,
    }
    outbox: asyncio.Queue[Message | None] = asyncio.Queue()
    gone = asyncio.Event()
    body_sent = False

    async def receive() -> Message:
        nonlocal body_sent
        if not body_sent:
            body_sent = True
            return {"type": "http.request", "body": request.body, "more_body": False}
        await gone.wait()
        return {"type": "http.disconnect"}

    async def send(message: Message) -> None:
        await outbox.put(message)

    async def run() -> None:
        try:
            await app(scope, receive, send)
        finally:
            outbox.put_nowait(None)

    task = asyncio.get_running_loop().create_task(run())
    try:
        while (message := await outbox.get()) is not None:
            yield message
        await task  # its exception, if any, is Serve's to report
    finally:
        gone.set()  # a stream still open sees its client leave and aborts its request
        if not task.done():
            with contextlib.suppress(asyncio.CancelledError, asyncio.TimeoutError):
                await asyncio.wait_for(asyncio.shield(task), 5.0)
            task.cancel()
