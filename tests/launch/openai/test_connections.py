"""Slow and idle clients cannot take the server's connections: a request head or body sent
a byte at a time is cut off after its timeout, a head too large is 431, and past
--max-connections (or the descriptor limit) the connection waiting longest for a request
head is closed, so /health keeps answering under a slowloris of hundreds (a real server on
the built-in model)."""

from __future__ import annotations

import contextlib
import http.client
import resource
import select
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from launch.openai.connections import MAX_HEAD_BYTES, RESERVED_FDS
from tests.helpers.cli_helpers import ENV
from tests.helpers.server import Server, start_server

TIMEOUT_S = 2.0
HEALTH_BOUND_S = 2.0  # however loaded the machine; ms when idle


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    s = start_server(
        None,
        tmp_path_factory.mktemp("conns"),
        "--timeout-request-head",
        str(TIMEOUT_S),
        "--timeout-request-body",
        str(TIMEOUT_S),
    )
    yield s
    s.stop()


def _address(url: str) -> tuple[str, int]:
    host, port = url.split("//")[1].split(":")
    return host, int(port)


def _health(url: str) -> tuple[int, float]:
    began = time.monotonic()
    conn = http.client.HTTPConnection(*_address(url), timeout=30)
    try:
        conn.request("GET", "/health")
        return conn.getresponse().status, time.monotonic() - began
    except OSError:  # refused or reset: no answer
        return 0, time.monotonic() - began
    finally:
        conn.close()


def _closed(sock: socket.socket) -> bool:
    """Whether the server closed sock (it reads as ended, or was reset)."""
    if not select.select([sock], [], [], 0)[0]:
        return False
    try:
        data = sock.recv(65536)
    except OSError:
        return True
    assert data == b"", f"an unfinished head was answered: {data[:80]!r}"
    return True


def _slow_clients(url: str, n: int) -> list[socket.socket]:
    """n connections that each begin a request head, up to a header's value."""
    socks = []
    for _ in range(n):
        sock = socket.create_connection(_address(url), timeout=30)
        sock.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\nX-Slow: ")
        socks.append(sock)
    return socks


def _drip(socks: list[socket.socket]) -> None:
    """One more byte of each connection's head (a header value that never ends)."""
    for sock in socks:
        with contextlib.suppress(OSError):
            sock.send(b"a")


def test_slow_request_heads_are_closed_after_the_timeout_and_health_answers_meanwhile(
    server: Server,
) -> None:
    socks = _slow_clients(server.url, 50)
    began = time.monotonic()
    try:
        status, took = _health(server.url)
        assert status == 200 and took < HEALTH_BOUND_S
        deadline = began + 30
        while not all(_closed(s) for s in socks):
            assert time.monotonic() < deadline, "slow heads were never cut off"
            _drip(socks)  # keeps sending, so only the head timeout can end them
            time.sleep(0.2)
        assert time.monotonic() - began >= TIMEOUT_S * 0.9  # not before the timeout
    finally:
        for s in socks:
            s.close()
    assert _health(server.url)[0] == 200


def test_a_stalled_request_body_is_closed_after_the_timeout(server: Server) -> None:
    sock = socket.create_connection(_address(server.url), timeout=30)
    with sock:
        sock.sendall(
            b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            b"Content-Length: 100\r\n\r\n" + b'{"prompt": '
        )
        began = time.monotonic()
        sock.settimeout(30)
        with contextlib.suppress(ConnectionResetError):
            assert sock.recv(65536) == b""  # closed, unanswered
        assert TIMEOUT_S * 0.9 <= time.monotonic() - began < 30
    assert _health(server.url)[0] == 200


def test_a_request_head_too_large_is_431(server: Server) -> None:
    sock = socket.create_connection(_address(server.url), timeout=30)
    with sock:
        line = b"X-Filler: " + b"a" * 1000 + b"\r\n"
        head = b"GET /health HTTP/1.1\r\nHost: x\r\n" + line * (MAX_HEAD_BYTES // len(line) + 2)
        with contextlib.suppress(OSError):
            sock.sendall(head)
        answer = sock.recv(65536)
    assert answer.startswith(b"HTTP/1.1 431 ")


@contextlib.contextmanager
def _fd_limit(n: int) -> Iterator[None]:
    """Children started inside inherit a soft descriptor limit of n."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (n, hard))
    try:
        yield
    finally:
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))


def test_health_answers_under_300_slowloris_connections_with_256_descriptors(
    tmp_path: Path,
) -> None:
    # Timeouts long enough that only the connection cap can keep the server answering.
    with _fd_limit(256):
        server = start_server(None, tmp_path, "--timeout-request-head", "120")
    socks: list[socket.socket] = []
    try:
        socks = _slow_clients(server.url, 300)
        answers = []
        for _ in range(10):
            _drip(socks)
            answers.append(_health(server.url))
            time.sleep(0.1)
        worst = max(took for _, took in answers)
        print(f"/health under 300 slow connections, 256 fds: slowest {worst * 1000:.0f} ms")
        assert all(status == 200 for status, _ in answers)
        assert worst < HEALTH_BOUND_S
        closed = [i for i, s in enumerate(socks) if _closed(s)]
        # The server holds at most 256 - RESERVED_FDS; it closed the oldest of the rest.
        assert len(closed) >= 300 - (256 - RESERVED_FDS)
        assert closed == list(range(len(closed)))
    finally:
        for s in socks:
            s.close()
        server.stop()


@pytest.mark.parametrize(
    "flag",
    [
        "--max-connections=0",
        "--timeout-request-head=0",
        "--timeout-request-body=inf",
        "--timeout-keep-alive=nan",
        "--max-request-body-bytes=0",
        "--max-request-body-bytes=32M",
    ],
)
def test_bad_limits_are_refused_before_the_engine_starts(flag: str) -> None:
    proc = subprocess.run(
        [sys.executable, "-m", "launch.cli", "serve", "--port", "0", flag],
        capture_output=True,
        text=True,
        env=ENV,
        timeout=120,
        check=False,
    )
    assert proc.returncode == 2
    assert flag.split("=")[0] in proc.stderr
