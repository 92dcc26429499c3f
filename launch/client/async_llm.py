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
from collections.abc import Coroutine, Sequence
from typing import Any, TypeVar

import zmq
import zmq.asyncio

from launch.client.beam_search import BeamSearchOutput, BeamSearchParams, check_room, search
from launch.client.engine_args import DEFAULT_LOG_LEVEL
from launch.client.engine_client import EngineClient
from launch.client.engine_processes import CORE_REPORT_TIMEOUT_S, EngineDeadError
from launch.client.inputs import (
    PreparedPrompt,
    Prompt,
    check_priority,
    check_stream_interval,
    to_prompt,
)
from launch.client.request_stream import RequestStream, StreamOutput
from protocol.engine import EngineDead, EngineOutputs, RequestOutput, SamplingParams

log = logging.getLogger("pagedserve.launch")
T = TypeVar("T")

# How often the reader looks at the child processes while the core is silent (an idle
# engine sends nothing; a dead one may not be able to say so).
WATCH_INTERVAL_MS = 500


class AsyncLLM(EngineClient):
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
        super().__init__(model, log_level=log_level, chat_template=chat_template, **kwargs)
        self._ids = itertools.count()
        self._reader: asyncio.Task[None] | None = None
        self._socket: zmq.asyncio.Socket | None = None
        self._dead = asyncio.Event()  # binds to a loop only when first awaited
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
        one = self.prepare(
            _as_prompt(prompt), sampling_params, f"request {rid}", cache_salt, priority
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
            self.prepare(p, params, f"request {rid} prompt {i}", cache_salt, priority)
            for i, (p, params) in enumerate(zip(items, per_prompt))
        ]
        return self._open(rid, checked, text, stream_interval)

    def _request_id(self, request_id: str | None) -> str:
        rid = f"req-{next(self._ids)}" if request_id is None else request_id
        if not isinstance(rid, str):
            raise TypeError(f"request_id must be a str, got {type(rid).__name__}")
        if rid in self._sinks:
            raise ValueError(f"request id {rid!r} is already open")
        return rid

    def _open(
        self,
        rid: str,
        prompts: list[PreparedPrompt],
        text: bool,
        stream_interval: int | None = None,
    ) -> RequestStream:
        """Send the core requests of prompts; the stream of them all. One prompt's copies
        are named as fan_out names them after rid; prompt k of several, after
        "{rid}-{k}"."""
        requests = []
        for k, one in enumerate(prompts):
            base = rid if len(prompts) == 1 else f"{rid}-{k}"
            requests.extend((one, *copy) for copy in self.sequences(base, one, text))
        sequences = {core_id: seq for _, core_id, _, seq in requests}
        interval = self.stream_interval
        if stream_interval is not None:
            interval = max(interval, check_stream_interval(stream_interval, "stream_interval"))
        stream = RequestStream(self, rid, [one.ids for one in prompts], sequences, interval)
        for one, core_id, copy, _ in requests:
            self.send(core_id, one, copy, stream.inbox.put)
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
        check_priority(priority, self.limits.scheduling_policy)
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

    def reset_prefix_cache(self) -> None:
        self._check_running()
        self.engine.reset_prefix_cache()

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
                    self.dispatch(msg)
                elif isinstance(msg, EngineDead):
                    raise await self._stop_engine(msg.reason, msg.outputs)
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

    async def _stop_engine(
        self, reason: str, failed: list[RequestOutput] | None = None
    ) -> EngineDeadError:
        """The engine is going down: stop its processes off the loop; the error to raise.
        failed: the core's answers to its open requests, delivered once nothing sends."""
        self._closing = True
        # Known dead from now, not once its processes are gone (that may take seconds):
        # requests and /health answer 503 with the reason at once.
        self.dead_reason = self.engine.failure(reason)
        if failed:
            self.dispatch(EngineOutputs(failed))
        self._release_socket()
        return await asyncio.to_thread(self.engine.stopped, reason)

    def _die(self, reason: str) -> None:
        self.dead_reason = reason
        self.fail_open(EngineDeadError(reason))
        self._release_socket()
        self._dead.set()

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
        self.fail_open(EngineDeadError("the engine was shut down"))
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
