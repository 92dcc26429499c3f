"""Anthropic's Messages API (POST /v1/messages, /v1/messages/count_tokens) through the
official `anthropic` client: the same tokens as the chat completion of the same
conversation (the oracle), Anthropic's event stream, stop reasons, tool_use and
tool_result blocks, and errors in Anthropic's shape. Every answer is checked against the
client's typed models strictly (a required field missing fails)."""

from __future__ import annotations

import json
import urllib.error
import urllib.request
from collections.abc import Callable
from typing import Any

import anthropic
import pydantic
import pytest
from anthropic.types import Message, MessageTokensCount, RawMessageStreamEvent

from tests.helpers.model_files import CONVERSATION
from tests.helpers.server import CALLED, CITY, MODEL_NAME, TOOLS, TOOLS_TEMPLATE, Server, post

N = 10
GREEDY = {"temperature": 0}  # extra_body: newer clients dropped sampling arguments
SYSTEM, *TURNS = CONVERSATION
_EVENT = pydantic.TypeAdapter(RawMessageStreamEvent)


def _client(server: Server, key: str = "none") -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=server.url, api_key=key, max_retries=0)


def _create(client: anthropic.Anthropic, **args: Any) -> Message:
    """messages.create, its raw JSON validated by the client's Message model."""
    raw = client.messages.with_raw_response.create(**args)
    Message.model_validate(raw.http_response.json())
    return raw.parse()


def _events(client: anthropic.Anthropic, **args: Any) -> list[RawMessageStreamEvent]:
    """A streamed create's events, each validated by the client's event models."""
    events = list(client.messages.create(stream=True, **args))
    for e in events:
        _EVENT.validate_python(e.to_dict())
    return events


def _chat(server: Server, messages: list[dict[str, Any]], **extra: Any) -> dict[str, Any]:
    body = {"model": MODEL_NAME, "messages": messages, "temperature": 0, **extra}
    status, answer = post(f"{server.url}/v1/chat/completions", body)
    assert status == 200, answer
    return answer


def test_a_message_is_the_chat_completion_of_its_conversation(server: Server) -> None:
    client = _client(server)
    chat = _chat(server, CONVERSATION, max_tokens=N, return_token_ids=True)
    want = chat["choices"][0]["message"]["content"]
    args: dict[str, Any] = dict(
        model=MODEL_NAME, max_tokens=N, system=SYSTEM["content"], messages=TURNS, extra_body=GREEDY
    )
    m = _create(client, **args)
    assert m.id.startswith("msg_") and m.type == "message" and m.role == "assistant"
    assert m.model == MODEL_NAME
    assert [(b.type, b.text) for b in m.content] == [("text", want)]  # type: ignore[union-attr]
    assert m.stop_reason == "max_tokens" and m.stop_sequence is None
    prompt = chat["usage"]["prompt_tokens"]
    assert m.usage.output_tokens == len(chat["choices"][0]["token_ids"]) == N
    # Anthropic counts prompt tokens read from the cache apart: the chat cached them.
    assert m.usage.cache_read_input_tokens and m.usage.cache_read_input_tokens > 0
    assert m.usage.input_tokens + m.usage.cache_read_input_tokens == prompt
    counted = client.messages.count_tokens(
        model=MODEL_NAME, system=SYSTEM["content"], messages=TURNS
    )
    MessageTokensCount.model_validate(counted.to_dict())
    assert counted.input_tokens == prompt
    # System as text blocks, a turn as text blocks: the same prompt.
    blocks = [{"type": "text", "text": SYSTEM["content"]}]
    turns = [{**TURNS[0], "content": [{"type": "text", "text": TURNS[0]["content"]}]}, *TURNS[1:]]
    counted = client.messages.count_tokens(model=MODEL_NAME, system=blocks, messages=turns)
    assert counted.input_tokens == prompt
    # Streamed: Anthropic's events, the same text.
    events = _events(client, **args)
    kinds = [e.type for e in events]
    deltas = [e for e in events if e.type == "content_block_delta"]
    assert kinds == [
        "message_start",
        "content_block_start",
        *["content_block_delta"] * len(deltas),
        "content_block_stop",
        "message_delta",
        "message_stop",
    ]
    assert len(deltas) >= 2
    assert "".join(d.delta.text for d in deltas) == want  # type: ignore[union-attr]
    start, end = events[0], events[-2]
    assert start.message.usage.input_tokens == prompt and start.message.stop_reason is None  # type: ignore[union-attr]
    assert end.delta.stop_reason == "max_tokens" and end.usage.output_tokens == N  # type: ignore[union-attr]
    with client.messages.stream(**args) as stream:
        final = stream.get_final_message()
    assert [b.text for b in final.content] == [want]  # type: ignore[union-attr]
    assert final.stop_reason == "max_tokens" and final.usage.output_tokens == N
    assert final.usage.input_tokens + (final.usage.cache_read_input_tokens or 0) == prompt


def test_the_stream_opens_with_a_ping(server: Server) -> None:
    """Anthropic's stream sends a ping after message_start (clients drop it)."""
    body = {"model": MODEL_NAME, "max_tokens": 2, "messages": TURNS, "stream": True}
    request = urllib.request.Request(
        f"{server.url}/v1/messages", json.dumps(body).encode(), {"content-type": "application/json"}
    )
    with urllib.request.urlopen(request, timeout=300) as r:
        lines = r.read().decode().split("\n")
    names = [line.removeprefix("event: ") for line in lines if line.startswith("event: ")]
    assert names[:3] == ["message_start", "ping", "content_block_start"], names
    assert names[-2:] == ["message_delta", "message_stop"]


def test_stop_sequences_end_the_message(server: Server) -> None:
    client = _client(server)
    args: dict[str, Any] = dict(model=MODEL_NAME, messages=TURNS, extra_body=GREEDY)
    text = _create(client, max_tokens=N, **args).content[0].text  # type: ignore[union-attr]
    stop = text.split()[-1]
    m = _create(client, max_tokens=N, stop_sequences=[stop, "never"], **args)
    assert m.stop_reason == "stop_sequence" and m.stop_sequence == stop
    assert m.content[0].text == text[: text.index(stop)]  # type: ignore[union-attr]
    with client.messages.stream(max_tokens=N, stop_sequences=[stop], **args) as stream:
        final = stream.get_final_message()
    assert final.stop_reason == "stop_sequence" and final.stop_sequence == stop
    assert final.content[0].text == text[: text.index(stop)]  # type: ignore[union-attr]
    # max_tokens 1: cut at once.
    m = _create(client, max_tokens=1, **args)
    assert m.stop_reason == "max_tokens" and m.usage.output_tokens == 1


def test_an_assistant_turn_last_is_continued(server: Server) -> None:
    """A prefilled answer: the message continues the last assistant turn, as chat's
    continue_final_message does."""
    client = _client(server)
    turns = [TURNS[0], {"role": "assistant", "content": "It is"}]  # the template keeps 3
    m = _create(client, model=MODEL_NAME, max_tokens=4, messages=turns, extra_body=GREEDY)
    chat = _chat(
        server, turns, max_tokens=4, add_generation_prompt=False, continue_final_message=True
    )
    assert m.content[0].text == chat["choices"][0]["message"]["content"]  # type: ignore[union-attr]


@pytest.mark.parametrize(
    ("body", "says"),
    [
        ({"messages": TURNS}, "max_tokens"),
        ({"max_tokens": 4}, "messages"),
        ({"max_tokens": 0, "messages": TURNS}, "max_tokens"),
        ({"max_tokens": 4, "messages": TURNS, "temperature": 1.5}, "temperature"),
        ({"max_tokens": 4, "messages": []}, "messages"),
        ({"max_tokens": 4, "messages": [{"role": "system", "content": "x"}]}, "role"),
        ({"max_tokens": -1, "messages": TURNS}, "max_tokens"),
        (
            {
                "max_tokens": 4,
                "messages": [
                    {
                        "role": "user",
                        "content": [{"type": "image", "source": {"type": "url", "url": "x"}}],
                    }
                ],
            },
            "image",
        ),
        (
            {
                "max_tokens": 4,
                "messages": TURNS,
                "tools": [{"name": "web", "type": "web_search_20250305", "input_schema": {}}],
            },
            "server tool",
        ),
        (
            {"max_tokens": 4, "messages": TURNS, "tool_choice": {"type": "tool", "name": "x"}},
            "tool_choice",
        ),
    ],
)
def test_a_bad_body_is_an_anthropic_400(server: Server, body: dict[str, Any], says: str) -> None:
    status, answer = post(f"{server.url}/v1/messages", {"model": MODEL_NAME, **body})
    assert status == 400, answer
    assert answer["type"] == "error" and answer["error"]["type"] == "invalid_request_error"
    assert says in answer["error"]["message"] or says == answer["error"].get("param"), answer
    # The server keeps serving.
    ok = {"model": MODEL_NAME, "max_tokens": 1, "messages": TURNS}
    assert post(f"{server.url}/v1/messages", ok)[0] == 200


def test_unknown_fields_are_ignored(server: Server) -> None:
    """Newer clients' and agents' fields (a block's too) are ignored, as vLLM ignores them,
    and logged."""
    turn = {"role": "user", "content": [{"type": "text", "text": "Hi", "extra": 1}]}
    body = {"model": MODEL_NAME, "max_tokens": 1, "messages": [turn], "zz_future": {"a": 1}}
    status, answer = post(f"{server.url}/v1/messages", body)
    assert status == 200 and answer["type"] == "message", answer
    server.watch.wait_for(r"ignored unknown fields zz_future", timeout=60)


def test_errors_are_the_clients_typed_errors(server: Server) -> None:
    client = _client(server)
    with pytest.raises(anthropic.NotFoundError) as missing:
        client.messages.create(model="other", max_tokens=4, messages=TURNS)  # type: ignore[arg-type]
    assert missing.value.body["error"]["type"] == "not_found_error"  # type: ignore[index]
    with pytest.raises(anthropic.NotFoundError):
        client.messages.count_tokens(model="other", messages=TURNS)  # type: ignore[arg-type]
    with pytest.raises(anthropic.BadRequestError) as bad:
        client.messages.create(model=MODEL_NAME, max_tokens=0, messages=TURNS)  # type: ignore[arg-type]
    assert bad.value.body["error"]["type"] == "invalid_request_error"  # type: ignore[index]


def _tools_server(builtin_server: Callable[..., Server]) -> Server:
    flags = ("--chat-template", TOOLS_TEMPLATE, "--tool-call-parser", "hermes")
    return builtin_server(*flags, "--api-key", "s3cret")


# tests/helpers/server.py's tools in Anthropic's shape.
ANTHROPIC_TOOLS = [
    {"name": "get_weather", "input_schema": CITY},
    {"name": "now", "description": "the time", "input_schema": {"type": "object"}},
]
ASK = [{"role": "user", "content": "Weather?"}]


def test_tool_use_and_tool_result_round_trip(builtin_server: Callable[..., Server]) -> None:
    """A named tool's tool_use block (input as an object, streamed as input_json_delta),
    "any", "auto"; the tool_use and its tool_result sent back render as chat's tool call
    and tool message; the key is taken from x-api-key."""
    server = _tools_server(builtin_server)
    client = _client(server, "s3cret")
    args: dict[str, Any] = dict(
        model="pagedserve-builtin", tools=ANTHROPIC_TOOLS, messages=ASK, extra_body=GREEDY
    )
    named = {"type": "tool", "name": "get_weather"}
    m = _create(client, tool_choice=named, max_tokens=300, **args)
    assert m.stop_reason == "tool_use"
    (call,) = m.content
    assert call.type == "tool_use" and call.name == "get_weather" and call.id
    city = call.input["city"]  # type: ignore[index]
    assert isinstance(city, str) and len(city) <= CITY["properties"]["city"]["maxLength"]
    events = _events(client, tool_choice=named, max_tokens=300, **args)
    parts = [
        e.delta.partial_json  # type: ignore[union-attr]
        for e in events
        if e.type == "content_block_delta" and e.delta.type == "input_json_delta"
    ]
    assert len(parts) >= 2 and json.loads("".join(parts)) == call.input
    starts = [e.content_block for e in events if e.type == "content_block_start"]  # type: ignore[union-attr]
    assert [(b.type, b.name) for b in starts] == [("tool_use", "get_weather")]  # type: ignore[union-attr]
    assert events[-2].delta.stop_reason == "tool_use"  # type: ignore[union-attr]
    for stream_it in (False, True):
        any_call = {"type": "any", "disable_parallel_tool_use": True}
        if stream_it:
            with client.messages.stream(tool_choice=any_call, max_tokens=600, **args) as s:  # type: ignore[arg-type]
                got = s.get_final_message()
        else:
            got = _create(client, tool_choice=any_call, max_tokens=600, **args)
        assert got.stop_reason == "tool_use", got
        (block,) = got.content
        assert block.type == "tool_use" and block.name in ("get_weather", "now")
        assert isinstance(block.input, dict)
    # auto: the model decides (a random model writes text, no call).
    m = _create(client, max_tokens=5, **args)
    assert [b.type for b in m.content] == ["text"] and m.stop_reason == "max_tokens"
    events = _events(client, max_tokens=5, **args)
    texts = [e.delta.text for e in events if e.type == "content_block_delta"]  # type: ignore[union-attr]
    assert "".join(texts) == m.content[0].text  # type: ignore[union-attr]
    # The call and its result sent back: chat's tool call and tool message.
    back = [
        *ASK,
        {"role": "assistant", "content": [_tool_use("c1", "now", {"z": 1})]},
        {
            "role": "user",
            "content": [{"type": "tool_result", "tool_use_id": "c1", "content": "noon"}],
        },
    ]
    counted = client.messages.count_tokens(
        model="pagedserve-builtin",
        messages=back,  # type: ignore[arg-type]
        tools=ANTHROPIC_TOOLS,  # type: ignore[arg-type]
    )
    bearer = {"Authorization": "Bearer s3cret"}
    status, tokens = post_headers(server, "/tokenize", {"messages": CALLED, "tools": TOOLS}, bearer)
    assert status == 200 and counted.input_tokens == tokens["count"]
    m = _create(
        client,
        model="pagedserve-builtin",
        tools=ANTHROPIC_TOOLS,
        tool_choice={"type": "none"},
        messages=back,
        max_tokens=1,
    )
    assert m.usage.input_tokens + (m.usage.cache_read_input_tokens or 0) == tokens["count"]
    # The key as x-api-key (what Anthropic's clients send; newer ones send a bearer token
    # too); a wrong key is Anthropic's 401.
    body = {"model": "pagedserve-builtin", "max_tokens": 1, "messages": ASK}
    assert post_headers(server, "/v1/messages", body, {"x-api-key": "s3cret"})[0] == 200
    status, refused = post_headers(server, "/v1/messages", body, {"x-api-key": "guess"})
    assert status == 401 and refused["error"]["type"] == "authentication_error", refused
    with pytest.raises(anthropic.AuthenticationError):
        _client(server, "guess").messages.create(**body)


def _tool_use(call_id: str, name: str, tool_input: dict[str, Any]) -> dict[str, Any]:
    return {"type": "tool_use", "id": call_id, "name": name, "input": tool_input}


def post_headers(
    server: Server, path: str, body: object, headers: dict[str, str]
) -> tuple[int, dict]:
    """A JSON post with these headers (the key, as one API or the other sends it)."""
    headers = {"Content-Type": "application/json", **headers}
    request = urllib.request.Request(f"{server.url}{path}", json.dumps(body).encode(), headers)
    try:
        with urllib.request.urlopen(request, timeout=300) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


def test_reasoning_comes_back_as_a_thinking_block(builtin_server: Callable[..., Server]) -> None:
    """Under deepseek_r1's parser the think block opens in the prompt, so a random model's
    text, never closing it, is all reasoning: a thinking block equal to chat's reasoning,
    whole and streamed; thinking disabled leaves it out."""
    template = "{% for m in messages %}{{ m.role }}: {{ m.content }}\n{% endfor %}<think>"
    server = builtin_server("--chat-template", template, "--reasoning-parser", "deepseek_r1")
    body = {"model": "pagedserve-builtin", "messages": ASK, "max_tokens": 6, "temperature": 0}
    status, chat = post(f"{server.url}/v1/chat/completions", body)
    assert status == 200, chat
    thought = chat["choices"][0]["message"]["reasoning"]
    assert thought
    client = _client(server)
    args: dict[str, Any] = dict(
        model="pagedserve-builtin", messages=ASK, max_tokens=6, extra_body=GREEDY
    )
    m = _create(client, **args)
    assert [(b.type, getattr(b, "thinking", None)) for b in m.content] == [
        ("thinking", thought),
        ("text", None),
    ]
    events = _events(client, **args)
    deltas = [e.delta for e in events if e.type == "content_block_delta"]  # type: ignore[union-attr]
    assert "".join(d.thinking for d in deltas) == thought  # type: ignore[union-attr]
    starts = [e.content_block.type for e in events if e.type == "content_block_start"]  # type: ignore[union-attr]
    assert starts == ["thinking", "text"]
    m = _create(client, thinking={"type": "disabled"}, **args)
    assert [b.type for b in m.content] == ["text"]
