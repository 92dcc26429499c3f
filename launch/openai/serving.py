"""One completions or chat completions request as the server answers it: its choices as
they grow (Choice: tokens, text, reasoning, logprobs), and the Call that turns its engine
stream into OpenAI's answer, whole (complete) or as server-sent events (events); a beam
search (use_beam_search) reaches a Call as a BeamSearchStream."""

from __future__ import annotations

import time
from collections.abc import AsyncIterator, Callable
from typing import TYPE_CHECKING, Any

import msgspec
from starlette.responses import Response

from launch.client.async_llm import AsyncLLM
from launch.client.beam_search import BeamSearchError, BeamSearchOutput, BeamSearchParams, search
from launch.client.engine_processes import EngineDeadError
from launch.client.request_stream import RequestStream, StreamOutput
from launch.openai.metrics import RequestTimer
from launch.openai.protocol import (
    APIError,
    ChatCompletionRequest,
    CompletionRequest,
    chat_logprobs,
    completion_logprobs,
    sse_event,
    usage,
    vllm_prompt_logprobs,
)
from launch.openai.reasoning import ReasoningParser, ReasoningSplit
from launch.openai.tool_parsers import new_call_id
from launch.openai.tools import ToolPlan
from protocol.engine import Logprobs, SamplingParams

if TYPE_CHECKING:
    from launch.openai.api_server import OpenAIServer

_json = msgspec.json.Encoder()


def json_response(body: object, status: int = 200) -> Response:
    return Response(_json.encode(body), status, media_type="application/json")


def error_response(e: APIError) -> Response:
    return json_response(e.body(), e.status)


class Choice:
    """One sequence of a request (choice index = prompt_i * n + copy_j), as it grows."""

    __slots__ = (
        "finish",
        "ids",
        "logprobs",
        "num_cached",
        "offset",
        "prompt",
        "prompt_logprobs",
        "sent",
        "split",
        "stop_reason",
        "texts",
        "thoughts",
        "tool_call",
    )

    def __init__(
        self, prompt: int, logprobs: bool, reasoning: ReasoningParser | None = None
    ) -> None:
        self.prompt = prompt  # which prompt it answers
        self.num_cached = 0  # its prompt tokens served from the prefix cache (at finish)
        self.ids: list[int] = []
        # Each output's text; with a reasoning parser, its answer part, and its reasoning
        # part in thoughts (both "" while a tag is held back).
        self.texts: list[str] = []
        self.thoughts: list[str] = []
        self.split = ReasoningSplit(reasoning) if reasoning is not None else None
        self.logprobs: list[Logprobs] | None = [] if logprobs else None
        self.finish: str | None = None
        self.stop_reason: str | int | None = None
        self.sent = 0  # tokens already streamed
        self.offset = 0  # text streamed so far, in characters (completions' text_offset)
        # With the first output, when asked for (None first); streamed once, then None.
        self.prompt_logprobs: list[Logprobs | None] | None = None
        # A streamed named tool call: its id once its first delta is out.
        self.tool_call: str | None = None

    def add(self, out: StreamOutput) -> None:
        self.ids += out.new_token_ids
        text = out.text
        if self.split is not None:
            thought, text = self.split.feed(text, len(out.new_token_ids))
            if out.finish_reason is not None:
                more_thought, more_text = self.split.finish()
                thought, text = thought + more_thought, text + more_text
            self.thoughts.append(thought)
        self.texts.append(text)
        if self.logprobs is not None and out.logprobs:
            self.logprobs += out.logprobs
        if out.prompt_logprobs is not None:
            self.prompt_logprobs = out.prompt_logprobs
        if out.finish_reason is not None:
            self.finish, self.stop_reason = out.finish_reason, out.stop_reason
            self.num_cached = out.num_cached_tokens


class BeamSearchStream:
    """A beam search over several prompts shaped as a RequestStream for the server's
    Call: its outputs, one per answer sequence (index prompt_i * beam_width + rank), all
    come once the search is over; a failure is one output with finish_reason "error".
    Closing it (or cancelling its consumer) aborts the round in flight."""

    def __init__(
        self,
        engine: AsyncLLM,
        request_id: str,
        prompts: list[list[int]],
        params: BeamSearchParams,
        num_logprobs: int | None,
        cache_salt: str | None = None,
        priority: int = 0,
    ) -> None:
        self.request_id = request_id
        self.prompts = prompts
        self.prompt_token_ids = prompts[0]
        self.finished = False
        # Called after each round (the server's Call: the request is no longer waiting).
        self.on_round: Callable[[], None] | None = None
        self._engine = engine
        self._params = params
        self._num_logprobs = num_logprobs  # top alternatives per token in the answer
        self._cache_salt = cache_salt
        self._priority = priority
        self._outputs: list[StreamOutput] | None = None

    def __aiter__(self) -> BeamSearchStream:
        return self

    async def __anext__(self) -> StreamOutput:
        if self._outputs is None:
            if self.finished:
                raise StopAsyncIteration
            try:
                found = await search(
                    self._engine,
                    self.prompts,
                    self._params,
                    self.request_id,
                    self._cache_salt,
                    self._priority,
                    self.on_round,
                )
                self._outputs = self._answers(found)
            except BeamSearchError as e:
                self._outputs = [StreamOutput(self.request_id, [], "", 0, "error", error=str(e))]
            self._outputs.reverse()
        if not self._outputs:
            self.finished = True
            raise StopAsyncIteration
        out = self._outputs.pop()
        self.finished = not self._outputs
        return out

    def _answers(self, found: list[BeamSearchOutput]) -> list[StreamOutput]:
        width, k = self._params.beam_width, self._num_logprobs
        outs = []
        for i, result in enumerate(found):
            for j, seq in enumerate(result.sequences):
                logprobs = None
                if k is not None:
                    logprobs = [
                        Logprobs(lp.logprob, lp.top_token_ids[:k], lp.top_logprobs[:k])
                        for lp in seq.logprobs
                    ]
                outs.append(
                    StreamOutput(
                        self.request_id,
                        seq.token_ids,
                        seq.text,
                        len(seq.token_ids),
                        seq.finish_reason,
                        result.num_cached_tokens,
                        index=i * width + j,
                        logprobs=logprobs,
                        stop_reason=seq.stop_reason,
                    )
                )
        return outs

    def close(self) -> None:
        # The round in flight, if any, is closed by search()'s own cleanup when the
        # consumer's task is cancelled; nothing else holds engine requests.
        self.finished = True

    async def aclose(self) -> None:
        self.close()


class Call:
    """One generation request: its stream, timings, and the shapes of its answers."""

    def __init__(
        self,
        server: OpenAIServer,
        body: CompletionRequest | ChatCompletionRequest,
        stream: RequestStream | BeamSearchStream,
        request_id: str,
        chat: bool,
        params: SamplingParams,
        echo: list[str] | None = None,
        prompt_only: bool = False,
        tools: ToolPlan | None = None,
    ) -> None:
        self.server = server
        self.echo = echo
        self.prompt_only = prompt_only
        # A chat's tools, unless "none": its answers may be tool calls.
        self.tools = tools if tools is not None and tools.choice != "none" else None
        self.body = body
        self.stream = stream
        self.id = request_id
        self.chat = chat
        self.created = int(time.time())
        self.object = "chat.completion" if chat else "text_completion"
        self.num_prompt_tokens = sum(len(ids) for ids in stream.prompts)
        self.timer: RequestTimer = server.metrics.request(
            self.num_prompt_tokens, params.n, params.max_tokens
        )
        # Every prompt has the same n (one body): choice i answers prompt i // n.
        self.n = params.n
        lp = params.logprobs is not None
        reasoning = server.reasoning_parser if chat else None
        # The answer's reasoning field (the reasoning is told apart either way).
        self.show_reasoning = reasoning is not None and getattr(body, "include_reasoning", True)
        self.choices = [
            Choice(i // params.n, lp, reasoning) for i in range(len(stream.prompts) * params.n)
        ]
        self._waiting = True
        server.num_waiting += 1
        if isinstance(stream, BeamSearchStream):
            # Its answers come at the end, but it waits only until its first round ran.
            stream.on_round = self._started

    def _started(self) -> None:
        if self._waiting:
            self._waiting = False
            self.server.num_waiting -= 1

    async def outputs(self) -> AsyncIterator[StreamOutput]:
        """Each sequence's outputs, added to its choice; APIError for a failure."""
        try:
            async for out in self.stream:
                self._started()
                if out.queued_s is not None:
                    self.timer.queued(out.queued_s)
                self.timer.tokens(len(out.new_token_ids))
                if out.finish_reason == "error":
                    raise APIError(out.error or "the request failed", 500)
                if out.finish_reason == "abort":
                    raise APIError("the request was aborted: the server is stopping", 503)
                self.choices[out.index].add(out)
                if out.finish_reason is not None and self.stream.finished:
                    longest = max(len(c.ids) for c in self.choices)
                    self.timer.finish(out.finish_reason, longest, self._cached_tokens())
                yield out
        except EngineDeadError as e:
            raise APIError(str(e), 500) from None
        finally:
            self._started()
            self.stream.close()

    def _usage(self) -> dict[str, Any]:
        """Each prompt counted once (its first copy's cache hits: later copies hit what
        the first brought in), completion tokens of every choice."""
        generated = 0 if self.prompt_only else self.timer.num_tokens
        return usage(self.num_prompt_tokens, generated, self._cached_tokens())

    def _cached_tokens(self) -> int:
        return sum(c.num_cached for c in self.choices[:: self.n])

    def token_text(self, token_id: int) -> str:
        tok = self.server.engine.tokenizer
        return tok.decode([token_id]) if tok is not None else f"token_id:{token_id}"

    def _logprobs(self, c: Choice, start: int, offset: int) -> dict[str, Any] | None:
        """The logprobs of c's tokens from start on, in the endpoint's shape."""
        if c.logprobs is None:
            return None
        ids, lps = c.ids[start:], c.logprobs[start:]
        if self.chat:
            return chat_logprobs(ids, lps, self.token_text)
        return completion_logprobs(ids, lps, self.token_text, offset)

    def _prompt_logprobs(self, c: Choice) -> list[Any] | None:
        if c.prompt_logprobs is None:
            return None
        ids = self.stream.prompts[c.prompt]
        return vllm_prompt_logprobs(ids, c.prompt_logprobs, self.token_text)

    def _echo_head(self, c: Choice) -> dict[str, Any]:
        """The legacy logprobs of c's prompt, echoed: its tokens, the first without a
        logprob (nothing comes before it)."""
        ids = self.stream.prompts[c.prompt]
        first = self.token_text(ids[0])
        found = [lp for lp in (c.prompt_logprobs or [])[1:] if lp is not None]
        head = completion_logprobs(ids[1:], found, self.token_text, len(first))
        return {
            "tokens": [first, *head["tokens"]],
            "token_logprobs": [None, *head["token_logprobs"]],
            "top_logprobs": [None, *head["top_logprobs"]],
            "text_offset": [0, *head["text_offset"]],
        }

    def _echo_logprobs(self, c: Choice, completion: dict[str, Any]) -> dict[str, Any]:
        """OpenAI's echo with logprobs: the prompt's tokens first, then the completion's."""
        head = self._echo_head(c)
        return {k: head[k] + completion[k] for k in head}

    async def complete(self) -> Response:
        try:
            async for _ in self.outputs():
                pass
        except APIError as e:
            return error_response(e)
        choices = []
        for i, c in enumerate(self.choices):
            if self.prompt_only:  # the one token generated is not part of the answer
                c.ids, c.texts = [], []
                c.logprobs = None if c.logprobs is None else []
            text = "".join(c.texts)
            echo = "" if self.echo is None else self.echo[c.prompt]
            choice: dict[str, Any] = {"index": i}
            finish = c.finish
            if self.chat:
                message: dict[str, Any] = {"role": "assistant", "content": text}
                if self.show_reasoning:
                    message["reasoning"] = "".join(c.thoughts) or None
                if self.tools is not None:
                    content, calls = self.tools.calls(text, c.finish == "stop")
                    message["content"] = content
                    if calls:
                        message["tool_calls"] = [call.body() for call in calls]
                        finish = "tool_calls" if c.finish == "stop" else c.finish
                choice["message"] = message
            else:
                choice["text"] = echo + text
            logprobs = self._logprobs(c, 0, len(echo))
            if logprobs is not None and self.echo is not None:
                logprobs = self._echo_logprobs(c, logprobs)
            choice.update(logprobs=logprobs, finish_reason=finish, stop_reason=c.stop_reason)
            if self.body.prompt_logprobs is not None and not self.chat:
                choice["prompt_logprobs"] = self._prompt_logprobs(c)
            if self.body.return_token_ids:
                choice["token_ids"] = c.ids
                choice["prompt_token_ids"] = self.stream.prompts[c.prompt]
            choices.append(choice)
        answer = self._envelope(choices, self._usage())
        if self.body.prompt_logprobs is not None and self.chat:
            answer["prompt_logprobs"] = self._prompt_logprobs(self.choices[0])
        if self.body.return_token_ids and len(self.stream.prompts) == 1:
            answer["prompt_token_ids"] = self.stream.prompt_token_ids
        return json_response(answer)

    def _envelope(self, choices: list[dict[str, Any]], usage: object) -> dict[str, Any]:
        obj = self.object + (".chunk" if self.chat and self.body.stream else "")
        answer = {"id": self.id, "object": obj, "created": self.created}
        answer.update(model=self.server.model_name, choices=choices)
        if usage is not None or self.body.include_usage:
            answer["usage"] = usage  # OpenAI: null on every chunk but the last
        return answer

    async def events(self) -> AsyncIterator[bytes]:
        ids_too = self.body.return_token_ids
        echo_logprobs = isinstance(self.body, CompletionRequest) and self.body.echo_logprobs
        options = self.body.stream_options
        continuous = options is not None and options.continuous_usage_stats
        try:
            if self.chat:
                for i in range(len(self.choices)):
                    first = {"role": "assistant", "content": ""}
                    yield sse_event(self._envelope([self._chunk(i, first, None, None)], None))
            elif self.echo is not None and not echo_logprobs:
                for i, c in enumerate(self.choices):
                    chunk = self._chunk(i, self.echo[c.prompt], None, None)
                    yield sse_event(self._envelope([chunk], None))
            echoed: set[int] = set()
            async for out in self.outputs():
                c = self.choices[out.index]
                if echo_logprobs and out.index not in echoed:
                    # The prompt's logprobs came with this first output: its echo goes
                    # first, with them.
                    assert self.echo is not None
                    echoed.add(out.index)
                    echo = self.echo[c.prompt]
                    chunk = self._chunk(out.index, echo, None, None)
                    chunk["logprobs"] = self._echo_head(c)
                    c.offset = len(echo)
                    yield sse_event(self._envelope([chunk], None))
                text, finish = c.texts[-1], out.finish_reason
                thought = c.thoughts[-1] if self.show_reasoning else ""
                delta: Any
                if self.tools is not None:
                    delta, finish, text = self._tool_delta(c, text, finish)
                    if thought:
                        delta = {"reasoning": thought, **(delta or {})}
                    if delta is None:
                        continue  # held until the calls can be read
                elif not (text or thought or finish or (ids_too and out.new_token_ids)):
                    # A character unfinished or text held back for a stop string (or a
                    # reasoning tag): its tokens (and logprobs) go with the next chunk.
                    continue
                elif self.chat:
                    delta = {"reasoning": thought} if thought else {}
                    if text or not (finish or thought):
                        delta["content"] = text
                else:
                    delta = text
                choice = self._chunk(out.index, delta, finish, c.ids[c.sent :] if ids_too else None)
                choice["logprobs"] = self._logprobs(c, c.sent, c.offset)
                if finish is not None:
                    choice["stop_reason"] = c.stop_reason
                c.sent = len(c.ids)
                c.offset += len(text)
                envelope = self._envelope([choice], self._usage() if continuous else None)
                if c.prompt_logprobs is not None:  # the choice's first chunk: once
                    if self.body.prompt_logprobs is not None:
                        prompt = self._prompt_logprobs(c)
                        (envelope if self.chat else choice)["prompt_logprobs"] = prompt
                    c.prompt_logprobs = None
                yield sse_event(envelope)
            if self.body.include_usage:
                yield sse_event(self._envelope([], self._usage()))
        except APIError as e:
            yield sse_event(e.body())
        yield b"data: [DONE]\n\n"

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

    def _chunk(
        self, index: int, delta: Any, finish: str | None, ids: list[int] | None
    ) -> dict[str, Any]:
        choice: dict[str, Any] = {"index": index}
        choice["delta" if self.chat else "text"] = delta
        choice.update(logprobs=None, finish_reason=finish)
        if ids is not None:
            choice["token_ids"] = ids
        return choice
