"""One Messages API request being generated (anthropic_protocol.py has its body): the
Message it ends as, whole, or Anthropic's stream of events as it grows.

The stream: message_start (the message with no content yet), ping, then each content
block opened (content_block_start), grown (content_block_delta: text_delta,
thinking_delta, input_json_delta) and closed (content_block_stop) in order, then
message_delta (stop_reason, stop_sequence, usage) and message_stop; a failure mid-stream
is an `error` event. Text streams as it comes (under tool_choice auto, up to where a call
may begin), a named tool's input as it comes, calls read whole at the end each as one
block with its whole input in one delta.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from typing import Any

from launch.openai.anthropic_protocol import MessagesRequest, error_body
from launch.openai.generation import Generation
from launch.openai.protocol import APIError
from launch.openai.response_shapes import sse_event
from launch.openai.tool_parsers import ToolCall, new_call_id
from launch.openai.tools import ToolPlan


class MessageRun:
    """One Messages request being generated: its Message, complete or as events."""

    def __init__(
        self,
        body: MessagesRequest,
        generation: Generation,
        plan: ToolPlan | None,
        model: str,
        show_thinking: bool,
    ) -> None:
        self.body = body
        self.generation = generation
        # Tools, unless "none": the answer may be tool_use blocks.
        self.plan = plan if plan is not None and plan.choice != "none" else None
        self.model = model
        self.show_thinking = show_thinking
        self.id = "msg_" + generation.id.split("-", 1)[1]

    # -- shapes -------------------------------------------------------------------------
    def message(
        self, content: list[dict[str, Any]], stop: tuple[str | None, str | None]
    ) -> dict[str, Any]:
        return {
            "id": self.id,
            "type": "message",
            "role": "assistant",
            "model": self.model,
            "content": content,
            "stop_reason": stop[0],
            "stop_sequence": stop[1],
            "usage": self._usage(),
        }

    def _usage(self) -> dict[str, Any]:
        """Anthropic counts prompt tokens read from the cache apart from input_tokens
        (their sum is the prompt); the cache hits are known at the finish."""
        gen = self.generation
        cached = gen.choices[0].num_cached
        return {
            "input_tokens": gen.num_prompt_tokens - cached,
            "output_tokens": gen.timer.num_tokens,
            "cache_creation_input_tokens": 0,
            "cache_read_input_tokens": cached,
        }

    def _stop(self, calls: list[ToolCall]) -> tuple[str, str | None]:
        """(stop_reason, stop_sequence) of the finished answer."""
        c = self.generation.choices[0]
        if c.finish == "length":
            return "max_tokens", None
        if calls:
            return "tool_use", None
        if isinstance(c.stop_reason, str):
            return "stop_sequence", c.stop_reason
        return "end_turn", None

    def _calls(self, text: str) -> tuple[str, list[ToolCall]]:
        """(text, calls) of the finished answer; a call whose input is not a JSON object
        (cut by max_tokens) stays text."""
        plan = self.plan
        if plan is None:
            return text, []
        c = self.generation.choices[0]
        content, calls = plan.calls(text, c.finish == "stop")
        kept, rest = [], [content or ""]
        for call in calls:
            if isinstance(_input(call.arguments), dict):
                kept.append(call)
            else:
                rest.append(call.arguments)
        return "".join(rest), kept

    # -- whole ---------------------------------------------------------------------------
    async def complete(self) -> dict[str, Any]:
        """The Message (APIError if generation failed)."""
        async for _ in self.generation.outputs():
            pass
        c = self.generation.choices[0]
        text, calls = self._calls("".join(c.texts))
        content: list[dict[str, Any]] = []
        thought = "".join(c.thoughts)
        if thought and self.show_thinking:
            content.append({"type": "thinking", "thinking": thought, "signature": ""})
        if text or not calls:
            content.append({"type": "text", "text": text})
        content += [_tool_use(call, _input(call.arguments)) for call in calls]
        return self.message(content, self._stop(calls))

    # -- streamed ------------------------------------------------------------------------
    async def events(self) -> AsyncIterator[bytes]:
        s = _Streamed()
        start = self.message([], (None, None))
        start["usage"] = {**start["usage"], "input_tokens": self.generation.num_prompt_tokens}
        yield sse_event({"type": "message_start", "message": start}, "message_start")
        yield sse_event({"type": "ping"}, "ping")
        c = self.generation.choices[0]
        named = self.plan is not None and self.plan.choice == "named"
        try:
            async for out in self.generation.outputs():
                events = []
                if self.show_thinking and c.thoughts and c.thoughts[-1]:
                    events += self._delta(s, "thinking", c.thoughts[-1])
                if named:
                    events += self._named_input(s, c.texts[-1])
                else:
                    events += self._delta(s, "text", self._releasable(s, out.finish_reason))
                for event in events:
                    yield event
        except APIError as e:
            yield sse_event(error_body(e), "error")
            return
        for event in self._close(s):
            yield event

    def _releasable(self, s: _Streamed, finish: str | None) -> str:
        """What of the text may go out now."""
        whole = "".join(self.generation.choices[0].texts)
        plan = self.plan
        if plan is None:
            return whole[len(s.text) :]
        if plan.choice == "auto" and finish is None:
            return whole[len(s.text) : max(len(s.text), plan.content_so_far(whole))]
        return ""  # calls read whole at the end

    def _open(self, s: _Streamed, kind: str, block: dict[str, Any]) -> list[bytes]:
        """The open block closed (if another kind) and a new one of this kind opened."""
        if s.kind == kind:
            return []
        events = self._close_block(s)
        s.kind = kind
        start = {"type": "content_block_start", "index": s.index, "content_block": block}
        return [*events, sse_event(start, "content_block_start")]

    def _close_block(self, s: _Streamed) -> list[bytes]:
        if s.kind is None:
            return []
        stop = {"type": "content_block_stop", "index": s.index}
        s.kind, s.index = None, s.index + 1
        return [sse_event(stop, "content_block_stop")]

    def _delta(self, s: _Streamed, kind: str, text: str) -> list[bytes]:
        """Text or thinking, in a block of its kind (opened at its first)."""
        if not text:
            return []
        if kind == "thinking":
            block = {"type": "thinking", "thinking": "", "signature": ""}
            delta = {"type": "thinking_delta", "thinking": text}
        else:
            block = {"type": "text", "text": ""}
            delta = {"type": "text_delta", "text": text}
            s.text += text
        events = self._open(s, kind, block)
        body = {"type": "content_block_delta", "index": s.index, "delta": delta}
        return [*events, sse_event(body, "content_block_delta")]

    def _named_input(self, s: _Streamed, text: str) -> list[bytes]:
        """A named tool's block, opened at once, and its input JSON so far."""
        events = []
        if s.call is None:
            plan = self.plan
            assert plan is not None and plan.name is not None
            s.call = ToolCall(plan.name, "", new_call_id(plan.parser))
            events += self._open(s, "tool_use", _tool_use(s.call, {}))
        if text:
            events.append(self._input_delta(s, text))
        return events

    def _input_delta(self, s: _Streamed, partial: str) -> bytes:
        delta = {"type": "input_json_delta", "partial_json": partial}
        body = {"type": "content_block_delta", "index": s.index, "delta": delta}
        return sse_event(body, "content_block_delta")

    def _close(self, s: _Streamed) -> list[bytes]:
        """The rest of the text and the calls, each block closed, then the message's end."""
        c = self.generation.choices[0]
        whole = "".join(c.texts)
        calls: list[ToolCall] = []
        events = []
        if s.call is not None or (self.plan is not None and self.plan.choice == "named"):
            events += self._named_input(s, "")  # no text at all: the block still opens
            assert s.call is not None
            calls = [ToolCall(s.call.name, whole, s.call.id)]
        else:
            rest, calls = self._calls(whole[len(s.text) :])
            events += self._delta(s, "text", rest)
            if not calls and s.kind != "text" and not s.text:
                events += self._open(s, "text", {"type": "text", "text": ""})  # empty answer
        for call in calls:
            if s.kind != "tool_use":
                events += self._open(s, "tool_use", _tool_use(call, {}))
                events.append(self._input_delta(s, call.arguments))
            events += self._close_block(s)
        events += self._close_block(s)
        stop_reason, stop_sequence = self._stop(calls)
        delta = {"stop_reason": stop_reason, "stop_sequence": stop_sequence}
        end = {"type": "message_delta", "delta": delta, "usage": self._usage()}
        events.append(sse_event(end, "message_delta"))
        events.append(sse_event({"type": "message_stop"}, "message_stop"))
        return events


def _tool_use(call: ToolCall, tool_input: Any) -> dict[str, Any]:
    # A call's id as the tool_use block's; the chat path's ids serve as well.
    return {"type": "tool_use", "id": call.id, "name": call.name, "input": tool_input}


def _input(arguments: str) -> Any:
    try:
        return json.loads(arguments) if arguments else {}
    except ValueError:
        return None


class _Streamed:
    """What a streamed message has sent so far."""

    __slots__ = ("call", "index", "kind", "text")

    def __init__(self) -> None:
        self.kind: str | None = None  # the open block's type
        self.index = 0  # the open (or next) block's index
        self.text = ""  # the text its deltas carried
        self.call: ToolCall | None = None  # a named tool's open block
