"""GET /openapi.json and GET /docs on a real server: every route the app registers is in
the document with its methods, each request body's schema comes from the Struct that
decodes it, and the page lists every route without fetching anything."""

from __future__ import annotations

import ast
import json
import urllib.request
from pathlib import Path
from typing import Any

import msgspec
import pytest

from launch.openai import api_server
from launch.openai.openapi import REQUEST_BODIES
from launch.openai.protocol import ChatCompletionRequest
from launch.openai.serving_tokens import TokensRequest
from tests.helpers.server import Server


def _get(url: str) -> tuple[str, bytes]:
    with urllib.request.urlopen(url, timeout=60) as r:
        return r.headers["content-type"], r.read()


@pytest.fixture(scope="module")
def document(server: Server) -> dict[str, Any]:
    kind, raw = _get(f"{server.url}/openapi.json")
    assert kind.startswith("application/json")
    return json.loads(raw)


def _registered_routes() -> set[tuple[str, str]]:
    """(method, path) of every Route(...) api_server.py registers, read from its source."""
    tree = ast.parse(Path(api_server.__file__).read_text())
    found = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Call) and getattr(node.func, "id", None) == "Route":
            path = node.args[0]
            assert isinstance(path, ast.Constant)
            (methods,) = [k.value for k in node.keywords if k.arg == "methods"]
            assert isinstance(methods, ast.List)
            for m in methods.elts:
                assert isinstance(m, ast.Constant)
                found.add((m.value.lower(), path.value.replace(":path}", "}")))
    return found


def test_every_registered_route_is_in_the_document(document: dict[str, Any]) -> None:
    registered = _registered_routes()
    assert len(registered) > 20
    listed = {(m, p) for p, ops in document["paths"].items() for m in ops}
    assert registered <= listed, registered - listed
    assert document["openapi"].startswith("3.") and document["info"]["title"] == "pagedserve"


def test_request_bodies_are_the_schemas_of_the_structs_that_decode_them(
    document: dict[str, Any],
) -> None:
    paths = document["paths"]
    for path in ("/v1/chat/completions", "/v1/completions", "/inference/v1/generate"):
        assert path in REQUEST_BODIES and "requestBody" in paths[path]["post"], path
    schemas = document["components"]["schemas"]
    (_, want) = msgspec.json.schema_components([ChatCompletionRequest, TokensRequest])
    chat = schemas["ChatCompletionRequest"]
    assert chat["required"] == want["ChatCompletionRequest"]["required"] == ["messages"]
    assert set(chat["properties"]) == set(want["ChatCompletionRequest"]["properties"])
    ref = paths["/inference/v1/generate"]["post"]["requestBody"]["content"]["application/json"]
    assert ref["schema"] == {"$ref": "#/components/schemas/TokensRequest"}
    assert schemas["TokensRequest"]["required"] == ["token_ids"]
    # Every reference resolves: the document is whole.
    text = json.dumps(document)
    for name in {r.split("/")[-1] for r in _refs(document)}:
        assert name in schemas, name
    assert '"$ref": "#/components/schemas/' in text


def _refs(value: Any) -> list[str]:
    if isinstance(value, dict):
        own = [value["$ref"]] if isinstance(value.get("$ref"), str) else []
        return own + [r for v in value.values() for r in _refs(v)]
    if isinstance(value, list):
        return [r for v in value for r in _refs(v)]
    return []


def test_path_parameters_are_declared(document: dict[str, Any]) -> None:
    cancel = document["paths"]["/v1/responses/{response_id}/cancel"]["post"]
    assert cancel["parameters"] == [
        {"name": "response_id", "in": "path", "required": True, "schema": {"type": "string"}}
    ]
    assert "/v1/models/{model}" in document["paths"]


def test_the_docs_page_lists_every_route_and_loads_nothing(
    server: Server, document: dict[str, Any]
) -> None:
    kind, raw = _get(f"{server.url}/docs")
    page = raw.decode()
    assert kind.startswith("text/html")
    for path, ops in document["paths"].items():
        for method in ops:
            assert f"{method.upper()} {path}" in page, path
    assert not any(tag in page for tag in ("<script", "<link", "src="))
