"""Connections the server keeps open, and for how long, so that slow or idle clients
cannot take the sockets and descriptors /health and everyone else need.

uvicorn closes an idle keep-alive connection (--timeout-keep-alive) and caps a request head
with h11, but it waits forever for a head or body sent a byte at a time, and its
limit_concurrency is checked only once a head is complete. The protocol class here adds:
- a request head must arrive whole within --timeout-request-head seconds of the
  connection (or of the previous response), and be at most MAX_HEAD_BYTES;
- a request body must not pause for --timeout-request-body seconds;
- at most --max-connections are open (fewer when the descriptor limit is lower): one
  more closes the connection that has waited longest for a request head (a slow or idle
  client's), or, when every one is busy with a request, itself.
"""

from __future__ import annotations

import asyncio
import resource
from dataclasses import dataclass
from typing import Any

from uvicorn.protocols.http.auto import AutoHTTPProtocol

# A request head's size at most (uvicorn's h11 default is 16 KiB; browsers send < 8 KiB).
MAX_HEAD_BYTES = 64 * 1024
# Descriptors the server needs besides its connections (engine sockets, files, the loop).
RESERVED_FDS = 64

_HEAD_TOO_LARGE = (
    b"HTTP/1.1 431 Request Header Fields Too Large\r\n"
    b"content-type: text/plain\r\ncontent-length: 23\r\nconnection: close\r\n\r\n"
    b"request head too large\n"
)


@dataclass(frozen=True)
class ConnectionLimits:
    max_connections: int = 1000
    head_timeout_s: float = 10.0
    body_timeout_s: float = 30.0


def connection_cap(wanted: int) -> int:
    """wanted, or fewer so that the process's descriptor limit leaves room for them all
    (an accept() that fails for want of a descriptor would stall every client)."""
    soft, _hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft == resource.RLIM_INFINITY:
        return wanted
    return max(1, min(wanted, soft - RESERVED_FDS))


class _Registry:
    """The server's open connections, and those between requests in the order they
    started waiting (a dict keeps insertion order; entries may be stale and are skipped)."""

    def __init__(self, limits: ConnectionLimits) -> None:
        self.limits = limits
        self.cap = connection_cap(limits.max_connections)
        self.open: set[Any] = set()
        self.waiting: dict[Any, None] = {}

    def make_room(self, newcomer: Any) -> None:
        """Over the cap: close the longest-waiting connection between requests, else the
        newcomer."""
        while self.waiting:
            oldest = next(iter(self.waiting))
            del self.waiting[oldest]
            if oldest is not newcomer and oldest.between_requests():
                oldest.close_now()
                return
        newcomer.close_now()


def guarded_protocol(limits: ConnectionLimits) -> type[asyncio.Protocol]:
    """uvicorn's HTTP protocol (httptools, else h11) under limits; one registry per server."""
    registry = _Registry(limits)
    head_s, body_s = limits.head_timeout_s, limits.body_timeout_s
    tick = min(head_s, body_s) / 4

    class GuardedHTTPProtocol(AutoHTTPProtocol):  # type: ignore[misc,valid-type]
        def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
            super().connection_made(transport)
            self._waiting_since = self._last_data = self.loop.time()
            self._head_bytes = 0
            registry.open.add(self)
            registry.waiting[self] = None
            self._timer = self.loop.call_later(tick, self._check)
            if len(registry.open) > registry.cap:
                registry.make_room(self)

        def connection_lost(self, exc: Exception | None) -> None:
            registry.open.discard(self)
            registry.waiting.pop(self, None)
            self._timer.cancel()
            super().connection_lost(exc)

        def data_received(self, data: bytes) -> None:
            self._last_data = self.loop.time()
            super().data_received(data)
            if self.between_requests() and not self.transport.is_closing():
                self._head_bytes += len(data)
                if self._head_bytes > MAX_HEAD_BYTES:
                    self.transport.write(_HEAD_TOO_LARGE)
                    self.close_now()

        def on_response_complete(self) -> None:
            super().on_response_complete()
            self._waiting_since = self.loop.time()
            self._head_bytes = 0
            registry.waiting.pop(self, None)
            registry.waiting[self] = None  # the newest to wait

        def between_requests(self) -> bool:
            """Waiting for (the rest of) a request head: none yet, or the last answered."""
            cycle = self.cycle
            return cycle is None or cycle.response_complete

        def close_now(self) -> None:
            registry.open.discard(self)
            registry.waiting.pop(self, None)
            if not self.transport.is_closing():
                self.transport.close()

        def _check(self) -> None:
            now = self.loop.time()
            if self.between_requests():
                if now - self._waiting_since >= head_s:
                    self.close_now()
                    return
            elif self.cycle.more_body and now - self._last_data >= body_s:
                self.close_now()  # the app's receive() then says the client went away
                return
            self._timer = self.loop.call_later(tick, self._check)

    return GuardedHTTPProtocol
