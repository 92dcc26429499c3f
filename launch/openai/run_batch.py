"""`pagedserve run-batch`: OpenAI's Batch API file format, run offline (vLLM's run-batch).

Each input line is a request as OpenAI's batch files hold them, `{"custom_id": ...,
"method": "POST", "url": "/v1/chat/completions" | "/v1/completions" | "/v1/embeddings" |
"/v1/responses", "body": {...}}`; each output line, in input order, is `{"id",
"custom_id", "response": {"status_code", "request_id", "body"}, "error"}`. The requests
go to the same routes the server answers (OpenAIServer, called in-process, no socket), all
at once, so the engine batches them and a bad body fails alone with the 400 the server
would give. A line that is not such a request gets `error` and no response.
"""

from __future__ import annotations

import asyncio
import json
import sys
import time
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

import msgspec

from launch.openai.api_server import OpenAIServer

ROUTES = ("/v1/chat/completions", "/v1/completions", "/v1/embeddings", "/v1/responses")
# Requests handed to the server at once: the engine's queue holds the rest of them anyway,
# this bounds the server-side objects a huge file makes.
MAX_IN_FLIGHT = 1024


class BatchLine(msgspec.Struct, forbid_unknown_fields=True):
    custom_id: str
    method: str
    url: str
    body: dict[str, Any]


async def run_batch(
    api: OpenAIServer,
    lines: list[bytes],
    progress: Callable[[int], None] = lambda done: None,
) -> list[dict[str, Any]]:
    """Every line's output object, in input order."""
    limit = asyncio.Semaphore(MAX_IN_FLIGHT)
    app = api.app()
    done = 0

    async def one(raw: bytes) -> dict[str, Any]:
        nonlocal done
        async with limit:
            out = await _answer(app, raw)
        done += 1
        progress(done)
        return out

    return await asyncio.gather(*(one(raw) for raw in lines))


async def _answer(app: Any, raw: bytes) -> dict[str, Any]:
    out: dict[str, Any] = {"id": f"batch_req_{uuid.uuid4().hex}", "custom_id": None}
    try:
        line = msgspec.json.decode(raw, type=BatchLine)
    except msgspec.DecodeError as e:
        return {**out, "response": None, "error": {"code": "invalid_line", "message": str(e)}}
    out["custom_id"] = line.custom_id
    problem = None
    if line.method != "POST":
        problem = f"method {line.method!r}: a batch request is a POST"
    elif line.url not in ROUTES:
        problem = f"url {line.url!r}: one of {', '.join(ROUTES)}"
    elif line.body.get("stream"):
        problem = "stream: a batch request is answered whole"
    if problem is not None:
        return {**out, "response": None, "error": {"code": "invalid_line", "message": problem}}
    status, body = await _post(app, line.url, msgspec.json.encode(line.body))
    request_id = body.get("id") if isinstance(body, dict) else None
    response = {"status_code": status, "request_id": request_id or out["id"], "body": body}
    return {**out, "response": response, "error": None}


async def _post(app: Any, path: str, body: bytes) -> tuple[int, Any]:
    """POST body to the ASGI app, as a client that stays connected until the answer."""
    scope = {
        "type": "http",
        "asgi": {"version": "3.0", "spec_version": "2.3"},
        "http_version": "1.1",
        "method": "POST",
        "scheme": "http",
        "path": path,
        "raw_path": path.encode(),
        "root_path": "",
        "query_string": b"",
        "headers": [(b"content-type", b"application/json")],
        "client": ("run-batch", 0),
        "server": ("run-batch", 0),
    }
    sent = False
    answered = asyncio.Event()
    status = 500
    chunks: list[bytes] = []

    async def receive() -> dict[str, Any]:
        nonlocal sent
        if not sent:
            sent = True
            return {"type": "http.request", "body": body, "more_body": False}
        await answered.wait()  # no disconnect before the answer is complete
        return {"type": "http.disconnect"}

    async def send(message: dict[str, Any]) -> None:
        nonlocal status
        if message["type"] == "http.response.start":
            status = message["status"]
        elif message["type"] == "http.response.body":
            chunks.append(message.get("body", b""))
            if not message.get("more_body"):
                answered.set()

    await app(scope, receive, send)
    answered.set()
    data = b"".join(chunks)
    try:
        return status, json.loads(data) if data else None
    except ValueError:
        return status, data.decode(errors="replace")


def run(api: OpenAIServer, input_path: Path, output_path: Path, progress: bool = True) -> int:
    """Run the file's requests through api (its engine started here); 0 when every line got
    an output line (failed requests included), as vLLM's run-batch."""
    lines = [line for line in input_path.read_bytes().splitlines() if line.strip()]
    start = time.monotonic()
    every = max(1, len(lines) // 20)

    def report(done: int) -> None:
        if progress and (done % every == 0 or done == len(lines)):
            print(f"run-batch: {done}/{len(lines)} requests", file=sys.stderr)

    async def main() -> list[dict[str, Any]]:
        await api.engine.start()
        try:
            return await run_batch(api, lines, report)
        finally:
            await api.engine.aclose()

    outputs = asyncio.run(main())
    encoder = msgspec.json.Encoder()
    with output_path.open("wb") as f:
        for out in outputs:
            f.write(encoder.encode(out) + b"\n")
    failed = sum(
        1 for o in outputs if o["error"] is not None or o["response"]["status_code"] != 200
    )
    seconds = time.monotonic() - start
    print(
        f"run-batch: {len(outputs)} requests, {failed} failed, {seconds:.1f} s -> {output_path}",
        file=sys.stderr,
    )
    return 0
