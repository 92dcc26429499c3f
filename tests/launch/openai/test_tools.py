"""launch/openai/tools.py: what tools and tool_choice make of a chat's answer (the server's
end-to-end tests are in test_serving_chat.py)."""

from __future__ import annotations

import json

import pytest

from launch.openai.tools import (
    FunctionDef,
    FunctionName,
    NamedToolChoice,
    ToolDef,
    ToolError,
    plan_tools,
    template_messages,
)
from worker.structured_output import grammar_of

WEATHER = ToolDef(
    "function",
    FunctionDef(
        "get_weather",
        parameters={
            "type": "object",
            "properties": {"city": {"type": "string"}},
            "required": ["city"],
        },
    ),
)
NOW = ToolDef("function", FunctionDef("now"))


@pytest.mark.parametrize(
    ("tools", "choice", "parser", "param", "message"),
    [
        (None, "required", None, "tool_choice", "needs tools"),
        ([WEATHER, WEATHER], "required", None, "tools", "distinct"),
        ([ToolDef("function", FunctionDef("a b"))], "required", None, "tools", "letters"),
        ([WEATHER], NamedToolChoice("function", FunctionName("x")), None, "tool_choice", "'x'"),
        ([WEATHER], "auto", None, "tool_choice", "--tool-call-parser"),
        ([WEATHER], None, None, "tool_choice", "--tool-call-parser"),  # auto by default
    ],
)
def test_plans_that_cannot_be_served_name_their_field(
    tools: list[ToolDef] | None, choice: object, parser: str | None, param: str, message: str
) -> None:
    with pytest.raises(ToolError, match=message) as e:
        plan_tools(tools, choice, True, parser)  # type: ignore[arg-type]
    assert e.value.param == param


def test_named_and_required_hold_the_output_to_the_tools_schemas() -> None:
    assert plan_tools(None, None, True, None) is None
    assert plan_tools(None, "none", True, None) is None
    named = plan_tools([WEATHER, NOW], NamedToolChoice("function", FunctionName("now")), True, None)
    assert named is not None and named.constraint is not None
    assert json.loads(named.constraint.json or "") == {"type": "object"}  # no parameters
    content, calls = named.calls('{"a": 1}', True)
    assert content is None and [(c.name, c.arguments) for c in calls] == [("now", '{"a": 1}')]
    required = plan_tools([WEATHER, NOW], "required", False, None)
    assert required is not None and required.constraint is not None
    schema = json.loads(required.constraint.json or "")
    assert schema["minItems"] == schema["maxItems"] == 1
    assert [s["properties"]["name"] for s in schema["items"]["anyOf"]] == [
        {"const": "get_weather"},
        {"const": "now"},
    ]
    grammar_of(required.constraint)  # it compiles
    text = json.dumps(
        [{"name": "get_weather", "parameters": {"city": "Oslo"}}, {"name": "now", "parameters": {}}]
    )
    content, calls = required.calls(text, True)
    assert content is None
    assert [(c.name, json.loads(c.arguments)) for c in calls] == [
        ("get_weather", {"city": "Oslo"}),
        ("now", {}),
    ]
    assert calls[0].id != calls[1].id and calls[0].id.startswith("call_")
    assert required.calls('[{"name": "now", "par', False) == ('[{"name": "now", "par', [])
    none = plan_tools([WEATHER], "none", True, None)
    assert none is not None and none.constraint is None and none.calls("hi", True) == ("hi", [])
    assert none.template_tools() == [
        {
            "type": "function",
            "function": {"name": "get_weather", "parameters": WEATHER.function.parameters},
        }
    ]


def test_without_parallel_calls_an_auto_answer_holds_one() -> None:
    text = '<tool_call>{"name": "now"}</tool_call><tool_call>{"name": "get_weather"}</tool_call>'
    for parallel, names in ((True, ["now", "get_weather"]), (False, ["now"])):
        plan = plan_tools([WEATHER, NOW], "auto", parallel, "hermes")
        assert plan is not None
        assert [c.name for c in plan.calls(text, True)[1]] == names


def test_a_named_mistral_call_gets_a_mistral_call_id() -> None:
    plan = plan_tools([NOW], NamedToolChoice("function", FunctionName("now")), True, "mistral")
    assert plan is not None and len(plan.calls("{}", True)[1][0].id) == 9


def test_tool_call_arguments_reach_the_template_as_objects() -> None:
    call = {"id": "c1", "type": "function", "function": {"name": "now", "arguments": '{"a": 1}'}}
    bad = {"id": "c2", "type": "function", "function": {"name": "now", "arguments": "{"}}
    messages = [
        {"role": "user", "content": "hi"},
        {"role": "assistant", "content": None, "tool_calls": [call, bad]},
        {"role": "tool", "tool_call_id": "c1", "content": "3"},
    ]
    out = template_messages(messages)
    assert out[1]["tool_calls"][0]["function"]["arguments"] == {"a": 1}
    assert out[1]["tool_calls"][1] == bad  # not JSON: left as sent
    assert messages[1]["tool_calls"][0] is call and call["function"]["arguments"] == '{"a": 1}'
    assert out[0] is messages[0] and out[2] is messages[2]
