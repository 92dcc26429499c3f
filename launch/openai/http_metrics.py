"""HTTP traffic in the families vLLM's server exposes beside its own (those of
prometheus-fastapi-instrumentator's defaults), so its dashboards' request-rate and
latency panels read this server too.

| family | type | labels |
| --- | --- | --- |
| http_requests_total | counter | method, status ("2xx"...), handler |
| http_request_size_bytes | summary | handler (the request's Content-Length, else 0) |
| http_response_size_bytes | summary | handler (the response's Content-Length, else 0) |
| http_request_duration_highr_seconds | histogram | none: fine buckets for quantiles |
| http_request_duration_seconds | histogram | handler, method: three coarse buckets |

handler is the route's template ("/v1/responses/{response_id}"), or "none" for a path
no route knows, so a scan of random paths cannot grow the series without bound (nor
can made-up methods: they count as "other"). Probes
and scrapes are not counted, and a streamed answer's time runs to its last byte.
"""

from __future__ import annotations

import time
from collections.abc import Sequence

import prometheus_client as prom
from starlette.routing import BaseRoute, Match
from starlette.types import ASGIApp, Message, Receive, Scope, Send

# Paths left out, as vLLM leaves them out: a handler containing one is not counted.
EXCLUDED_HANDLERS = ("/metrics", "/health", "/load", "/ping", "/version", "/server_info")
HIGHR_BUCKETS = (
    0.01, 0.025, 0.05, 0.075, 0.1, 0.25, 0.5, 0.75, 1, 1.5, 2, 2.5, 3, 3.5, 4, 4.5, 5, 7.5,
    10, 30, 60,
)  # fmt: skip
LOWR_BUCKETS = (0.1, 0.5, 1)
# Any other method a client invents is counted as "other", so it cannot add series.
METHODS = frozenset({"GET", "HEAD", "POST", "PUT", "DELETE", "PATCH", "OPTIONS"})


class HTTPMetrics:
    def __init__(self, registry: prom.CollectorRegistry) -> None:
        r = registry
        self.requests = prom.Counter(
            "http_requests_total",
            "Requests by method, status class and handler.",
            ["method", "status", "handler"],
            registry=r,
        )
        self.request_size = prom.Summary(
            "http_request_size_bytes", "Requests' Content-Length.", ["handler"], registry=r
        )
        self.response_size = prom.Summary(
            "http_response_size_bytes", "Responses' Content-Length.", ["handler"], registry=r
        )
        self.duration_highr = prom.Histogram(
            "http_request_duration_highr_seconds",
            "Request latency, all handlers, fine buckets.",
            buckets=HIGHR_BUCKETS,
            registry=r,
        )
        self.duration = prom.Histogram(
            "http_request_duration_seconds",
            "Request latency by handler and method.",
            ["handler", "method"],
            buckets=LOWR_BUCKETS,
            registry=r,
        )

    def record(
        self, handler: str, method: str, status: int, sizes: tuple[int, int], seconds: float
    ) -> None:
        self.requests.labels(method, f"{str(status)[0]}xx", handler).inc()
        self.request_size.labels(handler).observe(sizes[0])
        self.response_size.labels(handler).observe(sizes[1])
        self.duration_highr.observe(seconds)
        self.duration.labels(handler, method).observe(seconds)


class HTTPMetricsMiddleware:
    """ASGI middleware recording each HTTP request into HTTPMetrics; routes name the
    handler (the app's own, matched as it will match them)."""

    def __init__(self, app: ASGIApp, metrics: HTTPMetrics, routes: Sequence[BaseRoute]) -> None:
        self.app = app
        self.metrics = metrics
        self.routes = routes

    def handler(self, scope: Scope) -> str:
        """The template of the route that takes this request (a route that matches the
        path but not the method counts, as it answers 405); "none" if no route does."""
        partial = None
        for route in self.routes:
            match, _ = route.matches(scope)
            if match == Match.FULL:
                return getattr(route, "path", "none")
            if match == Match.PARTIAL and partial is None:
                partial = getattr(route, "path", None)
        return partial or "none"

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        handler = self.handler(scope)
        if any(path in handler for path in EXCLUDED_HANDLERS):
            await self.app(scope, receive, send)
            return
        start = time.perf_counter()
        status, response_bytes = 500, 0  # an app that raises before answering

        async def send_counted(message: Message) -> None:
            nonlocal status, response_bytes
            if message["type"] == "http.response.start":
                status = message["status"]
                response_bytes = _content_length(message.get("headers", ()))
            await send(message)

        try:
            await self.app(scope, receive, send_counted)
        finally:
            sizes = (_content_length(scope.get("headers", ())), response_bytes)
            seconds = time.perf_counter() - start
            method = scope["method"] if scope["method"] in METHODS else "other"
            self.metrics.record(handler, method, status, sizes, seconds)


def _content_length(headers: Sequence[tuple[bytes, bytes]]) -> int:
    for name, value in headers:
        if name.lower() == b"content-length":
            # A header is the client's word: digits only, and no more than an int64 holds.
            return int(value) if value.isdigit() and len(value) < 19 else 0
    return 0
