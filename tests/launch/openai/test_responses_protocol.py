"""launch/openai/responses_protocol.py: a Responses body decoded strictly, refused where
this engine cannot serve it, and turned into the chat completion that samples it."""

from __future__ import annotations

from typing import Any

import msgspec
import pytest

from launch.openai.protocol import APIError
from launch.openai.responses_protocol import LOGPROBS_INCLUDE, ResponsesRequest
from launch.openai.tools import FunctionName, NamedToolChoice

MESSAGES = [{"role": "user", "content": "hi"}]


def _decode(**body: Any) -> Any:
    return msgspec.json.decode(msgspec.json.encode({"input": "hi", **body}), type=ResponsesRequest)


def test_an_unknown_field_is_refused_at_decoding() -> None:
    with pytest.raises(msgspec.ValidationError, match="unknown field `temperatures`"):
        _decode(temperatures=1.0)


def test_sampling_fields_tools_and_format_become_the_chat_request() -> None:
    req = _decode(
        max_output_tokens=7,
        temperature=0.5,
        top_k=3,
        stop=["END"],
        tools=[{"type": "function", "name": "now", "description": "the time"}],
        tool_choice={"type": "function", "name": "now"},
        text={"format": {"type": "json_schema", "name": "s", "schema": {"type": "object"}}},
        stream=True,
    )
    req.check()
    chat = req.chat_request(MESSAGES)
    assert chat.messages == MESSAGES and chat.max_completion_tokens == 7
    assert (chat.temperature, chat.top_k, chat.stop, chat.stream) == (0.5, 3, ["END"], True)
    assert chat.tools is not None and chat.tools[0].function.name == "now"
    assert chat.tools[0].function.description == "the time"
    assert chat.tool_choice == NamedToolChoice("function", FunctionName("now"))
    assert chat.response_format is not None and chat.response_format.type == "json_schema"
    assert chat.response_format.json_schema is not None
    assert chat.response_format.json_schema.schema == {"type": "object"}
    assert not chat.logprobs and chat.top_logprobs is None


@pytest.mark.parametrize(
    ("body", "top"),
    [({"include": [LOGPROBS_INCLUDE]}, None), ({"top_logprobs": 3}, 3), ({}, None)],
)
def test_logprobs_are_asked_by_include_or_top_logprobs(body: dict[str, Any], top: int) -> None:
    req = _decode(**body)
    chat = req.chat_request(MESSAGES)
    assert chat.logprobs is req.wants_logprobs is bool(body)
    assert chat.top_logprobs == top


@pytest.mark.parametrize(
    ("body", "param", "message"),
    [
        ({"background": True, "stream": True}, "background", "background needs store"),
        ({"background": True, "store": False}, "background", "background needs store"),
        ({"reasoning": {"effort": "high"}}, "reasoning", "reasoning: not supported"),
        ({"text": {"verbosity": "low"}}, "text.verbosity", "text.verbosity: not supported"),
        ({"include": ["file_search_call.results"]}, "include", "include takes only"),
        ({"max_output_tokens": 0}, "max_output_tokens", "max_output_tokens must be >= 1"),
        ({"metadata": {f"k{i}": "v" for i in range(17)}}, "metadata", "at most 16 pairs"),
        ({"metadata": {"k": "v" * 513}}, "metadata", "values of at most 512"),
    ],
)
def test_what_cannot_be_served_is_a_400_naming_the_parameter(
    body: dict[str, Any], param: str, message: str
) -> None:
    with pytest.raises(APIError) as info:
        _decode(**body).check()
    assert info.value.status == 400 and info.value.param == param
    assert message in info.value.message


def test_the_options_openai_accepts_as_no_ops_pass_the_check() -> None:
    _decode(
        reasoning={"effort": "none"},
        text={"verbosity": "medium"},
        include=[LOGPROBS_INCLUDE],
        metadata={"k" * 64: "v" * 512},
    ).check()


def test_a_json_schema_format_without_its_schema_is_refused() -> None:
    req = _decode(text={"format": {"type": "json_schema", "name": "s"}})
    with pytest.raises(APIError, match="needs a name and a schema") as info:
        req.chat_request(MESSAGES)
    assert info.value.param == "text.format"
