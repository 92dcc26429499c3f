"""One started generation request as the server answers it: its choices as they grow
(Choice: tokens, text, reasoning, logprobs) and the Generation that reads its engine
stream into them (timings, usage, the admission ticket); ChoicesAnswer is the skeleton of
the completions-shaped answers, whole (complete) or as server-sent events (events), that
chat and legacy completions fill in (serving_chat.py, serving_completions.py)."""

from __future__ import annotations

import time
from collections.abc import AsyncIterator, Callable
from typing import Any, ClassVar, NamedTuple

from starlette.responses import Response

from launch.client.engine_processes import EngineDeadError
from launch.client.request_stream import RequestStream, StreamOutput
from launch.openai.beam_search_stream import BeamSearchStream
from launch.openai.metrics import RequestTimer
from launch.openai.protocol import APIError, GenerationRequest
from launch.openai.reasoning import ReasoningParser, ReasoningSplit
from launch.openai.response_shapes import sse_event, usage, vllm_prompt_logprobs
from launch.openai.serving_base import (
    ServingContext,
    Waiting,
    error_response,
    json_response,
    token_id_text,
)
from protocol.engine import Logprobs, SamplingParams


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


class Started(NamedTuple):
    """A request sent to the engine: its stream, its (first prompt's) parameters, its
    place among the waiting requests."""

    stream: RequestStream | BeamSearchStream
    request_id: str
    params: SamplingParams
    waiting: Waiting


class Generation:
    """One generation request: its stream, timings, and choices. reasoning: the parser
    that tells the answer's reasoning apart (chat-shaped answers only)."""

    def __init__(
        self,
        ctx: ServingContext,
        body: GenerationRequest,
        started: Started,
        reasoning: ReasoningParser | None = None,
    ) -> None:
        stream, request_id, params, waiting = started
        self.ctx = ctx
        # A token's text in logprobs (bound once: called per token).
        self.token_text: Callable[[int], str] = (
            token_id_text if body.return_tokens_as_token_ids else ctx.token_text
        )
        self.body = body
        self.stream = stream
        self.id = request_id
        self.created = int(time.time())
        self.num_prompt_tokens = sum(len(ids) for ids in stream.prompts)
        self.timer: RequestTimer = ctx.metrics.request(
            self.num_prompt_tokens, params.n, params.max_tokens
        )
        # Every prompt has the same n (one body): choice i answers prompt i // n.
        self.n = params.n
        lp = params.logprobs is not None
        self.choices = [
            Choice(i // params.n, lp, reasoning) for i in range(len(stream.prompts) * params.n)
        ]
        self._waiting = waiting
        if isinstance(stream, BeamSearchStream):
            # Its answers come at the end, but it waits only until its first round ran.
            stream.on_round = waiting.started

    async def outputs(self) -> AsyncIterator[StreamOutput]:
        """Each sequence's outputs, added to its choice; APIError for a failure."""
        try:
            async for out in self.stream:
                self._waiting.started()
                if out.queued_s is not None:
                    self.timer.queued(out.queued_s)
                self.timer.tokens(len(out.new_token_ids), out.num_preemptions)
                if out.finish_reason == "error":
                    raise APIError(out.error or "the request failed", 500)
                if out.finish_reason == "abort":
                    raise APIError("the request was aborted: the server is stopping", 503)
                self.choices[out.index].add(out)
                if out.finish_reason is not None and self.stream.finished:
                    longest = max(len(c.ids) for c in self.choices)
                    self.timer.finish(out.finish_reason, longest, self.cached_tokens())
                yield out
        except EngineDeadError as e:
            raise APIError(str(e), 500) from None
        finally:
            self.close()

    def close(self) -> None:
        """Abort what is still running and free the admission ticket (idempotent)."""
        self._waiting.started()
        self.stream.close()

    def cached_tokens(self) -> int:
        """Each prompt counted once (its first copy's cache hits: later copies hit what
        the first brought in)."""
        return sum(c.num_cached for c in self.choices[:: self.n])

    def prompt_logprobs(self, c: Choice) -> list[Any] | None:
        if c.prompt_logprobs is None:
            return None
        ids = self.stream.prompts[c.prompt]
        return vllm_prompt_logprobs(ids, c.prompt_logprobs, self.token_text)


class ChoicesAnswer(Generation):
    """A generation answered as choices (chat and legacy completions): the envelope, the
    whole answer and the chunk stream; the endpoint fills in each choice."""

    OBJECT: ClassVar[str]
    STREAM_OBJECT: ClassVar[str]  # what chunks call themselves
    DELTA_KEY: ClassVar[str]  # where a chunk's choice carries its new text

    def _usage(self) -> dict[str, Any]:
        """Completion tokens of every choice; each prompt once."""
        return usage(self.num_prompt_tokens, self._generated_tokens(), self.cached_tokens())

    def _generated_tokens(self) -> int:
        return self.timer.num_tokens

    # -- what each endpoint fills in -----------------------------------------------------
    def _logprobs(self, c: Choice, start: int, offset: int) -> dict[str, Any] | None:
        """The logprobs of c's tokens from start on, in the endpoint's shape."""
        raise NotImplementedError

    def _whole_choice(self, index: int, c: Choice) -> dict[str, Any]:
        raise NotImplementedError

    def _add_whole_extras(self, answer: dict[str, Any]) -> None:
        """Fields of the whole answer beside its choices."""

    def _opening_events(self) -> list[bytes]:
        """Chunks sent before the first output's own."""
        return []

    def _first_output_event(self, out: StreamOutput, c: Choice) -> bytes | None:
        """A chunk sent before this output's own (the choice's first), if any."""
        return None

    def _delta(
        self, out: StreamOutput, c: Choice, ids_too: bool
    ) -> tuple[Any, str | None, str] | None:
        """This output's chunk: (its delta, finish reason, the text it releases), or None
        to hold it back for the next."""
        raise NotImplementedError

    def _put_prompt_logprobs(
        self, envelope: dict[str, Any], choice: dict[str, Any], value: Any
    ) -> None:
        raise NotImplementedError

    # -- shared shapes -------------------------------------------------------------------
    def _envelope(self, choices: list[dict[str, Any]], usage: object) -> dict[str, Any]:
        obj = self.STREAM_OBJECT if self.body.stream else self.OBJECT
        answer = {"id": self.id, "object": obj, "created": self.created}
        answer.update(model=self.ctx.model_name, choices=choices)
        if usage is not None or self.body.include_usage:
            answer["usage"] = usage  # OpenAI: null on every chunk but the last
        return answer

    def _chunk(
        self, index: int, delta: Any, finish: str | None, ids: list[int] | None
    ) -> dict[str, Any]:
        choice: dict[str, Any] = {"index": index, self.DELTA_KEY: delta}
        choice.update(logprobs=None, finish_reason=finish)
        if ids is not None:
            choice["token_ids"] = ids
        return choice

    def _with_token_ids(self, c: Choice, choice: dict[str, Any]) -> dict[str, Any]:
        if self.body.return_token_ids:
            choice["token_ids"] = c.ids
            choice["prompt_token_ids"] = self.stream.prompts[c.prompt]
        return choice

    # -- whole ---------------------------------------------------------------------------
    async def complete(self) -> Response:
        try:
            async for _ in self.outputs():
                pass
        except APIError as e:
            return error_response(e)
        choices = [self._whole_choice(i, c) for i, c in enumerate(self.choices)]
        answer = self._envelope(choices, self._usage())
        self._add_whole_extras(answer)
        if self.body.return_token_ids and len(self.stream.prompts) == 1:
            answer["prompt_token_ids"] = self.stream.prompt_token_ids
        return json_response(answer)

    # -- streamed ------------------------------------------------------------------------
    async def events(self) -> AsyncIterator[bytes]:
        ids_too = self.body.return_token_ids
        options = self.body.stream_options
        continuous = options is not None and options.continuous_usage_stats
        try:
            # Sent with the first output, as vLLM sends them: a client that times a
            # stream's first chunk (vLLM's `bench serve` does) times the first token.
            opening = self._opening_events()
            async for out in self.outputs():
                if opening:
                    for event in opening:
                        yield event
                    opening = []
                c = self.choices[out.index]
                first = self._first_output_event(out, c)
                if first is not None:
                    yield first
                step = self._delta(out, c, ids_too)
                if step is None:
                    continue
                delta, finish, text = step
                choice = self._chunk(out.index, delta, finish, c.ids[c.sent :] if ids_too else None)
                choice["logprobs"] = self._logprobs(c, c.sent, c.offset)
                if finish is not None:
                    choice["stop_reason"] = c.stop_reason
                c.sent = len(c.ids)
                c.offset += len(text)
                envelope = self._envelope([choice], self._usage() if continuous else None)
                if c.prompt_logprobs is not None:  # the choice's first chunk: once
                    if self.body.prompt_logprobs is not None:
                        self._put_prompt_logprobs(envelope, choice, self.prompt_logprobs(c))
                    c.prompt_logprobs = None
                yield sse_event(envelope)
            for event in opening:  # no output came: the stream still opens
                yield event
            if self.body.include_usage:
                yield sse_event(self._envelope([], self._usage()))
        except APIError as e:
            yield sse_event(e.body())
        yield b"data: [DONE]\n\n"
