"""GET /v1/models as vLLM answers it (root, parent, permission, a real created), parsed by
the `openai` client's own types, and GET /load: the requests in flight."""

from __future__ import annotations

import json
import time
import urllib.request
from pathlib import Path
from typing import Any

import openai
from openai.types import Model

from tests.helpers.server import MODEL_NAME, PROMPT_IDS, Server, post


def _get(url: str) -> Any:
    with urllib.request.urlopen(url, timeout=60) as r:
        return json.loads(r.read())


def test_model_cards_carry_vllms_fields_and_parse_as_openai_models(
    server: Server, client: openai.OpenAI, chat_model: Path
) -> None:
    now = time.time()
    (card,) = _get(f"{server.url}/v1/models")["data"]
    Model.model_validate(card, strict=True)
    assert card["id"] == MODEL_NAME and card["root"] == str(chat_model)
    assert card["parent"] is None
    # When the server started: not 0, not each request's own time.
    assert now - 600 < card["created"] <= now
    (perm,) = card["permission"]
    assert perm["object"] == "model_permission" and perm["allow_sampling"] is True
    assert perm["created"] == card["created"]
    assert _get(f"{server.url}/v1/models/{MODEL_NAME}") == card
    listed = client.models.list().data
    assert [m.id for m in listed] == [MODEL_NAME] and listed[0].created == card["created"]


def test_load_counts_the_requests_in_flight(server: Server) -> None:
    assert _get(f"{server.url}/load") == {"server_load": 0}
    context = post(f"{server.url}/tokenize", {"prompt": "x"})[1]["max_model_len"]
    body = {
        "prompt": PROMPT_IDS,
        "max_tokens": context - len(PROMPT_IDS),
        "ignore_eos": True,
        "n": 2,
        "stream": True,
    }
    request = urllib.request.Request(
        f"{server.url}/v1/completions",
        json.dumps(body).encode(),
        {"Content-Type": "application/json"},
    )
    with urllib.request.urlopen(request, timeout=60) as stream:
        assert stream.readline().startswith(b"data: ")  # generating now
        assert _get(f"{server.url}/load") == {"server_load": 2}  # both copies
    # The client went away: its request is aborted, and the load falls back.
    deadline = time.monotonic() + 60
    while _get(f"{server.url}/load")["server_load"]:
        assert time.monotonic() < deadline
        time.sleep(0.05)


def test_probes_need_no_api_key(builtin_server: Any) -> None:
    server = builtin_server("--api-key", "k")
    for path in ("/load", "/openapi.json", "/docs"):
        with urllib.request.urlopen(f"{server.url}{path}", timeout=60) as r:
            assert r.status == 200, path
    status, answer = post(f"{server.url}/inference/v1/generate", {"token_ids": [1]})
    assert status == 401, answer
