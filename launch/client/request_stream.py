"""A request's stream of outputs on an AsyncLLM: what the engine's reader hands over
(Inbox), and what the caller iterates (RequestStream of StreamOutputs)."""

from __future__ import annotations

import asyncio
import contextlib
from collections import deque
from dataclasses import dataclass
from typing import TYPE_CHECKING

from launch.client.output_processor import SequenceOutput, SequenceState, merge
from protocol.engine import Logprobs, RequestOutput

if TYPE_CHECKING:
    from launch.client.engine_client import EngineClient


@dataclass(slots=True)
class StreamOutput:
    """What one engine step added to one sequence of a request (index: which of its n).
    text is the decoded delta (never part of a character, never text a stop string will
    cut; "" when the model has no tokenizer); finish_reason is set once per sequence, on
    its last output ("length", "stop", "abort" or "error", with error saying why)."""

    request_id: str
    new_token_ids: list[int]
    text: str
    num_output_tokens: int  # so far, this output's included
    finish_reason: str | None = None
    num_cached_tokens: int = 0  # prompt tokens served from the prefix cache (at finish)
    error: str | None = None
    index: int = 0
    logprobs: list[Logprobs] | None = None  # one per new token, when asked for
    stop_reason: str | int | None = None  # the stop string or stop token id that ended it
    # On a sequence's first output, when asked for: one per prompt token, None first.
    prompt_logprobs: list[Logprobs | None] | None = None
    # On a sequence's first output, when asked for (SamplingParams.embedding).
    embedding: list[float] | None = None
    # On a sequence's first output: seconds the core queued it before first scheduling it.
    queued_s: float | None = None
    # On a sequence's last output: how many times the core preempted it.
    num_preemptions: int = 0


class Inbox:
    """A request's outputs as the reader hands them over. Unlike asyncio.Queue, which
    wakes its getter once per put, the consumer wakes once however many outputs arrive
    before it runs, and finds them all (RequestStream merges them into one output).

    With a stream interval N > 1 (vLLM's --stream-interval) a sequence wakes it for its
    first output, its last, and once N tokens of it wait, not for every token: a server
    then writes a chunk per N tokens a stream, and its per-token work is shared."""

    __slots__ = ("held", "interval", "items", "ready", "waiter")

    def __init__(self, interval: int = 1) -> None:
        self.items: deque[RequestOutput | BaseException] = deque()
        self.waiter: asyncio.Future[None] | None = None
        self.ready = False  # items worth waking for wait (cleared once they are all taken)
        self.interval = interval
        # With an interval: tokens each sequence (core request id) added since the last
        # wake-up; absent until its first output.
        self.held: dict[str, int] = {}

    def put(self, item: RequestOutput | BaseException) -> None:
        self.items.append(item)
        if self.interval > 1 and self._held_back(item):
            return
        if self.held:  # the consumer takes everything waiting: every count starts over
            self.held = dict.fromkeys(self.held, 0)
        self.ready = True
        waiter = self.waiter
        if waiter is not None:
            self.waiter = None
            if not waiter.done():  # a consumer cancelled while waiting leaves it cancelled
                waiter.set_result(None)

    def _held_back(self, item: RequestOutput | BaseException) -> bool:
        """Whether item waits for more of its sequence's tokens (not a first or last
        output, fewer than interval tokens since the last wake-up)."""
        if not isinstance(item, RequestOutput) or item.finish_reason is not None:
            return False
        count = self.held.get(item.request_id)
        if count is None:  # its first output
            self.held[item.request_id] = 0
            return False
        count += len(item.new_token_ids)
        self.held[item.request_id] = count
        return count < self.interval

    async def wait(self) -> None:
        while not self.ready:
            self.waiter = asyncio.get_running_loop().create_future()
            await self.waiter


class RequestStream:
    """An open request: iterate it for StreamOutputs (of its sequences, interleaved; it
    ends when all have finished). A consumer slower than the engine gets, per sequence,
    everything that arrived meanwhile as one output (token ids, text, logprobs in order),
    so falling behind costs one wake-up for several tokens. Closing the stream, or
    dropping it before the end, aborts the request in the core."""

    def __init__(
        self,
        engine: EngineClient,
        request_id: str,
        prompts: list[list[int]],
        sequences: dict[str, SequenceState],
        stream_interval: int = 1,
    ) -> None:
        self.request_id = request_id
        self.prompt_token_ids = prompts[0]
        self.prompts = prompts  # each prompt's token ids (several with generate_many)
        self._engine = engine
        self.inbox = Inbox(stream_interval)
        # Core request id -> its sequence, in index order.
        self._sequences = sequences
        self._index = {core_id: i for i, core_id in enumerate(sequences)}
        self._open = len(sequences)
        self.finished = False

    def __aiter__(self) -> RequestStream:
        return self

    async def __anext__(self) -> StreamOutput:
        inbox = self.inbox
        items = inbox.items
        while not self.finished:
            if not inbox.ready:
                try:
                    await inbox.wait()
                except BaseException:
                    # Cancelled while waiting (a client went away): the core stops at once.
                    self.close()
                    raise
            out = self._next(items)
            if not items:
                inbox.ready = False
            if out is not None:
                return out
        raise StopAsyncIteration

    def _next(self, items: deque[RequestOutput | BaseException]) -> StreamOutput | None:
        """The first queued output merged with its sequence's later ones; None when it
        belongs to a sequence already ended (the core ran on before it heard of a stop)."""
        o = items.popleft()
        if isinstance(o, BaseException):
            self.finished = True
            raise o
        core_id = o.request_id
        seq = self._sequences[core_id]
        if seq.finished:
            return None
        out = self._process(seq, o)
        last = o
        if items and not seq.finished:
            # Take this sequence's later outputs; keep the others' (and an error) in order.
            others: list[RequestOutput | BaseException] = []
            while items:
                nxt = items.popleft()
                if isinstance(nxt, RequestOutput) and nxt.request_id == core_id:
                    if not seq.finished:
                        merge(out, self._process(seq, nxt))
                        last = nxt
                    continue
                others.append(nxt)
                if isinstance(nxt, BaseException):
                    others.extend(items)
                    items.clear()
            items.extend(others)
        return StreamOutput(
            self.request_id,
            out.new_token_ids,
            out.text,
            out.num_output_tokens,
            out.finish_reason,
            last.num_cached_tokens,
            last.error,
            self._index[core_id],
            out.logprobs,
            out.stop_reason,
            out.prompt_logprobs,
            out.embedding,
            o.queued_s,
            last.num_preemptions,
        )

    def _process(self, seq: SequenceState, o: RequestOutput) -> SequenceOutput:
        out = seq.process(o)
        if seq.stopped:  # a stop string: the core stops now, its later tokens are dropped
            self._engine.abort_requests([o.request_id])
        elif seq.finished:
            self._engine.forget(o.request_id)
        if seq.finished:
            self._open -= 1
            self.finished = self._open == 0
        return out

    def close(self) -> None:
        """Abort the request if it is still running (idempotent, never blocks)."""
        if not self.finished:
            self.finished = True
            self._engine.abort_requests([r for r, s in self._sequences.items() if not s.finished])

    async def aclose(self) -> None:
        self.close()

    def __del__(self) -> None:
        # `break` out of `async for` drops the stream: abort now, not at garbage
        # collection of some async generator later.
        with contextlib.suppress(Exception):
            self.close()
