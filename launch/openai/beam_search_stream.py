"""A beam search (use_beam_search) shaped as an engine RequestStream, so that the
server's answers read it as they read sampling."""

from __future__ import annotations

from collections.abc import Callable

from launch.client.async_llm import AsyncLLM
from launch.client.beam_search import BeamSearchError, BeamSearchOutput, BeamSearchParams, search
from launch.client.request_stream import StreamOutput
from protocol.engine import Logprobs


class BeamSearchStream:
    """A beam search over several prompts shaped as a RequestStream for the server's
    Generation: its outputs, one per answer sequence (index prompt_i * beam_width + rank), all
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
        # Called after each round (the server's Generation: the request is no longer waiting).
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
