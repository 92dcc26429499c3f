"""`pagedserve serve` as clients use it (api_server.py: the app, its routes and
middleware; run_server.py: start and stop): real processes, the official `openai` client,
raw HTTP where a client must misbehave (disconnecting mid-stream).

The model is the tiny random Llama with a word-level tokenizer and a chat template
(test_model_files.word_tokenizer). Token ids are compared through the server's
`return_token_ids` extension, so a greedy request must give exactly LLM.generate's ids.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import socket
import ssl
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from pathlib import Path

import openai
import pytest

from tests.helpers.cli_helpers import (
    ENV,
    children_of,
)
from tests.helpers.model_files import CONVERSATION
from tests.helpers.server import (
    EXTRA,
    MODEL_NAME,
    PROMPT_IDS,
    PROMPT_TEXT,
    N,
    Server,
    metrics,
    nothing_left,
    post,
    wait_for_metric,
)


def test_completions_and_chat_equal_llm_generate(
    server: Server, client: openai.OpenAI, reference: dict[str, list[int]]
) -> None:
    args = dict(model=MODEL_NAME, max_tokens=N, temperature=0, extra_body=EXTRA)
    c = client.completions.create(prompt=PROMPT_TEXT, **args)
    assert c.choices[0].token_ids == reference["text"]  # type: ignore[attr-defined]
    assert c.choices[0].finish_reason == "length"
    assert c.usage is not None and c.usage.completion_tokens == N
    assert c.usage.prompt_tokens == len(c.prompt_token_ids)  # type: ignore[attr-defined]
    # Token-id prompt, streamed: the chunks' ids and texts add up to the whole answer.
    chunks = list(client.completions.create(prompt=PROMPT_IDS, stream=True, **args))
    ids = [t for ch in chunks for t in ch.choices[0].token_ids]  # type: ignore[attr-defined]
    assert ids == reference["ids"]
    whole = client.completions.create(prompt=PROMPT_IDS, **args)
    assert "".join(ch.choices[0].text for ch in chunks) == whole.choices[0].text
    assert chunks[-1].choices[0].finish_reason == "length"
    # Chat, the model's template, plain and streamed with usage.
    chat_args = dict(model=MODEL_NAME, messages=CONVERSATION, temperature=0, extra_body=EXTRA)
    r = client.chat.completions.create(max_completion_tokens=N, **chat_args)  # type: ignore
    assert r.choices[0].token_ids == reference["chat"]  # type: ignore[attr-defined]
    assert r.object == "chat.completion" and r.choices[0].message.role == "assistant"
    stream = client.chat.completions.create(
        max_tokens=N, stream=True, stream_options={"include_usage": True}, **chat_args
    )  # type: ignore[call-overload]
    events = list(stream)
    assert events[0].choices[0].delta.role == "assistant"
    ids = [t for e in events[1:] if e.choices for t in e.choices[0].token_ids]  # type: ignore
    assert ids == reference["chat"]
    assert "".join(e.choices[0].delta.content or "" for e in events if e.choices) == (
        r.choices[0].message.content
    )
    usage = events[-1].usage
    assert events[-1].choices == [] and usage is not None
    assert usage.completion_tokens == N and usage.prompt_tokens == len(r.prompt_token_ids)  # type: ignore
    # The same conversation again: its prompt comes from the prefix cache, unless salted.
    assert usage.prompt_tokens_details is not None
    assert usage.prompt_tokens_details.cached_tokens > 0
    salted = client.chat.completions.create(
        max_tokens=N, **{**chat_args, "extra_body": {**EXTRA, "cache_salt": "tenant-b"}}
    )  # type: ignore[call-overload]
    assert salted.usage.prompt_tokens_details.cached_tokens == 0  # type: ignore[union-attr]
    assert salted.choices[0].token_ids == reference["chat"]  # type: ignore[attr-defined]
    assert [m.id for m in client.models.list().data] == [MODEL_NAME]
    assert client.models.retrieve(MODEL_NAME).id == MODEL_NAME
    with pytest.raises(openai.NotFoundError):
        client.models.retrieve("other")


async def _stream_text(client: openai.AsyncOpenAI, prompt: list[int]) -> list[int]:
    stream = await client.completions.create(
        model=MODEL_NAME, prompt=prompt, max_tokens=N, temperature=0, stream=True, extra_body=EXTRA
    )
    return [t async for chunk in stream for t in chunk.choices[0].token_ids]  # type: ignore


async def _disconnect_mid_stream(url: str, prompt: object = PROMPT_IDS) -> None:
    """A raw HTTP client that reads two events of a long stream, then hangs up."""
    host, port = url.removeprefix("http://").split(":")
    reader, writer = await asyncio.open_connection(host, int(port))
    body = json.dumps(
        {"prompt": prompt, "max_tokens": 240, "stream": True, "ignore_eos": True}
    ).encode()
    writer.write(
        b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
        + f"Content-Length: {len(body)}\r\n\r\n".encode()
        + body
    )
    events = 0
    while events < 2:
        line = await reader.readline()
        assert line, "the server closed the stream first"
        events += line.startswith(b"data: {")
    writer.close()
    await writer.wait_closed()


def test_concurrent_streams_finish_and_disconnects_free_every_block(
    server: Server, reference: dict[str, list[int]]
) -> None:
    async def run() -> list[list[int]]:
        client = openai.AsyncOpenAI(base_url=f"{server.url}/v1", api_key="none", max_retries=0)
        jobs = [_stream_text(client, PROMPT_IDS) for _ in range(64)]
        jobs += [_disconnect_mid_stream(server.url) for _ in range(16)]  # type: ignore[misc]
        several = [PROMPT_IDS, PROMPT_TEXT, [7, 8]]  # a hang-up aborts all three
        jobs += [_disconnect_mid_stream(server.url, several) for _ in range(4)]  # type: ignore[misc]
        results = await asyncio.gather(*jobs)
        await client.close()
        return results[:64]  # type: ignore[return-value]

    assert asyncio.run(run()) == [reference["ids"]] * 64
    # Each hang-up aborted its request: once the server holds none open, one more request
    # runs a step after the aborts and reports the pool empty.
    wait_for_metric(server.url, "pagedserve:open_requests", 0)
    assert post(f"{server.url}/v1/completions", {"prompt": [5, 6], "max_tokens": 2})[0] == 200
    m = metrics(server.url)
    assert m["vllm:kv_cache_usage_perc"] == 0.0 and m["vllm:num_requests_running"] == 0


def test_metrics_parse_and_move(server: Server, client: openai.OpenAI) -> None:
    before = metrics(server.url)
    for _ in range(2):  # the second finds the first's prompt cached
        client.completions.create(model=MODEL_NAME, prompt=[9] * 40, max_tokens=3, temperature=0)
    after = metrics(server.url)
    moved = {
        "vllm:prompt_tokens_total": 80,
        "vllm:generation_tokens_total": 6,
        "vllm:request_success_total{finished_reason=length}": 2,
        "vllm:time_to_first_token_seconds_count": 2,
        "vllm:inter_token_latency_seconds_count": 4,
        "vllm:e2e_request_latency_seconds_count": 2,
        "vllm:request_prompt_tokens_count": 2,
        "vllm:request_generation_tokens_sum": 6,
        "vllm:prefix_cache_queries_total": 80,
        "vllm:request_queue_time_seconds_count": 2,
        "vllm:request_prefill_time_seconds_count": 2,
        "vllm:request_decode_time_seconds_count": 2,
        "vllm:request_inference_time_seconds_count": 2,
        "vllm:request_time_per_output_token_seconds_count": 2,
        "vllm:request_max_num_generation_tokens_sum": 6,
        "vllm:request_params_n_sum": 2,
        "vllm:request_params_max_tokens_sum": 6,
        "vllm:prompt_tokens_cached_total": 32,  # the second's two full blocks
    }
    for name, delta in moved.items():
        assert after[name] - before.get(name, 0) == delta, name
    assert after["vllm:prefix_cache_hits_total"] - before["vllm:prefix_cache_hits_total"] >= 32

    def spent(name: str) -> float:
        return after[f"{name}_sum"] - before.get(f"{name}_sum", 0)

    # The engine's share of each request's time: queue + inference = the whole.
    queue, inference = (
        spent("vllm:request_queue_time_seconds"),
        spent("vllm:request_inference_time_seconds"),
    )
    assert 0 <= queue <= spent("vllm:e2e_request_latency_seconds")
    assert queue + inference == pytest.approx(spent("vllm:e2e_request_latency_seconds"))
    for name in ("vllm:num_preemptions_total", "vllm:num_requests_waiting"):
        assert name in after


def test_health_and_reset_prefix_cache(server: Server) -> None:
    with urllib.request.urlopen(f"{server.url}/health", timeout=60) as r:
        assert r.status == 200
    body = {"prompt": [8] * 40, "max_tokens": 1}
    post(f"{server.url}/v1/completions", body)
    assert post(f"{server.url}/reset_prefix_cache", b"")[0] == 200
    status, answer = post(f"{server.url}/v1/completions", body)
    assert status == 200 and answer["usage"]["prompt_tokens_details"]["cached_tokens"] == 0


def test_an_api_key_guards_every_route_but_the_probes_and_stats_are_logged(
    builtin_server: Callable[..., Server],
) -> None:
    server = builtin_server("--api-key", "s3cret", "--log-stats-interval", "0.2")
    good = openai.OpenAI(base_url=f"{server.url}/v1", api_key="s3cret", max_retries=0)
    bad = openai.OpenAI(base_url=f"{server.url}/v1", api_key="guess", max_retries=0)
    args = dict(prompt=[5, 6, 7], max_tokens=3, temperature=0, extra_body={"ignore_eos": True})
    with pytest.raises(openai.AuthenticationError) as refused:
        bad.completions.create(model="pagedserve-builtin", **args)  # type: ignore[call-overload]
    assert refused.value.code == "invalid_api_key" and refused.value.status_code == 401
    chunks = list(good.completions.create(model="pagedserve-builtin", stream=True, **args))  # type: ignore
    assert chunks[-1].choices[0].finish_reason == "length"
    for path in ("/v1/completions", "/tokenize", "/reset_prefix_cache"):
        status, answer = post(server.url + path, {"prompt": "x"})
        assert status == 401 and answer["error"]["code"] == "invalid_api_key", path
    for path in ("/health", "/metrics", "/version"):
        with urllib.request.urlopen(server.url + path, timeout=60) as r:
            assert r.status == 200, path
    # vLLM's periodic line, at the default log level: the interval that held the stream's
    # tokens reports them (waited for, not timed).
    line = server.watch.wait_for(r"pagedserve.stats: Avg prompt throughput: .*").group(0)
    assert "Running:" in line and "KV cache usage:" in line
    server.watch.wait_for(r"Avg generation throughput: [1-9]")


TLS = (
    Path(__file__).resolve().parents[2] / "data"
)  # a self-signed certificate for 127.0.0.1, to 2126


def _fetch(url: str, method: str = "GET", **headers: str) -> tuple[int, dict[str, str]]:
    """Status and headers of a request over TLS, trusting only the test certificate."""
    context = ssl.create_default_context(cafile=str(TLS / "tls_cert.pem"))
    request = urllib.request.Request(url, method=method, headers=headers)
    try:
        with urllib.request.urlopen(request, timeout=60, context=context) as r:
            return r.status, {k.lower(): v for k, v in r.headers.items()}
    except urllib.error.HTTPError as e:
        return e.code, {k.lower(): v for k, v in e.headers.items()}


def test_https_cors_and_a_root_path(builtin_server: Callable[..., Server]) -> None:
    """Served over TLS behind a path prefix, with CORS for one origin and an API key: the
    probes stay open, a browser's preflight needs no key, other origins get no CORS."""
    ui = "http://ui.example"
    server = builtin_server(
        *("--ssl-keyfile", str(TLS / "tls_key.pem"), "--ssl-certfile", str(TLS / "tls_cert.pem")),
        *("--allowed-origins", f'["{ui}"]', "--api-key", "secret", "--root-path", "/api"),
        *("--served-model-name", "main", "alias"),
    )
    assert server.url.startswith("https://127.0.0.1:")
    assert _fetch(f"{server.url}/health")[0] == 200
    assert _fetch(f"{server.url}/ping")[0] == _fetch(f"{server.url}/ping", "POST")[0] == 200
    status, headers = _fetch(
        f"{server.url}/v1/models",
        "OPTIONS",
        Origin=ui,
        **{
            "Access-Control-Request-Method": "GET",
            "Access-Control-Request-Headers": "authorization",
        },
    )
    assert status == 200 and headers["access-control-allow-origin"] == ui
    status, headers = _fetch(f"{server.url}/v1/models", Origin=ui, Authorization="Bearer secret")
    assert status == 200 and headers["access-control-allow-origin"] == ui
    status, headers = _fetch(f"{server.url}/v1/models", Origin="http://evil.example")
    assert status == 401 and "access-control-allow-origin" not in headers
    import httpx2

    http = httpx2.Client(verify=ssl.create_default_context(cafile=str(TLS / "tls_cert.pem")))
    client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="secret", http_client=http)
    # Two names: both listed and served, answers carry the first.
    assert [m.id for m in client.models.list()] == ["main", "alias"]
    assert client.models.retrieve("alias").id == "alias"
    answer = client.completions.create(model="alias", prompt="x", max_tokens=1)
    assert answer.model == "main"
    with pytest.raises(openai.NotFoundError, match="'main' or 'alias'"):
        client.completions.create(model="other", prompt="x", max_tokens=1)


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (("--ssl-keyfile", str(TLS / "tls_key.pem")), "go together"),
        (("--ssl-keyfile", "/nope", "--ssl-certfile", "/nope"), "no such file"),
        (
            (
                "--ssl-keyfile",
                str(TLS / "tls_cert.pem"),
                "--ssl-certfile",
                str(TLS / "tls_cert.pem"),
            ),
            "--ssl-certfile / --ssl-keyfile",
        ),
        (("--ssl-cert-reqs", "2"), "need --ssl-keyfile"),
        (("--allowed-origins", "[1]"), "JSON list"),
    ],
)
def test_bad_tls_and_cors_flags_stop_before_the_engine_starts(
    flags: tuple[str, ...], message: str
) -> None:
    done = subprocess.run(
        [sys.executable, "-m", "launch.cli", "serve", "--port", "0", *flags],
        env=ENV,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 2 and message in done.stderr, done.stderr


def _sse_stream(url: str, body: dict) -> subprocess.Popen[bytes]:
    """A long streaming request from another process (curl-like), so the test can act
    while it runs; its stdout is the raw event stream."""
    code = (
        "import sys, urllib.request\n"
        f"r = urllib.request.Request({url + '/v1/completions'!r}, {json.dumps(body).encode()!r},"
        " {'Content-Type': 'application/json'})\n"
        "with urllib.request.urlopen(r, timeout=600) as f:\n"
        "    for line in f:\n"
        "        sys.stdout.buffer.write(line); sys.stdout.flush()\n"
    )
    return subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE)


def _first_event(stream: subprocess.Popen[bytes]) -> None:
    assert stream.stdout is not None
    while not stream.stdout.readline().startswith(b"data: {"):
        pass


def test_back_pressure_then_a_killed_worker_ends_streams_and_the_server(
    builtin_server: Callable[..., Server],
) -> None:
    # One request runs at a time; one more may wait; a third is refused with 503.
    server = builtin_server("--max-num-seqs", "1", "--max-waiting-requests", "1")
    children = children_of(server.proc.pid)
    long = {"prompt": [1, 2, 3], "max_tokens": 4000, "ignore_eos": True, "stream": True}
    running = _sse_stream(server.url, long)
    _first_event(running)
    waiting = _sse_stream(server.url, long)
    wait_for_metric(server.url, "vllm:num_requests_waiting", 1)
    status, answer = post(f"{server.url}/v1/completions", {"prompt": "x", "max_tokens": 1})
    assert status == 503 and "--max-waiting-requests 1" in answer["error"]["message"]
    (worker,) = [p for p in children if b"worker.main" in Path(f"/proc/{p}/cmdline").read_bytes()]
    os.kill(worker, signal.SIGKILL)
    for stream in (running, waiting):
        out, _ = stream.communicate(timeout=300)
        events = [line for line in out.splitlines() if line.startswith(b"data: ")]
        assert events[-1] == b"data: [DONE]"
        error = json.loads(events[-2].removeprefix(b"data: "))["error"]
        assert "worker rank 0" in error["message"], error
    assert server.proc.wait(timeout=60) == 1
    stderr = server.watch.join()
    assert "worker rank 0" in stderr and "Traceback" not in stderr, stderr
    nothing_left(server, children)


def _leave_a_plain_request(url: str) -> None:
    """Send a long request that is not streamed; hang up once the server has it open."""
    host, port = url.removeprefix("http://").split(":")
    body = json.dumps({"prompt": "b", "max_tokens": 4000, "ignore_eos": True})
    with socket.create_connection((host, int(port))) as conn:
        conn.sendall(
            f"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            f"Content-Length: {len(body)}\r\n\r\n{body}".encode()
        )
        wait_for_metric(url, "pagedserve:open_requests", 2)


def test_sigterm_ends_open_streams_and_stops_everything(
    builtin_server: Callable[..., Server],
) -> None:
    server = builtin_server()
    children = children_of(server.proc.pid)
    stream = _sse_stream(
        server.url, {"prompt": "a", "max_tokens": 4000, "ignore_eos": True, "stream": True}
    )
    _first_event(stream)
    # A client that leaves a plain (not streamed) request aborts it too: only the
    # stream stays open (the request would otherwise run its 4000 tokens).
    _leave_a_plain_request(server.url)
    wait_for_metric(server.url, "pagedserve:open_requests", 1)
    server.proc.send_signal(signal.SIGTERM)
    out, _ = stream.communicate(timeout=300)
    events = [line for line in out.splitlines() if line]
    assert events[-1] == b"data: [DONE]"  # the stream was ended, not cut
    assert b"the server is stopping" in events[-2]
    assert server.proc.wait(timeout=60) == 0
    assert "Traceback" not in server.watch.join()
    nothing_left(server, children)


def test_a_shutdown_timeout_lets_open_streams_finish(
    builtin_server: Callable[..., Server],
) -> None:
    """With --shutdown-timeout, SIGTERM stops taking requests (503, /health 503) while
    the open stream runs to its end; then the server exits 0 and leaves nothing."""
    server = builtin_server("--shutdown-timeout", "600")
    children = children_of(server.proc.pid)
    # Long enough (seconds) to be open while the test sees the server drain.
    stream = _sse_stream(
        server.url, {"prompt": "a", "max_tokens": 2000, "ignore_eos": True, "stream": True}
    )
    _first_event(stream)
    server.proc.send_signal(signal.SIGTERM)
    deadline = time.monotonic() + 300
    while (status := _status(f"{server.url}/health")) == 200:
        assert time.monotonic() < deadline, "never started draining"
        time.sleep(0.05)
    assert status == 503
    status, answer = post(f"{server.url}/v1/completions", {"prompt": "b", "max_tokens": 2})
    assert status == 503 and answer["error"]["code"] == "server_shutting_down", answer
    out, _ = stream.communicate(timeout=600)
    events = [line for line in out.splitlines() if line]
    assert events[-1] == b"data: [DONE]"
    last = json.loads(events[-2].removeprefix(b"data: "))
    assert last["choices"][0]["finish_reason"] == "length", last  # ran to its end
    assert server.proc.wait(timeout=60) == 0
    assert "Traceback" not in server.watch.join()
    nothing_left(server, children)


def _status(url: str) -> int:
    try:
        with urllib.request.urlopen(url, timeout=60) as r:
            return r.status
    except urllib.error.HTTPError as e:
        return e.code
