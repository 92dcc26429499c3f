"""`pagedserve run-batch`: OpenAI's Batch API file format, run offline (vLLM's run-batch).

Each input line is a request as OpenAI's batch files hold them, `{"custom_id": ...,
"method": "POST", "url": "/v1/chat/completions" | "/v1/completions" | "/v1/embeddings" |
"/v1/responses", "body": {...}}`; each output line is `{"id", "custom_id", "response":
{"status_code", "request_id", "body"}, "error"}`, written the moment its request ends
through JsonLinesOutput, so a signal or a kill keeps every finished answer (in the order
they finished; custom_id says which) and a write error stops the run; a run that ends
rewrites the file in input order. The requests go to the same
routes the server answers (OpenAIServer, called in-process, no socket), many at once, so
the engine batches them and a bad body fails alone with the 400 the server would give. A
line that is not such a request gets `error` and no response.
"""

from __future__ import annotations

import array
import asyncio
import json
import signal
import sys
import time
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

import msgspec

from launch.client.signals import Terminated
from launch.openai.api_server import OpenAIServer
from launch.output_file import JsonLinesOutput
from protocol.gc_heap import freeze_startup_heap

ROUTES = ("/v1/chat/completions", "/v1/completions", "/v1/embeddings", "/v1/responses")
# Requests handed to the server at once (one worker task each): the engine's queue holds the
# rest of them anyway, this bounds the server-side objects a huge file makes.
MAX_IN_FLIGHT = 1024


class BatchLine(msgspec.Struct, forbid_unknown_fields=True):
    custom_id: str
    method: str
    url: str
    body: dict[str, Any]


async def run_batch(
    api: OpenAIServer,
    lines: list[bytes],
    write: Callable[[int, dict[str, Any]], None],
    progress: Callable[[int], None] = lambda done: None,
) -> None:
    """Answer every line, write(line number, output object) as its request ends. An
    exception from write cancels the requests still open (the engine aborts them) and
    is raised."""
    app = api.app()
    todo = iter(enumerate(lines))  # shared: each line is taken by one worker
    done = 0

    async def worker() -> None:
        nonlocal done
        for number, raw in todo:
            write(number, await _answer(app, raw))
            done += 1
            progress(done)

    workers = [asyncio.ensure_future(worker()) for _ in range(min(MAX_IN_FLIGHT, len(lines)))]
    try:
        await asyncio.gather(*workers)
    finally:  # after a failure or a cancel: the rest stop (their requests are aborted)
        for w in workers:
            w.cancel()
        await asyncio.gather(*workers, return_exceptions=True)


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


def run(api: OpenAIServer, input_path: Path, output: JsonLinesOutput, progress: bool = True) -> int:
    """Run the file's requests through api (its engine started here); 0 when every line got
    an output line (failed requests included), as vLLM's run-batch. Terminated or
    KeyboardInterrupt after a stop signal, OutputWriteError when the output fails; the
    engine is closed and every finished answer is in the output either way."""
    lines = [line for line in input_path.read_bytes().splitlines() if line.strip()]
    start = time.monotonic()
    every = max(1, len(lines) // 20)
    encoder = msgspec.json.Encoder()
    failed = 0
    numbers = array.array("q")  # the input line of each output line, to sort them at the end

    def write(number: int, out: dict[str, Any]) -> None:
        nonlocal failed
        output.write(encoder.encode(out))
        numbers.append(number)
        if out["error"] is not None or out["response"]["status_code"] != 200:
            failed += 1

    def report(done: int) -> None:
        if progress and (done % every == 0 or done == len(lines)):
            print(f"run-batch: {done}/{len(lines)} requests", file=sys.stderr)

    async def main() -> None:
        stop.attach()
        await api.engine.start()
        freeze_startup_heap()
        output.start()  # the engine is up: only now may an existing file go
        try:
            await run_batch(api, lines, write, report)
        finally:
            await api.engine.aclose()

    with _StopOnSignal() as stop:
        try:
            asyncio.run(main())
        except asyncio.CancelledError:
            if stop.signum is None:
                raise
        if stop.signum is not None:
            raise Terminated(stop.signum)
    output.close(lambda position, _raw: numbers[position])  # in input order
    seconds = time.monotonic() - start
    print(
        f"run-batch: {len(lines)} requests, {failed} failed, {seconds:.1f} s -> {output.name}",
        file=sys.stderr,
    )
    return 0


class _StopOnSignal:
    """SIGTERM and SIGHUP during the run cancel its main task from the event loop, so the
    requests and the engine close in order (as asyncio.run does for SIGINT) instead of an
    exception raised inside whichever task happens to run. A second signal, or one before
    the loop runs, goes to the handler that was there before."""

    SIGNALS = (signal.SIGTERM, signal.SIGHUP)

    def __init__(self) -> None:
        self.signum: int | None = None
        self._task: asyncio.Task[Any] | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._previous: dict[int, Any] = {}

    def __enter__(self) -> _StopOnSignal:
        self._previous = {sig: signal.signal(sig, self._on_signal) for sig in self.SIGNALS}
        return self

    def __exit__(self, *exc: object) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)

    def attach(self) -> None:
        """Called in the main task, once the loop runs."""
        self._loop = asyncio.get_running_loop()
        self._task = asyncio.current_task()

    def _on_signal(self, signum: int, frame: Any) -> None:
        if self.signum is None and self._task is not None and self._loop is not None:
            self.signum = signum
            self._loop.call_soon_threadsafe(self._task.cancel)
            return
        previous = self._previous.get(signum)
        if callable(previous):
            previous(signum, frame)
