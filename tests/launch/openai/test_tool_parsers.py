"""launch/openai/tool_parsers.py: tool calls read out of a model's text in each
`--tool-call-parser` format, and how much of a streaming answer is content for sure (how
tools and tool_choice use them is in test_tools.py)."""

from __future__ import annotations

import json

import pytest

from launch.openai.tool_parsers import content_so_far, parse_calls


def _read(parser: str, text: str) -> tuple[str | None, list[tuple[str, object]]]:
    content, calls = parse_calls(parser, text)  # type: ignore[arg-type]
    return content, [(c.name, json.loads(c.arguments)) for c in calls]


OSLO = ("get_weather", {"city": "Oslo"})


@pytest.mark.parametrize(
    ("parser", "text", "content", "calls"),
    [
        (
            "hermes",
            'Let me check. <tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}\n'
            '</tool_call>\n<tool_call>{"name": "now"}</tool_call> <tool_call>not json</tool_call>',
            "Let me check. \n <tool_call>not json</tool_call>",
            [OSLO, ("now", {})],
        ),
        ("hermes", "no calls here", "no calls here", []),
        # Cut at max_tokens inside a block that still parses: read anyway.
        ("hermes", '<tool_call>{"name": "now", "arguments": {}}', None, [("now", {})]),
        ("hermes", "<tool_call>{", "<tool_call>{", []),
        (
            "llama3_json",
            '<|python_tag|>{"name": "get_weather", "parameters": {"city": "Oslo"}}; '
            '{"name": "now", "arguments": {}}',
            None,
            [OSLO, ("now", {})],
        ),
        ("llama3_json", ' {"name": "now"}\n', None, [("now", {})]),
        ("llama3_json", 'It is {"name": "now"}', 'It is {"name": "now"}', []),
        ("llama3_json", '{"name": "now", "parameters": {}} and more', None, None),
        ("llama3_json", '{"city": "Oslo"}', '{"city": "Oslo"}', []),  # no name: not a call
        (
            "mistral",
            'Checking.[TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Oslo"}}, '
            '{"name": "now", "arguments": {}}]',
            "Checking.",
            [OSLO, ("now", {})],
        ),
        (
            "mistral",
            '[TOOL_CALLS]get_weather[ARGS]{"city": "Oslo"}[TOOL_CALLS]now[ARGS]{}',
            None,
            [OSLO, ("now", {})],
        ),
        ("mistral", "[TOOL_CALLS][{", "[TOOL_CALLS][{", []),
        ("mistral", "plain", "plain", []),
        (
            "pythonic",
            '[get_weather(city="Oslo"), now()]',
            None,
            [OSLO, ("now", {})],
        ),
        ("pythonic", "<|python_start|>[now()]<|python_end|>", None, [("now", {})]),
        ("pythonic", "[1] is a citation", "[1] is a citation", []),
        ("pythonic", "[f(x)]", "[f(x)]", []),  # a positional argument: not a call
        ("pythonic", "[f(a=open('x'))]", "[f(a=open('x'))]", []),  # not a literal
    ],
)
def test_each_format_is_read_out_of_the_text(
    parser: str, text: str, content: str | None, calls: list | None
) -> None:
    if calls is None:  # trailing text after a whole-answer format: all content
        assert _read(parser, text) == (text, [])
    else:
        assert _read(parser, text) == (content, calls)


def test_mistral_call_ids_are_nine_letters_and_digits() -> None:
    _, calls = parse_calls("mistral", '[TOOL_CALLS][{"name": "now", "arguments": {}}]')
    assert len(calls[0].id) == 9 and calls[0].id.isalnum()
    _, calls = parse_calls("hermes", '<tool_call>{"name": "now"}</tool_call>')
    assert calls[0].id.startswith("call_")


@pytest.mark.parametrize(
    ("parser", "text", "content"),
    [
        ("hermes", "plain", 5),
        ("hermes", "ok <", 3),
        ("hermes", "ok <tool_ca", 3),
        ("hermes", "ok <tool_call>{", 3),
        ("hermes", "<x", 2),
        ("llama3_json", "  ", 0),
        ("llama3_json", " {", 0),
        ("llama3_json", "<|python", 0),
        ("llama3_json", "Hi {", 4),
        ("mistral", "Sure [TOOL_", 5),
        ("mistral", "Sure [TOOL_CALLS][", 5),
        ("pythonic", "[get", 0),
        ("pythonic", "Sure", 4),
    ],
)
def test_a_stream_holds_back_what_could_begin_a_call(parser: str, text: str, content: int) -> None:
    assert content_so_far(parser, text) == content  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("parser", "text"),
    [
        ("hermes", '<tool_call>{"name": "now", "arguments": [1]}</tool_call>'),
        ("hermes", '<tool_call>{"name": 7}</tool_call>'),
        ("mistral", '[TOOL_CALLS]{"name": "now"}'),
        ("mistral", "[TOOL_CALLS]now[ARGS][1]"),
        ("mistral", "[TOOL_CALLS]now"),
        ("pythonic", "[]"),
        ("pythonic", "[f(**extra)]"),
        ("pythonic", "[obj.method()]"),
    ],
)
def test_what_is_not_a_call_in_the_format_stays_content(parser: str, text: str) -> None:
    assert _read(parser, text) == (text, [])


def test_a_call_body_is_the_openai_tool_call_with_arguments_as_json_text() -> None:
    _, (call,) = parse_calls("pythonic", '[get_weather(city="Oslo", days=2, metric=True)]')
    body = call.body()
    assert body["id"] == call.id and body["type"] == "function"
    assert body["function"]["name"] == "get_weather"
    arguments = body["function"]["arguments"]
    assert isinstance(arguments, str)
    assert json.loads(arguments) == {"city": "Oslo", "days": 2, "metric": True}
