"""Structured outputs through the server (sampling_params.py turns response_format and
structured_outputs into the engine's language; bad specs are 400s naming their field)."""

from __future__ import annotations

import json
import re
from collections.abc import Callable

import openai

from tests.helpers.server import (
    Server,
    post,
)

PERSON = {
    "type": "object",
    "properties": {"name": {"type": "string", "maxLength": 5}, "ok": {"type": "boolean"}},
    "required": ["name", "ok"],
    "additionalProperties": False,
}


def test_structured_outputs_through_the_openai_client(
    builtin_server: Callable[..., Server],
) -> None:
    """response_format (OpenAI's) and structured_outputs (vLLM's), streamed and not, on
    the built-in model (byte tokenizer: the text is exactly what the language allows)."""
    server = builtin_server("--chat-template", "{% for m in messages %}{{ m.content }}{% endfor %}")
    client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="none", max_retries=0)
    fmt = {"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON}}
    chat = client.chat.completions.create(
        model="pagedserve-builtin",
        messages=[{"role": "user", "content": "A person: "}],
        response_format=fmt,  # type: ignore[arg-type]
        max_tokens=400,  # whitespace between JSON tokens is bounded: so is the answer
        temperature=0,
    )
    choice = chat.choices[0]
    assert choice.finish_reason == "stop", choice
    person = json.loads(choice.message.content or "")
    assert set(person) == {"name", "ok"} and len(person["name"]) <= 5
    assert isinstance(person["ok"], bool)
    any_object = client.chat.completions.create(
        model="pagedserve-builtin",
        messages=[{"role": "user", "content": "JSON: "}],
        response_format={"type": "json_object"},
        max_tokens=60,
        temperature=0,
    ).choices[0]
    if any_object.finish_reason == "stop":  # else cut at max_tokens, inside the object
        assert isinstance(json.loads(any_object.message.content or ""), dict)
    assert (any_object.message.content or "").lstrip().startswith("{")
    # Streamed, a choice and a regex, several seeded samples each.
    for extra, check in (
        ({"choice": ["left", "right", "up"]}, lambda t: t in ("left", "right", "up")),
        ({"regex": "[0-9]{3}-[a-f]{2}"}, lambda t: re.fullmatch("[0-9]{3}-[a-f]{2}", t)),
    ):
        stream = client.completions.create(
            model="pagedserve-builtin",
            prompt="Go ",
            max_tokens=20,
            temperature=1.0,
            seed=3,
            n=4,
            stream=True,
            extra_body={"structured_outputs": extra},
        )
        texts = ["", "", "", ""]
        finishes: list[str | None] = [None] * 4
        for chunk in stream:
            for c in chunk.choices:
                texts[c.index] += c.text
                finishes[c.index] = c.finish_reason or finishes[c.index]
        assert finishes == ["stop"] * 4 and all(check(t) for t in texts), texts
    # Bad specs are 400s naming their field; the server keeps serving.
    for body, param in (
        (
            {
                "response_format": {
                    "type": "json_schema",
                    "json_schema": {"name": "x", "schema": {"type": "nope"}},
                }
            },
            "response_format",
        ),
        ({"response_format": {"type": "json_schema"}}, "response_format"),
        ({"response_format": {"type": "xml"}}, "response_format"),
        ({"structured_outputs": {"regex": "a(b"}}, "structured_outputs"),
        ({"structured_outputs": {"regex": "a", "choice": ["a"]}}, "structured_outputs"),
        ({"structured_outputs": {"choice": []}}, "structured_outputs"),
        ({"structured_outputs": {"regex": "a"}, "min_tokens": 1}, "min_tokens"),
        (
            {"structured_outputs": {"regex": "a"}, "response_format": {"type": "json_object"}},
            "structured_outputs",
        ),
    ):
        status, answer = post(f"{server.url}/v1/completions", {"prompt": "x", **body})
        assert status == 400 and answer["error"]["param"] == param, (body, answer)
    status, answer = post(
        f"{server.url}/v1/completions",
        {"prompt": "x", "max_tokens": 5, "structured_outputs": {"choice": ["ok"]}},
    )
