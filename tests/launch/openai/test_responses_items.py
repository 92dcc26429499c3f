"""A Responses body's input items as chat messages, and truncation's oldest turn
(responses_items.py)."""

from __future__ import annotations

import pytest

from launch.openai.protocol import APIError
from launch.openai.responses_items import input_messages, turn_starts, without_oldest_turns


def test_input_items_become_chat_messages() -> None:
    items = [
        {"role": "developer", "content": "Be brief."},
        {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "a"}]},
        {"role": "assistant", "content": [{"type": "output_text", "text": "b", "annotations": []}]},
        {"type": "function_call", "call_id": "1", "name": "f", "arguments": "{}"},
        {"type": "function_call", "call_id": "2", "name": "g", "arguments": "{}"},
        {"type": "function_call_output", "call_id": "1", "output": "x"},
        {
            "type": "function_call_output",
            "call_id": "2",
            "output": [{"type": "input_text", "text": "y"}],
        },
    ]
    call = lambda i, n: {"id": i, "type": "function", "function": {"name": n, "arguments": "{}"}}  # noqa: E731
    assert input_messages(items) == [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "a"},
        {"role": "assistant", "content": "b", "tool_calls": [call("1", "f"), call("2", "g")]},
        {"role": "tool", "tool_call_id": "1", "content": "x"},
        {"role": "tool", "tool_call_id": "2", "content": "y"},
    ]
    assert input_messages("hi") == [{"role": "user", "content": "hi"}]
    for bad in ([1], [{"type": "function_call", "name": "f"}], [{"role": "user", "content": 3}]):
        with pytest.raises(APIError) as e:
            input_messages(bad)
        assert e.value.param == "input"


def test_the_oldest_turn_goes_with_the_tool_results_that_answered_it() -> None:
    s, u, a, t = ({"role": r, "content": r} for r in ("system", "user", "assistant", "tool"))
    assert turn_starts([s, u, a, u]) == [1, 2, 3]
    assert without_oldest_turns([s, u, a, u], 2) == [s, a, u]
    assert turn_starts([s, a, t, t, u]) == [1, 4]
    assert without_oldest_turns([s, a, t, t, u], 4) == [s, u]
    assert turn_starts([s, u]) == [1]  # one turn: nothing more can go
    assert turn_starts([u]) == [0]
    assert turn_starts([s, s, u, a, t, a]) == [2, 3, 5]
