"""POST /v1/chat/completions: the conversation rendered by the chat template with its
tools, generated, and answered as OpenAI's chat completion (messages, reasoning, tool
calls), whole or as chunks."""

from __future__ import annotations

from typing import Any, ClassVar

from starlette.requests import Request
from starlette.responses import Response

from launch.client.chat import ChatTemplateError
from launch.client.inputs import Prompt
from launch.client.request_stream import StreamOutput
from launch.openai.generation import Choice, ChoicesAnswer, Started
from launch.openai.protocol import APIError, ChatCompletionRequest
from launch.openai.response_shapes import chat_logprobs, sse_event
from launch.openai.serving_base import ServingContext, off_loop
from launch.openai.serving_generation import GenerationServing
from launch.openai.tool_parsers import new_call_id
from launch.openai.tools import ToolError, ToolPlan, plan_tools, template_messages


class ChatServing(GenerationServing):
    async def create(self, request: Request) -> Response:
        body: ChatCompletionRequest = await self.read(request, ChatCompletionRequest)
        self.check_model(body.model)
        ids, tools = await off_loop(self.prompt, body, "messages")
        max_tokens = body.max_completion_tokens
        if max_tokens is None:
            max_tokens = body.max_tokens
        started = await self.start(body, [ids], max_tokens, "chatcmpl", thinking=True, tools=tools)
        answer = ChatCompletion(self.ctx, body, started, tools)
        return await self.answer(request, body.stream, answer.events, answer.complete)

    def prompt(self, body: ChatCompletionRequest, param: str) -> tuple[list[int], ToolPlan | None]:
        """The conversation's token ids, rendered by the chat template with its tools, and
        what the tools make of the answer; param names the conversation in errors. A tool
        format whose markers are special tokens keeps them in the answer's text."""
        try:
            tools = plan_tools(
                body.tools, body.tool_choice, body.parallel_tool_calls, self.ctx.tool_call_parser
            )
        except ToolError as e:
            raise APIError(str(e), param=e.param, code="invalid_value") from None
        if tools is not None and tools.keeps_special_tokens:
            body.skip_special_tokens = False
        kwargs = body.chat_template_kwargs
        if body.documents is not None:  # the template's documents, as transformers passes them
            kwargs = {**(kwargs or {}), "documents": body.documents}
        prompt = Prompt(
            messages=template_messages(body.messages),
            add_generation_prompt=body.add_generation_prompt,
            chat_template_kwargs=kwargs,
            tools=tools.template_tools() if tools is not None else None,
            continue_final_message=body.continue_final_message,
        )
        try:
            return self.engine.prompt_token_ids(prompt), tools
        except (ChatTemplateError, TypeError, ValueError) as e:
            raise APIError(str(e), param=param, code="invalid_value") from None


class ChatCompletion(ChoicesAnswer):
    """A chat completion's answer: each choice a message (its reasoning apart under a
    reasoning parser; tool calls under tools)."""

    OBJECT: ClassVar[str] = "chat.completion"
    STREAM_OBJECT: ClassVar[str] = "chat.completion.chunk"
    DELTA_KEY: ClassVar[str] = "delta"

    def __init__(
        self,
        ctx: ServingContext,
        body: ChatCompletionRequest,
        started: Started,
        tools: ToolPlan | None,
    ) -> None:
        reasoning = ctx.reasoning_parser
        super().__init__(ctx, body, started, reasoning)
        # Its tools, unless "none": its answers may be tool calls.
        self.tools = tools if tools is not None and tools.choice != "none" else None
        # The answer's reasoning field (the reasoning is told apart either way).
        self.show_reasoning = reasoning is not None and body.include_reasoning
        self.echo = _echo(body)

    def _logprobs(self, c: Choice, start: int, offset: int) -> dict[str, Any] | None:
        if c.logprobs is None:
            return None
        return chat_logprobs(c.ids[start:], c.logprobs[start:], self.token_text)

    def _whole_choice(self, index: int, c: Choice) -> dict[str, Any]:
        text = "".join(c.texts)
        finish = c.finish
        message: dict[str, Any] = {"role": "assistant", "content": self.echo + text}
        if self.show_reasoning:
            message["reasoning"] = "".join(c.thoughts) or None
        if self.tools is not None:
            content, calls = self.tools.calls(text, c.finish == "stop")
            message["content"] = content
            if calls:
                message["tool_calls"] = [call.body() for call in calls]
                finish = "tool_calls" if c.finish == "stop" else c.finish
        choice: dict[str, Any] = {"index": index, "message": message}
        logprobs = self._logprobs(c, 0, 0)
        choice.update(logprobs=logprobs, finish_reason=finish, stop_reason=c.stop_reason)
        return self._with_token_ids(c, choice)

    def _add_whole_extras(self, answer: dict[str, Any]) -> None:
        if self.body.prompt_logprobs is not None:
            answer["prompt_logprobs"] = self.prompt_logprobs(self.choices[0])

    def _opening_events(self) -> list[bytes]:
        first = {"role": "assistant", "content": self.echo}
        return [
            sse_event(self._envelope([self._chunk(i, first, None, None)], None))
            for i in range(len(self.choices))
        ]

    def _delta(
        self, out: StreamOutput, c: Choice, ids_too: bool
    ) -> tuple[Any, str | None, str] | None:
        text, finish = c.texts[-1], out.finish_reason
        thought = c.thoughts[-1] if self.show_reasoning else ""
        delta: Any
        if self.tools is not None:
            delta, finish, text = self._tool_delta(c, text, finish)
            if thought:
                delta = {"reasoning": thought, **(delta or {})}
            if delta is None:
                return None  # held until the calls can be read
            return delta, finish, text
        # A token whose character is unfinished, or whose text waits on a stop string, still
        # gets its chunk (empty content), as vLLM streams it: clients time tokens by chunks.
        # Under a reasoning parser, text held for a tag goes with the next chunk.
        tokens = out.new_token_ids and (ids_too or c.split is None)
        if not (text or thought or finish or tokens):
            return None
        delta = {"reasoning": thought} if thought else {}
        if text or not (finish or thought):
            delta["content"] = text
        return delta, finish, text

    def _put_prompt_logprobs(
        self, envelope: dict[str, Any], choice: dict[str, Any], value: Any
    ) -> None:
        envelope["prompt_logprobs"] = value

    def _tool_delta(
        self, c: Choice, text: str, finish: str | None
    ) -> tuple[dict[str, Any] | None, str | None, str]:
        """A streamed chat answer under tools: (its next delta, or None to hold it; the
        finish reason; the text the delta released). A named function's arguments stream
        as they come; an "auto" answer streams its text up to where a tool call may
        begin; calls that must be read whole ("required", a parsed call) go out at the
        end, complete."""
        plan = self.tools
        assert plan is not None
        # A named call holds nothing back: what is new is this output's text.
        fresh = text if plan.choice == "named" else "".join(c.texts)[c.offset :]
        if plan.choice == "named":
            if finish == "stop":
                finish = "tool_calls"
            if not fresh:
                return ({} if finish else None), finish, ""
            call: dict[str, Any] = {"index": 0, "function": {"arguments": fresh}}
            if c.tool_call is None:
                c.tool_call = new_call_id(plan.parser)
                call.update(id=c.tool_call, type="function")
                call["function"] = {"name": plan.name, "arguments": fresh}
            return {"tool_calls": [call]}, finish, fresh
        if finish is None:
            if plan.choice != "auto":
                return None, None, ""
            ready = fresh[: max(0, plan.content_so_far("".join(c.texts)) - c.offset)]
            return ({"content": ready} if ready else None), None, ready
        content, calls = plan.calls(fresh, finish == "stop")
        delta: dict[str, Any] = {"content": content} if content else {}
        if calls:
            delta["tool_calls"] = [{"index": k, **call.body()} for k, call in enumerate(calls)]
            finish = "tool_calls" if finish == "stop" else finish
        return delta, finish, fresh


def _echo(body: ChatCompletionRequest) -> str:
    """vLLM's echo: the last message's text, when the answer continues it (the last
    message is the assistant's); else ""."""
    last = body.messages[-1] if body.echo and body.messages else None
    if not isinstance(last, dict) or last.get("role") != "assistant":
        return ""
    content = last.get("content")
    if isinstance(content, list):
        return "".join(p.get("text", "") for p in content if isinstance(p, dict))
    return content if isinstance(content, str) else ""
