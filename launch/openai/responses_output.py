"""One Responses API request being generated (responses_protocol.py has its body, the
conversation it stands for): the Response it ends as, whole, or OpenAI's
typed event stream as it grows: reasoning, text or a named function's arguments as they
come, calls that must be read whole at the end, each item opened and closed in order."""

from __future__ import annotations

import time
from collections.abc import AsyncIterator
from typing import Any

import msgspec

from launch.openai.generation import Generation
from launch.openai.protocol import APIError
from launch.openai.response_shapes import chat_logprobs, sse_event
from launch.openai.responses_items import input_item_list, new_item_id
from launch.openai.responses_protocol import ResponsesRequest, TextFormat
from launch.openai.responses_store import ResponseStore, StoredResponse
from launch.openai.tool_parsers import ToolCall, new_call_id
from launch.openai.tools import ToolPlan


class ResponseRun:
    """One Responses request being generated: its Response, complete or as events."""

    def __init__(
        self,
        body: ResponsesRequest,
        generation: Generation,
        plan: ToolPlan | None,
        model: str,
        messages: list[dict[str, Any]],
        store: ResponseStore,
    ) -> None:
        self.body = body
        self.generation = generation
        # Tools, unless "none": the answer may be function calls.
        self.plan = plan if plan is not None and plan.choice != "none" else None
        self.model = model
        self.messages = messages
        self.store = store if body.store and store.capacity else None
        self.id = "resp_" + generation.id.split("-", 1)[1]
        self.created = int(time.time())
        self._seq = 0

    # -- shapes -------------------------------------------------------------------------
    def response(
        self,
        status: str,
        output: list[dict[str, Any]] | None = None,
        error: dict[str, Any] | None = None,
    ) -> dict[str, Any]:
        b = self.body
        done = status in ("completed", "incomplete")
        choice = b.tool_choice
        fmt = b.text.format if b.text is not None and b.text.format else TextFormat("text")
        return {
            "id": self.id,
            "object": "response",
            "created_at": self.created,
            "completed_at": int(time.time()) if done else None,
            "status": status,
            "error": error,
            "incomplete_details": {"reason": "max_output_tokens"}
            if status == "incomplete"
            else None,
            "instructions": b.instructions,
            "max_output_tokens": b.max_output_tokens,
            "model": self.model,
            "output": output or [],
            "parallel_tool_calls": b.parallel_tool_calls,
            "previous_response_id": b.previous_response_id,
            "temperature": b.temperature,
            "top_p": b.top_p,
            "top_logprobs": b.top_logprobs,
            "tool_choice": msgspec.to_builtins(choice) if choice is not None else "auto",
            "tools": msgspec.to_builtins(b.tools or []),
            "text": {"format": msgspec.to_builtins(fmt)},
            "truncation": b.truncation,
            "store": self.store is not None,
            "metadata": b.metadata or {},
            "user": b.user,
            "safety_identifier": b.safety_identifier,
            "prompt_cache_key": b.prompt_cache_key,
            "service_tier": b.service_tier or "default",
            "reasoning": None,
            "background": b.background,
            "usage": self._usage() if done else None,
        }

    def _usage(self) -> dict[str, Any]:
        gen = self.generation
        inputs, outputs = gen.num_prompt_tokens, gen.timer.num_tokens
        cached = gen.choices[0].num_cached
        return {
            "input_tokens": inputs,
            # Written: the prompt tokens computed now (prefix caching keeps their blocks).
            "input_tokens_details": {
                "cached_tokens": cached,
                "cache_write_tokens": inputs - cached,
            },
            "output_tokens": outputs,
            "output_tokens_details": {"reasoning_tokens": self._reasoning_tokens()},
            "total_tokens": inputs + outputs,
        }

    def _reasoning_tokens(self) -> int:
        split = self.generation.choices[0].split
        return split.reasoning_tokens if split is not None else 0

    def _status(self) -> str:
        return "incomplete" if self.generation.choices[0].finish == "length" else "completed"

    def _logprobs(self, start: int, end: int | None = None) -> list[dict[str, Any]]:
        c = self.generation.choices[0]
        if c.logprobs is None:
            return []
        ids, lps = c.ids[start:end], c.logprobs[start:end]
        return chat_logprobs(ids, lps, self.generation.token_text)["content"]

    @staticmethod
    def _message(item_id: str, status: str, content: list[dict[str, Any]]) -> dict[str, Any]:
        return {
            "id": item_id,
            "type": "message",
            "status": status,
            "role": "assistant",
            "content": content,
        }

    @staticmethod
    def _text_part(text: str, logprobs: list[dict[str, Any]]) -> dict[str, Any]:
        return {"type": "output_text", "text": text, "annotations": [], "logprobs": logprobs}

    @staticmethod
    def _call_item(item_id: str, call: ToolCall, status: str, arguments: str) -> dict[str, Any]:
        return {
            "id": item_id,
            "type": "function_call",
            "status": status,
            "call_id": call.id,
            "name": call.name,
            "arguments": arguments,
        }

    def _finish(
        self, output: list[dict[str, Any]], text: str | None, calls: list[ToolCall]
    ) -> dict[str, Any]:
        """The final Response; stored, with the conversation it ends, when asked."""
        status = self._status()
        answer = self.response(status, output)
        if self.store is not None:
            turn: dict[str, Any] = {"role": "assistant", "content": text}
            if calls:
                turn["tool_calls"] = [c.body() for c in calls]
            items = input_item_list(self.body.input)
            if not self.store.put(self.id, StoredResponse(answer, [*self.messages, turn], items)):
                answer["store"] = False  # over the store's whole byte budget: not kept
        return answer

    # -- whole ---------------------------------------------------------------------------
    async def complete(self) -> dict[str, Any]:
        """The Response (APIError if generation failed)."""
        async for _ in self.generation.outputs():
            pass
        c = self.generation.choices[0]
        text: str | None = "".join(c.texts)
        calls: list[ToolCall] = []
        if self.plan is not None:
            text, calls = self.plan.calls(text, c.finish == "stop")
        status = self._status()
        output = []
        thought = "".join(c.thoughts)
        if thought:
            output.append(self._reasoning_item(new_item_id("rs"), status, thought))
        if text or not calls:
            part = self._text_part(text or "", self._logprobs(0))
            output.append(self._message(new_item_id("msg"), status, [part]))
        output += [
            self._call_item(new_item_id("fc"), call, status, call.arguments) for call in calls
        ]
        return self._finish(output, text, calls)

    @staticmethod
    def _reasoning_item(item_id: str, status: str, text: str | None) -> dict[str, Any]:
        content = [] if text is None else [{"type": "reasoning_text", "text": text}]
        return {
            "id": item_id,
            "type": "reasoning",
            "status": status,
            "summary": [],
            "content": content,
        }

    # -- streamed ------------------------------------------------------------------------
    def _event(self, kind: str, **fields: Any) -> bytes:
        body = {"type": kind, "sequence_number": self._seq, **fields}
        self._seq += 1
        return sse_event(body, kind)

    def _part_event(self, kind: str, item_id: str, index: int, **fields: Any) -> bytes:
        """An event about the (only) content part of output item `index`."""
        return self._event(kind, item_id=item_id, output_index=index, content_index=0, **fields)

    async def events(self) -> AsyncIterator[bytes]:
        """OpenAI's stream of typed events for this response: reasoning and text as they
        come (under tool_choice "auto", text up to where a call may begin), a named
        function's arguments as they come, calls that must be read whole at the end."""
        yield self._event("response.created", response=self.response("in_progress"))
        yield self._event("response.in_progress", response=self.response("in_progress"))
        s = _Streamed()
        c = self.generation.choices[0]
        named = self.plan is not None and self.plan.choice == "named"
        try:
            async for out in self.generation.outputs():
                text = c.texts[-1]
                events = self._thought_delta(s, c.thoughts[-1] if c.thoughts else "")
                if named:
                    events += self._arguments_delta(s, text)
                else:
                    events += self._text_delta(s, self._releasable(s, out.finish_reason, text))
                for event in events:
                    yield event
        except APIError as e:
            error = {"code": e.code or "server_error", "message": e.message}
            yield self._event("response.failed", response=self.response("failed", s.output, error))
            return
        for event in self._close(s):
            yield event

    def _thought_delta(self, s: _Streamed, thought: str) -> list[bytes]:
        """Reasoning text, in the reasoning item (output 0), opened at its first."""
        if not thought:
            return []
        events = []
        if s.reasoning is None:
            s.reasoning = new_item_id("rs")
            item = self._reasoning_item(s.reasoning, "in_progress", None)
            events.append(self._event("response.output_item.added", output_index=0, item=item))
            part = {"type": "reasoning_text", "text": ""}
            events.append(
                self._part_event("response.content_part.added", s.reasoning, 0, part=part)
            )
        events.append(
            self._part_event("response.reasoning_text.delta", s.reasoning, 0, delta=thought)
        )
        s.thought += thought
        return events

    def _close_reasoning(self, s: _Streamed) -> list[bytes]:
        """The reasoning item closed, before the answer's first item opens."""
        if s.reasoning is None:
            return []
        part = {"type": "reasoning_text", "text": s.thought}
        item = self._reasoning_item(s.reasoning, "completed", s.thought)
        events = [
            self._part_event("response.reasoning_text.done", s.reasoning, 0, text=s.thought),
            self._part_event("response.content_part.done", s.reasoning, 0, part=part),
            self._event("response.output_item.done", output_index=0, item=item),
        ]
        s.output.append(item)
        s.reasoning = None
        return events

    def _releasable(self, s: _Streamed, finish: str | None, text: str) -> str:
        """What of the text may go out now."""
        plan = self.plan
        if plan is None:
            return text
        if plan.choice == "auto" and finish is None:
            whole = "".join(self.generation.choices[0].texts)
            return whole[len(s.text) : max(len(s.text), plan.content_so_far(whole))]
        return ""  # calls read whole at the end

    def _text_delta(self, s: _Streamed, text: str, last: bool = False) -> list[bytes]:
        """A delta of text; the last one also carries the logprobs of tokens that had no
        text of their own (special tokens)."""
        c = self.generation.choices[0]
        if not text and not (last and c.logprobs and s.sent < len(c.ids)):
            return []
        events = self._open_message(s)
        assert s.message is not None
        logprobs = self._logprobs(s.sent)
        events.append(
            self._part_event(
                "response.output_text.delta", s.message, s.index, delta=text, logprobs=logprobs
            )
        )
        s.text += text
        s.sent = len(c.ids)
        return events

    def _open_message(self, s: _Streamed) -> list[bytes]:
        if s.message is not None:
            return []
        events = self._close_reasoning(s)
        s.message, s.index = new_item_id("msg"), len(s.output)
        item = self._message(s.message, "in_progress", [])
        return [
            *events,
            self._event("response.output_item.added", output_index=s.index, item=item),
            self._part_event(
                "response.content_part.added", s.message, s.index, part=self._text_part("", [])
            ),
        ]

    def _arguments_delta(self, s: _Streamed, text: str) -> list[bytes]:
        """A named function's call item, opened at once, and its arguments so far."""
        events = []
        if s.call is None:
            assert self.plan is not None and self.plan.name is not None
            events += self._close_reasoning(s)
            s.call, s.index = (
                (new_item_id("fc"), ToolCall(self.plan.name, "", new_call_id(self.plan.parser))),
                len(s.output),
            )
            events.append(self._open_call(*s.call, s.index))
        if text:
            events.append(self._arguments(s.call[0], s.index, text))
        return events

    def _open_call(self, item_id: str, call: ToolCall, index: int) -> bytes:
        item = self._call_item(item_id, call, "in_progress", "")
        return self._event("response.output_item.added", output_index=index, item=item)

    def _arguments(self, item_id: str, index: int, delta: str) -> bytes:
        return self._event(
            "response.function_call_arguments.delta",
            item_id=item_id,
            output_index=index,
            delta=delta,
        )

    def _close(self, s: _Streamed) -> list[bytes]:
        """The rest of the text and the calls, each item closed, then the Response."""
        c = self.generation.choices[0]
        plan = self.plan
        status = self._status()
        whole = "".join(c.texts)
        text: str | None = s.text
        calls: list[ToolCall] = []
        events = self._close_reasoning(s)
        if plan is not None and plan.choice == "named":
            events += self._arguments_delta(s, "")  # no text at all: the item still opens
            assert s.call is not None
            calls = [ToolCall(s.call[1].name, whole, s.call[1].id)]
            text = None
        elif plan is not None:
            rest, calls = plan.calls(whole[len(s.text) :], c.finish == "stop")
            text = s.text + (rest or "")
        if text or not calls:
            text = text or ""
            events += self._text_delta(s, text[len(s.text) :], last=True)
            events += self._open_message(s)  # an empty answer is an empty message
            assert s.message is not None
            logprobs = self._logprobs(0)
            part = self._text_part(text, logprobs)
            events.append(
                self._part_event(
                    "response.output_text.done", s.message, s.index, text=text, logprobs=logprobs
                )
            )
            events.append(
                self._part_event("response.content_part.done", s.message, s.index, part=part)
            )
            item = self._message(s.message, status, [part])
            events.append(self._event("response.output_item.done", output_index=s.index, item=item))
            s.output.append(item)
        for call in calls:
            index = len(s.output)
            if s.call is not None:
                item_id = s.call[0]  # opened and streamed already
            else:
                item_id = new_item_id("fc")
                events.append(self._open_call(item_id, call, index))
                events.append(self._arguments(item_id, index, call.arguments))
            events.append(
                self._event(
                    "response.function_call_arguments.done",
                    item_id=item_id,
                    output_index=index,
                    name=call.name,
                    arguments=call.arguments,
                )
            )
            item = self._call_item(item_id, call, status, call.arguments)
            events.append(self._event("response.output_item.done", output_index=index, item=item))
            s.output.append(item)
        answer = self._finish(s.output, text if (text or not calls) else None, calls)
        kind = "response.incomplete" if status == "incomplete" else "response.completed"
        events.append(self._event(kind, response=answer))
        return events


class _Streamed:
    """What a streamed response has sent so far."""

    __slots__ = ("call", "index", "message", "output", "reasoning", "sent", "text", "thought")

    def __init__(self) -> None:
        self.reasoning: str | None = None  # the open reasoning item's id
        self.thought = ""  # the reasoning its deltas carried
        self.index = 0  # the open message's or named call's place in the output
        self.message: str | None = None  # the open message item's id
        self.text = ""  # the text its deltas carried
        self.sent = 0  # tokens whose logprobs went out
        self.call: tuple[str, ToolCall] | None = None  # a named function's open call item
        self.output: list[dict[str, Any]] = []  # items closed
