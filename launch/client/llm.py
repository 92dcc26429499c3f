"""The Python API: `from launch import LLM, SamplingParams`."""

from __future__ import annotations

import functools
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

from launch.client.beam_search import (
    BeamSearch,
    BeamSearchError,
    BeamSearchOutput,
    BeamSearchParams,
    advance_all,
    check_room,
    round_prompts,
)
from launch.client.engine_args import DEFAULT_LOG_LEVEL
from launch.client.engine_client import EngineClient, OutputSink
from launch.client.engine_processes import EngineDeadError
from launch.client.inputs import (
    InputProcessor,
    PreparedPrompt,
    Prompt,
    check_priority,
    checked_params,
    to_prompt,
)
from launch.client.output_processor import SequenceState, text_token_ids
from protocol.engine import (
    EmbeddingParams,
    Logprobs,
    RequestOutput,
    SamplingParams,
    SchedulerStats,
)


@dataclass
class CompletionOutput:
    """One sequence generated for one prompt: index is the prompt's position in the
    input, seq_index which of its n sequences (0 when n is 1)."""

    index: int
    prompt_token_ids: list[int]
    token_ids: list[int] = field(default_factory=list)
    text: str | None = None
    finish_reason: str | None = None
    num_cached_tokens: int = 0
    error: str | None = None
    logprobs: list[Logprobs] | None = None  # one per token, when asked for
    stop_reason: str | int | None = None  # the stop string or stop token id that ended it
    seq_index: int = 0
    # When asked for (prompt_logprobs): one per prompt token, None for the first.
    prompt_logprobs: list[Logprobs | None] | None = None
    # When asked for (SamplingParams.embedding, LLM.embed): the prompt's embedding.
    embedding: list[float] | None = None
    # When a stop string ended it: the text before it (the tokens run to the one that
    # completed the match).
    _stop_text: list[str] | None = field(default=None, repr=False)
    _skip_special_tokens: bool = field(default=True, repr=False)
    # Whether the EOS or stop token that ended it is part of its text.
    _keep_stop: bool = field(default=False, repr=False)


@dataclass
class RunSummary:
    requests: int = 0
    failed: int = 0
    prompt_tokens: int = 0
    output_tokens: int = 0
    seconds: float = 0.0
    stats: SchedulerStats | None = None

    @property
    def output_tokens_per_s(self) -> float:
        return self.output_tokens / self.seconds if self.seconds else 0.0

    @property
    def prefix_cache_hit_rate(self) -> float:
        s = self.stats
        return s.prefix_cache_hits / s.prefix_cache_queries if s and s.prefix_cache_queries else 0.0


class LLM(EngineClient):
    """An engine (core + workers) for offline generation. model: a local checkpoint
    directory or a Hugging Face Hub id (org/name[@revision]); None runs the built-in
    small random Llama, offline. chat_template: a Jinja file or template used instead of
    the model's. Other keyword arguments are EngineArgs fields."""

    def __init__(
        self,
        model: str | None = None,
        *,
        log_level: str = DEFAULT_LOG_LEVEL,
        chat_template: str | None = None,
        **kwargs: Any,
    ):
        super().__init__(model, log_level=log_level, chat_template=chat_template, **kwargs)
        self.last_summary = RunSummary()
        self._next_id = 0
        self._closed = False

    def generate(
        self,
        prompts: str | list[int] | Sequence[str | list[int] | Prompt],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = True,
        on_finish: Callable[[CompletionOutput], None] | None = None,
        priority: Sequence[int] | None = None,
    ) -> list[CompletionOutput]:
        """Outputs in input order, n per prompt (SamplingParams.n, 1 by default): a
        prompt's n sequences are consecutive, with the prompt's index and seq_index 0..n-1;
        a bad prompt fails alone with one output (finish_reason "error"), so group by
        index when n > 1. The copies share the prompt's blocks through the prefix cache
        (num_cached_tokens); with a seed, copy i samples with seed + i.

        prompts: one prompt (text or token ids) or a list of them. sampling_params: one for
        all, or one per prompt. on_finish is called with each output as its request ends
        (in finish order), e.g. to save results as they come. Malformed arguments raise
        TypeError or ValueError before anything is sent. A stop string ends a request's
        text before it (its token ids run to the token that completed the match).
        priority: one per prompt (else each Prompt's, else 0), for an engine started with
        scheduling_policy="priority": lower values are admitted first."""
        if self._closed:
            raise EngineDeadError("this LLM was closed; create a new one")
        items = _as_prompt_list(prompts)
        if priority is not None and len(priority) != len(items):
            raise ValueError(f"{len(priority)} priorities for {len(items)} prompts")
        params = _per_prompt_params(sampling_params, len(items), self.vocab_size, self.inputs)
        run = _Generation(self, on_finish, len(items), use_tqdm)
        self.stats = None
        for index, (item, default) in enumerate(zip(items, params)):
            p = to_prompt(item)
            if priority is not None:
                p = replace(p, priority=priority[index])
            self._submit(run, index, p, default)
        run.summary.requests = len(run.results)
        if len(run.results) != len(items):
            run.bar.total = len(run.results)
            run.bar.refresh()
        try:
            self._collect()
        finally:
            run.bar.close()
            self._sinks.clear()  # after an error: none of this run's requests is waited for
        summary = run.summary
        summary.stats = self.stats
        summary.seconds = time.perf_counter() - run.start
        summary.failed = sum(1 for r in run.results if r.finish_reason == "error")
        if summary.failed and self.dead_reason is None and not self.engine.closed:
            # Failures may be the engine going down: say so rather than look healthy.
            self.dead_reason = self.engine.dead_reason()
        self.last_summary = summary
        return run.results

    def _submit(self, run: _Generation, index: int, p: Prompt, default: SamplingParams) -> None:
        """Check prompt index and send its core requests; a bad one fails alone, at once."""
        what = f"prompt {index}"
        try:
            # The prompt's own params, else the call's (checked already).
            own = p.sampling_params
            one = self.prepare(p, default if own is None else own, what, checked=own is None)
            # Text only for stop strings: the whole text is decoded once at the end.
            copies = self.sequences(f"req-{self._next_id}", one, bool(one.params.stop))
        except (TypeError, ValueError) as e:
            run.fail(index, e if str(e).startswith(f"{what}: ") else f"{what}: {e}")
            return
        self._next_id += 1
        run.summary.prompt_tokens += len(one.ids)
        for j, (core_id, copy, seq) in enumerate(copies):
            self.send(core_id, one, copy, run.sink(index, one, j, seq))

    def _collect(self) -> None:
        """Wait until every open request has finished (outputs go to their sinks)."""
        try:
            while self._sinks:
                batch = self.engine.get_outputs()
                if batch is not None:
                    self.dispatch(batch)
        except KeyboardInterrupt:
            self.abort_requests(list(self._sinks))
            raise
        except EngineDeadError as e:
            # The core fails the requests it knows of before it stops; any it never read
            # fail here with the same reason, so every input still gets its answer.
            self.dead_reason = str(e)
            self.fail_open(e)

    def beam_search(
        self,
        prompts: str | list[int] | Sequence[str | list[int] | Prompt],
        params: BeamSearchParams,
    ) -> list[BeamSearchOutput]:
        """vLLM's beam search (launch/client/beam_search.py): each prompt's params.beam_width
        best sequences, best first. The prompts search together: each round is one batch
        of every live beam, whose blocks its parent's requests left in the prefix cache.
        ValueError for bad params or a prompt without room for max_tokens more;
        BeamSearchError when a round fails."""
        if self._closed:
            raise EngineDeadError("this LLM was closed; create a new one")
        params.validate()
        searches = []
        for i, item in enumerate(_as_prompt_list(prompts)):
            p = to_prompt(item)
            ids = self.inputs.token_ids(p, self.vocab_size)
            check_room(len(ids), params, self.max_model_len, f"prompt {i}")
            check_priority(p.priority, self.limits.scheduling_policy)
            searches.append(BeamSearch(ids, params, self.eos_token_ids, p.cache_salt, p.priority))
        one = params.round_params()
        while asked := round_prompts(searches):
            outs = self.generate(asked, one, use_tqdm=False)
            failed = next((o for o in outs if o.finish_reason == "error"), None)
            if failed is not None:
                raise BeamSearchError(failed.error or "a beam's request failed")
            advance_all(
                searches, [(o.token_ids[0], o.logprobs[0], o.num_cached_tokens) for o in outs]
            )
        return [s.result(self.tokenizer) for s in searches]

    def chat(
        self,
        messages: list[dict[str, Any]] | Sequence[list[dict[str, Any]]],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = True,
        on_finish: Callable[[CompletionOutput], None] | None = None,
        add_generation_prompt: bool = True,
        chat_template_kwargs: dict[str, Any] | None = None,
        tools: list[dict[str, Any]] | None = None,
        continue_final_message: bool = False,
    ) -> list[CompletionOutput]:
        """generate() for conversations: one ([{"role": ..., "content": ...}, ...]) or a
        list of them, each rendered with the model's chat template. tools: function tools
        in OpenAI's shape, for the template (the answer is text, as vLLM's LLM.chat
        gives it; the server reads calls out of it, launch/openai/tools.py)."""
        if isinstance(messages, (list, tuple)) and messages and isinstance(messages[0], dict):
            conversations = [messages]
        elif isinstance(messages, (list, tuple)):
            conversations = list(messages)
        else:
            raise TypeError(
                f"messages must be a conversation or a list of them, got {type(messages).__name__}"
            )
        prompts = [
            Prompt(
                messages=c,  # type: ignore[arg-type]
                add_generation_prompt=add_generation_prompt,
                chat_template_kwargs=chat_template_kwargs,
                tools=tools,
                continue_final_message=continue_final_message,
            )
            for c in conversations
        ]
        return self.generate(prompts, sampling_params, use_tqdm, on_finish)

    def embed(
        self,
        prompts: str | list[int] | Sequence[str | list[int] | Prompt],
        *,
        normalize: bool = True,
        dimensions: int | None = None,
        truncate_prompt_tokens: int | None = None,
        use_tqdm: bool = True,
    ) -> list[CompletionOutput]:
        """Each prompt's embedding (out.embedding): the final hidden state at its last
        token, its first `dimensions` values if set, L2-normalized unless asked not to be
        (EmbeddingParams). One step of prefill per prompt; the token that step samples is
        left out (token_ids empty). A bad prompt fails alone, as in generate()."""
        params = SamplingParams(
            max_tokens=1,
            temperature=0.0,
            embedding=EmbeddingParams(normalize, dimensions),
            truncate_prompt_tokens=truncate_prompt_tokens,
        )
        outs = self.generate(prompts, params, use_tqdm)
        for out in outs:
            out.token_ids, out.text = [], None
        return outs

    def close(self) -> None:
        self._closed = True
        self.engine.shutdown()

    def __enter__(self) -> LLM:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class _Generation:
    """One generate() call: its outputs in input order, filled as the core's arrive."""

    def __init__(
        self,
        llm: LLM,
        on_finish: Callable[[CompletionOutput], None] | None,
        total: int,
        use_tqdm: bool,
    ) -> None:
        self.llm = llm
        self.finish = on_finish or (lambda _out: None)
        self.results: list[CompletionOutput] = []
        self.summary = RunSummary()
        self.start = time.perf_counter()
        self.bar = _progress(total, use_tqdm)

    def fail(self, index: int, error: object) -> None:
        """Prompt index cannot run: its one output says why."""
        out = CompletionOutput(index=index, prompt_token_ids=[])
        out.finish_reason, out.error = "error", str(error)
        self.results.append(out)
        self.finish(out)
        self.bar.update(1)

    def sink(self, index: int, one: PreparedPrompt, j: int, seq: SequenceState) -> OutputSink:
        """The output of prompt index's copy j, and what fills it."""
        params = one.params
        out = CompletionOutput(index=index, prompt_token_ids=one.ids, seq_index=j)
        out._skip_special_tokens = params.skip_special_tokens
        out._keep_stop = params.include_stop_str_in_output
        if params.logprobs is not None:
            out.logprobs = []
        if params.stop:
            out._stop_text = []
        self.results.append(out)
        return functools.partial(self.take, out, seq)

    # Per output of every request: kept flat.
    def take(
        self, out: CompletionOutput, seq: SequenceState, o: RequestOutput | BaseException
    ) -> None:
        if isinstance(o, BaseException):  # the engine died with this request open
            out.finish_reason, out.error = "error", str(o)
            self._finished(out)
            return
        step = seq.process(o)
        out.token_ids.extend(o.new_token_ids)
        if out.logprobs is not None and o.logprobs:
            out.logprobs.extend(o.logprobs)
        if step.prompt_logprobs is not None:
            out.prompt_logprobs = step.prompt_logprobs
        if step.embedding is not None:
            out.embedding = step.embedding
        if out._stop_text is not None:
            out._stop_text.append(step.text)
        self.summary.output_tokens += len(o.new_token_ids)
        if seq.stopped:  # by a stop string: the core stops now
            self.llm.abort_requests([o.request_id])
        if step.finish_reason is not None:
            out.finish_reason = step.finish_reason
            out.stop_reason = step.stop_reason
            out.num_cached_tokens = o.num_cached_tokens
            # The core names its request id; the caller knows the prompt index.
            out.error = o.error and o.error.replace(
                f"request {o.request_id}", f"prompt {out.index}"
            )
            self.llm.forget(o.request_id)
            self._finished(out)
            self.bar.update(1)

    def _finished(self, out: CompletionOutput) -> None:
        tokenizer = self.llm.tokenizer
        if out._stop_text is not None:
            out.text = "".join(out._stop_text)
        elif tokenizer is not None:
            ids = text_token_ids(out.token_ids, out.finish_reason, out._keep_stop)
            out.text = tokenizer.decode(ids, out._skip_special_tokens)
        self.finish(out)


def _as_prompt_list(prompts: object) -> list:
    """A bare prompt (text or token ids) is one prompt, not a list of characters."""
    if isinstance(prompts, (str, Prompt)):
        return [prompts]
    if isinstance(prompts, (list, tuple)):
        if prompts and all(isinstance(t, int) and not isinstance(t, bool) for t in prompts):
            return [list(prompts)]  # one prompt of token ids
        return list(prompts)
    raise TypeError(
        f"prompts must be a str, a list of token ids or a list of prompts, "
        f"got {type(prompts).__name__}"
    )


def _per_prompt_params(
    params: SamplingParams | Sequence[SamplingParams] | None,
    n: int,
    vocab_size: int,
    inputs: InputProcessor,
) -> list[SamplingParams]:
    """One checked SamplingParams per prompt (raises before anything is sent)."""
    if params is None:
        return [SamplingParams()] * n
    if isinstance(params, (list, tuple)):
        if len(params) != n:
            raise ValueError(f"{len(params)} sampling params for {n} prompts")
        return [checked_params(p, f"prompt {i}", vocab_size, inputs) for i, p in enumerate(params)]
    checked = checked_params(params, "prompt 0", vocab_size, inputs)
    return [checked] * n


def _progress(total: int, enabled: bool) -> Any:
    from tqdm import tqdm

    # miniters=1: tqdm's adaptive skipping would otherwise hold the bar at its first
    # counts while requests finish in bursts.
    return tqdm(
        total=total,
        desc="requests",
        unit="req",
        disable=not enabled,
        file=sys.stderr,
        miniters=1,
    )


__all__ = ["LLM", "CompletionOutput", "EngineDeadError", "Prompt", "SamplingParams"]
