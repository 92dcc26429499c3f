"""Beam search, as vLLM offers it (LLM.beam_search, and use_beam_search in its OpenAI
API), built on requests the core already serves.

Each round asks the engine for one token of every live beam (prompt + beam so far) with
its 2 * beam_width most likely next tokens' logprobs; the beam_width best extensions by
cumulative logprob become the next beams, and an extension by an end-of-sequence token
(unless ignore_eos) is a finished sequence. After max_tokens rounds, or once no beam is
left, the finished and live sequences are ranked by cum_logprob / length **
length_penalty (length: prompt and generated tokens, the end-of-sequence token not
counted) and the best beam_width are the answer. The prefix cache keeps a round's
prompts cheap: a beam's blocks are its parent's, so each round computes little more
than the tokens of its last partly filled block.

Logprobs are the model's raw ones (a log-softmax of the logits), so temperature only
changes the token each round's request samples, which joins the candidates when it is
not among the most likely already; 0 (the default) makes the search deterministic.
"""

from __future__ import annotations

import itertools
from collections.abc import AsyncIterator, Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Protocol

from launch.client.inputs import Prompt
from protocol.engine import MAX_LOGPROBS, Logprobs, SamplingParams

if TYPE_CHECKING:
    from launch.client.request_stream import StreamOutput
    from launch.client.tokenizer import Tokenizer

# Each round asks for 2 * beam_width alternatives, within the engine's logprobs cap.
MAX_BEAM_WIDTH = MAX_LOGPROBS // 2


@dataclass(frozen=True)
class BeamSearchParams:
    """vLLM's BeamSearchParams: beam_width sequences come back, each at most max_tokens
    long; length_penalty > 0 favours longer finished sequences, < 0 shorter ones."""

    beam_width: int
    max_tokens: int
    ignore_eos: bool = False
    temperature: float = 0.0
    length_penalty: float = 1.0
    include_stop_str_in_output: bool = False  # a finished sequence's token ids keep its EOS
    skip_special_tokens: bool = True

    def validate(self) -> None:
        """Raise ValueError naming the first bad field."""
        if not 1 <= self.beam_width <= MAX_BEAM_WIDTH:
            raise ValueError(
                f"beam_width must be in [1, {MAX_BEAM_WIDTH}] (each beam asks for "
                f"2 * beam_width logprobs, at most {MAX_LOGPROBS}), got {self.beam_width}"
            )
        if not 1 <= self.max_tokens < 2**63:
            raise ValueError(f"max_tokens must be >= 1, got {self.max_tokens}")
        if not self.temperature >= 0.0:  # NaN too
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        if not -1e6 < self.length_penalty < 1e6:  # NaN and infinities too
            raise ValueError(f"length_penalty must be a finite number, got {self.length_penalty}")

    def round_params(self) -> SamplingParams:
        """What each round asks of the engine for one beam."""
        return SamplingParams(
            max_tokens=1,
            temperature=self.temperature,
            logprobs=2 * self.beam_width,
            skip_special_tokens=self.skip_special_tokens,
        )


@dataclass
class BeamSearchSequence:
    """One answer: tokens are the prompt's and the generated ones (vLLM's field);
    token_ids and text the generated ones only."""

    tokens: list[int]
    token_ids: list[int]
    text: str
    cum_logprob: float
    logprobs: list[Logprobs]  # per generated token: its logprob and the round's best
    finish_reason: str  # "stop" (an end-of-sequence token) or "length"
    stop_reason: int | None = None  # the end-of-sequence token that finished it


@dataclass
class BeamSearchOutput:
    """A prompt's answers, best first."""

    sequences: list[BeamSearchSequence] = field(default_factory=list)
    num_cached_tokens: int = 0  # the prompt's tokens the first round found in the cache


class Beam:
    __slots__ = ("cum_logprob", "eos", "logprobs", "tokens")

    def __init__(
        self, tokens: list[int], cum_logprob: float, logprobs: list[Logprobs], eos: int | None
    ) -> None:
        self.tokens = tokens  # prompt and generated, the end-of-sequence token included
        self.cum_logprob = cum_logprob
        self.logprobs = logprobs
        self.eos = eos  # the end-of-sequence token that finished it, if any

    def extended(
        self, token: int, logprob: float, found: Logprobs, cum_logprob: float, eos: bool
    ) -> Beam:
        """This beam and token (its logprob; found: the round's best for this beam)."""
        chosen = Logprobs(logprob, found.top_token_ids, found.top_logprobs)
        return Beam(
            [*self.tokens, token], cum_logprob, [*self.logprobs, chosen], token if eos else None
        )

    def score(self, length_penalty: float) -> float:
        length = len(self.tokens) - (self.eos is not None)
        return self.cum_logprob / length**length_penalty


class BeamSearch:
    """One prompt's search: `beams` are the sequences the next round extends;
    advance() takes what the engine found for each, in order."""

    def __init__(
        self,
        prompt: list[int],
        params: BeamSearchParams,
        eos_token_ids: Iterable[int],
        cache_salt: str | None = None,
        priority: int = 0,
    ) -> None:
        if not prompt:
            raise ValueError("beam search needs a prompt of at least one token")
        self.params = params
        self.num_prompt_tokens = len(prompt)
        self.eos = frozenset(()) if params.ignore_eos else frozenset(eos_token_ids)
        self.beams = [Beam(list(prompt), 0.0, [], None)]
        self.finished: list[Beam] = []
        self.rounds = 0
        self.num_cached_tokens = 0
        # Every round's requests: a tenant's beams stay in its own prefix cache.
        self.cache_salt = cache_salt
        self.priority = priority

    @property
    def done(self) -> bool:
        return not self.beams or self.rounds >= self.params.max_tokens

    def advance(self, found: Sequence[tuple[int, Logprobs]]) -> None:
        """found[i]: the token the round sampled for beams[i] and its Logprobs (the round's
        most likely tokens with theirs)."""
        if len(found) != len(self.beams):
            raise ValueError(f"{len(found)} results for {len(self.beams)} beams")
        width, eos = self.params.beam_width, self.eos
        candidates: list[tuple[float, int, float, Beam, Logprobs]] = []
        for beam, (sampled, lp) in zip(self.beams, found):
            options = zip(lp.top_token_ids, lp.top_logprobs)
            if sampled not in lp.top_token_ids:
                options = itertools.chain(options, ((sampled, lp.logprob),))
            for token, logprob in options:
                cum = beam.cum_logprob + logprob
                if token in eos:
                    self.finished.append(beam.extended(token, logprob, lp, cum, True))
                else:
                    candidates.append((cum, token, logprob, beam, lp))
        # Stable: equal scores keep the order of beams, then of likelihood.
        candidates.sort(key=lambda c: -c[0])
        self.beams = [
            beam.extended(token, logprob, lp, cum, False)
            for cum, token, logprob, beam, lp in candidates[:width]
        ]
        self.rounds += 1

    def result(self, tokenizer: Tokenizer | None) -> BeamSearchOutput:
        """The best beam_width sequences, best first."""
        p = self.params
        ranked = sorted(
            self.finished + self.beams, key=lambda b: b.score(p.length_penalty), reverse=True
        )
        out = BeamSearchOutput(num_cached_tokens=self.num_cached_tokens)
        for beam in ranked[: p.beam_width]:
            spoken = beam.tokens[self.num_prompt_tokens : len(beam.tokens) - (beam.eos is not None)]
            text = "" if tokenizer is None else tokenizer.decode(spoken, p.skip_special_tokens)
            keep = p.include_stop_str_in_output or beam.eos is None
            tokens = beam.tokens if keep else beam.tokens[:-1]
            out.sequences.append(
                BeamSearchSequence(
                    tokens=tokens,
                    token_ids=tokens[self.num_prompt_tokens :],
                    text=text,
                    cum_logprob=beam.cum_logprob,
                    logprobs=beam.logprobs,
                    finish_reason="stop" if beam.eos is not None else "length",
                    stop_reason=beam.eos,
                )
            )
        return out


def check_room(
    num_prompt_tokens: int, params: BeamSearchParams, max_model_len: int, what: str
) -> None:
    """ValueError when a prompt leaves less than params.max_tokens of the context."""
    if num_prompt_tokens + params.max_tokens > max_model_len:
        raise ValueError(
            f"{what} has {num_prompt_tokens} tokens; with max_tokens {params.max_tokens} "
            f"that exceeds the model's context of {max_model_len} tokens"
        )


def round_prompts(searches: Sequence[BeamSearch]) -> list[Prompt]:
    """Every live beam of every unfinished search, in order: the next round's prompts."""
    return [
        Prompt(prompt_token_ids=b.tokens, cache_salt=s.cache_salt, priority=s.priority)
        for s in searches
        if not s.done
        for b in s.beams
    ]


def advance_all(searches: Sequence[BeamSearch], found: Sequence[tuple[int, Logprobs, int]]) -> None:
    """Hand each unfinished search its beams' results (token, Logprobs, cached prompt
    tokens) from a round over round_prompts(searches)."""
    at = 0
    for s in searches:
        if s.done:
            continue
        mine = found[at : at + len(s.beams)]
        at += len(s.beams)
        if s.rounds == 0:
            s.num_cached_tokens = mine[0][2]
        s.advance([(token, lp) for token, lp, _ in mine])
    if at != len(found):
        raise ValueError(f"{len(found)} results for {at} beams")


class RoundStream(Protocol):
    """One round's requests as search() reads them (AsyncLLM's RequestStream)."""

    def __aiter__(self) -> AsyncIterator[StreamOutput]: ...

    def close(self) -> None: ...


class RoundEngine(Protocol):
    """What search() needs of an engine (AsyncLLM has it): the model's end-of-sequence
    ids and tokenizer, and one stream for a round's prompts."""

    eos_token_ids: list[int]
    tokenizer: Tokenizer | None

    def generate_many(
        self,
        prompts: Sequence[Prompt],
        sampling_params: SamplingParams,
        request_id: str,
        *,
        text: bool,
    ) -> RoundStream: ...


async def search(
    engine: RoundEngine,
    prompts: list[list[int]],
    params: BeamSearchParams,
    request_id: str,
    cache_salt: str | None = None,
    priority: int = 0,
    on_round: Callable[[], None] | None = None,
) -> list[BeamSearchOutput]:
    """Beam search over every prompt at once on an AsyncLLM (one engine request per live
    beam per round, named "{request_id}-r{round}..."). A failed round raises
    BeamSearchError; cancelling aborts the round in flight. on_round is called after
    each round."""
    params.validate()
    eos = engine.eos_token_ids
    searches = [BeamSearch(ids, params, eos, cache_salt, priority) for ids in prompts]
    one = params.round_params()
    for r in itertools.count():
        asked = round_prompts(searches)
        if not asked:
            break
        found: list[tuple[int, Logprobs, int] | None] = [None] * len(asked)
        stream = engine.generate_many(asked, one, f"{request_id}-r{r}", text=False)
        try:
            async for out in stream:
                if out.finish_reason in ("error", "abort"):
                    raise BeamSearchError(
                        out.error or f"a beam's request ended: {out.finish_reason}"
                    )
                if out.finish_reason is not None:
                    assert out.logprobs  # asked for: one per token
                    found[out.index] = (
                        out.new_token_ids[0],
                        out.logprobs[0],
                        out.num_cached_tokens,
                    )
        finally:
            stream.close()
        advance_all(searches, found)  # type: ignore[arg-type]
        if on_round is not None:
            on_round()
    return [s.result(engine.tokenizer) for s in searches]


class BeamSearchError(RuntimeError):
    """A round of a beam search failed (the engine's reason)."""
