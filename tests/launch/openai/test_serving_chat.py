"""POST /v1/chat/completions (serving_chat.py): bad bodies, and tool calls (named,
required, auto) whole and streamed through the official `openai` client."""

from __future__ import annotations

import json
import re
import socket
import urllib.request
from collections.abc import Callable
from pathlib import Path
from typing import Any

import openai
import pytest

from tests.helpers.model_files import CONVERSATION
from tests.helpers.server import (
    ASK,
    CALLED,
    MODEL_NAME,
    PROMPT_TEXT,
    TOOLS,
    TOOLS_TEMPLATE,
    N,
    Server,
    post,
)


@pytest.mark.parametrize(
    ("body", "param"),
    [
        (b"{not json", None),
        ({"messages": [{"role": "tool", "content": "x"}]}, "messages"),  # template refuses
        ({"messages": "hello"}, "messages"),
        ({"messages": CONVERSATION, "tools": [{"type": "function"}]}, "tools"),
    ],
    ids=["malformed JSON", "template refuses", "messages not a list", "tools"],
)
def test_a_bad_chat_body_is_a_400(server: Server, body: object, param: str | None) -> None:
    status, answer = post(f"{server.url}/v1/chat/completions", body)
    assert status == 400 and answer["error"]["param"] == param, answer


def _streamed_calls(chunks: list[Any]) -> tuple[str, dict[int, dict[str, str]], str | None]:
    """(content, calls by index with id, name and arguments, finish reason) of a stream."""
    content, calls, finish = "", {}, None
    for chunk in chunks:
        delta = chunk.choices[0].delta
        content += delta.content or ""
        for call in delta.tool_calls or []:
            got = calls.setdefault(call.index, {"id": "", "name": "", "arguments": ""})
            got["id"] += call.id or ""
            got["name"] += (call.function and call.function.name) or ""
            got["arguments"] += (call.function and call.function.arguments) or ""
        finish = chunk.choices[0].finish_reason or finish
    return content, calls, finish


def test_tool_calls_through_the_openai_client(builtin_server: Callable[..., Server]) -> None:
    """tool_choice named, required and auto (Hermes blocks, with the parser), streamed and
    not; the tools and earlier calls reach the chat template."""
    server = builtin_server("--chat-template", TOOLS_TEMPLATE, "--tool-call-parser", "hermes")
    client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="none", max_retries=0)
    args: dict[str, Any] = dict(model="pagedserve-builtin", tools=TOOLS, temperature=0)
    # The template got the tools, and a call's arguments as an object.
    status, tokens = post(f"{server.url}/tokenize", {"messages": CALLED, "tools": TOOLS})
    want = '[get_weather][now]user:Weather?assistant:<now {"z": 1}>tool:noon'  # trim_blocks
    assert status == 200 and bytes(tokens["tokens"]).decode() == want, tokens
    named = {"type": "function", "function": {"name": "get_weather"}}
    answer = client.chat.completions.create(messages=ASK, tool_choice=named, max_tokens=300, **args)
    choice = answer.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    (call,) = choice.message.tool_calls or []
    assert call.function.name == "get_weather" and call.id.startswith("call_")
    city = json.loads(call.function.arguments)["city"]
    assert isinstance(city, str) and len(city) <= 6
    stream = client.chat.completions.create(
        messages=ASK, tool_choice=named, max_tokens=300, stream=True, **args
    )
    content, calls, finish = _streamed_calls(list(stream))
    assert content == "" and finish == "tool_calls" and list(calls) == [0]
    assert calls[0]["name"] == "get_weather" and calls[0]["id"].startswith("call_")
    assert json.loads(calls[0]["arguments"]) == json.loads(call.function.arguments)  # greedy
    for stream_it in (False, True):
        got = client.chat.completions.create(
            messages=ASK,
            tool_choice="required",
            parallel_tool_calls=False,
            max_tokens=600,
            stream=stream_it,
            **args,
        )
        if stream_it:
            content, calls, finish = _streamed_calls(list(got))  # type: ignore[arg-type]
            names = [c["name"] for c in calls.values()]
            arguments = [c["arguments"] for c in calls.values()]
        else:
            message = got.choices[0].message  # type: ignore[union-attr]
            finish, content = got.choices[0].finish_reason, message.content  # type: ignore[union-attr]
            names = [c.function.name for c in message.tool_calls or []]
            arguments = [c.function.arguments for c in message.tool_calls or []]
        assert finish == "tool_calls" and not content and len(names) == 1, got
        assert names[0] in ("get_weather", "now") and isinstance(json.loads(arguments[0]), dict)
    # auto: the model's own Hermes blocks (forced here: a random model writes none).
    forced = 'On it.<tool_call>{"name": "now", "arguments": {}}</tool_call>'
    extra = {"structured_outputs": {"regex": re.escape(forced)}}
    message = (
        client.chat.completions.create(messages=ASK, max_tokens=100, extra_body=extra, **args)
        .choices[0]
        .message
    )
    assert message.content == "On it." and [c.function.name for c in message.tool_calls or []] == [
        "now"
    ]
    stream = client.chat.completions.create(
        messages=ASK, max_tokens=100, extra_body=extra, stream=True, **args
    )
    chunks = list(stream)
    content, calls, finish = _streamed_calls(chunks)
    assert content == "On it." and finish == "tool_calls"
    assert [(c["name"], json.loads(c["arguments"])) for c in calls.values()] == [("now", {})]
    # The text went out as it came, up to where the call began.
    assert sum(bool(c.choices[0].delta.content) for c in chunks) >= 2
    for body, param in (
        ({"tool_choice": named, "response_format": {"type": "json_object"}}, "tool_choice"),
        ({"tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice"),
        ({"tools": [{"type": "function", "function": {"name": "a b"}}]}, "tools"),
        ({"tools": [{"type": "other"}]}, "tools"),
    ):
        status, answer = post(
            f"{server.url}/v1/chat/completions", {"messages": ASK, "tools": TOOLS, **body}
        )
        assert status == 400 and answer["error"]["param"] == param, (body, answer)


@pytest.mark.parametrize(
    ("parser", "written"),
    [
        ("pythonic", '[get_weather(city="Oslo"), now()]'),
        ("llama3_json", '{"name": "get_weather", "parameters": {"city": "Oslo"}}; {"name": "now"}'),
    ],
)
def test_whole_answer_tool_formats(
    builtin_server: Callable[..., Server], parser: str, written: str
) -> None:
    """Formats whose calls are the whole answer: a stream holds the answer while it may be
    a call, and lets a plain one go as it comes."""
    server = builtin_server("--chat-template", TOOLS_TEMPLATE, "--tool-call-parser", parser)
    client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="none", max_retries=0)
    args: dict[str, Any] = dict(
        model="pagedserve-builtin", messages=ASK, tools=TOOLS, temperature=0, max_tokens=200
    )
    want = [("get_weather", {"city": "Oslo"}), ("now", {})]
    extra = {"structured_outputs": {"regex": re.escape(written)}}
    choice = client.chat.completions.create(extra_body=extra, **args).choices[0]
    assert choice.finish_reason == "tool_calls" and not choice.message.content
    calls = choice.message.tool_calls or []
    assert [(c.function.name, json.loads(c.function.arguments)) for c in calls] == want
    chunks = list(client.chat.completions.create(extra_body=extra, stream=True, **args))
    content, streamed, finish = _streamed_calls(chunks)
    assert content == "" and finish == "tool_calls"
    assert [(c["name"], json.loads(c["arguments"])) for c in streamed.values()] == want
    plain = {"structured_outputs": {"regex": re.escape("Sure, it is sunny in Oslo today.")}}
    chunks = list(client.chat.completions.create(extra_body=plain, stream=True, **args))
    content, streamed, finish = _streamed_calls(chunks)
    assert content == "Sure, it is sunny in Oslo today." and not streamed and finish == "stop"
    assert sum(bool(c.choices[0].delta.content) for c in chunks) >= 2  # not held to the end


def test_auto_tool_choice_needs_a_parser(server: Server) -> None:
    status, answer = post(f"{server.url}/v1/chat/completions", {"messages": ASK, "tools": TOOLS})
    assert status == 400 and answer["error"]["param"] == "tool_choice", answer
    assert "--tool-call-parser" in answer["error"]["message"]
    status, answer = post(
        f"{server.url}/v1/chat/completions",
        {"messages": CONVERSATION, "tools": TOOLS, "tool_choice": "none", "max_tokens": 2},
    )
    assert status == 200 and "tool_calls" not in answer["choices"][0]["message"], answer


def _post_stream(url: str, path: str, body: dict[str, Any]) -> tuple[socket.socket, bytes]:
    """A streamed POST on a raw socket (it stays usable after a read times out); the
    socket and what came after the response's headers so far."""
    host, port = url.removeprefix("http://").split(":")
    sock = socket.create_connection((host, int(port)), timeout=60)
    data = json.dumps(body).encode()
    head = f"POST {path} HTTP/1.1\r\nHost: {host}\r\nContent-Type: application/json\r\n"
    sock.sendall(f"{head}Content-Length: {len(data)}\r\nConnection: close\r\n\r\n".encode() + data)
    got = b""
    while b"\r\n\r\n" not in got:
        got += sock.recv(65536)
    status, rest = got.split(b"\r\n", 1)[0], got.split(b"\r\n\r\n", 1)[1]
    assert b" 200 " in status, got
    return sock, rest


def _read_to_end(sock: socket.socket, got: bytes) -> list[bytes]:
    while chunk := sock.recv(65536):
        got += chunk
    sock.close()
    return [line for line in got.split(b"\n") if line.startswith(b"data: ")]


def test_a_streamed_chat_opens_with_its_first_token(
    builtin_server: Callable[..., Server], tmp_path: Path
) -> None:
    """The role chunk goes with the first output, as vLLM sends it: a client timing a
    stream's first chunk (vLLM's `bench serve`) times the first token. One request at a
    time: while a long one runs, a queued chat stream sends nothing; once it runs, it
    opens with the role and then its tokens."""
    template = tmp_path / "chat.jinja"
    template.write_text("{% for m in messages %}{{ m['content'] }} {% endfor %}")
    s = builtin_server("--max-num-seqs", "1", "--chat-template", str(template))
    with urllib.request.urlopen(f"{s.url}/v1/models") as r:
        name = json.load(r)["data"][0]["id"]
    long = {"model": name, "prompt": [5, 6, 7], "max_tokens": 3000, "ignore_eos": True}
    long_sock, got = _post_stream(s.url, "/v1/completions", {**long, "stream": True})
    while b"data: " not in got:  # it runs: the queue is full
        got += long_sock.recv(65536)
    # Greedy: the long request's abort point (timing) moves a sampler's random state.
    chat = {
        "model": name,
        "messages": CONVERSATION,
        "max_tokens": 3,
        "stream": True,
        "temperature": 0,
        "ignore_eos": True,
    }
    sock, early = _post_stream(s.url, "/v1/chat/completions", chat)
    assert b"data: " not in early
    sock.settimeout(1.0)
    with pytest.raises(TimeoutError):
        early += sock.recv(65536)  # queued behind the long request: no chunk yet
    long_sock.close()  # aborts it: the chat request runs
    sock.settimeout(60)
    events = _read_to_end(sock, early)
    first = json.loads(events[0].removeprefix(b"data: "))
    assert first["choices"][0]["delta"]["role"] == "assistant", first
    contents = [json.loads(e.removeprefix(b"data: ")) for e in events[1:-1]]
    assert any(c["choices"] and c["choices"][0]["delta"].get("content") for c in contents)
    assert events[-1] == b"data: [DONE]"


def test_every_token_gets_its_chunk_while_its_text_is_held(
    server: Server, client: openai.OpenAI
) -> None:
    """A token whose text is held back (here: it could still start a stop string) still
    gets its own chunk, with empty text and its logprob, as vLLM streams it; the text
    comes whole at the end. A client that times tokens by chunks (vLLM's `bench serve`)
    sees one gap per token, not one per released piece of text."""
    x = 30  # "x" in the word tokenizer (tests/helpers/model_files.py)
    stop = ["x " * 20 + "q", "x" * 20 + "q"]  # every prefix of the answer could start one
    extra = {"allowed_token_ids": [x], "ignore_eos": True}
    common = {"model": MODEL_NAME, "max_tokens": N, "stop": stop, "stream": True}
    chunks = client.completions.create(prompt=PROMPT_TEXT, logprobs=0, extra_body=extra, **common)
    got = [ch.choices[0] for ch in chunks if ch.choices]
    assert len(got) == N, [c.text for c in got]
    assert [c.text for c in got[:-1]] == [""] * (N - 1)
    assert got[-1].text.replace(" ", "") == "x" * N and got[-1].finish_reason == "length"
    assert all(len(c.logprobs.tokens) == 1 for c in got)  # type: ignore[union-attr]
    stream = client.chat.completions.create(
        messages=[{"role": "user", "content": PROMPT_TEXT}], extra_body=extra, **common
    )
    deltas = [ch.choices[0] for ch in stream if ch.choices][1:]  # after the role chunk
    assert len(deltas) == N, [d.delta.content for d in deltas]
    assert [d.delta.content for d in deltas[:-1]] == [""] * (N - 1)
    assert (deltas[-1].delta.content or "").replace(" ", "") == "x" * N
