"""Background responses and POST /v1/responses/{id}/cancel through the official `openai`
client on a real server: a background response is answered "queued" at once and ends as
the same response generated in the foreground; cancelling one aborts its engine request
and leaves it "cancelled" (again on a second cancel); what cannot be cancelled is a 400,
an unknown id a 404."""

from __future__ import annotations

import json
import time
import urllib.request
from pathlib import Path
from typing import Any

import openai
import pytest
from openai.types.responses import Response

from tests.helpers.server import MODEL_NAME, Server, metrics, post, start_server

GREEDY = {"model": MODEL_NAME, "temperature": 0, "max_output_tokens": 8}


def _load(server: Server) -> int:
    with urllib.request.urlopen(f"{server.url}/load", timeout=60) as r:
        return json.loads(r.read())["server_load"]


def _wait_until_ended(client: openai.OpenAI, response_id: str) -> Response:
    deadline = time.monotonic() + 300  # only guards against a hang
    while (r := client.responses.retrieve(response_id)).status in ("queued", "in_progress"):
        assert time.monotonic() < deadline, r.status
        time.sleep(0.05)
    return r


def _strict(server: Server, response_id: str) -> dict[str, Any]:
    """The stored response, parsed by the client's type (no required field missing)."""
    with urllib.request.urlopen(f"{server.url}/v1/responses/{response_id}", timeout=60) as r:
        body = json.loads(r.read())
    Response.model_validate(body)
    return body


def test_a_background_response_ends_as_the_foreground_one(
    server: Server, client: openai.OpenAI
) -> None:
    foreground = client.responses.create(input="2 + 2", **GREEDY)
    queued = client.responses.create(input="2 + 2", background=True, **GREEDY)
    assert queued.status == "queued" and queued.background is True and not queued.output
    done = _wait_until_ended(client, queued.id)
    assert done.status == foreground.status and done.output_text == foreground.output_text
    assert done.usage is not None and foreground.usage is not None
    assert done.usage.output_tokens == foreground.usage.output_tokens
    assert _strict(server, queued.id)["background"] is True


def test_cancel_aborts_a_running_response(server: Server, client: openai.OpenAI) -> None:
    context = post(f"{server.url}/tokenize", {"prompt": "x"})[1]["max_model_len"]
    long = {**GREEDY, "max_output_tokens": context // 2}
    before = metrics(server.url)["vllm:generation_tokens_total"]
    queued = client.responses.create(
        input="x", background=True, extra_body={"ignore_eos": True}, **long
    )
    cancelled = client.responses.cancel(queued.id)
    assert cancelled.id == queued.id and cancelled.status == "cancelled"
    assert _load(server) == 0  # its engine request is gone
    # It was stopped, not waited for.
    generated = metrics(server.url)["vllm:generation_tokens_total"] - before
    assert generated < long["max_output_tokens"]
    assert client.responses.retrieve(queued.id).status == "cancelled"
    assert _strict(server, queued.id)["status"] == "cancelled"
    # Cancelling again answers the same cancelled response.
    assert client.responses.cancel(queued.id).status == "cancelled"


def test_what_cannot_be_cancelled_is_refused(client: openai.OpenAI) -> None:
    with pytest.raises(openai.NotFoundError):
        client.responses.cancel("resp_unknown")
    foreground = client.responses.create(input="x", **GREEDY)
    with pytest.raises(openai.BadRequestError, match="only background responses"):
        client.responses.cancel(foreground.id)
    finished = client.responses.create(input="x", background=True, **GREEDY)
    assert _wait_until_ended(client, finished.id).status in ("completed", "incomplete")
    with pytest.raises(openai.BadRequestError, match="already ended"):
        client.responses.cancel(finished.id)


def test_no_more_run_in_the_background_than_the_store_keeps(
    chat_model: Path, tmp_path: Path
) -> None:
    server = start_server(chat_model, tmp_path, "--max-stored-responses", "1")
    try:
        client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="none", max_retries=0)
        context = post(f"{server.url}/tokenize", {"prompt": "x"})[1]["max_model_len"]
        long: Any = {"max_output_tokens": context // 2, "extra_body": {"ignore_eos": True}}
        first = client.responses.create(input="x", background=True, **long)
        with pytest.raises(openai.InternalServerError, match="background responses are"):
            client.responses.create(input="x", background=True, **long)
        assert client.responses.cancel(first.id).status == "cancelled"
        again = client.responses.create(input="x", background=True, **long)
        assert client.responses.cancel(again.id).status == "cancelled"
    finally:
        server.stop()
