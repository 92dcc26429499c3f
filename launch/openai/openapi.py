"""GET /openapi.json and GET /docs: an OpenAPI 3.1 document of every route the app
serves, read from the app's own route table (path, methods, the handler's first
docstring line), with each request body's JSON Schema generated from the msgspec Struct
that decodes it, so the document cannot drift from the code; and a plain HTML page of it
that needs nothing from the network."""

from __future__ import annotations

import html
import json
import re
from collections.abc import Iterable, Iterator, Mapping
from typing import Any

import msgspec
from starlette.routing import BaseRoute, Mount, Route

from launch.openai.anthropic_protocol import CountTokensRequest, MessagesRequest
from launch.openai.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    EmbeddingRequest,
    TokenizeRequest,
)
from launch.openai.responses_protocol import ResponsesRequest
from launch.openai.serving_tokens import TokensRequest

OPENAPI_VERSION = "3.1.0"
_REF = "#/components/schemas/{name}"


class ErrorDetail(msgspec.Struct):
    message: str
    type: str
    param: str | None
    code: str | None


class ErrorResponse(msgspec.Struct):
    """Every error's body (OpenAI's shape)."""

    error: ErrorDetail


# The body each POST route decodes (the Struct its handler passes to decode_body).
REQUEST_BODIES: dict[str, type] = {
    "/v1/completions": CompletionRequest,
    "/v1/completions/render": CompletionRequest,
    "/v1/chat/completions": ChatCompletionRequest,
    "/v1/chat/completions/render": ChatCompletionRequest,
    "/v1/embeddings": EmbeddingRequest,
    "/v1/responses": ResponsesRequest,
    "/tokenize": TokenizeRequest,
    "/detokenize": DetokenizeRequest,
    "/inference/v1/generate": TokensRequest,
    "/v1/messages": MessagesRequest,
    "/v1/messages/count_tokens": CountTokensRequest,
}

_PARAM = re.compile(r"\{(\w+)(?::\w+)?\}")


def openapi_document(
    routes: Iterable[BaseRoute],
    title: str,
    version: str,
    bodies: Mapping[str, type] = REQUEST_BODIES,
    root_path: str = "",
) -> dict[str, Any]:
    """The OpenAPI document of these routes; bodies: each POST path's request Struct."""
    flat = list(_flat(routes, ""))
    used = list(dict.fromkeys(bodies[p] for p, _r in flat if p in bodies))
    refs, components = msgspec.json.schema_components([*used, ErrorResponse], ref_template=_REF)
    ref_of = dict(zip([*used, ErrorResponse], refs))
    paths: dict[str, dict[str, Any]] = {}
    for full, route in flat:
        path = _PARAM.sub(r"{\1}", full)
        for method in sorted((route.methods or set()) - {"HEAD"}):
            op = _operation(full, route, method, ref_of[ErrorResponse])
            body = bodies.get(full) if method == "POST" else None
            if body is not None:
                op["requestBody"] = {
                    "required": True,
                    "content": {"application/json": {"schema": ref_of[body]}},
                }
            paths.setdefault(path, {})[method.lower()] = op
    doc: dict[str, Any] = {
        "openapi": OPENAPI_VERSION,
        "info": {"title": title, "version": version},
        "paths": paths,
        "components": {"schemas": components},
    }
    if root_path:
        doc["servers"] = [{"url": root_path}]
    return doc


def _flat(routes: Iterable[BaseRoute], prefix: str) -> Iterator[tuple[str, Route]]:
    """Every Route with its full path, those under a Mount too."""
    for route in routes:
        if isinstance(route, Route):
            yield prefix + route.path, route
        elif isinstance(route, Mount):
            yield from _flat(route.routes, prefix + route.path)


def _operation(path: str, route: Route, method: str, error_ref: dict[str, Any]) -> dict[str, Any]:
    doc = (route.endpoint.__doc__ or "").strip()
    summary = doc.splitlines()[0] if doc else f"{method} {path}"
    slug = re.sub(r"\W+", "_", _PARAM.sub(r"\1", path)).strip("_") or "root"
    op: dict[str, Any] = {
        "operationId": f"{method.lower()}_{slug}",
        "summary": summary,
        "responses": {
            "200": {"description": "Success"},
            "default": {
                "description": "Error",
                "content": {"application/json": {"schema": error_ref}},
            },
        },
    }
    params = [
        {"name": name, "in": "path", "required": True, "schema": {"type": "string"}}
        for name in route.param_convertors
    ]
    if params:
        op["parameters"] = params
    return op


def docs_page(doc: dict[str, Any]) -> str:
    """A readable HTML page of the document: each route, what it does, its body's
    schema (no scripts, nothing fetched)."""
    info = doc["info"]
    title = html.escape(f"{info['title']} {info['version']}")
    rows = []
    for path, ops in doc["paths"].items():
        for method, op in ops.items():
            row = (
                f"<h3><code>{method.upper()} {html.escape(path)}</code></h3>"
                f"<p>{html.escape(op['summary'])}</p>"
            )
            body = op.get("requestBody")
            if body is not None:
                ref = body["content"]["application/json"]["schema"]["$ref"]
                name = ref.rsplit("/", 1)[1]
                schema = json.dumps(doc["components"]["schemas"][name], indent=2)
                row += (
                    f"<details><summary>body: {html.escape(name)}</summary>"
                    f"<pre>{html.escape(schema)}</pre></details>"
                )
            rows.append(row)
    return (
        "<!doctype html><html><head><meta charset='utf-8'>"
        f"<title>{title}</title></head><body><h1>{title}</h1>"
        "<p>The machine-readable document: <a href='openapi.json'>openapi.json</a></p>"
        + "".join(rows)
        + "</body></html>"
    )
