"""A request of any size is prepared off the event loop, so /health keeps answering; a
body over --max-request-body-bytes is 413 and JSON nested too deep is 400, each with an
OpenAI-style message, whatever the body (a real server on the built-in model)."""

from __future__ import annotations

import http.client
import json
import socket
import threading
import time
from collections.abc import Iterator

import pytest

from launch.openai.body_limits import DEFAULT_MAX_BODY_BYTES
from launch.openai.json_shape import MAX_JSON_DEPTH, MAX_JSON_VALUES, json_shape_error
from tests.helpers.server import Server, post, start_server

# Each message on a line of its own, so a conversation's tokens grow with its turns; with
# chat_template_kwargs {"spin": n}, an idle loop of n * n steps first (a slow template).
TEMPLATE = (
    "{% for i in range(spin|default(0)) %}{% for j in range(spin) %}{% endfor %}{% endfor %}"
    "{% for m in messages %}{{ m.role }}: {{ m.content }}\n{% endfor %}"
)
# However loaded the machine, /health is answered within this (it takes ms when idle).
HEALTH_BOUND_S = 2.0


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    s = start_server(None, tmp_path_factory.mktemp("limits"), "--chat-template", TEMPLATE)
    yield s
    s.stop()


class HealthPoll:
    """GET /health on a fresh connection, again and again, while the block runs: every
    answer's status and seconds."""

    def __init__(self, url: str) -> None:
        self.host, port = url.split("//")[1].split(":")
        self.port = int(port)
        self.answers: list[tuple[int, float]] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._poll, daemon=True)

    def _poll(self) -> None:
        while not self._stop.is_set():
            began = time.monotonic()
            conn = http.client.HTTPConnection(self.host, self.port, timeout=60)
            try:
                conn.request("GET", "/health")
                status = conn.getresponse().status
            except OSError:
                status = 0
            finally:
                conn.close()
            self.answers.append((status, time.monotonic() - began))
            self._stop.wait(0.02)

    def __enter__(self) -> HealthPoll:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()

    def check(self, what: str) -> None:
        assert self.answers, "no /health answer at all"
        worst = max(s for _, s in self.answers)
        print(f"/health while {what}: {len(self.answers)} answers, slowest {worst * 1000:.0f} ms")
        assert all(status == 200 for status, _ in self.answers)
        assert worst < HEALTH_BOUND_S


def test_truncating_10000_responses_items_is_quick_and_health_keeps_answering(
    server: Server,
) -> None:
    items = [
        {"role": "user" if i % 2 == 0 else "assistant", "content": f"turn {i} " * 5}
        for i in range(10_000)
    ]
    body = {"input": items, "truncation": "auto", "max_output_tokens": 2, "store": False}
    with HealthPoll(server.url) as health:
        began = time.monotonic()
        status, answer = post(f"{server.url}/v1/responses", body)
        took = time.monotonic() - began
    print(f"10,000 items truncated in {took:.2f} s")
    assert status == 200, answer
    # The built-in model's 4096 positions hold only the newest turns.
    assert 0 < answer["usage"]["input_tokens"] <= 4096 - 2
    assert took < 60  # one render per dropped turn took minutes
    health.check("10,000 items are truncated")


def test_a_slow_chat_template_renders_while_health_keeps_answering(server: Server) -> None:
    # 81 million template steps: seconds on any machine, all of them on the event loop
    # if rendering ran there.
    body = {
        "messages": [{"role": "user", "content": "hi"}],
        "max_tokens": 1,
        "chat_template_kwargs": {"spin": 9000},
    }
    with HealthPoll(server.url) as health:
        began = time.monotonic()
        status, answer = post(f"{server.url}/v1/chat/completions", body)
        took = time.monotonic() - began
    assert status == 200, answer
    assert took > HEALTH_BOUND_S  # else this proves nothing
    health.check(f"a chat template renders for {took:.1f} s")


def test_a_32_mib_body_is_read_and_refused_while_health_keeps_answering(server: Server) -> None:
    body = json.dumps({"prompt": "x" * (DEFAULT_MAX_BODY_BYTES - 64), "max_tokens": 2})
    assert len(body) <= DEFAULT_MAX_BODY_BYTES
    with HealthPoll(server.url) as health:
        status, answer = post(f"{server.url}/v1/completions", body.encode())
    assert status == 400
    assert answer["error"]["message"].startswith(
        f"the prompt has {DEFAULT_MAX_BODY_BYTES - 64 + 1} tokens"  # and its BOS
    )
    health.check("a 32 MiB body is prepared")


def _answer(sock: socket.socket) -> tuple[int, dict]:
    """The HTTP answer on sock: its status and JSON body."""
    sock.settimeout(60)
    data = b""
    while chunk := sock.recv(65536):
        data += chunk
    head, _, body = data.partition(b"\r\n\r\n")
    return int(head.split()[1]), json.loads(body)


def _head(url: str, extra: str) -> tuple[socket.socket, bytes]:
    host, port = url.split("//")[1].split(":")
    sock = socket.create_connection((host, int(port)), timeout=60)
    head = "POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
    return sock, (head + extra + "\r\n").encode()


def _too_large(status: int, answer: dict) -> None:
    assert status == 413
    error = answer["error"]
    assert error["code"] == "request_too_large"
    assert f"larger than {DEFAULT_MAX_BODY_BYTES} bytes" in error["message"]
    assert "--max-request-body-bytes" in error["message"]


def test_a_declared_content_length_over_the_limit_is_413_before_any_body(server: Server) -> None:
    sock, head = _head(server.url, f"Content-Length: {DEFAULT_MAX_BODY_BYTES + 1}\r\n")
    with sock:
        sock.sendall(head)  # not a byte of the body
        _too_large(*_answer(sock))


def test_a_chunked_body_is_413_once_it_passes_the_limit(server: Server) -> None:
    sock, head = _head(server.url, "Transfer-Encoding: chunked\r\n")
    opening, piece = b'{"prompt": "', b"x" * (1 << 20)
    chunk = b"%x\r\n%s\r\n" % (len(piece), piece)
    with sock:
        sock.sendall(head + b"%x\r\n%s\r\n" % (len(opening), opening))
        try:  # until the server answers and closes the connection
            for _ in range(DEFAULT_MAX_BODY_BYTES // len(piece) + 8):
                sock.sendall(chunk)
        except OSError:
            pass
        _too_large(*_answer(sock))


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions", "/v1/responses"])
def test_json_nested_100000_deep_is_400(server: Server, path: str) -> None:
    deep = b"[" * 100_000 + b"]" * 100_000
    status, answer = post(f"{server.url}{path}", b'{"model": "x", "prompt": ' + deep + b"}")
    assert status == 400
    error = answer["error"]
    assert error["code"] == "invalid_json"
    assert f"more than {MAX_JSON_DEPTH} levels deep" in error["message"]
    status, _ = post(f"{server.url}/v1/completions", {"prompt": [1, 2], "max_tokens": 1})
    assert status == 200  # and the server serves on


@pytest.mark.parametrize("depth", [MAX_JSON_DEPTH, MAX_JSON_DEPTH + 1])
def test_nesting_is_judged_at_the_limit(server: Server, depth: int) -> None:
    # The body's object, chat_template_kwargs' object, then arrays (the template ignores it).
    nested = "[" * (depth - 2) + "]" * (depth - 2)
    raw = (
        '{"messages": [{"role": "user", "content": "hi"}], "max_tokens": 1, '
        f'"chat_template_kwargs": {{"unused": {nested}}}}}'
    )
    status, answer = post(f"{server.url}/v1/chat/completions", raw.encode())
    assert status == (200 if depth <= MAX_JSON_DEPTH else 400), answer


def test_a_body_of_millions_of_values_is_400_while_health_keeps_answering(
    server: Server,
) -> None:
    """The decoder holds the GIL for the whole body: millions of token ids would stall every
    connection for as long, so they are refused before decoding."""
    raw = json.dumps({"prompt": [7] * (MAX_JSON_VALUES + 1), "max_tokens": 1}).encode()
    with HealthPoll(server.url) as health:
        status, answer = post(f"{server.url}/v1/completions", raw)
    assert status == 400
    assert answer["error"]["code"] == "invalid_json"
    assert f"more than {MAX_JSON_VALUES} array items" in answer["error"]["message"]
    health.check("a body of a million values is refused")


@pytest.mark.parametrize(
    ("raw", "error"),
    [
        (b'{"a": [1, 2, 3]}', None),  # 4 values: the object's member, 3 items
        (b'{"a": [1, 2, 3, 4]}', "items"),
        (b'{"a": "1,2,3,4,5,6"}', None),  # commas in a string are text
        (b'{"a": "\\\\", "b": [1, 2, 3, 4]}', "items"),  # an escaped backslash ends no string
        (b'{"a": "\\", [1, 2, 3, 4]"}', None),  # an escaped quote does not end it
        (b'{"a": [[[[1]]]]}', "levels"),
    ],
)
def test_values_and_depth_are_counted_outside_strings(raw: bytes, error: str | None) -> None:
    json.loads(raw)  # each case is valid JSON
    found = json_shape_error(raw, max_depth=4, max_values=4)
    assert (found is None) if error is None else (error in (found or "")), found


def test_the_server_prepares_off_the_event_loop_for_every_family(server: Server) -> None:
    """Each endpoint family still answers through the preparing threads."""
    url = server.url
    assert post(f"{url}/tokenize", {"prompt": "ab"})[1]["tokens"] == [256, 97, 98]
    assert post(f"{url}/detokenize", {"tokens": [97, 98]})[1]["prompt"] == "ab"
    chat = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 1}
    assert post(f"{url}/v1/chat/completions", chat)[0] == 200
    assert post(f"{url}/v1/embeddings", {"input": "ab"})[0] == 200
    status, answer = post(f"{url}/v1/completions", {"prompt": "ab", "max_tokens": 1, "echo": True})
    assert status == 200 and answer["choices"][0]["text"].startswith("ab")
