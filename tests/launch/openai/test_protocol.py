"""The request bodies (protocol.py): sampling fields declared once, by SamplingParams, and
a bad body an APIError naming its field."""

from __future__ import annotations

import logging

import msgspec
import pytest

from launch.openai.protocol import (
    APIError,
    ChatCompletionRequest,
    CompletionRequest,
    decode_body,
)
from launch.openai.responses_protocol import ResponsesRequest
from protocol.engine import SamplingParams

# Where a body's field differs from SamplingParams' (null for the default, one stop string).
HTTP_TYPES = {
    "max_tokens": int | None,
    "stop_token_ids": list[int] | None,
    "bad_words": list[str] | None,
    "stop": str | list[str] | None,
}


@pytest.mark.parametrize("body", [CompletionRequest, ChatCompletionRequest, ResponsesRequest])
def test_a_bodys_sampling_fields_are_sampling_params_declarations(body: type) -> None:
    declared = {f.name: f for f in msgspec.structs.fields(SamplingParams)}
    shared = [f for f in msgspec.structs.fields(body) if f.name in declared]
    assert {"temperature", "top_p", "seed", "stop", "presence_penalty"} <= {f.name for f in shared}
    for f in shared:
        if f.name in HTTP_TYPES:
            assert f.type == HTTP_TYPES[f.name] and f.default is None, f.name
        elif f.name not in ("structured_outputs", "logprobs"):  # the body's own types
            want = declared[f.name]
            assert (f.type, f.default) == (want.type, want.default), f.name


@pytest.mark.parametrize(
    ("raw", "param", "code"),
    [
        (b'{"prompt": "x", "temperature": "hot"}', "temperature", "invalid_type"),
        (b'{"prompt": "x", "bogus": 1}', "bogus", "unknown_parameter"),
        (b'{"max_tokens": 3}', "prompt", "missing_required_parameter"),
        (b'{"prompt": "x", "suffix": "y"}', "suffix", "unsupported_parameter"),
        (b"{not json", None, "invalid_json"),
        (b'{"prompt": "x", "temperature": 2.5}', "temperature", "invalid_value"),
        (b'{"prompt": "x", "stream_options": {}}', "stream_options", "invalid_value"),
        (b'{"prompt": "x", "n": 2, "temperature": 0}', "n", "invalid_value"),
    ],
    ids=[
        "wrong type",
        "unknown field (strict)",
        "missing prompt",
        "unsupported",
        "not JSON",
        "temperature above 2",
        "stream_options without stream",
        "greedy n above 1",
    ],
)
def test_a_bad_body_names_its_field(raw: bytes, param: str | None, code: str) -> None:
    with pytest.raises(APIError) as bad:
        decode_body(raw, CompletionRequest, strict=True)
    assert (bad.value.status, bad.value.param, bad.value.code) == (400, param, code)


def test_unknown_fields_are_dropped_where_they_are_with_one_warning(
    caplog: pytest.LogCaptureFixture,
) -> None:
    raw = (
        b'{"prompt": "x", "bogus": 1, "response_format": {"type": "text", "new": [1]},'
        b' "metadata": {"a": "b"}}'
    )
    with caplog.at_level(logging.DEBUG, logger="pagedserve.openai"):
        body = decode_body(raw, CompletionRequest)
    assert body.prompt == "x" and body.response_format.type == "text"
    warned = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert warned == [
        "CompletionRequest: ignored unknown request fields: bogus, response_format.new"
    ]
    noted = [r.getMessage() for r in caplog.records if r.levelno == logging.DEBUG]
    assert noted == ["CompletionRequest: accepted, with no effect here: metadata"]
    # Greedy beam search takes n as its width.
    body = decode_body(
        b'{"prompt": "x", "n": 2, "temperature": 0, "use_beam_search": true}', CompletionRequest
    )
    assert body.n == 2


def test_functions_and_function_call_become_tools_and_tool_choice() -> None:
    raw = (
        b'{"messages": [], "functions": [{"name": "f", "parameters": {"type": "object"}}],'
        b' "function_call": {"name": "f"}}'
    )
    body = decode_body(raw, ChatCompletionRequest)
    assert body.tools is not None and [t.function.name for t in body.tools] == ["f"]
    assert body.tool_choice.function.name == "f"
    body = decode_body(
        b'{"messages": [], "functions": [{"name": "f"}], "function_call": "none"}',
        ChatCompletionRequest,
    )
    assert body.tool_choice == "none"


def test_null_and_one_string_take_the_http_meanings() -> None:
    body = decode_body(b'{"prompt": "x", "stop": "a", "stop_token_ids": null}', CompletionRequest)
    assert body.stop_strings() == ["a"] and body.stop_token_ids is None
    assert body.n == 1 and body.skip_special_tokens and body.bad_words is None
