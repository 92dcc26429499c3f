"""POST /v1/completions: one or several prompts (texts or token ids) generated, and
answered as OpenAI's legacy completion (text choices, echo, legacy logprobs), whole or as
chunks."""

from __future__ import annotations

from typing import Any, ClassVar

from starlette.requests import Request
from starlette.responses import Response

from launch.client.request_stream import StreamOutput
from launch.openai.generation import Choice, ChoicesAnswer, Started
from launch.openai.protocol import APIError, CompletionRequest
from launch.openai.response_shapes import completion_logprobs, sse_event
from launch.openai.serving_base import ServingContext, off_loop
from launch.openai.serving_generation import GenerationServing


class CompletionServing(GenerationServing):
    async def create(self, request: Request) -> Response:
        body: CompletionRequest = await self.read(request, CompletionRequest)
        self.check_model(body.model)
        ids, echo = await off_loop(self._prompts, body)
        max_tokens = body.max_tokens
        prompt_only = max_tokens == 0 and body.echo
        if prompt_only:
            # Scoring a text (its echo and, with logprobs, its tokens' logprobs): the engine
            # generates at least one token, which the answer leaves out (its usage counts
            # it, as vLLM's does).
            if body.stream:
                raise APIError(
                    "max_tokens 0 (echo only) is not streamed: send stream false",
                    param="max_tokens",
                    code="invalid_value",
                )
            max_tokens = 1
        started = await self.start(body, ids, max_tokens, "cmpl", prompt_only=prompt_only)
        answer = TextCompletion(self.ctx, body, started, echo, prompt_only)
        return await self.answer(request, body.stream, answer.events, answer.complete)

    def _prompts(self, body: CompletionRequest) -> tuple[list[list[int]], list[str] | None]:
        """Each prompt's token ids, and, to echo, each prompt as given (token ids as the
        tokenizer reads them)."""
        prompts = body.prompt_inputs()
        several = len(prompts) > 1
        ids = []
        for i, prompt in enumerate(prompts):
            try:
                ids.append(self.engine.prompt_token_ids(prompt))
            except (TypeError, ValueError) as e:
                message = f"prompt {i}: {e}" if several else str(e)
                raise APIError(message, param="prompt", code="invalid_value") from None
            if not ids[-1]:  # "" encodes to no tokens without a BOS: nothing to continue
                which = f"prompt {i}" if several else "the prompt"
                raise APIError(
                    f"{which} is empty: give at least one token",
                    param="prompt",
                    code="invalid_value",
                )
        if not body.echo:
            return ids, None
        try:
            return ids, [p if isinstance(p, str) else self.engine.inputs.decode(p) for p in prompts]
        except ValueError as e:
            raise APIError(str(e), param="echo", code="invalid_value") from None


class TextCompletion(ChoicesAnswer):
    """A legacy completion's answer: text choices, each after its prompt's echo when
    asked (echo; prompt_only: the echo alone, not the one token generated)."""

    OBJECT: ClassVar[str] = "text_completion"
    STREAM_OBJECT: ClassVar[str] = "text_completion"
    DELTA_KEY: ClassVar[str] = "text"

    def __init__(
        self,
        ctx: ServingContext,
        body: CompletionRequest,
        started: Started,
        echo: list[str] | None,
        prompt_only: bool,
    ) -> None:
        super().__init__(ctx, body, started)
        self.completion = body
        self.echo = echo
        self.prompt_only = prompt_only
        self._echoed: set[int] = set()  # choices whose echo (with logprobs) is streamed

    def _logprobs(self, c: Choice, start: int, offset: int) -> dict[str, Any] | None:
        if c.logprobs is None:
            return None
        ids, lps = c.ids[start:], c.logprobs[start:]
        return completion_logprobs(ids, lps, self.token_text, offset)

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

    def _whole_choice(self, index: int, c: Choice) -> dict[str, Any]:
        if self.prompt_only:  # the one token generated is not part of the answer
            c.ids, c.texts = [], []
            c.logprobs = None if c.logprobs is None else []
        echo = "" if self.echo is None else self.echo[c.prompt]
        choice: dict[str, Any] = {"index": index, "text": echo + "".join(c.texts)}
        logprobs = self._logprobs(c, 0, len(echo))
        if logprobs is not None and self.echo is not None:
            # OpenAI's echo with logprobs: the prompt's tokens first, then the completion's.
            head = self._echo_head(c)
            logprobs = {k: head[k] + logprobs[k] for k in head}
        choice.update(logprobs=logprobs, finish_reason=c.finish, stop_reason=c.stop_reason)
        if self.body.prompt_logprobs is not None:
            choice["prompt_logprobs"] = self.prompt_logprobs(c)
        return self._with_token_ids(c, choice)

    def _opening_events(self) -> list[bytes]:
        if self.echo is None or self.completion.echo_logprobs:
            return []
        return [
            sse_event(self._envelope([self._chunk(i, self.echo[c.prompt], None, None)], None))
            for i, c in enumerate(self.choices)
        ]

    def _first_output_event(self, out: StreamOutput, c: Choice) -> bytes | None:
        if not self.completion.echo_logprobs or out.index in self._echoed:
            return None
        # The prompt's logprobs came with this first output: its echo goes first, with them.
        assert self.echo is not None
        self._echoed.add(out.index)
        echo = self.echo[c.prompt]
        chunk = self._chunk(out.index, echo, None, None)
        chunk["logprobs"] = self._echo_head(c)
        c.offset = len(echo)
        return sse_event(self._envelope([chunk], None))

    def _delta(
        self, out: StreamOutput, c: Choice, ids_too: bool
    ) -> tuple[Any, str | None, str] | None:
        text, finish = c.texts[-1], out.finish_reason
        if not (text or finish or out.new_token_ids):
            return None
        # A token whose character is unfinished, or whose text waits on a stop string, still
        # gets its chunk (empty text), as vLLM streams it: clients time tokens by chunks.
        return text, finish, text

    def _put_prompt_logprobs(
        self, envelope: dict[str, Any], choice: dict[str, Any], value: Any
    ) -> None:
        choice["prompt_logprobs"] = value
