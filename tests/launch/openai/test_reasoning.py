"""`--reasoning-parser`: a model's <think> block answered apart from its answer, whole and
streamed, in chat completions and the Responses API, with tool calls read from the answer
only. The built-in model is made to write such text by structured outputs (a random model
writes none of its own); the parser's rules alone are checked against a simple model."""

from __future__ import annotations

import re
from collections.abc import Iterator
from typing import Any

import openai
import pytest
from hypothesis import given
from hypothesis import strategies as st

from launch.openai.reasoning import ReasoningSplit, split_reasoning
from tests.helpers.server import TOOLS, Server, start_server

# Thinking off by default: the prompt closes an empty think block (Qwen3's template with
# enable_thinking false), so a structured output's language starts at once.
TEMPLATE = (
    "{% for m in messages %}{{ m.role }}: {{ m.content }}\n{% endfor %}assistant:"
    "{% if not thinking %}<think></think>{% endif %}"
)
THOUGHT = "Two and two. <tool_call>not a call</tool_call> So four"
ANSWER = "It is 4."
CALL = '<tool_call>{"name": "now", "arguments": {}}</tool_call>'


@pytest.mark.parametrize(
    ("parser", "text", "reasoning", "answer"),
    [
        ("qwen3", "<think>a b</think>\n\nc", "a b", "c"),
        ("qwen3", "  <think>a</think>c", "a", "c"),
        ("qwen3", "a</think>c", None, "a</think>c"),  # no block opened: all answer
        ("qwen3", "<think>cut off", "cut off", ""),
        ("qwen3", "<thi", None, "<thi"),
        ("qwen3", "<think></think>c", None, "c"),
        ("deepseek_r1", "a b</think>\n\nc", "a b", "c"),  # opened in the prompt
        ("deepseek_r1", "<think>a</think>c", "a", "c"),
        ("deepseek_r1", "cut off", "cut off", ""),  # never closed: all reasoning
        ("deepseek_r1", "a</think>", "a", ""),
        ("deepseek_r1", "a</think>c</think>", "a", "c</think>"),  # the first one ends it
    ],
)
def test_the_rules(parser: str, text: str, reasoning: str | None, answer: str) -> None:
    assert split_reasoning(parser, text) == (reasoning, answer)  # type: ignore[arg-type]


def _streamed(parser: str, pieces: list[str]) -> tuple[str, str, int]:
    s = ReasoningSplit(parser)  # type: ignore[arg-type]
    reasoning = answer = ""
    for piece in pieces:
        r, a = s.feed(piece, 1)
        assert not (a and s.thinking), "answer text while thinking"
        reasoning, answer = reasoning + r, answer + a
    r, a = s.finish()
    return reasoning + r, answer + a, s.reasoning_tokens


@given(
    st.sampled_from(["qwen3", "deepseek_r1"]),
    st.lists(st.sampled_from(["<think>", "</think>", "<", "/", "think", ">", "a", " ", "\n"])),
    st.data(),
)
def test_streamed_in_any_pieces_it_splits_as_whole(
    parser: str, parts: list[str], data: Any
) -> None:
    text = "".join(parts)
    cuts = sorted(data.draw(st.lists(st.integers(0, len(text)), max_size=8)))
    pieces = [text[i:j] for i, j in zip([0, *cuts], [*cuts, len(text)])]
    reasoning, answer, _ = _streamed(parser, pieces)
    want_reasoning, want_answer = split_reasoning(parser, text)  # type: ignore[arg-type]
    assert (reasoning or None, answer) == (want_reasoning, want_answer)


def test_reasoning_tokens_count_up_to_the_closing_tag() -> None:
    text = "<think>ab</think>cd"
    assert _streamed("qwen3", list(text))[2] == text.index("d") - 1  # through the ">"
    assert _streamed("qwen3", list(" hello"))[2] == 0  # a held space is not reasoning
    assert _streamed("deepseek_r1", list("ab"))[2] == 2


# -- through the server -----------------------------------------------------------------
@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    flags = ("--chat-template", TEMPLATE, "--reasoning-parser", "qwen3")
    s = start_server(
        None, tmp_path_factory.mktemp("reasoning"), *flags, "--tool-call-parser", "hermes"
    )
    yield s
    s.stop()


@pytest.fixture(scope="module")
def client(server: Server) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key="none", max_retries=0)


def _forced(text: str) -> dict[str, Any]:
    """The body's extension that makes the random model write exactly text."""
    return {"structured_outputs": {"regex": re.escape(text)}}


ASK = [{"role": "user", "content": "2 + 2?"}]
ARGS: dict[str, Any] = dict(model="pagedserve-builtin", temperature=0, max_tokens=200)


def test_chat_answers_reasoning_apart(client: openai.OpenAI) -> None:
    extra = _forced(f"<think>{THOUGHT}</think>\n\n{ANSWER}")
    message = (
        client.chat.completions.create(messages=ASK, extra_body=extra, **ARGS).choices[0].message
    )
    assert message.content == ANSWER
    assert message.reasoning == THOUGHT  # type: ignore[attr-defined]
    chunks = list(
        client.chat.completions.create(messages=ASK, extra_body=extra, stream=True, **ARGS)
    )
    thoughts = [getattr(c.choices[0].delta, "reasoning", None) for c in chunks if c.choices]
    content = [c.choices[0].delta.content for c in chunks if c.choices]
    assert "".join(t for t in thoughts if t) == THOUGHT and sum(bool(t) for t in thoughts) >= 2
    assert "".join(t for t in content if t) == ANSWER
    # Reasoning first, then the answer: no chunk of the answer comes before the last thought.
    last_thought = max(i for i, t in enumerate(thoughts) if t)
    assert all(not t for t in content[:last_thought])
    hidden = (
        client.chat.completions.create(
            messages=ASK, extra_body={**extra, "include_reasoning": False}, **ARGS
        )
        .choices[0]
        .message
    )
    assert hidden.content == ANSWER and getattr(hidden, "reasoning", None) is None


def test_tool_calls_are_read_from_the_answer_only(client: openai.OpenAI) -> None:
    """The thinking holds a <tool_call> block too: only the answer's is a call."""
    extra = _forced(f"<think>{THOUGHT}</think>{ANSWER}{CALL}")
    args = dict(messages=ASK, tools=TOOLS, extra_body=extra, **ARGS)
    choice = client.chat.completions.create(**args).choices[0]  # type: ignore[call-overload]
    assert choice.finish_reason == "tool_calls"
    assert choice.message.reasoning == THOUGHT and choice.message.content == ANSWER
    assert [c.function.name for c in choice.message.tool_calls] == ["now"]
    chunks = list(client.chat.completions.create(stream=True, **args))  # type: ignore[call-overload]
    calls = [t for c in chunks for t in (c.choices[0].delta.tool_calls or [])]
    assert [c.function.name for c in calls] == ["now"]
    thought = "".join(getattr(c.choices[0].delta, "reasoning", None) or "" for c in chunks)
    assert thought == THOUGHT


def test_responses_answer_a_reasoning_item_first(client: openai.OpenAI) -> None:
    extra = _forced(f"<think>{THOUGHT}</think>{ANSWER}")
    args = dict(model="pagedserve-builtin", input="2 + 2?", temperature=0, extra_body=extra)
    r = client.responses.create(max_output_tokens=200, **args)  # type: ignore[arg-type]
    assert [o.type for o in r.output] == ["reasoning", "message"]
    assert r.output[0].content[0].text == THOUGHT  # type: ignore[union-attr,index]
    assert r.output_text == ANSWER
    assert r.usage is not None
    assert 0 < r.usage.output_tokens_details.reasoning_tokens < r.usage.output_tokens
    events = list(client.responses.create(max_output_tokens=200, stream=True, **args))  # type: ignore[arg-type]
    kinds = [e.type for e in events]
    thoughts = [e for e in events if e.type == "response.reasoning_text.delta"]
    assert len(thoughts) >= 2 and "".join(e.delta for e in thoughts) == THOUGHT
    assert {e.output_index for e in thoughts} == {0}
    texts = [e for e in events if e.type == "response.output_text.delta"]
    assert "".join(e.delta for e in texts) == ANSWER and {e.output_index for e in texts} == {1}
    # The reasoning item closes before the message opens.
    assert kinds.index("response.reasoning_text.done") < kinds.index("response.output_text.delta")
    done = events[-1].response  # type: ignore[union-attr]
    assert [o.type for o in done.output] == ["reasoning", "message"]
    assert done.output_text == ANSWER
    # Sent back as input, the reasoning item is left out of the conversation.
    again = client.responses.create(
        model="pagedserve-builtin",
        input=[{"role": "user", "content": "2 + 2?"}, *[o.model_dump() for o in r.output]],  # type: ignore[list-item]
        max_output_tokens=1,
    )
    status_ok = again.status in ("completed", "incomplete")
    plain = client.responses.create(
        model="pagedserve-builtin",
        input=[
            {"role": "user", "content": "2 + 2?"},
            {"role": "assistant", "content": ANSWER},
        ],
        max_output_tokens=1,
    )
    assert status_ok and again.usage is not None and plain.usage is not None
    assert again.usage.input_tokens == plain.usage.input_tokens


def test_a_structured_output_holds_the_answer_not_the_thinking(client: openai.OpenAI) -> None:
    """With thinking on, the language waits for </think> in the output (which this random
    model never writes: its output stays free); with the prompt's think block closed it
    holds the output from the first token."""
    args = dict(model="pagedserve-builtin", messages=ASK, temperature=0, max_tokens=12)
    extra = {"structured_outputs": {"regex": "[0-9]{4}"}}
    held = client.chat.completions.create(extra_body=extra, **args).choices[0]  # type: ignore[call-overload]
    assert re.fullmatch("[0-9]{4}", held.message.content) and held.finish_reason == "stop"
    thinking = {**extra, "chat_template_kwargs": {"thinking": True}}
    free = client.chat.completions.create(extra_body=thinking, **args).choices[0]  # type: ignore[call-overload]
    assert free.finish_reason == "length"
    assert not re.fullmatch("[0-9]{4}", free.message.content or "")
