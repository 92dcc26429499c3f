"""The ingress deployment: takes each HTTP request from Serve's proxy, reads its body (within
the server's body limit), hashes its prompt for the router, and hands it to an engine
replica through a Serve handle; the replica's ASGI messages stream back unchanged."""

from __future__ import annotations

import json
import logging
from typing import Any

from ray.serve.handle import DeploymentHandle
from starlette.applications import Starlette
from starlette.routing import Mount
from starlette.types import ASGIApp, Receive, Scope, Send

from launch.client.inputs import InputProcessor, Prompt
from launch.openai.body_limits import BodyLimit
from launch.openai.protocol import APIError
from launch.openai.serving_base import error_response, off_loop
from launch.serve_app.app_args import AppArgs
from launch.serve_app.forwarding import forwarded
from protocol.block_hash import BlockHasher

log = logging.getLogger("pagedserve.serve_app")

# The routes whose prompt the router scores; any other request goes by load alone.
PROMPT_ROUTES = ("/v1/completions", "/v1/chat/completions")


class PromptHasher:
    """The prompt's block hashes as every replica computes them (same tokenizer and chat
    template, block size, hash and seed), for routing only: a request this cannot read
    still goes to a replica, which checks it and answers as `pagedserve serve` does."""

    def __init__(self, app_args: AppArgs) -> None:
        cli = app_args.cli
        self.inputs = InputProcessor.load(cli.model, cli.chat_template)
        seed = app_args.engine["prefix_cache_hash_seed"]
        self.hasher = BlockHasher(cli.block_size, cli.hash, seed.encode())

    def block_hashes(self, path: str, body: bytes) -> list[bytes]:
        if path not in PROMPT_ROUTES:
            return []
        try:
            data = json.loads(body)
            ids = self._token_ids(data) if isinstance(data, dict) else None
        except Exception:  # any reason (a template's own errors too): the replica answers it
            return []
        hashes: list[bytes] = []
        if ids:
            self.hasher.extend(hashes, ids)
        return hashes

    def _token_ids(self, data: dict[str, Any]) -> list[int] | None:
        if data.get("cache_salt") is not None:
            return None  # salted hashes are the tenant's own: no replica shares them
        messages = data.get("messages")
        if isinstance(messages, list):
            prompt = Prompt(
                messages=messages,
                add_generation_prompt=data.get("add_generation_prompt", True) is True,
                continue_final_message=data.get("continue_final_message", False) is True,
                tools=data.get("tools"),
                chat_template_kwargs=data.get("chat_template_kwargs"),
            )
        else:
            text = data.get("prompt")
            if isinstance(text, list) and len(text) == 1:
                text = text[0]  # one prompt in a list (a batch of one)
            if isinstance(text, str):
                prompt = Prompt(prompt=text)
            elif isinstance(text, list) and all(type(t) is int for t in text):
                return text
            else:
                return None
        return self.inputs.token_ids(prompt, vocab_size=0)


class Ingress:
    """Serve's HTTP entry: one ASGI app forwarding every request to the engine deployment."""

    def __init__(self, engine: DeploymentHandle, app_args: AppArgs) -> None:
        self.engine = engine.options(stream=True)
        self.hasher = PromptHasher(app_args) if app_args.prefix_aware_routing else None
        self.max_body = app_args.cli.max_request_body_bytes

    def __serve_build_asgi_app__(self) -> ASGIApp:
        # BodyLimit answers 413 past the limit before the ingress buffers the body.
        return Starlette(routes=[Mount("/", app=BodyLimit(self.forward, self.max_body))])

    async def forward(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await send({"type": "websocket.close", "code": 1003})  # no websockets here
            return
        try:
            body = await _read_body(receive)
        except APIError as e:  # over the body limit (BodyLimit's 413)
            await error_response(e)(scope, receive, send)
            return
        if body is None:
            return  # the client left before sending it all
        request = forwarded(scope, body, [])
        if self.hasher is not None:
            # Tokenizing a long prompt takes milliseconds: off the loop, as the server does.
            path = request.scope["path"]
            request.block_hashes = await off_loop(self.hasher.block_hashes, path, body)
        started = False
        try:
            async for message in self.engine.remote(request):
                started = True
                await send(message)
        except Exception as e:
            if started:
                raise  # mid-answer: Serve closes the connection
            # No replica could take it (all dead, or the deployment is gone).
            log.warning("the engine deployment failed a request: %s", e)
            error = APIError(f"no engine replica could serve this request: {e}", 503)
            await error_response(error)(scope, receive, send)


async def _read_body(receive: Receive) -> bytes | None:
    chunks: list[bytes] = []
    more = True
    while more:
        message = await receive()
        if message["type"] == "http.disconnect":
            return None
        chunks.append(message.get("body", b""))
        more = message.get("more_body", False)
    return b"".join(chunks)
