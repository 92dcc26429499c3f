"""The asyncio API: stream requests through one engine from many coroutines.

`AsyncLLM` is how another Python program embeds the engine (the HTTP server is one)::

    import asyncio
    from launch import AsyncLLM, SamplingParams
    from launch.client.async_llm import run

    async def main() -> None:
        engine = AsyncLLM("HuggingFaceTB/SmolLM2-135M-Instruct", max_model_len=2048)
        try:
            params = SamplingParams(max_tokens=32, temperature=0)
            chat = [{"role": "user", "content": "What is the capital of France?"}]
            async for out in engine.generate(chat, params):
                print(out.text, end="", flush=True)
        finally:
            await engine.aclose()

    run(main())  # asyncio.run, on uvloop when it is installed

The constructor starts the engine processes (EngineProcesses: the same start-up and
supervision as `LLM`) and blocks until they are ready; `await AsyncLLM.create(...)` does it
off the event loop. One task on the loop reads the core's outputs and hands each to its
request's queue, so thousands of requests stream concurrently on one loop. Leaving a
stream early (break, an exception, cancelling the consuming task) aborts its request in
the core at once. If the engine dies, every open stream raises EngineDeadError naming
the process and the cause (requests the core could fail itself first end with
finish_reason "error" and that reason).
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import time
from collections import deque
from collections.abc import Callable, Coroutine, Sequence
from dataclasses import dataclass
from typing import Any, NamedTuple, TypeVar

import zmq
import zmq.asyncio

from launch.client.beam_search import BeamSearchOutput, BeamSearchParams, check_room, search
from launch.client.engine_args import DEFAULT_LOG_LEVEL, EngineArgs
from launch.client.engine_processes import CORE_REPORT_TIMEOUT_S, EngineDeadError, EngineProcesses
from launch.client.inputs import InputProcessor, Prompt, checked_params, to_prompt, truncated
from launch.client.output_processor import SequenceOutput, SequenceState, fan_out, merge
from protocol.engine import (
    EngineDead,
    EngineOutputs,
    Logprobs,
    RequestOutput,
    SamplingParams,
    SchedulerStats,
)

log = logging.getLogger("pagedserve.launch")
T = TypeVar("T")

# How often the reader looks at the child processes while the core is silent (an idle
# engine sends nothing; a dead one may not be able to say so).
WATCH_INTERVAL_MS = 500


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


class _Prepared(NamedTuple):
    """One prompt, checked and ready to send."""

    ids: list[int]
    params: SamplingParams
    cache_salt: str | None
    priority: int


class _Inbox:
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
        engine: AsyncLLM,
        request_id: str,
        prompts: list[list[int]],
        sequences: dict[str, SequenceState],
        stream_interval: int = 1,
    ) -> None:
        self.request_id = request_id
        self.prompt_token_ids = prompts[0]
        self.prompts = prompts  # each prompt's token ids (several with generate_many)
        self._engine = engine
        self._inbox = _Inbox(stream_interval)
        # Core request id -> its sequence, in index order.
        self._sequences = sequences
        self._index = {core_id: i for i, core_id in enumerate(sequences)}
        self._open = len(sequences)
        self.finished = False

    def __aiter__(self) -> RequestStream:
        return self

    async def __anext__(self) -> StreamOutput:
        inbox = self._inbox
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
        )

    def _process(self, seq: SequenceState, o: RequestOutput) -> SequenceOutput:
        out = seq.process(o)
        if seq.stopped:  # a stop string: the core stops now, its later tokens are dropped
            self._engine._abort([o.request_id])
        elif seq.finished:
            self._engine._forget(o.request_id)
        if seq.finished:
            self._open -= 1
            self.finished = self._open == 0
        return out

    def close(self) -> None:
        """Abort the request if it is still running (idempotent, never blocks)."""
        if not self.finished:
            self.finished = True
            self._engine._abort([r for r, s in self._sequences.items() if not s.finished])

    async def aclose(self) -> None:
        self.close()

    def __del__(self) -> None:
        # `break` out of `async for` drops the stream: abort now, not at garbage
        # collection of some async generator later.
        with contextlib.suppress(Exception):
            self.close()


class AsyncLLM:
    """An engine (core + workers) for asyncio programs. model: a local checkpoint
    directory or a Hub id (org/name[@revision]); None runs the built-in model.
    chat_template: a Jinja file or template used instead of the model's. stream_interval:
    a stream's outputs carry at least this many tokens, but for its first and last
    (vLLM's --stream-interval; a request may ask for more). Other keyword arguments are
    EngineArgs fields."""

    def __init__(
        self,
        model: str | None = None,
        *,
        log_level: str = DEFAULT_LOG_LEVEL,
        chat_template: str | None = None,
        stream_interval: int = 1,
        **kwargs: Any,
    ):
        self.stream_interval = check_stream_interval(stream_interval, "stream_interval")
        self.inputs = InputProcessor.load(model, chat_template)
        self.model = self.inputs.model_dir
        self.tokenizer = self.inputs.tokenizer
        self.engine = EngineProcesses(EngineArgs(model=self.model, **kwargs), log_level=log_level)
        ready = self.engine.ready
        self.vocab_size = ready.vocab_size
        self.max_model_len = ready.max_model_len
        self.eos_token_ids = ready.eos_token_ids
        self.sampling_defaults = ready.sampling_defaults
        self.stats: SchedulerStats | None = None  # the latest, after every engine step
        self.dead_reason: str | None = None  # set once the engine has stopped
        self.on_stats: Callable[[SchedulerStats], None] | None = None
        # Open requests' queues, not their streams: a stream the caller drops is collected
        # at once (its __del__ aborts the request).
        self._queues: dict[str, _Inbox] = {}
        self._ids = itertools.count()
        self._reader: asyncio.Task[None] | None = None
        self._socket: zmq.asyncio.Socket | None = None
        self._dead = asyncio.Event()  # binds to a loop only when first awaited
        # Set before the engine's sockets close (shutdown runs off the loop, in a thread):
        # from then on nothing on the loop sends.
        self._closing = False
        self._closed = False

    @classmethod
    async def create(cls, model: str | None = None, **kwargs: Any) -> AsyncLLM:
        """Start an engine without blocking the running event loop."""
        return await asyncio.to_thread(cls, model, **kwargs)

    # -- requests ---------------------------------------------------------------------
    def generate(
        self,
        prompt: str | list[int] | list[dict[str, Any]] | Prompt,
        sampling_params: SamplingParams | None = None,
        request_id: str | None = None,
        *,
        cache_salt: str | None = None,
        priority: int | None = None,
        text: bool = True,
        stream_interval: int | None = None,
    ) -> RequestStream:
        """Start a request and return its stream of outputs. prompt: text, token ids, a
        chat conversation ([{"role", "content"}, ...]) or a Prompt. request_id must not
        be open already (default: a fresh one). priority (default: the Prompt's, else 0):
        lower runs first when the engine runs the priority scheduling policy, and must be
        0 otherwise. text False skips detokenizing. stream_interval: at least this many
        tokens an output (but a sequence's first and last), or the engine's if larger. With
        n > 1 the core runs n requests "{request_id}-{i}" (sharing the prompt's blocks
        through the prefix cache) and each output's index says which.
        Bad arguments raise TypeError/ValueError here; EngineDeadError once it stopped."""
        self._check_running()
        rid = self._request_id(request_id)
        one = self._prepare(
            _as_prompt(prompt), sampling_params, cache_salt, priority, f"request {rid}"
        )
        return self._open(rid, [one], text, stream_interval)

    def generate_many(
        self,
        prompts: Sequence[str | list[int] | list[dict[str, Any]] | Prompt],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        request_id: str | None = None,
        *,
        cache_salt: str | None = None,
        priority: int | None = None,
        text: bool = True,
        stream_interval: int | None = None,
    ) -> RequestStream:
        """One request of several prompts (sampling_params: one for all, or one per
        prompt): one stream whose outputs' index is prompt-major, the sum of the earlier
        prompts' n plus the copy (prompt_i * n + copy_j when n is the same). Every prompt
        is checked before any is sent; closing the stream aborts them all."""
        self._check_running()
        rid = self._request_id(request_id)
        if isinstance(prompts, (str, Prompt)) or not prompts:
            raise TypeError("prompts must be a non-empty list of prompts")
        items = [_as_prompt(q) for q in prompts]
        if sampling_params is None or isinstance(sampling_params, SamplingParams):
            per_prompt = [sampling_params] * len(items)
        else:
            per_prompt = list(sampling_params)
            if len(per_prompt) != len(items):
                raise ValueError(f"{len(per_prompt)} sampling params for {len(items)} prompts")
        checked = [
            self._prepare(p, params, cache_salt, priority, f"request {rid} prompt {i}")
            for i, (p, params) in enumerate(zip(items, per_prompt))
        ]
        return self._open(rid, checked, text, stream_interval)

    def _prepare(
        self,
        p: Prompt,
        params: SamplingParams | None,
        cache_salt: str | None,
        priority: int | None,
        what: str,
    ) -> _Prepared:
        """A prompt's token ids, checked params (the call's, else the prompt's, else the
        defaults), cache salt and priority; raises naming `what`."""
        params = params if params is not None else p.sampling_params
        params = SamplingParams() if params is None else params
        params = checked_params(params, what, self.vocab_size, self.inputs)
        priority = p.priority if priority is None else priority
        try:
            self.engine.check_priority(priority)
        except ValueError as e:
            raise ValueError(f"{what}: {e}") from None
        ids = self.inputs.token_ids(p, self.vocab_size)
        ids = truncated(ids, params.truncate_prompt_tokens, self.max_model_len)
        return _Prepared(ids, params, cache_salt or p.cache_salt, priority)

    def _request_id(self, request_id: str | None) -> str:
        rid = f"req-{next(self._ids)}" if request_id is None else request_id
        if not isinstance(rid, str):
            raise TypeError(f"request_id must be a str, got {type(rid).__name__}")
        if rid in self._queues:
            raise ValueError(f"request id {rid!r} is already open")
        return rid

    def _open(
        self,
        rid: str,
        prompts: list[_Prepared],
        text: bool,
        stream_interval: int | None = None,
    ) -> RequestStream:
        """Send the core requests of prompts; the stream of them all. One prompt's copies
        are named as fan_out names them after rid; prompt k of several, after
        "{rid}-{k}"."""
        requests = []
        for k, one in enumerate(prompts):
            base = rid if len(prompts) == 1 else f"{rid}-{k}"
            for core_id, copy in fan_out(base, one.params):
                if core_id in self._queues:
                    raise ValueError(f"request id {core_id!r} is already open")
                seq = SequenceState(self.tokenizer, one.params, text)
                requests.append((core_id, one, copy, seq))
        sequences = {core_id: seq for core_id, _, _, seq in requests}
        interval = self.stream_interval
        if stream_interval is not None:
            interval = max(interval, check_stream_interval(stream_interval, "stream_interval"))
        stream = RequestStream(self, rid, [one.ids for one in prompts], sequences, interval)
        for core_id, one, copy, _ in requests:
            self._queues[core_id] = stream._inbox
            self.engine.add_request(core_id, one.ids, copy, one.cache_salt, one.priority)
        return stream

    async def beam_search(
        self,
        prompt: str | list[int] | list[dict[str, Any]] | Prompt,
        params: BeamSearchParams,
        request_id: str | None = None,
        *,
        cache_salt: str | None = None,
        priority: int | None = None,
    ) -> BeamSearchOutput:
        """vLLM's beam search of one prompt (launch/client/beam_search.py): each round is one
        engine request per live beam, "{request_id}-r{round}-{beam}". Cancelling it
        aborts the round in flight; ValueError for bad params or a prompt without room
        for max_tokens more; BeamSearchError when a round fails. cache_salt and priority
        (default: the Prompt's) go with every round's requests."""
        self._check_running()
        rid = self._request_id(request_id)
        params.validate()
        p = _as_prompt(prompt)
        priority = p.priority if priority is None else priority
        self.engine.check_priority(priority)
        ids = self.prompt_token_ids(p)
        check_room(len(ids), params, self.max_model_len, f"request {rid}")
        salt = cache_salt or p.cache_salt
        (found,) = await search(self, [ids], params, rid, salt, priority)
        return found

    def prompt_token_ids(
        self, prompt: str | list[int] | list[dict[str, Any]] | Prompt
    ) -> list[int]:
        """The token ids generate() would send for prompt (raises as it would)."""
        return self.inputs.token_ids(_as_prompt(prompt), self.vocab_size)

    @property
    def num_open_requests(self) -> int:
        return len(self._queues)

    def abort_all(self) -> None:
        """Abort every open request; each stream ends with finish_reason "abort"."""
        if self._queues and self._can_send():
            self.engine.abort(list(self._queues))

    def reset_prefix_cache(self) -> None:
        self._check_running()
        self.engine.reset_prefix_cache()

    def _abort(self, request_ids: list[str]) -> None:
        """Abort the core requests still open among request_ids (their later outputs are
        dropped)."""
        ids = [r for r in request_ids if self._queues.pop(r, None) is not None]
        if ids and self._can_send():
            self.engine.abort(ids)

    def _can_send(self) -> bool:
        return not self._closing and self.dead_reason is None and not self.engine.closed

    def _forget(self, request_id: str) -> None:
        self._queues.pop(request_id, None)

    def _check_running(self) -> None:
        if self.dead_reason is not None:
            raise EngineDeadError(self.dead_reason)
        if self._closing or self.engine.closed:
            raise EngineDeadError("the engine was shut down; start a new one")
        if self._reader is None:
            self._start_reader()

    # -- the output reader --------------------------------------------------------------
    def _start_reader(self) -> None:
        """Bind to the running loop: one task reads every output of the core."""
        self._socket = zmq.asyncio.Socket.from_socket(self.engine.from_core)
        self._reader = asyncio.get_running_loop().create_task(self._read(), name="engine-reader")

    async def start(self) -> None:
        """Attach to the running loop now (generate() does it on first use)."""
        self._check_running()

    async def wait_dead(self) -> str:
        """Wait until the engine dies (not a shutdown by aclose()); its reason."""
        if self.dead_reason is None and self._reader is None:
            self._check_running()
        await self._dead.wait()
        return self.dead_reason or "the engine stopped"

    async def _read(self) -> None:
        try:
            while True:
                msg = self.engine.decode(await self._next_frame())
                if isinstance(msg, EngineOutputs):
                    self._dispatch(msg)
                elif isinstance(msg, EngineDead):
                    raise await self._stop_engine(msg.reason)
                else:
                    raise EngineDeadError(f"unexpected {type(msg).__name__} from the engine core")
        except asyncio.CancelledError:
            raise
        except EngineDeadError as e:
            self._die(str(e))
        except Exception as e:  # a bug here must not leave streams waiting forever
            log.exception("engine output reader failed")
            self._die(f"the engine client failed: {type(e).__name__}: {e}")

    async def _next_frame(self) -> bytes:
        sock = self._socket
        assert sock is not None
        while not await sock.poll(WATCH_INTERVAL_MS):
            if not self.engine.lost_processes():
                continue
            # A process is gone: give the core the time EngineProcesses gives it to
            # report why (it fails the open requests first), without blocking the loop.
            deadline = time.monotonic() + CORE_REPORT_TIMEOUT_S
            while not await sock.poll(100):
                if not self.engine.awaiting_core_report(deadline):
                    raise await self._stop_engine("")
        return await sock.recv()

    async def _stop_engine(self, reason: str) -> EngineDeadError:
        """The engine is going down: stop its processes off the loop; the error to raise."""
        self._closing = True
        self._release_socket()
        return await asyncio.to_thread(self.engine.stopped, reason)

    def _dispatch(self, batch: EngineOutputs) -> None:
        if batch.stats is not None:
            self.stats = batch.stats
            if self.on_stats is not None:
                self.on_stats(batch.stats)
        queues = self._queues
        for o in batch.outputs:
            inbox = queues.get(o.request_id)
            if inbox is not None:
                inbox.put(o)
        for r in batch.rejected:  # generate() refuses open ids, so only a bug gets here
            log.error("the engine refused request %s: %s", r.request_id, r.reason)

    def _die(self, reason: str) -> None:
        self.dead_reason = reason
        self._end_streams(EngineDeadError(reason))
        self._release_socket()
        self._dead.set()

    def _end_streams(self, error: EngineDeadError) -> None:
        for inbox in self._queues.values():
            inbox.put(error)
        self._queues.clear()

    def _release_socket(self) -> None:
        # The event loop watches this socket's descriptor: stop that before the engine's
        # context closes it.
        if self._socket is not None and not self._socket.closed:
            self._socket.close(linger=0)

    # -- shutdown -----------------------------------------------------------------------
    async def aclose(self) -> None:
        """End every open stream (EngineDeadError), stop the reader, stop the engine
        processes in order (off the loop). Idempotent."""
        if self._closed:
            return
        self._closed = True
        self.abort_all()
        stopping = self._closing  # the reader is already stopping the engine: let it end
        self._closing = True
        self._end_streams(EngineDeadError("the engine was shut down"))
        if self._reader is not None:
            if not stopping:
                self._reader.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._reader
        self._release_socket()
        await asyncio.to_thread(self.engine.shutdown)

    def shutdown(self) -> None:
        """Stop the engine processes from outside a running loop (aclose() inside one)."""
        self._closing = True
        self._release_socket()
        self.engine.shutdown()


def check_stream_interval(value: object, name: str) -> int:
    """A stream interval (tokens an output, at least 1); ValueError naming `name`."""
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{name} must be an integer >= 1, got {value!r}")
    return value


def _as_prompt(prompt: object) -> Prompt:
    """A conversation ([{"role", "content"}, ...]) or what to_prompt takes, as a Prompt."""
    if isinstance(prompt, list) and prompt and all(isinstance(m, dict) for m in prompt):
        return Prompt(messages=prompt)
    return to_prompt(prompt)  # type: ignore[arg-type]


def run(main: Coroutine[Any, Any, T]) -> T:
    """asyncio.run(main) on uvloop when it is installed (a faster loop; same semantics)."""
    try:
        import uvloop
    except ImportError:
        return asyncio.run(main)
    return uvloop.run(main)


__all__ = ["AsyncLLM", "EngineDeadError", "RequestStream", "StreamOutput", "run"]
