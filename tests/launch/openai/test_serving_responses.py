"""OpenAI's Responses API (POST /v1/responses) through the official `openai` client: the
same tokens as a chat completion of the same conversation (LLM.chat is the oracle), the
typed event stream, stored responses continued by previous_response_id, function tools,
and the 400s of what cannot be served. The store and the input conversion alone:
test_responses_store.py, test_responses_items.py."""

from __future__ import annotations

import json
import re
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import openai
import pytest

from tests.helpers.model_files import CONVERSATION
from tests.helpers.server import (
    CALLED,
    CITY,
    EXTRA,
    MODEL_NAME,
    TOOLS,
    TOOLS_TEMPLATE,
    Server,
    metrics,
    post,
    start_server,
)

N = 10
# The Responses shape of tests/helpers/server.py's tools: flat functions.
FLAT_TOOLS = [{"type": "function", **t["function"]} for t in TOOLS]  # type: ignore[dict-item]
GREEDY = {"model": MODEL_NAME, "temperature": 0, "max_output_tokens": N}


@pytest.fixture(scope="module")
def server(chat_model: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    s = start_server(
        chat_model, tmp_path_factory.mktemp("responses"), "--max-stored-responses", "3"
    )
    yield s
    s.stop()


@pytest.fixture(scope="module")
def client(server: Server) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key="none", max_retries=0)


def _chat(server: Server, messages: list[dict[str, Any]], **extra: Any) -> dict[str, Any]:
    """The chat completion of the same conversation (the oracle), with its token ids."""
    body = {"model": MODEL_NAME, "messages": messages, "max_tokens": N, "temperature": 0}
    status, answer = post(f"{server.url}/v1/chat/completions", {**body, **EXTRA, **extra})
    assert status == 200, answer
    return answer


def _count(server: Server, messages: list[dict[str, Any]]) -> int:
    status, answer = post(f"{server.url}/tokenize", {"messages": messages})
    assert status == 200, answer
    return answer["count"]


def test_a_response_is_the_chat_completion_of_its_conversation(
    server: Server, client: openai.OpenAI
) -> None:
    chat = _chat(server, CONVERSATION, logprobs=True, top_logprobs=2)
    want = chat["choices"][0]["message"]["content"]
    # instructions are the system message; input items the rest.
    system, *rest = CONVERSATION
    r = client.responses.create(
        input=rest,  # type: ignore[arg-type]
        instructions=system["content"],
        extra_body={"ignore_eos": True},
        include=["message.output_text.logprobs"],
        top_logprobs=2,
        **GREEDY,  # type: ignore[arg-type]
    )
    assert r.object == "response" and r.id.startswith("resp_")
    assert r.output_text == want and want
    assert r.status == "incomplete" and r.incomplete_details is not None
    assert r.incomplete_details.reason == "max_output_tokens"
    (message,) = r.output
    assert message.type == "message" and message.role == "assistant"
    (part,) = message.content
    assert part.type == "output_text" and part.logprobs is not None and len(part.logprobs) == N
    assert all(len(lp.top_logprobs) == 2 for lp in part.logprobs)
    want_lps = chat["choices"][0]["logprobs"]["content"]
    assert [lp.token for lp in part.logprobs] == [w["token"] for w in want_lps]
    assert [lp.logprob for lp in part.logprobs] == pytest.approx(
        [w["logprob"] for w in want_lps], abs=1e-5
    )
    assert r.usage is not None and r.usage.output_tokens == N
    assert r.usage.input_tokens == chat["usage"]["prompt_tokens"] == _count(server, CONVERSATION)
    assert r.usage.total_tokens == r.usage.input_tokens + N
    # Streamed: OpenAI's typed events, numbered, carrying the same text.
    events = list(
        client.responses.create(
            input=rest,  # type: ignore[arg-type]
            instructions=system["content"],
            stream=True,
            extra_body={"ignore_eos": True},
            include=["message.output_text.logprobs"],
            **GREEDY,  # type: ignore[arg-type]
        )
    )
    kinds = [e.type for e in events]
    deltas = [e for e in events if e.type == "response.output_text.delta"]
    assert kinds == [
        "response.created",
        "response.in_progress",
        "response.output_item.added",
        "response.content_part.added",
        *["response.output_text.delta"] * len(deltas),
        "response.output_text.done",
        "response.content_part.done",
        "response.output_item.done",
        "response.incomplete",
    ]
    assert [e.sequence_number for e in events] == list(range(len(events)))
    assert len(deltas) >= 2 and "".join(d.delta for d in deltas) == want
    # Each token's logprob goes out once, with the delta its text ends in.
    streamed = [lp.token for d in deltas for lp in d.logprobs]
    assert streamed == [w["token"] for w in want_lps]
    done = events[-1].response  # type: ignore[union-attr]
    assert done.output_text == want and done.status == "incomplete"
    assert done.usage is not None and done.usage.output_tokens == N
    item_ids = {e.item_id for e in events if hasattr(e, "item_id")}
    assert item_ids == {done.output[0].id}


def test_stored_responses_continue_a_conversation(server: Server, client: openai.OpenAI) -> None:
    """previous_response_id renders the stored conversation and its answer first; the
    store keeps the last --max-stored-responses (3); store false keeps nothing."""
    system, first, *_ = CONVERSATION
    args: dict[str, Any] = dict(extra_body={"ignore_eos": True}, **GREEDY)
    r1 = client.responses.create(input=[first], instructions=system["content"], **args)
    r2 = client.responses.create(input="And 3 + 3?", previous_response_id=r1.id, **args)
    conversation = [
        first,
        {"role": "assistant", "content": r1.output_text},
        {"role": "user", "content": "And 3 + 3?"},
    ]
    # The instructions stay with the response that had them (OpenAI's rule).
    assert r2.usage is not None and r2.usage.input_tokens == _count(server, conversation)
    assert r2.output_text == _chat(server, conversation)["choices"][0]["message"]["content"]
    assert r2.previous_response_id == r1.id
    # Asked again, the conversation's blocks come from the prefix cache.
    again = client.responses.create(input="And 3 + 3?", previous_response_id=r1.id, **args)
    assert again.output_text == r2.output_text
    assert again.usage is not None and again.usage.input_tokens_details.cached_tokens >= 16
    assert client.responses.retrieve(r1.id).output_text == r1.output_text
    assert client.responses.input_items.list(r1.id).data[0].type == "message"
    client.responses.delete(r1.id)
    # Its input, listed back as items, pages by id, newest first unless asked otherwise.
    three = [first, {"role": "assistant", "content": "4"}, {"role": "user", "content": "x"}]
    r3 = client.responses.create(input=three, **args)
    page = client.responses.input_items.list(r3.id, order="asc", limit=2)
    assert [(i.role, i.content[0].text) for i in page.data] == [  # type: ignore[union-attr]
        ("user", first["content"]),
        ("assistant", "4"),
    ]
    assert page.has_more and page.last_id == page.data[-1].id
    rest = client.responses.input_items.list(r3.id, order="asc", after=page.last_id)
    assert [i.content[0].text for i in rest.data] == ["x"] and not rest.has_more  # type: ignore[union-attr]
    newest = client.responses.input_items.list(r3.id, limit=1)
    assert newest.data[0].id == rest.data[0].id
    for query, param in (("limit=0", "limit"), ("order=up", "order"), ("after=nope", "after")):
        with pytest.raises(openai.BadRequestError) as e:
            client.get(f"/responses/{r3.id}/input_items?{query}", cast_to=object)
        assert e.value.body["param"] == param  # type: ignore[index]
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(r1.id)
    status, answer = post(
        f"{server.url}/v1/responses", {"input": "x", "previous_response_id": r1.id}
    )
    assert status == 400 and answer["error"]["param"] == "previous_response_id", answer
    unstored = client.responses.create(input="x", store=False, **args)
    assert unstored.store is False
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(unstored.id)
    later = [client.responses.create(input="x", **args) for _ in range(3)]
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(again.id)  # the oldest of four went
    assert [client.responses.retrieve(r.id).id for r in later] == [r.id for r in later]


def test_a_disconnected_stream_frees_its_blocks(server: Server) -> None:
    import socket
    from urllib.parse import urlparse

    u = urlparse(server.url)
    body = json.dumps({"input": "x", "stream": True, "max_output_tokens": 100, "ignore_eos": True})
    with socket.create_connection((u.hostname, u.port)) as s:
        s.sendall(
            f"POST /v1/responses HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            f"Content-Length: {len(body)}\r\n\r\n{body}".encode()
        )
        seen = b""
        while b"response.output_text.delta" not in seen:
            chunk = s.recv(65536)
            assert chunk, seen
            seen += chunk
    from tests.helpers.server import wait_for_metric

    wait_for_metric(server.url, "vllm:num_requests_running", 0)
    assert metrics(server.url)["vllm:kv_cache_usage_perc"] == 0


@pytest.fixture
def tools_server(tmp_path: Path) -> Iterator[Callable[[], Server]]:
    started: list[Server] = []

    def start() -> Server:
        flags = ("--chat-template", TOOLS_TEMPLATE, "--tool-call-parser", "hermes")
        started.append(start_server(None, tmp_path / "server", *flags))
        return started[-1]

    yield start
    for s in started:
        s.stop()


def test_function_tools(tools_server: Callable[[], Server]) -> None:
    """A named function's call streams its arguments; "required" answers calls; the
    calls and their outputs, sent back as items, render as chat messages do."""
    server = tools_server()
    client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="none", max_retries=0)
    args: dict[str, Any] = dict(
        model="pagedserve-builtin", input="Weather?", tools=FLAT_TOOLS, temperature=0
    )
    named = {"type": "function", "name": "get_weather"}
    r = client.responses.create(tool_choice=named, max_output_tokens=300, **args)  # type: ignore[arg-type]
    assert r.status == "completed"
    (call,) = r.output
    assert call.type == "function_call" and call.name == "get_weather"
    assert call.call_id.startswith("call_") and call.id.startswith("fc_")  # type: ignore[union-attr]
    city = json.loads(call.arguments)["city"]
    assert isinstance(city, str) and len(city) <= CITY["properties"]["city"]["maxLength"]
    events = list(
        client.responses.create(tool_choice=named, max_output_tokens=300, stream=True, **args)  # type: ignore[arg-type]
    )
    deltas = [e.delta for e in events if e.type == "response.function_call_arguments.delta"]
    assert len(deltas) >= 2 and json.loads("".join(deltas)) == json.loads(call.arguments)
    assert events[-1].type == "response.completed"
    assert events[-1].response.output[0].arguments == "".join(deltas)  # type: ignore[union-attr]
    for stream in (False, True):
        got = client.responses.create(
            tool_choice="required",
            parallel_tool_calls=False,
            max_output_tokens=600,
            stream=stream,
            **args,
        )
        answer = list(got)[-1].response if stream else got  # type: ignore[union-attr,arg-type]
        (call,) = answer.output  # type: ignore[union-attr]
        assert call.type == "function_call" and call.name in ("get_weather", "now")
        assert isinstance(json.loads(call.arguments), dict)
    # auto: the model's own Hermes blocks (forced here: a random model writes none); the
    # text streams up to where the call begins.
    forced = 'On it.<tool_call>{"name": "now", "arguments": {}}</tool_call>'
    extra = {"structured_outputs": {"regex": re.escape(forced)}}
    r = client.responses.create(max_output_tokens=100, extra_body=extra, **args)
    assert r.output_text == "On it." and r.status == "completed"
    assert [(o.type, getattr(o, "name", None)) for o in r.output] == [
        ("message", None),
        ("function_call", "now"),
    ]
    events = list(
        client.responses.create(max_output_tokens=100, extra_body=extra, stream=True, **args)
    )
    deltas = [e.delta for e in events if e.type == "response.output_text.delta"]
    assert len(deltas) >= 2 and "".join(deltas) == "On it."
    done = events[-1].response  # type: ignore[union-attr]
    assert [o.type for o in done.output] == ["message", "function_call"]
    assert done.output[1].name == "now" and json.loads(done.output[1].arguments) == {}
    assert [e.output_index for e in events if e.type == "response.output_item.done"] == [0, 1]
    # Sent back: the call and its output are the chat turns they stand for.
    items = [
        {"role": "user", "content": "Weather?"},
        {"type": "function_call", "call_id": "c1", "name": "now", "arguments": '{"z": 1}'},
        {"type": "function_call_output", "call_id": "c1", "output": "noon"},
    ]
    r = client.responses.create(
        input=items,  # type: ignore[arg-type]
        tools=FLAT_TOOLS,  # type: ignore[arg-type]
        tool_choice="none",
        max_output_tokens=1,
        model="pagedserve-builtin",
    )
    status, tokens = post(f"{server.url}/tokenize", {"messages": CALLED, "tools": TOOLS})
    assert status == 200 and r.usage is not None and r.usage.input_tokens == tokens["count"]


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({}, "input"),
        ({"input": "x", "max_output_tokens": 0}, "max_output_tokens"),
        ({"input": "x", "tools": [{"type": "web_search"}]}, "tools"),
        ({"input": "x", "include": ["reasoning.encrypted_content"]}, "include"),
        ({"input": "x", "reasoning": {"effort": "high"}}, "reasoning"),
        ({"input": "x", "background": True, "stream": True}, "background"),
        ({"input": [{"role": "user", "content": [{"type": "input_image"}]}]}, "input"),
        ({"input": [{"type": "computer_call_output", "call_id": "1"}]}, "input"),
        ({"input": [{"role": "robot", "content": "x"}]}, "input"),
        ({"input": "x " * 3000}, "input"),
        ({"input": "x", "text": {"format": {"type": "json_schema"}}}, "text.format"),
        ({"input": "x", "tool_choice": "required"}, "tool_choice"),
        ({"input": "x", "metadata": {str(i): "v" for i in range(17)}}, "metadata"),
        ({"input": "x", "top_logprobs": 21}, "top_logprobs"),
    ],
)
def test_a_bad_body_is_a_400_naming_its_field(
    server: Server, body: dict[str, Any], param: str
) -> None:
    status, answer = post(f"{server.url}/v1/responses", body)
    assert status == 400 and answer["error"]["param"] == param, answer
    assert answer["error"]["message"]
    assert post(f"{server.url}/v1/responses", {"input": "x", "max_output_tokens": 1})[0] == 200


def test_truncation_auto_drops_the_oldest_turns(server: Server, client: openai.OpenAI) -> None:
    context = client.models.retrieve(MODEL_NAME).max_model_len  # type: ignore[attr-defined]
    long = "x " * (context * 3 // 5)  # one fits, two do not
    # (This model's template renders the first three messages.)
    turns = [
        {"role": "system", "content": "You are terse."},
        {"role": "user", "content": long + "2"},
        {"role": "user", "content": long + "3"},
    ]
    body = {"input": turns, "max_output_tokens": 4}
    status, answer = post(f"{server.url}/v1/responses", body)
    assert status == 400 and answer["error"]["code"] == "context_length_exceeded", answer
    assert answer["error"]["param"] == "input"
    status, answer = post(f"{server.url}/v1/responses", {**body, "truncation": "auto"})
    assert status == 200, answer
    kept = [turns[0], turns[2]]  # the oldest turn went, the system message stayed
    assert answer["usage"]["input_tokens"] == _count(server, kept)
    assert answer["truncation"] == "auto"
