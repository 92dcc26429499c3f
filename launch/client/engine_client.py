"""The one request path of `LLM` and `AsyncLLM`: start the engine, check a prompt, send
its core requests, hand each core output to whoever waits for it, abort.

Both front ends subclass EngineClient; they differ only in how they wait for outputs (a
blocking loop, or a task on an event loop) and in what they make of them (whole
CompletionOutputs, or streams).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

from launch.client.chat import ChatTemplate
from launch.client.engine_args import DEFAULT_LOG_LEVEL, EngineArgs
from launch.client.engine_processes import EngineDeadError, EngineProcesses
from launch.client.inputs import InputProcessor, PreparedPrompt, Prompt, RequestLimits
from launch.client.output_processor import SequenceState, fan_out
from launch.client.tokenizer import Tokenizer
from protocol.engine import EngineOutputs, RequestOutput, SamplingParams, SchedulerStats

log = logging.getLogger("pagedserve.launch")

# Who takes a core request's outputs: called with each, or with the error that ends it.
OutputSink = Callable[[RequestOutput | BaseException], None]


class EngineClient:
    """An engine (core + workers) and the requests open on it. model: a local checkpoint
    directory or a Hub id (org/name[@revision]); None runs the built-in model.
    chat_template: a Jinja file or template used instead of the model's. Other keyword
    arguments are EngineArgs fields."""

    def __init__(
        self,
        model: str | None = None,
        *,
        log_level: str = DEFAULT_LOG_LEVEL,
        chat_template: str | None = None,
        **kwargs: Any,
    ) -> None:
        self.inputs = InputProcessor.load(model, chat_template)
        self.model = self.inputs.model_dir
        self.tokenizer: Tokenizer | None = self.inputs.tokenizer
        self.chat_template: ChatTemplate | None = self.inputs.chat_template
        self.engine = EngineProcesses(EngineArgs(model=self.model, **kwargs), log_level=log_level)
        ready = self.engine.ready
        self.vocab_size = ready.vocab_size
        self.max_model_len = ready.max_model_len
        self.eos_token_ids = ready.eos_token_ids
        self.sampling_defaults = ready.sampling_defaults
        self.limits = RequestLimits(
            ready.vocab_size, ready.max_model_len, self.engine.args.scheduling_policy
        )
        self.stats: SchedulerStats | None = None  # the latest, after every engine step
        self.on_stats: Callable[[SchedulerStats], None] | None = None
        self.dead_reason: str | None = None  # set once the engine has stopped
        # Open core requests -> who takes their outputs (not the requests themselves: a
        # stream the caller drops is collected at once, and its __del__ aborts it).
        self._sinks: dict[str, OutputSink] = {}
        # Set before the engine's sockets close: from then on nothing sends.
        self._closing = False

    # -- sending ------------------------------------------------------------------------
    def prepare(
        self,
        p: Prompt,
        params: SamplingParams | None,
        what: str,
        cache_salt: str | None = None,
        priority: int | None = None,
        checked: bool = False,
    ) -> PreparedPrompt:
        """The prompt checked against this engine (InputProcessor.prepare)."""
        return self.inputs.prepare(p, params, self.limits, what, cache_salt, priority, checked)

    def sequences(
        self, request_id: str, one: PreparedPrompt, text: bool
    ) -> list[tuple[str, SamplingParams, SequenceState]]:
        """The core requests of one prompt (fan_out's ids and params) with the state that
        turns their outputs into SequenceOutputs; raises, sending nothing, for an id
        already open. text False skips detokenizing (stop strings decode anyway)."""
        copies = []
        for core_id, copy in fan_out(request_id, one.params):
            if core_id in self._sinks:
                raise ValueError(f"request id {core_id!r} is already open")
            copies.append((core_id, copy, SequenceState(self.tokenizer, one.params, text)))
        return copies

    def send(
        self, core_id: str, one: PreparedPrompt, params: SamplingParams, sink: OutputSink
    ) -> None:
        """Open a core request whose outputs go to sink."""
        self._sinks[core_id] = sink
        self.engine.add_request(core_id, one.ids, params, one.cache_salt, one.priority)

    # -- receiving ----------------------------------------------------------------------
    # Per engine step: one dict lookup and one call per output.
    def dispatch(self, batch: EngineOutputs) -> None:
        if batch.stats is not None:
            self.stats = batch.stats
            if self.on_stats is not None:
                self.on_stats(batch.stats)
        sinks = self._sinks
        for o in batch.outputs:
            sink = sinks.get(o.request_id)
            if sink is not None:
                sink(o)
        for r in batch.rejected:  # open ids are refused before sending, so only a bug gets here
            log.error("the engine refused request %s: %s", r.request_id, r.reason)

    def fail_open(self, error: EngineDeadError) -> None:
        """End every open request with error (the engine is gone or going)."""
        sinks = list(self._sinks.values())
        self._sinks.clear()
        for sink in sinks:
            sink(error)

    # -- ending -------------------------------------------------------------------------
    @property
    def num_open_requests(self) -> int:
        return len(self._sinks)

    def abort_requests(self, request_ids: list[str]) -> None:
        """Abort the core requests still open among request_ids (their later outputs are
        dropped)."""
        ids = [r for r in request_ids if self._sinks.pop(r, None) is not None]
        if ids and self.can_send():
            self.engine.abort(ids)

    def abort_all(self) -> None:
        """Abort every open request; each ends with finish_reason "abort"."""
        if self._sinks and self.can_send():
            self.engine.abort(list(self._sinks))

    def forget(self, request_id: str) -> None:
        """A core request has finished: its later outputs (none are expected) are dropped."""
        self._sinks.pop(request_id, None)

    def can_send(self) -> bool:
        return not self._closing and self.dead_reason is None and not self.engine.closed

    def reset_prefix_cache(self) -> None:
        """Forget every cached prefix block (the engine refuses while requests run)."""
        self.engine.reset_prefix_cache()

    def get_default_sampling_params(self) -> SamplingParams:
        """The model's sampling defaults (generation_config.json), spelled out; fields a
        request leaves unset take these anyway."""
        d = self.sampling_defaults
        return SamplingParams(
            temperature=d.temperature, top_p=d.top_p, top_k=d.top_k, min_p=d.min_p
        )
